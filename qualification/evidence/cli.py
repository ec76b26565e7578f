"""``validation-evidence``: seal, sign, verify and make keys for qualification evidence bundles.

One error handler: any :class:`QualificationError` (bad flags included) becomes one line on stderr and its exit code
(table in :mod:`qualification.errors`); no traceback for bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from qualification.errors import EXIT_FAILED, EXIT_OK, BundleInvalid, QualificationError, UsageError
from qualification.evidence.facts_file import load_facts
from qualification.evidence.seal import seal_bundle, sign_bundle
from qualification.evidence.sign import (
    GITHUB_OIDC_ISSUER,
    generate_key,
    keyid,
    load_public_key,
    make_signer,
)
from qualification.evidence.verdict import scope_text
from qualification.evidence.verify import TrustPolicy, VerificationResult, verify_bundle

PROG = "validation-evidence"


def _version() -> str:
    from importlib import (
        metadata,
    )  # not gemscout.cli's: importing gemscout loads torch, slow for a sealing tool

    try:
        return metadata.version("gemscout")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Seal, sign and verify revision-bound qualification evidence bundles.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    seal = commands.add_parser("seal", help="hash every file in DIR and write DIR/manifest.json")
    seal.add_argument(
        "directory", type=Path, metavar="DIR", help="payload directory (logs, reports) to seal"
    )
    seal.add_argument(
        "--facts", type=Path, required=True, help="JSON run facts: campaign, commands, summary, ..."
    )
    seal.add_argument(
        "--campaign", type=Path, help="campaign TOML; overrides the facts' campaign.path"
    )
    seal.add_argument(
        "--repo", type=Path, default=Path("."), help="git checkout the run used (default: .)"
    )
    seal.add_argument(
        "--sign", choices=("none", "key", "sigstore"), default="none", help="signing mode"
    )
    seal.add_argument("--key", type=Path, help="P-256 private key (PEM) for --sign key")
    seal.add_argument(
        "--archive", type=Path, help="also write a reproducible .tar.gz here (outside DIR)"
    )
    seal.set_defaults(handler=_seal)

    sign = commands.add_parser(
        "sign", help="sign an already sealed bundle (e.g. in a separate CI job)"
    )
    sign.add_argument("directory", type=Path, metavar="DIR", help="sealed bundle directory")
    sign.add_argument("--sign", choices=("key", "sigstore"), required=True, help="signing mode")
    sign.add_argument("--key", type=Path, help="P-256 private key (PEM) for --sign key")
    sign.set_defaults(handler=_sign)

    verify = commands.add_parser(
        "verify", help="verify a bundle and report its freshness against main"
    )
    verify.add_argument("bundle", type=Path, metavar="BUNDLE", help="bundle directory or .tar.gz")
    verify.add_argument(
        "--expected-commit", required=True, metavar="SHA", help="full 40-hex commit it must be for"
    )
    verify.add_argument(
        "--json", action="store_true", help="print the result as one JSON object on stdout"
    )
    verify.add_argument(
        "--repo", type=Path, default=Path("."), help="git clone to judge freshness in (default: .)"
    )
    verify.add_argument(
        "--main-ref", default="main", help="ref that is main (default: main; fetch first)"
    )
    verify.add_argument(
        "--allow-stale", action="store_true", help="exit 0 for a valid STALE bundle"
    )
    verify.add_argument(
        "--require-complete",
        action="store_true",
        help="exit 7 for a run narrowed by --filter/--seed (PARTIAL) or one that records no scope",
    )
    verify.add_argument(
        "--public-key", type=Path, help="P-256 public key (PEM) for key-signed bundles"
    )
    verify.add_argument(
        "--require-signature", action="store_true", help="reject an unsigned bundle"
    )
    verify.add_argument(
        "--trusted-root", type=Path, help="pinned Sigstore trusted_root.json (offline)"
    )
    verify.add_argument(
        "--cert-identity", help="exact signer identity (SAN) of a Sigstore signature"
    )
    verify.add_argument(
        "--cert-oidc-issuer", default=GITHUB_OIDC_ISSUER, help="OIDC issuer of that identity"
    )
    verify.set_defaults(handler=_verify)

    keygen = commands.add_parser(
        "keygen", help="write a new P-256 key pair: PATH (private, 0600) and PATH.pub"
    )
    keygen.add_argument("path", type=Path, metavar="PATH")
    keygen.set_defaults(handler=_keygen)
    return parser


def _seal(args: argparse.Namespace) -> int:
    facts = load_facts(args.facts, campaign_file=args.campaign)
    signer = make_signer(
        args.sign, key=args.key, identity_token=os.environ.get("SIGSTORE_ID_TOKEN")
    )
    sealed = seal_bundle(args.directory, facts, repo=args.repo, signer=signer, archive=args.archive)
    print(
        f"sealed {sealed.directory}: {sealed.subjects} files, result {sealed.result}, commit {sealed.commit}"
    )
    print(f"manifest sha256 {sealed.manifest_sha256}")
    if sealed.dirty:
        print(
            "warning: the working tree was dirty; this bundle can never verify as CURRENT",
            file=sys.stderr,
        )
    for written in (sealed.signature, sealed.archive):
        if written is not None:
            print(f"wrote {written}")
    return EXIT_OK


def _sign(args: argparse.Namespace) -> int:
    signer = make_signer(
        args.sign, key=args.key, identity_token=os.environ.get("SIGSTORE_ID_TOKEN")
    )
    print(f"wrote {sign_bundle(args.directory, signer)}")
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    trust = TrustPolicy(
        public_key=args.public_key,
        trusted_root=args.trusted_root,
        cert_identity=args.cert_identity,
        cert_issuer=args.cert_oidc_issuer,
        require_signature=args.require_signature,
    )
    result = verify_bundle(
        args.bundle,
        expected_commit=args.expected_commit,
        trust=trust,
        repo=args.repo,
        main_ref=args.main_ref,
        allow_stale=args.allow_stale,
        require_complete=args.require_complete,
    )
    if args.json:
        print(json.dumps(result.to_json(), sort_keys=True))
    else:
        _print_result(result)
    return result.exit_code


def _print_result(result: VerificationResult) -> None:
    freshness = result.freshness
    behind = f", {freshness.commits_behind} commit(s) behind" if freshness.commits_behind else ""
    counts = result.counts or {}
    scope = result.scope
    print(f"VALID: {result.message}")
    print(f"  verdict    {result.headline.text}")
    print(f"  commit     {result.commit}")
    print(
        f"  result     {result.result}: "
        + ", ".join(
            f"{counts.get(k, 0)} {k}"
            for k in ("passed", "failed", "skipped", "measured")
            if k in counts
        )
    )
    if scope is None:
        print(f"  scope      not recorded (schema {result.schema_version})")
    elif scope["complete"]:
        print(f"  scope      complete: all {scope['cellsInCampaign']} cells of the campaign")
    else:
        print(f"  scope      {scope_text(scope)}")
    print(f"  signature  {result.signature}")
    print(f"  checks     {', '.join(result.checks_passed)}")
    print(f"  freshness  {freshness.state} against {freshness.main_ref}{behind}")
    bounds = result.boundaries or {}
    for claim in bounds.get("validated", []):
        text = claim if isinstance(claim, str) else claim["claim"]
        backing = "" if isinstance(claim, str) else f" [{len(claim['backedBy'])} cell(s)]"
        print(f"  validated      {text}{backing}")
    for claim in bounds.get("notValidated", []):
        text = claim if isinstance(claim, str) else f"{claim['claim']} [{claim['reason']}]"
        print(f"  not validated  {text}")


def _keygen(args: argparse.Namespace) -> int:
    private_path, public_path = generate_key(args.path)
    print(f"wrote {private_path} (private, keep it secret) and {public_path}")
    print(f"keyid {keyid(load_public_key(public_path))}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default: ``sys.argv[1:]``) and return the exit code; never raises for bad input."""
    wants_json = "--json" in (sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        code: int = args.handler(args)
        return code
    except QualificationError as exc:
        return _fail(
            str(exc),
            exc.exit_code,
            wants_json,
            "INVALID" if isinstance(exc, BundleInvalid) else "ERROR",
        )
    except (
        OSError
    ) as exc:  # unreadable bundle, full disk: the environment's fault, not a bug to trace
        return _fail(f"{exc.strerror or exc}: {exc.filename}", EXIT_FAILED, wants_json, "ERROR")
    except KeyboardInterrupt:
        return _fail("interrupted", 130, wants_json, "ERROR")
    except (
        RecursionError
    ):  # a parser exhausted by nesting in some input file: malformed input, not a crash
        return _fail(
            "an input file is nested too deeply to be evidence", EXIT_FAILED, wants_json, "INVALID"
        )


def _fail(message: str, exit_code: int, wants_json: bool, status: str) -> int:
    one_line = " ".join(message.split())
    if wants_json:
        print(
            json.dumps(
                {"status": status, "exit_code": exit_code, "message": one_line}, sort_keys=True
            )
        )
    print(f"{PROG}: error: {one_line}", file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())

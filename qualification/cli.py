"""``qualify``: run qualification campaigns, seal their evidence, render and verify it.

Exit codes (see ``qualification.errors``): 0 success; 1 a cell failed or a bundle is invalid; 2 bad usage or a
malformed campaign (nothing ran); 3-6 verification outcomes (stale, commit mismatch, signature, not on main).
Every harness error ends as one line on stderr and its exit code, never a traceback. Standard library argparse, as
``validation-evidence`` and ``gemscout``.

This module is the command line: the flags, ``--help``, and the one error handler. What each subcommand does once
its flags are parsed is in ``qualification._commands``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

from qualification._commands import _err, list_campaigns, report, run, seal, verify
from qualification.errors import QualificationError, UsageError

PROG = "qualify"
SIGN_MODES = ("none", "key", "sigstore")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line and exit 2, not argparse's usage block
        raise UsageError(f"{message} (see {self.prog} --help)")


def _version() -> str:
    """The installed distribution's version, from its metadata (importing gemscout would load torch)."""
    try:
        return metadata.version("gemscout")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _at_least(low: float, kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value

    return parse


def _signing(parser: argparse.ArgumentParser, archive_help: str) -> None:
    parser.add_argument(
        "--sign",
        choices=SIGN_MODES,
        default="none",
        help="sign the manifest: none, key (with --key), sigstore",
    )
    parser.add_argument("--key", type=Path, help="private key (PEM) for --sign key")
    parser.add_argument("--archive", type=Path, help=archive_help)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Run gemscout qualification campaigns and seal their results into revision-bound "
        "evidence bundles.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )

    listing = commands.add_parser(
        "list", help="list the campaigns in campaigns/ with their tier and cell count"
    )
    listing.set_defaults(handler=list_campaigns)

    run_ = commands.add_parser(
        "run", help="run a campaign, then seal the run directory and render the report"
    )
    run_.add_argument(
        "campaign", help="campaign name (campaigns/NAME.toml) or path to a campaign file"
    )
    run_.add_argument(
        "--out", type=Path, help="run directory, absent or empty (default: runs/NAME-UTCTIME)"
    )
    run_.add_argument(
        "--jobs",
        "-j",
        type=_at_least(1, int),
        default=1,
        help="cells run at once (capped at the CPU count)",
    )
    run_.add_argument(
        "--seed", type=int, help="run every cell with this seed instead of the file's"
    )
    run_.add_argument(
        "--filter",
        dest="filter_expr",
        help="only cells whose id matches: substring or glob; comma-separated alternatives",
    )
    _signing(run_, "also pack the sealed bundle into this .tar.gz")
    run_.add_argument("--no-seal", action="store_true", help="leave the run directory unsealed")
    run_.add_argument("--no-report", action="store_true", help="do not render the HTML report")
    run_.add_argument(
        "--grace",
        dest="grace_s",
        type=_at_least(0.0, float),
        default=5.0,
        help="seconds between SIGTERM and SIGKILL when a cell times out (default: 5)",
    )
    run_.set_defaults(handler=run)

    seal_ = commands.add_parser(
        "seal", help="seal a run directory into an evidence bundle, from its summary.json"
    )
    seal_.add_argument(
        "directory", type=Path, help="a run directory written by `qualify run --no-seal`"
    )
    _signing(seal_, "also pack the bundle into this .tar.gz")
    seal_.set_defaults(handler=seal)

    verify_ = commands.add_parser(
        "verify",
        help="verify an evidence bundle (signature, schema, digests, consistency, commit, freshness)",
    )
    verify_.add_argument("bundle", type=Path, help="bundle directory or .tar.gz")
    verify_.add_argument(
        "--expected-commit", required=True, help="full SHA the bundle must be bound to"
    )
    verify_.add_argument(
        "--json", dest="as_json", action="store_true", help="print the verification result as JSON"
    )
    verify_.add_argument("--public-key", type=Path, help="public key (PEM) of a key-signed bundle")
    verify_.add_argument(
        "--require-signature", action="store_true", help="reject an unsigned bundle"
    )
    verify_.add_argument(
        "--main-ref", default="main", help="the ref that is main, for freshness (fetch first)"
    )
    verify_.add_argument(
        "--allow-stale", action="store_true", help="exit 0 for a valid STALE bundle"
    )
    verify_.add_argument(
        "--require-complete",
        action="store_true",
        help="exit 7 for a PARTIAL run (narrowed by --filter or --seed)",
    )
    verify_.set_defaults(handler=verify)

    report_ = commands.add_parser(
        "report", help="render the HTML report of a run directory or bundle"
    )
    report_.add_argument("bundle", type=Path, help="a run directory or sealed bundle")
    report_.add_argument("--out", type=Path, help="HTML file to write (default: BUNDLE.html)")
    report_.add_argument(
        "--expected-commit",
        help="verify the bundle against this full SHA first and show the verdict (VALID + freshness, "
        "or INVALID)",
    )
    report_.add_argument("--public-key", type=Path, help="public key (PEM) of a key-signed bundle")
    report_.add_argument(
        "--main-ref", default="main", help="the ref that is main, for freshness (fetch first)"
    )
    report_.set_defaults(handler=report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it). The CLI's one error
    handler: a QualificationError (bad flags included) becomes one line on stderr and its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args:
        parser.print_help(sys.stderr)
        return UsageError.exit_code
    try:
        parsed = parser.parse_args(args)
        return int(parsed.handler(parsed) or 0)
    except QualificationError as exc:
        _err(f"{PROG}: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        _err(f"{PROG}: interrupted; running cells were terminated")
        return 130
    except (
        OSError
    ) as exc:  # an unreadable file or a full disk: the environment's fault, said in one line
        _err(f"{PROG}: {exc.strerror or exc}: {exc.filename}")
        return 1

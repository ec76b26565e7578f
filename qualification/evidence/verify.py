"""The verifier: is this bundle what it claims, made from the expected commit, and is that commit still main?

Checks run in a fixed order and the first failure stops verification with its own message (the prefix names the
check) and exit code; :func:`verify_bundle` never half-succeeds:

1. intake       safe paths, no links or special files, size limits, manifest.json present and JSON   exit 1
2. signature    when present or required; manifest.json must equal the signed bytes                 exit 5
3. schema       draft 2020-12 with formats asserted; schemaVersion not newer than this verifier     exit 1
4. files        files on disk equal the subject set exactly: no missing, no extra, size + sha256    exit 1
5. consistency  the result follows from the counts and exit codes; counts add up; times ordered;     exit 1
                (1.1) the scope adds up, every validated claim is backed by commands that exited 0,
                and the sealed summary.json records the same scope, claims and cell verdicts
6. commit       the manifest's commit equals ``expected_commit``                                   exit 4

Freshness is then reported apart from validity (see :mod:`.freshness`); with the result and the scope it decides the
exit code of a valid bundle: 1 for a valid record of a FAILED run, 7 for a PARTIAL one under ``require_complete``,
then 0 CURRENT, 3 STALE (0 with ``allow_stale``), 6 NOT-ON-MAIN or UNKNOWN. The one-line verdict that combines them
all is :func:`.verdict.headline`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from qualification.errors import (
    EXIT_FAILED,
    EXIT_INCOMPLETE,
    EXIT_NOT_ON_MAIN,
    EXIT_OK,
    EXIT_STALE,
    BundleInvalid,
    CommitMismatch,
    SignatureInvalid,
    UsageError,
)
from qualification.evidence.consistency import (
    SUMMARY_NAME as SUMMARY_NAME,
)  # re-exported: it was defined here
from qualification.evidence.consistency import check_claims, check_consistency
from qualification.evidence.freshness import (
    GIT_TIMEOUT,
    Freshness,
    FreshnessReport,
    check_freshness,
)
from qualification.evidence.manifest import (
    DSSE_NAME,
    MANIFEST_NAME,
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_METADATA_BYTES,
    RESERVED_NAMES,
    SCHEMA_VERSION,
    SIGSTORE_NAME,
    BundleFile,
    extract_archive,
    parse_json,
    path_problem,
    scan_bundle,
    schema_errors,
    sha256_file,
)
from qualification.evidence.sign import (
    GITHUB_OIDC_ISSUER,
    load_public_key,
    verify_dsse,
    verify_sigstore,
)
from qualification.evidence.verdict import Headline, headline, scope_text

_FULL_SHA = re.compile(r"[0-9a-fA-F]{40}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrustPolicy:
    """Which signatures to accept. A present signature is always checked; it is never skipped for lack of keys."""

    public_key: Path | None = None
    """P-256 public key (PEM) for ``manifest.dsse.json``; giving one also requires the bundle to be signed."""
    trusted_root: Path | None = None
    """Pinned Sigstore ``trusted_root.json`` for ``manifest.sigstore.json`` (verification is offline)."""
    cert_identity: str | None = None
    """Exact certificate SAN expected of a Sigstore signature, e.g. the workflow ``...yml@refs/heads/main``."""
    cert_issuer: str = GITHUB_OIDC_ISSUER
    require_signature: bool = False
    """Reject an unsigned bundle."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VerificationResult:
    """A bundle that passed every validity check, with its freshness and the exit code it earns."""

    commit: str
    result: str
    signature: str
    checks_passed: tuple[str, ...]
    freshness: FreshnessReport
    manifest_sha256: str
    exit_code: int
    message: str
    schema_version: str = SCHEMA_VERSION
    scope: dict[str, Any] | None = None
    """The manifest's ``scope`` (camelCase); None for a 1.0.0 manifest, which records none."""
    boundaries: dict[str, Any] | None = None
    """The manifest's ``boundaries``: claim records from 1.1.0, plain strings in 1.0.0."""
    counts: dict[str, int] | None = None

    @property
    def headline(self) -> Headline:
        return headline(
            validity="VALID",
            result=self.result,
            scope=self.scope,
            freshness=str(self.freshness.state),
        )

    @property
    def complete(self) -> bool:
        return bool(self.scope and self.scope.get("complete"))

    def to_json(self) -> dict[str, Any]:
        return {
            "status": "VALID",
            "verdict": self.headline.to_json(),
            "exit_code": self.exit_code,
            "message": self.message,
            "commit": self.commit,
            "result": self.result,
            "schema_version": self.schema_version,
            "scope": self.scope,
            "complete": self.complete,
            "counts": self.counts,
            "boundaries": self.boundaries,
            "signature": self.signature,
            "checks_passed": list(self.checks_passed),
            "freshness": str(self.freshness.state),
            "commits_behind": self.freshness.commits_behind,
            "main_ref": self.freshness.main_ref,
            "main_head": self.freshness.main_head,
            "freshness_reason": self.freshness.reason,
            "non_evidence_changes": list(self.freshness.non_evidence),
            "manifest_sha256": self.manifest_sha256,
        }


def verify_bundle(
    bundle: Path,
    *,
    expected_commit: str,
    trust: TrustPolicy | None = None,
    repo: Path | None = None,
    main_ref: str = "main",
    allow_stale: bool = False,
    require_complete: bool = False,
    max_files: int = MAX_FILES,
    max_file_bytes: int = MAX_FILE_BYTES,
    timeout: timedelta = GIT_TIMEOUT,
) -> VerificationResult:
    """Verify the bundle directory or ``.tar.gz`` at ``bundle`` (checks in the module docstring).

    ``repo`` is a clone to judge freshness in (UNKNOWN without one). ``require_complete`` gives a valid bundle of a
    narrowed run (or one that records no scope) exit code 7. Blocks on reading every payload file once and on
    git (``timeout`` per call). Raises :class:`UsageError` for bad arguments, :class:`BundleInvalid` (or its
    subclasses :class:`SignatureInvalid`, :class:`CommitMismatch`) for a bundle that fails a check.
    """
    if not _FULL_SHA.fullmatch(expected_commit):
        raise UsageError(
            f"--expected-commit must be a full 40-hex commit SHA, got {expected_commit!r}"
        )
    if not bundle.exists():
        raise UsageError(f"bundle {bundle} does not exist")
    verify_dir = _Verification(
        trust or TrustPolicy(), expected_commit.lower(), max_files, max_file_bytes
    )
    if bundle.is_dir():
        document, checks = verify_dir.run(bundle)
    elif bundle.name.endswith((".tar.gz", ".tgz")):
        with tempfile.TemporaryDirectory(prefix="evidence-") as scratch:
            document, checks = verify_dir.run(
                extract_archive(
                    bundle, Path(scratch), max_files=max_files, max_file_bytes=max_file_bytes
                )
            )
    else:
        raise UsageError(f"bundle {bundle} is neither a directory nor a .tar.gz")
    predicate = document["predicate"]
    source = predicate["source"]
    freshness = check_freshness(
        verify_dir.expected_commit,
        repo=repo,
        main_ref=main_ref,
        dirty=source["dirty"],
        timeout=timeout,
    )
    scope = predicate.get("scope")
    exit_code, message = _verdict(
        predicate["result"], scope, freshness, allow_stale, require_complete
    )
    return VerificationResult(
        commit=source["digest"]["gitCommit"],
        result=predicate["result"],
        signature=verify_dir.signature,
        checks_passed=checks,
        freshness=freshness,
        manifest_sha256=verify_dir.manifest_sha256,
        exit_code=exit_code,
        message=message,
        schema_version=predicate["schemaVersion"],
        scope=scope,
        boundaries=predicate["boundaries"],
        counts=dict(predicate["summary"]),
    )


def _verdict(
    result: str,
    scope: dict[str, Any] | None,
    freshness: FreshnessReport,
    allow_stale: bool,
    require_complete: bool,
) -> tuple[int, str]:
    state = freshness.state
    partial = scope_text(scope)
    what = result + (f", {partial}" if partial else "")
    if result == "FAILED":
        return EXIT_FAILED, f"valid bundle of a FAILED run; freshness {state}: {freshness.reason}"
    if require_complete and partial is not None:
        return (
            EXIT_INCOMPLETE,
            f"valid, but not a complete campaign ({partial}); --require-complete refuses it",
        )
    if state is Freshness.CURRENT:
        return EXIT_OK, f"valid, {what} and CURRENT: {freshness.reason}"
    if state is Freshness.CURRENT_EVIDENCE_ONLY:
        return EXIT_OK, f"valid, {what} and CURRENT-EVIDENCE-ONLY: {freshness.reason}"
    if state is Freshness.STALE:
        return (
            EXIT_OK if allow_stale else EXIT_STALE
        ), f"valid and {what}, but STALE: {freshness.reason}"
    return EXIT_NOT_ON_MAIN, f"valid and {what}, but {state}: {freshness.reason}"


class _Verification:
    """One pass over one bundle directory; each ``_check_*`` raises or returns, in the documented order."""

    def __init__(
        self, trust: TrustPolicy, expected_commit: str, max_files: int, max_file_bytes: int
    ) -> None:
        self.trust, self.expected_commit = trust, expected_commit
        self.max_files, self.max_file_bytes = max_files, max_file_bytes
        self.signature = "none"
        self.manifest_sha256 = ""

    def run(self, root: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
        files = {
            f.name: f
            for f in scan_bundle(root, max_files=self.max_files, max_file_bytes=self.max_file_bytes)
        }
        manifest = self._check_intake(root, files)
        checks = ["intake"]
        document = self._check_signature(files, manifest)
        if self.signature != "none":
            checks.append("signature")
        self._check_schema(document)
        self._check_files(document, files)
        check_consistency(document)
        if not document["predicate"]["schemaVersion"].startswith("1.0."):
            check_claims(document, files)
        commit = document["predicate"]["source"]["digest"]["gitCommit"]
        if commit != self.expected_commit:
            raise CommitMismatch(
                f"commit: bundle was made from {commit}, expected {self.expected_commit}"
            )
        return document, (*checks, "schema", "files", "consistency", "commit")

    def _check_intake(self, root: Path, files: dict[str, BundleFile]) -> bytes:
        if MANIFEST_NAME not in files:
            raise BundleInvalid(f"intake: {MANIFEST_NAME} is missing from {root}")
        for metadata in sorted(RESERVED_NAMES & files.keys()):
            size = files[metadata].size
            if size > MAX_METADATA_BYTES:
                raise BundleInvalid(
                    f"intake: {metadata} is {size} bytes, over the {MAX_METADATA_BYTES}-byte limit"
                )
        manifest = files[MANIFEST_NAME].path.read_bytes()
        self.manifest_sha256 = hashlib.sha256(manifest).hexdigest()
        try:
            document = parse_json(manifest)
        except (ValueError, RecursionError) as exc:
            raise BundleInvalid(f"intake: {MANIFEST_NAME} is not valid JSON ({exc})") from exc
        subjects = document.get("subject") if isinstance(document, dict) else None
        for subject in subjects if isinstance(subjects, list) else []:
            name = subject.get("name") if isinstance(subject, dict) else None
            if isinstance(name, str):  # anything stranger is the schema's to reject
                problem = path_problem(name)
                if problem is not None:
                    raise BundleInvalid(f"intake: subject name {name!r} {problem}")
                if name in RESERVED_NAMES:
                    raise BundleInvalid(
                        f"intake: subject name {name!r} is reserved for the manifest or a signature"
                    )
        return manifest

    def _check_signature(self, files: dict[str, BundleFile], manifest: bytes) -> Any:
        trust = self.trust
        envelopes = [name for name in (DSSE_NAME, SIGSTORE_NAME) if name in files]
        if not envelopes:
            if trust.require_signature or trust.public_key or trust.trusted_root:
                raise SignatureInvalid(
                    "signature: bundle is not signed, but a signature is required"
                )
            return parse_json(manifest)
        signed: list[tuple[str, bytes]] = []
        for name in envelopes:
            envelope = files[name].path.read_bytes()
            if name == DSSE_NAME:
                if trust.public_key is None:
                    raise UsageError(
                        f"bundle is signed ({DSSE_NAME}); pass --public-key to verify it"
                    )
                signed.append((name, verify_dsse(envelope, load_public_key(trust.public_key))))
            else:
                if trust.trusted_root is None or trust.cert_identity is None:
                    raise UsageError(
                        f"bundle is signed ({SIGSTORE_NAME}); pass --trusted-root and --cert-identity"
                    )
                payload = verify_sigstore(
                    envelope,
                    trusted_root=trust.trusted_root,
                    identity=trust.cert_identity,
                    issuer=trust.cert_issuer,
                    expected_commit=self.expected_commit,
                )
                signed.append((name, payload))
        for name, payload in signed:
            if not hmac.compare_digest(payload, manifest):
                raise SignatureInvalid(
                    f"signature: {MANIFEST_NAME} differs from the payload signed in {name}"
                )
        self.signature = "+".join("key" if name == DSSE_NAME else "sigstore" for name, _ in signed)
        # From here on only the verified bytes are used (the DSSE rule); they equal manifest.json, checked above.
        return parse_json(signed[0][1])

    def _check_schema(self, document: Any) -> None:
        errors = schema_errors(document)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise BundleInvalid(f"schema: {errors[0]}{more}")
        version = tuple(int(part) for part in document["predicate"]["schemaVersion"].split("."))
        if version > tuple(int(part) for part in SCHEMA_VERSION.split(".")):
            raise BundleInvalid(
                f"schema: schemaVersion {document['predicate']['schemaVersion']} is newer than this verifier "
                f"understands ({SCHEMA_VERSION}); upgrade gemscout"
            )

    def _check_files(self, document: dict[str, Any], files: dict[str, BundleFile]) -> None:
        subjects: dict[str, dict[str, Any]] = {}
        for subject in document["subject"]:
            if subject["name"] in subjects:
                raise BundleInvalid(f"files: subject {subject['name']!r} is listed twice")
            subjects[subject["name"]] = subject
        payload = {name for name in files if name not in RESERVED_NAMES}
        missing = sorted(set(subjects) - payload)
        if missing:
            raise BundleInvalid(
                f"files: subject {missing[0]!r} is missing from the bundle ({len(missing)} missing)"
            )
        extra = sorted(payload - set(subjects))
        if extra:
            raise BundleInvalid(
                f"files: {extra[0]!r} is in the bundle but is not a subject ({len(extra)} undeclared)"
            )
        for name, subject in sorted(subjects.items()):
            declared_size = subject["annotations"]["sizeBytes"]
            if files[name].size != declared_size:
                raise BundleInvalid(
                    f"files: {name!r} is {files[name].size} bytes, the manifest says {declared_size}"
                )
            if not hmac.compare_digest(sha256_file(files[name].path), subject["digest"]["sha256"]):
                raise BundleInvalid(
                    f"files: {name!r} does not match its sha256 in the manifest (edited?)"
                )

"""Sealing: turn a directory of payload files plus the engine's run facts into a bundle with ``manifest.json``.

The engine knows what ran (:class:`SealInput`); sealing finds out the rest itself (git commit and dirtiness, package
version, python, platform, torch, CPU/GPU inventory, allow-listed environment variables), hashes every payload file,
checks the statement against the schema, writes it atomically, signs it, and optionally packs a ``.tar.gz``.

Layout::

    <bundle>/manifest.json           the Statement (canonical bytes, the thing that is signed)
    <bundle>/manifest.dsse.json      signature, key mode (manifest.sigstore.json in sigstore mode)
    <bundle>/<anything else>         payload: every other file is a subject, logs included
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

from qualification.errors import UsageError
from qualification.evidence.facts import SealInput, timestamp
from qualification.evidence.freshness import GIT_TIMEOUT, SourceFacts, read_source
from qualification.evidence.manifest import (
    MANIFEST_NAME,
    MAX_FILE_BYTES,
    MAX_FILES,
    RESERVED_NAMES,
    SCHEMA_VERSION,
    Subject,
    allowed_env_names,
    build_statement,
    canonical_bytes,
    scan_bundle,
    schema_errors,
    sha256_file,
    write_atomic,
)
from qualification.evidence.sign import NoneSigner, Signer


@dataclass(frozen=True, slots=True, kw_only=True)
class SealedBundle:
    """What :func:`seal_bundle` wrote."""

    directory: Path
    manifest_sha256: str
    commit: str
    dirty: bool
    result: str
    subjects: int
    signature: Path | None
    archive: Path | None


def seal_bundle(
    bundle_dir: Path,
    facts: SealInput,
    *,
    repo: Path = Path("."),
    signer: Signer | None = None,
    archive: Path | None = None,
    timeout: timedelta = GIT_TIMEOUT,
) -> SealedBundle:
    """Seal ``bundle_dir``: hash every file in it, write ``manifest.json`` and the signer's envelope.

    ``repo`` is the checkout the run used (commit, ref, dirtiness; the bundle itself, if inside it, is not counted
    as a change). ``archive``, if given, is a ``.tar.gz`` path outside the bundle. Blocks on git (``timeout`` per
    call) and on reading every payload file once. Raises :class:`UsageError` for bad input (no payload, a log that
    is missing, an already sealed bundle, no git checkout) and :class:`BundleInvalid` for unsafe payload files.
    """
    signer = signer or NoneSigner()
    if not bundle_dir.is_dir():
        raise UsageError(f"bundle directory {bundle_dir} does not exist")
    if archive is not None and archive.resolve().is_relative_to(bundle_dir.resolve()):
        raise UsageError(f"archive {archive} must be outside the bundle directory")
    files = scan_bundle(bundle_dir, max_files=MAX_FILES, max_file_bytes=MAX_FILE_BYTES)
    sealed = sorted(f.name for f in files if f.name in RESERVED_NAMES)
    if sealed:
        raise UsageError(
            f"{bundle_dir} is already sealed ({', '.join(sealed)}); seal a fresh payload directory"
        )
    if not files:
        raise UsageError(f"{bundle_dir} is empty; there is nothing to seal")
    names = {f.name for f in files}
    for command in facts.commands:
        if command.log not in names:
            raise UsageError(
                f"seal input: log {command.log!r} of command {command.id!r} is not in {bundle_dir}"
            )
    subjects = [Subject(f.name, sha256_file(f.path), f.size) for f in files]
    source = read_source(repo, exclude=bundle_dir, timeout=timeout)
    statement = build_statement(subjects, _predicate(facts, source, timeout))
    problems = schema_errors(statement)
    if (
        problems
    ):  # our own output must pass our own verifier; a failure here is a bug in the facts or in us
        raise UsageError(f"sealed manifest would not pass the schema: {problems[0]}")
    manifest = canonical_bytes(statement)
    envelope = signer.sign(
        manifest
    )  # before writing: a refused signature must leave the payload unsealed
    write_atomic(bundle_dir / MANIFEST_NAME, manifest)
    signature_path = None
    if envelope is not None and signer.envelope_name is not None:
        signature_path = bundle_dir / signer.envelope_name
        write_atomic(signature_path, envelope)
    if archive is not None:
        write_archive(bundle_dir, archive)
    return SealedBundle(
        directory=bundle_dir,
        manifest_sha256=hashlib.sha256(manifest).hexdigest(),
        commit=source.commit,
        dirty=source.dirty,
        result=facts.result,
        subjects=len(subjects),
        signature=signature_path,
        archive=archive,
    )


def _predicate(facts: SealInput, source: SourceFacts, timeout: timedelta) -> dict[str, Any]:
    validated, not_validated = facts.boundaries.resolve(facts.commands)
    scope = facts.effective_scope
    return {
        "schemaVersion": SCHEMA_VERSION,
        "campaign": {
            "name": facts.campaign.name,
            "tier": facts.campaign.tier,
            "path": _display_path(facts.campaign.path, source.root),
            "digest": {"sha256": sha256_file(facts.campaign.path)},
        },
        "source": {
            "repository": source.repository,
            "ref": source.ref,
            "digest": {"gitCommit": source.commit},
            "dirty": source.dirty,
        },
        "package": {"name": facts.package_name, "version": _package_version(facts.package_name)},
        "run": {
            "invocationId": facts.invocation_id or str(uuid.uuid4()),
            "startedOn": timestamp(facts.started_on),
            "finishedOn": timestamp(facts.finished_on),
            "trigger": facts.trigger,
            "runner": facts.runner,
        },
        "environment": collect_environment(timeout),
        "topology": {
            "hosts": facts.topology.hosts,
            "worldSize": facts.topology.world_size,
            "backends": list(facts.topology.backends),
            "devices": list(facts.topology.devices),
        },
        "commands": [
            {
                "id": c.id,
                "argv": list(c.argv),
                "cwd": c.cwd,
                "startedOn": timestamp(c.started_on),
                "finishedOn": timestamp(c.finished_on),
                "exitCode": c.exit_code,
                "log": c.log,
            }
            for c in facts.commands
        ],
        "summary": {
            "total": facts.summary.total,
            "passed": facts.summary.passed,
            "failed": facts.summary.failed,
            "skipped": facts.summary.skipped,
            "measured": facts.summary.measured,
        },
        "result": facts.result,
        "scope": {
            "complete": scope.complete,
            "cellsInCampaign": scope.cells_in_campaign,
            "campaignCellsRun": scope.campaign_cells_run,
            "cellsRun": scope.cells_run,
            "filter": scope.filter,
            "seedOverride": scope.seed_override,
        },
        "boundaries": {
            "validated": [{"claim": c.claim, "backedBy": list(c.backed_by)} for c in validated],
            "notValidated": [{"claim": c.claim, "reason": c.reason} for c in not_validated],
        },
        "artifact": {
            "name": facts.artifact_name or f"qualification-evidence-{source.commit}",
            "runUrl": facts.run_url,
        },
    }


def _display_path(path: Path, root: Path) -> str:
    """``path`` relative to the checkout when inside it (``campaigns/cpu.toml``), else as given."""
    resolved = path.resolve()
    return (
        resolved.relative_to(root.resolve()).as_posix()
        if resolved.is_relative_to(root.resolve())
        else path.as_posix()
    )


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def collect_environment(timeout: timedelta = GIT_TIMEOUT) -> dict[str, Any]:
    """Python, platform, torch, CPU and GPU inventory, and the allow-listed environment variables only.

    Never imports torch (seconds, and CUDA init): its version comes from the loaded module or package metadata.
    """
    allowed = allowed_env_names()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "torch": _torch_version(),
        "cpu": {"count": os.cpu_count() or 1, "model": _cpu_model()},
        "gpus": _gpus(timeout),
        "variables": {name: os.environ[name] for name in sorted(allowed) if name in os.environ},
    }


def _torch_version() -> str | None:
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return str(loaded.__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        for line in (
            Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
        ):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def _gpus(timeout: timedelta) -> list[dict[str, Any]]:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return []
    query = [tool, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(
            query, capture_output=True, text=True, timeout=timeout.total_seconds(), check=True
        )
    except (OSError, subprocess.SubprocessError):
        return []  # a wedged driver must not stop the evidence from being sealed; the inventory just stays empty
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [part.strip() for part in line.split(",", 2)]
        if len(parts) == 3 and parts[0].isdigit() and parts[1]:
            memory = int(parts[2]) if parts[2].isdigit() else None
            gpus.append({"index": int(parts[0]), "name": parts[1], "memoryMiB": memory})
    return gpus


def write_archive(bundle_dir: Path, archive: Path) -> Path:
    """Pack ``bundle_dir`` into a reproducible ``.tar.gz`` at ``archive``: files only, sorted, at the archive root,
    with zeroed owners and times, so the same bundle always packs to the same bytes. Written atomically."""
    files = scan_bundle(bundle_dir, max_files=MAX_FILES, max_file_bytes=MAX_FILE_BYTES)

    def pack(handle: BinaryIO) -> None:
        with (
            gzip.GzipFile(fileobj=handle, mode="wb", mtime=0) as zipped,
            tarfile.open(fileobj=zipped, mode="w") as tar,
        ):
            for item in files:
                info = tarfile.TarInfo(item.name)
                info.size, info.mode, info.mtime = item.size, 0o644, 0
                with item.path.open("rb") as source:
                    tar.addfile(info, source)

    write_atomic(archive, pack)
    return archive


def sign_bundle(bundle_dir: Path, signer: Signer) -> Path:
    """Sign the already sealed ``bundle_dir`` (a separate CI job may hold the signing identity; the GPU runner need
    not). Signs ``manifest.json`` byte for byte. Raises :class:`UsageError` if unsealed, already signed that way,
    or the signer makes no signature file (mode ``none``)."""
    manifest_path = bundle_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        raise UsageError(f"{bundle_dir} is not sealed: {MANIFEST_NAME} is missing (run seal first)")
    if signer.envelope_name is None:
        raise UsageError("signing mode 'none' makes no signature; choose key or sigstore")
    target = bundle_dir / signer.envelope_name
    if target.exists():
        raise UsageError(f"{target} already exists; the bundle is already signed this way")
    envelope = signer.sign(manifest_path.read_bytes())
    if envelope is None:
        raise UsageError(f"signing mode {signer.mode!r} made no signature")
    write_atomic(target, envelope)
    return target

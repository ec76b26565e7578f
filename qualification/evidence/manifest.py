"""The manifest format: an in-toto Statement v1 whose subjects are the bundle's payload files.

Canonical bytes: keys sorted, UTF-8 (``ensure_ascii=False``), two-space indent, one trailing newline. The same
statement always serializes to the same bytes, so a manifest can be diffed, hashed and signed as-is. Only integers and
strings are stored (no floats), so no number formatting can differ between writers.

This module also holds the bundle's file rules, shared by sealing and verification: which names are reserved, what a
safe relative path is, how files are walked (never following links) and hashed (streaming SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from jsonschema import Draft202012Validator

from qualification.errors import BundleInvalid

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://gemscout.dev/qualification-evidence/v1"
SCHEMA_VERSION = "1.1.0"
"""1.1.0: ``scope``; boundaries as claim records (backing cells / reason); ``summary.measured``; results
PASSED-WITH-SKIPS and MEASURED. A 1.0.0 manifest still verifies, by the rules of its own version."""
PAYLOAD_TYPE = "application/vnd.in-toto+json"
"""DSSE payloadType of a signed manifest."""

MANIFEST_NAME = "manifest.json"
DSSE_NAME = "manifest.dsse.json"
SIGSTORE_NAME = "manifest.sigstore.json"
RESERVED_NAMES = frozenset({MANIFEST_NAME, DSSE_NAME, SIGSTORE_NAME})
"""Top-level names that are never subjects: the manifest and the signatures over it."""

MAX_FILES = 10_000
MAX_FILE_BYTES = 4 << 30
MAX_METADATA_BYTES = 64 << 20
"""Default intake limits; sealing uses them too, so a bundle we seal always passes our own intake."""

SCHEMA_FILE = "evidence-manifest.schema.json"
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Subject:
    """One payload file: its bundle-relative POSIX path, SHA-256 (hex) and size in bytes."""

    name: str
    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "digest": {"sha256": self.sha256},
            "annotations": {"sizeBytes": self.size},
        }


def build_statement(subjects: list[Subject], predicate: Mapping[str, Any]) -> dict[str, Any]:
    """The Statement dict for ``subjects`` (sorted by name) and our ``predicate``."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [s.to_json() for s in sorted(subjects, key=lambda s: s.name)],
        "predicateType": PREDICATE_TYPE,
        "predicate": dict(predicate),
    }


def canonical_bytes(document: Mapping[str, Any]) -> bytes:
    """Serialize ``document`` canonically (see the module docstring). Floats are refused: they do not round-trip."""
    _refuse_floats(document)
    return (json.dumps(document, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode(
        "utf-8"
    )


def _refuse_floats(value: Any) -> None:
    if isinstance(value, float):
        raise TypeError(f"float {value!r} in manifest: store integers or strings")
    if isinstance(value, Mapping):
        for item in value.values():
            _refuse_floats(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _refuse_floats(item)


def parse_json(data: bytes) -> Any:
    """Parse JSON, refusing duplicate keys: parsers disagree on which one wins, so one signed document could be read
    as two different claims. Raises ValueError (or RecursionError for absurd nesting)."""

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            duplicate = next(key for key in keys if keys.count(key) > 1)
            raise ValueError(f"duplicate key {duplicate!r}")
        return dict(pairs)

    return json.loads(data, object_pairs_hook=no_duplicates)


@cache
def load_schema() -> dict[str, Any]:
    """The manifest schema, ``qualification/schemas/`` (package data: the one copy)."""
    text = (
        resources.files("qualification")
        .joinpath("schemas", SCHEMA_FILE)
        .read_text(encoding="utf-8")
    )
    schema: dict[str, Any] = json.loads(text)
    return schema


def allowed_env_names() -> frozenset[str]:
    """Environment variables that may be recorded; the schema's ``envName`` enum is the single source."""
    return frozenset(load_schema()["$defs"]["envName"]["enum"])


def schema_errors(document: Any) -> list[str]:
    """Every schema violation of ``document`` as ``"/json/pointer: message"``, sorted; empty when valid.

    Formats (date-time, uri) are asserted, not just annotated: without ``format_checker`` jsonschema ignores them.
    """
    validator = Draft202012Validator(
        load_schema(), format_checker=Draft202012Validator.FORMAT_CHECKER
    )
    found = []
    for error in validator.iter_errors(document):
        pointer = "/" + "/".join(str(part) for part in error.absolute_path)
        found.append(f"{pointer}: {error.message}")
    return sorted(found)


def path_problem(name: str) -> str | None:
    """Why ``name`` is not a safe bundle-relative POSIX path, or None when it is.

    The reasons are distinct on purpose: the verifier reports each as its own failure.
    """
    if not name:
        return "is empty"
    if "\x00" in name or "\\" in name:
        return "contains a backslash or NUL"
    if name.startswith("/") or (len(name) > 1 and name[0].isalpha() and name[1] == ":"):
        return "is an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "escapes the bundle (a '..' segment)"
    if "." in parts or "" in parts:
        return "is not normalized (an empty or '.' segment)"
    return None


@dataclass(frozen=True, slots=True)
class BundleFile:
    """A regular file found in a bundle directory: relative POSIX name, absolute path, size."""

    name: str
    path: Path
    size: int


def scan_bundle(root: Path, *, max_files: int, max_file_bytes: int) -> list[BundleFile]:
    """Every regular file under ``root`` (sorted by name), including reserved ones. Never follows a link.

    Raises :class:`BundleInvalid` for a symlink anywhere, anything that is not a regular file or directory, a file
    over ``max_file_bytes``, or more than ``max_files`` files: a bundle is untrusted input until verified.
    """
    found: list[BundleFile] = []
    for name, path, info in _walk(root, PurePosixPath()):
        if stat.S_ISLNK(info.st_mode):
            raise BundleInvalid(f"intake: {name!r} is a symlink; bundles hold regular files only")
        if not stat.S_ISREG(info.st_mode):
            raise BundleInvalid(f"intake: {name!r} is not a regular file (device, socket or pipe)")
        if info.st_size > max_file_bytes:
            raise BundleInvalid(
                f"intake: {name!r} is {info.st_size} bytes, over the {max_file_bytes}-byte limit"
            )
        found.append(BundleFile(name, path, info.st_size))
        if len(found) > max_files:
            raise BundleInvalid(f"intake: more than {max_files} files in the bundle")
    return sorted(found, key=lambda f: f.name)


def _walk(directory: Path, prefix: PurePosixPath) -> Iterator[tuple[str, Path, os.stat_result]]:
    with os.scandir(directory) as entries:
        for entry in entries:
            info = entry.stat(follow_symlinks=False)
            name = str(prefix / entry.name)
            if stat.S_ISDIR(info.st_mode):
                yield from _walk(Path(entry.path), prefix / entry.name)
            else:
                yield name, Path(entry.path), info


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of ``path``, read in 1 MiB chunks so a large log never sits in memory."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` (bytes, or a function that writes to the open file) to ``path`` so that a crash leaves either
    the old file or the new one, never half of one.

    Temp file in the same directory, fsync, rename over the target, fsync the directory (the rename itself must
    survive a power cut). A leftover temp file after a crash is an undeclared file, so the bundle fails verification.
    """
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            if isinstance(data, bytes):
                handle.write(data)
            else:
                data(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def extract_archive(archive: Path, dest: Path, *, max_files: int, max_file_bytes: int) -> Path:
    """Unpack the ``.tar.gz`` bundle ``archive`` into the empty directory ``dest``; return the bundle root in it.

    Regular files only, each name checked by :func:`path_problem` before anything is written; links, devices and
    oversized members raise :class:`BundleInvalid` (they are rejected, not skipped). Never uses ``extractall``.
    """
    try:
        with tarfile.open(archive, "r:gz") as tar:
            count = 0
            for member in tar:
                name = member.name.removeprefix("./")
                if member.isdir() or name in ("", "."):
                    continue
                problem = path_problem(name)
                if problem is not None:
                    raise BundleInvalid(f"intake: archive member {member.name!r} {problem}")
                if member.issym() or member.islnk():
                    raise BundleInvalid(
                        f"intake: archive member {name!r} is a link; bundles hold regular files only"
                    )
                if not member.isreg():
                    raise BundleInvalid(f"intake: archive member {name!r} is not a regular file")
                if member.size > max_file_bytes:
                    raise BundleInvalid(
                        f"intake: archive member {name!r} is over the {max_file_bytes}-byte limit"
                    )
                count += 1
                if count > max_files:
                    raise BundleInvalid(f"intake: more than {max_files} files in the archive")
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                if source is None:
                    raise BundleInvalid(f"intake: archive member {name!r} cannot be read")
                try:
                    with source, target.open("xb") as sink:
                        while chunk := source.read(_CHUNK):
                            sink.write(chunk)
                except FileExistsError as exc:
                    raise BundleInvalid(f"intake: archive member {name!r} appears twice") from exc
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BundleInvalid(f"intake: {archive} is not a readable .tar.gz ({exc})") from exc
    entries = list(dest.iterdir())
    if not (dest / MANIFEST_NAME).exists() and len(entries) == 1 and entries[0].is_dir():
        return entries[0]  # packed with one top folder, as ``tar czf b.tgz bundle/`` does
    return dest

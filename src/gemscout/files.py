"""Reading files that something else wrote: regular files only, never past their declared size, JSON bounded.

Every reader of a checkpoint folder (GEMINI's recovery, the durable tier, ``gemscout inspect``) reads what a crashed
process, a full disk or a hostile user may have left there. A FIFO named like a step file would block ``open()``
forever, a symbolic link to ``/dev/zero`` or an 8 GiB sparse file would be read into memory whole, and a JSON file
nested a hundred thousand levels deep ends in ``RecursionError``. So: open with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO
opens without waiting for a writer, a link is refused), ``fstat`` the descriptor and accept only ``S_ISREG``, refuse
a size over the caller's cap before reading a byte, and check a parsed document's depth without recursion.
Everything refused raises :class:`~gemscout.errors.IntegrityError` naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gemscout.errors import IntegrityError

MAX_JSON_BYTES = 64 << 20
"""Default cap for a JSON document a reader accepts (a ledger, run.json, a sidecar of many ranks' skeletons)."""
MAX_JSON_DEPTH = 64
"""Default nesting cap: deeper than any document gemscout writes (a skeleton of optimizer state is ~6)."""


@contextmanager
def open_regular(path: Path) -> Iterator[tuple[int, os.stat_result]]:
    """``(fd, stat)`` of ``path`` opened read-only, if it is a regular file and not a symbolic link; the descriptor
    is closed on exit. Never blocks (a FIFO or device is refused after ``fstat``). Raises IntegrityError for a link
    or a special file, FileNotFoundError / OSError as ``open`` does otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise IntegrityError(
                f"{path} is a symbolic link; gemscout reads only regular files"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(
                f"{path} is not a regular file (a FIFO, device or folder); gemscout reads only regular files"
            )
        yield fd, st
    finally:
        os.close(fd)


def read_exactly(fd: int, offset: int, n: int, path: Path) -> bytes:
    """``n`` bytes of ``fd`` at ``offset``; raises IntegrityError if the file ends first (it shrank)."""
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, min(n - got, 1 << 24), offset + got)
        if not chunk:
            raise IntegrityError(
                f"{path.name} is truncated: it ended at {offset + got} bytes, {offset + n} expected"
            )
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """The whole of a regular file no larger than ``max_bytes`` (checked before reading)."""
    with open_regular(path) as (fd, st):
        if st.st_size > max_bytes:
            raise IntegrityError(
                f"{path} is {st.st_size} bytes, over the {max_bytes}-byte cap for this file"
            )
        return read_exactly(fd, 0, st.st_size, path)


def check_depth(doc: Any, max_depth: int, what: str) -> None:
    """Refuse a parsed JSON value nested deeper than ``max_depth`` (iterative: a deep value cannot recurse here)."""
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise IntegrityError(f"{what} is nested deeper than {max_depth} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def parse_json(
    text: bytes | str, what: str, *, max_depth: int = MAX_JSON_DEPTH, allow_nan: bool = False
) -> Any:
    """Parse a JSON document, refusing bad UTF-8, bad JSON, NaN / infinities (unless ``allow_nan``) and nesting past
    ``max_depth``, all as IntegrityError naming ``what``."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        doc = json.loads(text, parse_constant=None if allow_nan else no_constants)
    except RecursionError:
        raise IntegrityError(f"{what} is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{what} is not valid JSON: {exc}") from None
    check_depth(doc, max_depth, what)
    return doc


def load_json(
    path: Path, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """A JSON file read with :func:`read_bounded` and parsed with :func:`parse_json`."""
    return parse_json(read_bounded(path, max_bytes), str(path), max_depth=max_depth)


def is_int(value: Any, *, minimum: int = 0) -> bool:
    """A JSON integer (not a bool) of at least ``minimum``."""
    return type(value) is int and value >= minimum


def recorded_run_id(directory: Path) -> str:
    """The run id ``directory/run.json`` records, or "" when it is missing or not a small, regular JSON file holding
    ``{"run_id": "<str>"}`` (a FIFO, a link, a deep or malformed document: never a hang or a RecursionError)."""
    try:
        doc = load_json(Path(directory) / "run.json", max_bytes=1 << 20)
    except (OSError, IntegrityError):
        return ""
    run_id = doc.get("run_id") if isinstance(doc, dict) else None
    return run_id if isinstance(run_id, str) else ""

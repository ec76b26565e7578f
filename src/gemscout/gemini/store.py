"""Atomic, verified checkpoint files on a rank's local storage.

Layout under the checkpoint directory (one folder per rank, grouped by node so a node loss is one ``rm -r``)::

    node-<n>/rank-<r>/own/step-<s>.gsc                 this rank's own checkpoint of step s
    node-<n>/rank-<r>/replicas/owner-<o>/step-<s>.gsc  the replica this rank holds for rank o
    node-<n>/rank-<r>/status.json                      trust states, rejected steps, recovery attempts

Writes go to a temp file in the same folder, are fsynced, renamed into place and the folder fsynced, so a reader sees
either the old file or the whole new one. A file whose digests do not match is never loaded (fail closed). A pruned
generation may be kept as its folder's *spare* (a temp file) and overwritten by the next write there (see
:class:`Spares`).
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gemscout.errors import IntegrityError
from gemscout.files import open_regular, read_exactly
from gemscout.state.digest import DIGEST_SIZE
from gemscout.state.layout import MAX_HEADER_BYTES, Parsed, parse_prefix, verify_data

# ASCII digits only, and fullmatch (never "$", which also matches before a trailing newline): "\d" would take a
# junk name of other scripts' digits for a step (int() reads them), and that phantom step could make a real
# generation be pruned.
_STEP = re.compile(r"step-([0-9]{9})\.gsc")
_TMP = re.compile(r"\.tmp-([0-9]+)-[0-9a-f]+-")
_OWNER = re.compile(r"owner-([0-9]{1,9})")
_HEAD = struct.Struct("<8sQ")  # magic, header length (see gemscout.state.layout)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path, fsync: bool) -> None:
    """Rename the finished temp file over ``path`` (atomic), then fsync the folder so the rename is durable."""
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


@contextmanager
def atomic_writer(path: Path, *, fsync: bool = True) -> Iterator[Any]:
    """Open a temp file beside ``path``; on clean exit publish it atomically, on error remove it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{path.name}"
    try:
        with open(tmp, "wb") as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        _publish(tmp, path, fsync)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, doc: Any, *, fsync: bool = True) -> None:
    with atomic_writer(path, fsync=fsync) as fh:
        fh.write(json.dumps(doc, indent=1, sort_keys=True).encode())


def clean_stale_temps(folder: Path) -> int:
    """Remove temp files left by writers that are no longer alive. Returns how many were removed."""
    removed = 0
    if not folder.exists():
        return 0
    for path in folder.rglob(".tmp-*"):
        m = _TMP.match(path.name)  # a prefix: the rest of a temp name is the file it stands for
        if not m:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and _alive(pid):
            continue
        if pid == os.getpid():
            continue
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True, slots=True)
class RankPaths:
    """Where one rank keeps its files."""

    root: Path

    @classmethod
    def of(cls, directory: Path, *, node: int, rank: int) -> RankPaths:
        return cls(Path(directory) / f"node-{node}" / f"rank-{rank}")

    @property
    def own(self) -> Path:
        return self.root / "own"

    def replicas(self, owner: int) -> Path:
        return self.root / "replicas" / f"owner-{owner}"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    def held_owners(self) -> list[int]:
        """Owners with a replica folder here; a name that is not ``owner-<n>`` (``owner-x``) is not one. Raises
        OSError if ``replicas`` exists but cannot be listed (a file, no permission)."""
        base = self.root / "replicas"
        if not base.exists():
            return []
        return sorted(int(m.group(1)) for p in base.iterdir() if (m := _OWNER.fullmatch(p.name)))


def step_file(folder: Path, step: int) -> Path:
    return folder / f"step-{step:09d}.gsc"


def list_steps(folder: Path) -> list[int]:
    """Steps with a published file in ``folder``, newest first."""
    if not folder.exists():
        return []
    steps = [int(m.group(1)) for p in folder.iterdir() if (m := _STEP.fullmatch(p.name))]
    return sorted(steps, reverse=True)


class Spares:
    """Pruned generation files kept, one per folder, under a temp name, for the next write there to overwrite.

    Writing a checkpoint into a new file makes the kernel allocate a page-cache page and disk blocks for every 4 KiB,
    and pruning the old one frees them again; overwriting a file that already has them costs the copy only. A spare
    is only ever a temp file (``.tmp-<pid>-…-spare``), never a published name: no reader lists it, and a crash
    leaves it to :func:`clean_stale_temps`. A file with another hard link is deleted, never recycled (writing into it
    would change the other name's content). Thread-safe: a spare is handed to one writer at most.
    """

    def __init__(self) -> None:
        self._by_folder: dict[Path, Path] = {}
        self._lock = threading.Lock()

    def retire(self, path: Path) -> None:
        """Take a pruned file out of view: keep it as its folder's spare, or delete it if the folder has one."""
        with self._lock:
            if path.parent in self._by_folder:
                path.unlink(missing_ok=True)
                return
            spare = path.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-spare"
            try:
                os.rename(path, spare)
            except FileNotFoundError:
                return
            if os.lstat(spare).st_nlink != 1:
                spare.unlink(missing_ok=True)
                return
            self._by_folder[path.parent] = spare

    def take(self, folder: Path) -> Path | None:
        """The folder's spare, now owned by the caller (who publishes or deletes it), or None."""
        with self._lock:
            return self._by_folder.pop(folder, None)

    def discard(self) -> None:
        """Delete every spare (at close: an idle run keeps no extra file per folder)."""
        with self._lock:
            spares, self._by_folder = list(self._by_folder.values()), {}
        for spare in spares:
            spare.unlink(missing_ok=True)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_folder)


def write_checkpoint(
    path: Path,
    prefix: bytes,
    data: torch.Tensor,
    *,
    fsync: bool = True,
    spares: Spares | None = None,
) -> None:
    """Publish ``prefix + data`` atomically at ``path``: written with ``pwrite`` straight from ``data``'s memory
    into a temp file (the folder's spare from ``spares`` when it has one, overwritten in place and cut to size),
    fsynced, renamed over ``path``, the folder fsynced. On any error the temp file is deleted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = spares.take(path.parent) if spares is not None else None
    fd = -1
    if tmp is not None:
        try:
            fd = os.open(tmp, os.O_WRONLY)
        except FileNotFoundError:  # removed behind our back: write a new file
            tmp = None
    if tmp is None:
        tmp = path.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{path.name}"
    try:
        if fd < 0:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            end = _pwrite_all(fd, prefix, 0)
            end = _pwrite_all(fd, data.numpy().data if data.numel() else b"", end)
            os.ftruncate(fd, end)  # a recycled file may be longer; a no-op for a new one
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        _publish(tmp, path, fsync)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pwrite_all(fd: int, buf: bytes | memoryview, offset: int) -> int:
    """Write all of ``buf`` at ``offset`` (a write may be partial); returns the offset after it."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"write made no progress at offset {offset + done}")
        done += n
    return offset + done


def prune_safe(
    folder: Path,
    frontier: int,
    keep: int,
    protect: Iterable[int] = (),
    *,
    spares: Spares | None = None,
) -> None:
    """Keep every step newer than ``frontier``, the ``keep`` newest steps at or below it and every step in
    ``protect``; delete the rest (or hand them to ``spares``)."""
    kept = set(protect)
    safe = [s for s in list_steps(folder) if s <= frontier]
    for step in safe[keep:]:
        if step in kept:
            continue
        if spares is not None:
            spares.retire(step_file(folder, step))
        else:
            step_file(folder, step).unlink(missing_ok=True)


def read_verified(path: Path) -> tuple[Parsed, torch.Tensor]:
    """Read a checkpoint file and verify every digest. Returns the parsed header and its data region (uint8).

    Reads only a regular file (see :mod:`gemscout.files`), the header first and then exactly the data its header
    declares, after checking the file's size against it: a FIFO, a link to ``/dev/zero`` or a huge sparse file is
    refused before anything large is read. Raises IntegrityError (wrong or missing digest, truncation, bad magic,
    malformed header, not a regular file) or OSError (FileNotFoundError)."""
    _, parsed, data = _read_whole(path)
    verify_data(parsed, data)
    return parsed, data


def read_header(path: Path) -> Parsed:
    """Read and verify a checkpoint file's header only, and check the file's size against it.

    What recovery's inventory needs to propose the file: its identity and that it is whole. The tensor digests are
    checked only when the file is actually loaded (:func:`read_frame` + verification), so proposing a generation
    costs a few KiB of reading, not the whole file. Raises IntegrityError (bad magic, header digest, malformed
    header, truncation, trailing bytes, not a regular file) or OSError.
    """
    with open_regular(path) as (fd, st):
        return _read_prefix(fd, st.st_size, path)[1]


def _read_prefix(fd: int, size: int, path: Path) -> tuple[bytes, Parsed]:
    """The file's magic, header and header digest (read from ``fd`` at offset 0), parsed and checked against the
    file's size. Raises IntegrityError for truncation, a bad header or a size that does not match."""
    if size < _HEAD.size:
        raise IntegrityError(f"{path.name} is truncated before its header")
    start = read_exactly(fd, 0, _HEAD.size, path)
    _, header_len = _HEAD.unpack(start)
    if header_len + _HEAD.size + DIGEST_SIZE > size:
        raise IntegrityError(f"{path.name} is truncated inside its header")
    if header_len > MAX_HEADER_BYTES:
        raise IntegrityError(
            f"{path.name}: header length {header_len} is over the {MAX_HEADER_BYTES}-byte cap"
        )
    prefix = start + read_exactly(fd, _HEAD.size, header_len + DIGEST_SIZE, path)
    parsed = parse_prefix(prefix)
    _check_size(path, size, parsed)
    return prefix, parsed


def read_frame(path: Path) -> tuple[bytes, torch.Tensor]:
    """The file as a frame ``(prefix, data)``, unverified: the data is read straight into a fresh tensor (no
    intermediate copy), never more than the header declares. The header digest and structure and the file size are
    checked; the caller verifies the tensor digests. Raises IntegrityError or OSError."""
    prefix, _, data = _read_whole(path)
    return prefix, data


def _read_whole(path: Path) -> tuple[bytes, Parsed, torch.Tensor]:
    with open_regular(path) as (fd, st):
        prefix, parsed = _read_prefix(fd, st.st_size, path)
        prefix += read_exactly(
            fd, len(prefix), parsed.data_offset - len(prefix), path
        )  # the padding
        data = torch.empty(parsed.layout.data_nbytes, dtype=torch.uint8)
        if data.numel():
            view = data.numpy().data
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got : got + (1 << 26)]], parsed.data_offset + got)
                if not n:
                    raise IntegrityError(f"{path.name} is truncated: it shrank while being read")
                got += n
    return prefix, parsed, data


def _check_size(path: Path, size: int, parsed: Parsed) -> None:
    end = parsed.data_offset + parsed.layout.data_nbytes
    if size < end:
        raise IntegrityError(f"{path.name} is truncated: {size} of {end} bytes")
    if size > end:
        raise IntegrityError(f"{path.name} has {size - end} unexpected trailing bytes")

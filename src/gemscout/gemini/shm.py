"""GEMINI's memory tier: capture slots and held replicas as files in shared memory that outlive the process.

A slot is a file in a tmpfs folder (``/dev/shm`` by default) mapped into the process: the capture copies the state
straight into the mapping, so the copy *is* the persistence — a SIGKILL of the training process loses nothing that
was sealed, and a rank restarted on the same node adopts the files and recovers from them without touching disk.
A replica is received straight into the mapping of its own file, in its final place. Nothing is fsynced here: tmpfs
has no disk behind it, and what it cannot survive (the node's power, a reboot) is the disk cadence's job
(``CheckpointConfig.persist_every``).

Layout, per rank (the same names and file format as the disk tier, so every reader of :mod:`gemscout.gemini.store`
reads these too)::

    <memory_directory>/<run key>/node-<n>/rank-<r>/owner.json              pid, process start time, token
    <memory_directory>/<run key>/node-<n>/rank-<r>/own/step-<s>.gsc        a sealed capture slot
    <memory_directory>/<run key>/node-<n>/rank-<r>/replicas/owner-<o>/...  a held replica
    <directory>/node-<n>/rank-<r>/memory.json                               the anchor: where the memory is, token

The run key is the run id plus a digest of the checkpoint directory's absolute path: two jobs with the same run id
on different directories never share memory. The anchor lives in the rank's disk folder: a rank whose disk folder
is gone (its node was replaced, or a test deleted it to simulate that) finds no anchor and discards the memory it
finds, so the memory tier is lost exactly when the node's storage is.

Publishing is the disk tier's: a file is written under a temp name and renamed to ``step-<s>.gsc`` only once its
header (with every tensor digest) is in; before a published slot is written again it is renamed back to a temp
name. A SIGKILL at any moment leaves each published file whole, and temps are removed at the next start; a file
whose digests do not match is never loaded (recovery verifies what it restores).

The header's length is not known before the data is copied (it holds the digests and the caller's state), but the
data must start at a fixed offset in the mapping. So a slot reserves room for its header, and the header JSON is
padded with spaces (valid JSON whitespace, covered by the header digest) to end exactly where the data starts.

Who owns a folder (``owner.json``), removing the folders of dead jobs, and describing a rank's memory for
``gemscout inspect`` are :mod:`gemscout.gemini.shm_sweep`'s.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from gemscout.errors import ConfigError, IntegrityError
from gemscout.gemini import store
from gemscout.gemini.shm_sweep import (
    ANCHOR,
    OWNER,
    owner_alive,
    proc_start,
    read_json,
    remove_empty_parents,
    sweep_dead,
)
from gemscout.state.layout import ALIGN, Parsed, parse_prefix

log = logging.getLogger("gemscout.gemini")

PAGE = mmap.PAGESIZE
_HEAD_FIXED = 8 + 8 + 32  # magic, header length, header digest (gemscout.state.layout)
_KEY_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def run_key(run_id: str, directory: Path) -> str:
    """The folder name of one run's memory under the memory directory."""
    digest = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:12]
    return f"{_KEY_SAFE.sub('_', run_id)[:64]}-{digest}"


def reserve_for(hint: int) -> int:
    """Bytes to reserve ahead of a slot's data for a header of about ``hint`` bytes (page multiple)."""
    want = int(hint * 1.5) + _HEAD_FIXED + 1024
    return (want + PAGE - 1) // PAGE * PAGE


def pad_header(header: bytes, data_offset: int) -> bytes | None:
    """``header`` padded with spaces so that its frame prefix is exactly ``data_offset`` bytes, or None when it does
    not fit."""
    room = data_offset - _HEAD_FIXED
    if data_offset % ALIGN or len(header) > room:
        return None
    return header + b" " * (room - len(header))


class ShmFile:
    """One file of the memory tier, mapped read-write. ``data`` is the mapping's data region as a uint8 tensor."""

    def __init__(self, path: Path, total: int, data_offset: int, *, create: bool) -> None:
        self.path = path
        self.data_offset = data_offset
        self.total = total
        # Never through a link, never blocking on a FIFO: a file found here was left by another process and is
        # read like any other file of a checkpoint folder (gemscout.files).
        flags = (
            os.O_RDWR
            | os.O_NOFOLLOW
            | os.O_NONBLOCK
            | os.O_CLOEXEC
            | (os.O_CREAT | os.O_EXCL if create else 0)
        )
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise IntegrityError(
                    f"{path} is a symbolic link; gemscout maps only regular files"
                ) from None
            raise
        try:
            if not create:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise IntegrityError(
                        f"{path} is not a regular file; gemscout maps only regular files"
                    )
                if st.st_size != total:
                    # Mapping past the end would turn the first read of a missing page into SIGBUS.
                    raise IntegrityError(
                        f"{path} is {st.st_size} bytes, its header declares {total}"
                    )
            if create and total:
                try:
                    # Allocates every page now: a full tmpfs fails here with ENOSPC, not later with SIGBUS when
                    # the copy touches a page that cannot be backed.
                    os.posix_fallocate(fd, 0, total)
                except OSError as exc:
                    os.close(fd)
                    fd = -1
                    path.unlink(missing_ok=True)
                    if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                        raise _no_room(path.parent, total) from None
                    raise
            self._mm = (
                mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                if total
                else None
            )
        finally:
            if fd >= 0:
                os.close(fd)
        n = total - data_offset
        self.data = (
            torch.frombuffer(self._mm, dtype=torch.uint8, offset=data_offset, count=n)
            if self._mm is not None and n
            else torch.empty(0, dtype=torch.uint8)
        )

    def write_prefix(self, prefix: bytes) -> None:
        if len(prefix) != self.data_offset:
            raise ValueError(
                f"prefix of {len(prefix)} bytes for a data offset of {self.data_offset}"
            )
        if self._mm is not None:
            self._mm[: len(prefix)] = prefix

    def prefix(self) -> bytes:
        return bytes(self._mm[: self.data_offset]) if self._mm is not None else b""

    def move(self, path: Path) -> None:
        """Rename the file (publish or unpublish); the mapping stays valid."""
        os.replace(self.path, path)
        self.path = path

    def unlink(self) -> None:
        """Delete the file; its memory is freed once the mapping goes (the tensors that view it)."""
        self.path.unlink(missing_ok=True)


def _no_room(folder: Path, need: int) -> ConfigError:
    st = os.statvfs(folder)
    limit, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return ConfigError(
        f"GEMINI's memory tier needs {need / 2**20:.1f} MiB more in {folder} but the filesystem there has "
        f"{free / 2**20:.1f} MiB free of a {limit / 2**20:.1f} MiB limit; raise the limit (docker run --shm-size=..., "
        "or mount -o remount,size=... /dev/shm), point CheckpointConfig(memory_directory=...) at a larger tmpfs, or "
        "set memory_directory=None to keep slots in process memory (a killed process then recovers from disk)"
    )


@dataclass(frozen=True, slots=True)
class Adopted:
    """A published file found at start: its header, and the mapped file."""

    parsed: Parsed
    prefix: bytes
    file: ShmFile


class MemoryTier:
    """One rank's folder in shared memory (see the module docstring). Construct with :meth:`open`."""

    def __init__(self, root: Path, anchor: Path, token: str) -> None:
        self.root, self.anchor, self.token = root, anchor, token
        self.paths = store.RankPaths(root)
        self.base = root.parent.parent.parent  # the memory directory
        self.key = root.parent.parent.name

    @classmethod
    def open(
        cls,
        memory_directory: Path,
        *,
        run_id: str,
        directory: Path,
        node: int,
        rank: int,
        disk_root: Path,
        stale_after_s: float,
        fsync: bool,
    ) -> MemoryTier:
        """Claim this rank's memory folder: keep what a dead earlier process of this rank left if the disk anchor
        still names it, else discard it; remove what dead jobs of other runs left on this node; record this
        process as the owner and write the anchor."""
        base = Path(memory_directory)
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"CheckpointConfig.memory_directory {base} cannot be created: {exc}; point it at a "
                "tmpfs folder this user can write (e.g. /dev/shm/gemscout), or set it to None"
            ) from None
        sweep_dead(base, keep=run_key(run_id, directory), stale_after_s=stale_after_s)
        root = base / run_key(run_id, directory) / f"node-{node}" / f"rank-{rank}"
        anchor_path = disk_root / ANCHOR
        prev_owner = read_json(root / OWNER)
        if (
            prev_owner is not None
            and owner_alive(prev_owner)
            and prev_owner.get("pid") != os.getpid()
        ):
            raise ConfigError(
                f"GEMINI memory folder {root} belongs to a live process (pid {prev_owner.get('pid')}) of this run and "
                "rank; a rank runs once per job: stop the other job, or give this one another run_id or directory"
            )
        anchor = read_json(anchor_path)
        keep = (
            prev_owner is not None
            and anchor is not None
            and anchor.get("token") == prev_owner.get("token")
            and anchor.get("path") == str(root)
        )
        if root.exists() and not keep:
            why = (
                "no anchor in the rank's disk folder (its node's storage was lost)"
                if anchor is None
                else "its anchor names another memory folder"
            )
            log.warning("gemini: discarding memory folder %s: %s", root, why)
            shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        token = prev_owner["token"] if keep and prev_owner is not None else uuid.uuid4().hex
        store.write_json_atomic(
            root / OWNER,
            {
                "pid": os.getpid(),
                "start": proc_start(os.getpid()),
                "token": token,
                "run_id": run_id,
                "directory": str(directory),
            },
            fsync=False,
        )
        if not keep or anchor is None:
            store.write_json_atomic(anchor_path, {"path": str(root), "token": token}, fsync=fsync)
        tier = cls(root, anchor_path, token)
        tier._remove_temps()
        return tier

    # ------------------------------------------------------------------ files
    def new_file(self, folder: Path, nbytes: int, data_offset: int) -> ShmFile:
        """A new, unpublished file for ``nbytes`` of data after ``data_offset`` bytes of header room."""
        folder.mkdir(parents=True, exist_ok=True)
        return ShmFile(self._temp(folder), data_offset + nbytes, data_offset, create=True)

    def _temp(self, folder: Path) -> Path:
        return folder / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-slot"

    def publish(self, f: ShmFile, folder: Path, step: int) -> None:
        """Give a file whose prefix and data are complete its step's name (atomic)."""
        f.move(store.step_file(folder, step))

    def unpublish(self, f: ShmFile) -> None:
        """Take a published file out of view before it is written again."""
        if store._STEP.match(f.path.name):
            f.move(self._temp(f.path.parent))

    def _remove_temps(self) -> None:
        for p in self.root.rglob(".tmp-*"):
            p.unlink(missing_ok=True)

    def adopt(self, folder: Path, keep: int) -> list[Adopted]:
        """Map the ``keep`` newest published files of ``folder`` whose header verifies, newest first; delete the
        rest. The tensor digests are checked when recovery loads one (fail closed)."""
        out: list[Adopted] = []
        for step in store.list_steps(folder):
            path = store.step_file(folder, step)
            if len(out) >= keep:
                path.unlink(missing_ok=True)
                continue
            try:
                parsed = store.read_header(path)
                f = ShmFile(
                    path,
                    parsed.data_offset + parsed.layout.data_nbytes,
                    parsed.data_offset,
                    create=False,
                )
                prefix = f.prefix()
                # The header kept is the mapping's own, parsed again: the file may have changed since it was read.
                if parse_prefix(prefix) != parsed:
                    raise IntegrityError("its header changed while it was being adopted")
            except (IntegrityError, OSError, ValueError) as exc:
                log.warning("gemini: memory file %s is unusable, removed: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            out.append(Adopted(parsed, prefix, f))
        return out

    def held_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*.gsc") if p.is_file())

    def check_room(self, need: int) -> None:
        """Raise ConfigError before a capture when the tmpfs cannot hold ``need`` more bytes."""
        st = os.statvfs(self.root)
        if need <= st.f_bavail * st.f_frsize:
            return
        # Dead jobs' memory goes before this job is refused, without waiting out their grace period.
        if sweep_dead(self.base, keep=self.key, stale_after_s=0.0):
            st = os.statvfs(self.root)
            if need <= st.f_bavail * st.f_frsize:
                return
        raise _no_room(self.root, need)

    def close(self, *, release: bool) -> None:
        """``release``: the job ended cleanly — delete this rank's memory and its anchor. Otherwise keep it for a
        restart of this rank (a later job of another run removes it once this process is dead)."""
        if not release:
            return
        shutil.rmtree(self.root, ignore_errors=True)
        self.anchor.unlink(missing_ok=True)
        remove_empty_parents(self.root, stop=2)

"""The durable tier: a standard ``torch.distributed.checkpoint`` directory per promoted step, plus a SHA-256 sidecar.

Any DCP user can load a promotion (its tensors are keyed ``t<index>``); gemscout additionally records, in the sidecar
``gemscout-sidecar.json``, the SHA-256 of every file of the directory and the JSON skeleton that turns the tensors
back into model, optimizer, scheduler, caller and RNG state. Loading verifies the sidecar first: a promotion with a
missing, extra or altered file is refused (fail closed).

Every rank promotes together, off the training thread, on a dedicated group (:mod:`gemscout.gemini.durable_sharded`):
sharded state (DTensor shards, DeepSpeed ZeRO partitions) has a part on each rank, and under DDP, where model,
optimizer and schedulers are the same everywhere and stored once, each rank's RNG streams and caller state are its
own. The directory is written under a temporary name and renamed into place, so a reader never sees half a
promotion. Any world size can load a DDP promotion (on another size, rank r takes rank r % n's own state), which is
how a job resumes on another size. Format 1 (rank 0's checkpoint alone, tensors keyed ``t<index>``) is still read.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gemscout.errors import IntegrityError
from gemscout.files import is_int, load_json, open_regular
from gemscout.gemini import held_files
from gemscout.state import integrity, training_state
from gemscout.state.codec import decode
from gemscout.state.layout import check_skeleton

# torch.distributed.checkpoint is imported where it is used: importing it imports DTensor, ~45 MiB of resident memory
# and seconds of import time that a job without the durable tier (or without DTensors) should not pay.
log = logging.getLogger("gemscout.gemini")
SIDECAR = "gemscout-sidecar.json"
_DIR = re.compile(r"step-([0-9]{9})")  # ASCII digits, fullmatch (see gemscout.gemini.store)
_HEX = frozenset("0123456789abcdef")
MAX_SIDECAR_BYTES = 256 << 20


def _sha256(path: Path, size: int | None = None) -> str:
    """Streamed SHA-256 of a regular file; with ``size``, refused (IntegrityError) unless the file has exactly that
    many bytes, checked before reading and never read past."""
    with open_regular(path) as (fd, st):
        return _sha256_fd(path.name, fd, st, size)


def _sha256_fd(name: str, fd: int, st: os.stat_result, size: int | None) -> str:
    h = hashlib.sha256()
    if size is not None and st.st_size != size:
        raise IntegrityError(f"{name} is {st.st_size} bytes, not the {size} its sidecar records")
    done, end = 0, st.st_size if size is None else size
    while done < end:
        block = os.pread(fd, min(1 << 20, end - done), done)
        if not block:
            raise IntegrityError(f"{name} shrank while being hashed")
        h.update(block)
        done += len(block)
    return h.hexdigest()


def check_sidecar(doc: Any, step: int) -> dict[str, Any]:
    """The sidecar's structure, checked before anything in it is used: ``files`` maps plain file names to
    ``{"sha256": 64 hex digits, "size": int >= 0}``; a sharded one lists per rank an object with its skeleton,
    identity and ``entries`` of ``[key, shape | null, stride | null]``; format 1 gives a tensor count. Raises
    IntegrityError naming what is wrong."""

    def refuse(why: str) -> IntegrityError:
        return IntegrityError(f"durable step {step}: sidecar is malformed: {why}")

    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise refuse("no files object")
    for name, meta in doc["files"].items():
        if not name or "/" in name or name in (".", "..", SIDECAR) or "\0" in name:
            raise refuse(f"file name {name!r} is not a plain name")
        if (
            not isinstance(meta, dict)
            or not is_int(meta.get("size"))
            or not isinstance(meta.get("sha256"), str)
            or len(meta["sha256"]) != 64
            or not set(meta["sha256"]) <= _HEX
        ):
            raise refuse(f"file {name!r} has no valid size and sha256")
    if not isinstance(doc.get("run_id", ""), str):
        raise refuse("run_id is not a string")
    if doc.get("sharded"):
        ranks = doc.get("ranks")
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
            raise refuse("ranks is not a non-empty list of objects")
        for i, r in enumerate(ranks):
            if r.get("codec") is not None:
                if not isinstance(r["codec"], str):
                    raise refuse(f"rank {i} codec is not a string")
                continue
            entries = r.get("entries")
            if not isinstance(entries, list) or not all(
                isinstance(e, list)
                and len(e) == 3
                and isinstance(e[0], str)
                and all(
                    v is None or (isinstance(v, list) and all(is_int(d) for d in v)) for v in e[1:]
                )
                for e in entries
            ):
                raise refuse(f"rank {i} entries are not [key, shape, stride] lists")
            if not isinstance(r.get("identity"), dict) or not is_int(r.get("rank_specific", 0)):
                raise refuse(f"rank {i} has no identity object")
            try:
                check_skeleton(r.get("skeleton"), len(entries))
            except IntegrityError as exc:
                raise refuse(f"rank {i}: {exc}") from None
    else:
        if not is_int(doc.get("tensors")):
            raise refuse("tensors is not a non-negative integer")
        try:
            check_skeleton(doc.get("skeleton"), doc["tensors"])
        except IntegrityError as exc:
            raise refuse(str(exc)) from None
    return doc


def _check_mac(sidecar: dict[str, Any], step: int) -> None:
    """With the job's integrity key, the sidecar must carry a valid MAC (see :mod:`gemscout.state.integrity`)."""
    from gemscout.gemini.durable_sharded import sidecar_canonical

    key = integrity.current_key()
    mac = sidecar.get("mac")
    if key is None:
        if mac is not None:
            raise IntegrityError(
                f"durable step {step}: the promotion is authenticated with an integrity key this "
                f"process does not have; set {integrity.ENV_KEY_FILE} or {integrity.ENV_KEY}"
            )
        return
    if not isinstance(mac, str) or not hmac.compare_digest(
        mac, integrity.sidecar_mac(sidecar_canonical(sidecar), key)
    ):
        raise IntegrityError(
            f"durable step {step}: sidecar MAC missing or wrong: not written with this job's "
            "integrity key (forged or another job)"
        )


class DurableTier:
    """Promotions under ``directory`` (shared by every rank)."""

    def __init__(
        self,
        directory: Path,
        *,
        run_id: str,
        fsync: bool = True,
        group: dist.ProcessGroup | None = None,
        rank: int = 0,
    ) -> None:
        self.directory, self.run_id, self.fsync = Path(directory), run_id, fsync
        self.group, self.rank = group, rank
        """``group``: the dedicated gloo group of collective (sharded) promotions and loads; None for DDP state."""

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}"

    def verify(self, step: int) -> dict[str, Any]:
        """Check the sidecar against the directory: exactly its files, each with its SHA-256. Returns the sidecar."""
        with contextlib.ExitStack() as stack:
            return self._verify_held(step, stack)[0]

    def _verify_held(
        self, step: int, stack: contextlib.ExitStack
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """:meth:`verify`, keeping every file open (until ``stack`` closes): the sidecar and name -> descriptor of
        the very files that were hashed (:mod:`gemscout.gemini.held_files`)."""
        folder = self.path(step)
        try:
            sidecar = check_sidecar(load_json(folder / SIDECAR, max_bytes=MAX_SIDECAR_BYTES), step)
            files = sidecar["files"]
            # Every entry but the sidecar is one of its files: a folder, link or FIFO among them is refused too.
            present = {p.name for p in folder.iterdir() if p.name != SIDECAR}
        except (OSError, IntegrityError) as exc:
            raise IntegrityError(
                f"durable step {step}: sidecar missing or unreadable ({exc})"
            ) from None
        _check_mac(sidecar, step)
        if present != set(files):
            raise IntegrityError(
                f"durable step {step}: files {sorted(present ^ set(files))} differ from the sidecar"
            )

        held: dict[str, int] = {}
        for name, meta in files.items():
            try:
                fd, st = stack.enter_context(open_regular(folder / name))
                digest = _sha256_fd(name, fd, st, meta["size"])
            except (OSError, IntegrityError) as exc:
                raise IntegrityError(f"durable step {step}: {name} is unreadable ({exc})") from None
            if not hmac.compare_digest(digest, meta["sha256"]):
                raise IntegrityError(f"durable step {step}: {name} does not match its SHA-256")
            held[name] = fd
        return sidecar, held

    def steps(self) -> list[int]:
        if not self.directory.exists():
            return []
        return sorted(
            (int(m.group(1)) for p in self.directory.iterdir() if (m := _DIR.fullmatch(p.name))),
            reverse=True,
        )

    def scan(self) -> list[tuple[int, str | None]]:
        """This run's promotions from the newest down to the first that verifies (included), each with why it is
        refused (None: it verifies). A promotion of another run is skipped (a shared directory may hold one; it is
        not this job's history); one whose sidecar cannot even be read is this job's and refused."""
        found: list[tuple[int, str | None]] = []
        for step in self.steps():
            try:
                sidecar = self.verify(step)
            except IntegrityError as exc:
                log.warning("gemini: %s", exc)
                found.append((step, str(exc)))
                continue
            if sidecar.get("run_id") != self.run_id:
                log.warning(
                    "gemini: durable step %d belongs to run %r, not %r; skipped",
                    step,
                    sidecar.get("run_id"),
                    self.run_id,
                )
                continue
            found.append((step, None))
            break
        return found

    def newest_step(self) -> int | None:
        """The newest promotion that verifies; broken ones are logged and skipped."""
        return next((step for step, why in self.scan() if why is None), None)

    def load(self, step: int, sources: training_state.StateSources) -> None:
        """Verify, then restore the promotion of ``step`` into the live objects (any world size). A sharded
        promotion loads collectively: every rank of ``group`` calls (recovery decisions are collective)."""
        with contextlib.ExitStack() as stack:
            # DCP reads the descriptors that were hashed, never the names again: a file swapped after the check
            # is not what loads.
            sidecar, held = self._verify_held(step, stack)
            reader = held_files.storage_reader(self.path(step), held)
            if sidecar.get("sharded"):
                from gemscout.gemini import durable_sharded

                durable_sharded.load(
                    self.path(step),
                    sidecar,
                    sources,
                    group=self.group,
                    rank=self.rank,
                    reader=reader,
                )
                return
            import torch.distributed.checkpoint as dcp

            meta = reader.read_metadata()
            tensors: dict[str, torch.Tensor] = {}
            for i in range(int(sidecar["tensors"])):
                md = meta.state_dict_metadata[f"t{i}"]
                tensors[f"t{i}"] = torch.empty(md.size, dtype=md.properties.dtype)  # type: ignore[union-attr]
            dcp.load(tensors, storage_reader=reader, no_dist=True)
        state = decode(sidecar["skeleton"], [tensors[f"t{i}"] for i in range(len(tensors))])
        training_state.restore(sources, state)

"""The durable tier: a standard ``torch.distributed.checkpoint`` directory per promoted step, plus a SHA-256 sidecar.

Any DCP user can load a promotion; gemscout additionally records, in the sidecar (:mod:`.sidecar`), the SHA-256 of
every file of the directory and the JSON skeleton that turns the tensors back into model, optimizer, scheduler,
caller and RNG state. Loading verifies the sidecar first: a promotion with a missing, extra or altered file is
refused (fail closed), and DCP then reads the very files that were hashed (:mod:`.held_files`).

Promotions are written collectively by every rank (:mod:`.promote`) and loaded collectively (:mod:`.load`). Any world
size can load a DDP promotion (on another size, rank r takes rank r % n's own state), which is how a job resumes on
another size. Format 1 (rank 0's checkpoint alone, tensors keyed ``t<index>``) is still read, here.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gemscout.errors import IntegrityError
from gemscout.files import load_json, open_regular
from gemscout.gemini.durable import held_files
from gemscout.gemini.durable import load as collective
from gemscout.gemini.durable.sidecar import (
    MAX_SIDECAR_BYTES,
    SIDECAR,
    check_mac,
    check_sidecar,
    sha256_fd,
)
from gemscout.state import training_state
from gemscout.state.codec import decode

# torch.distributed.checkpoint is imported where it is used: importing it imports DTensor, ~45 MiB of resident memory
# and seconds of import time that a job without the durable tier (or without DTensors) should not pay.
log = logging.getLogger("gemscout.gemini")
_DIR = re.compile(r"step-([0-9]{9})")  # ASCII digits, fullmatch (see gemscout.gemini.store)


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
        the very files that were hashed (:mod:`.held_files`)."""
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
        check_mac(sidecar, step)
        if present != set(files):
            raise IntegrityError(
                f"durable step {step}: files {sorted(present ^ set(files))} differ from the sidecar"
            )

        held: dict[str, int] = {}
        for name, meta in files.items():
            try:
                fd, st = stack.enter_context(open_regular(folder / name))
                digest = sha256_fd(name, fd, st, meta["size"])
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
                collective.load(
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

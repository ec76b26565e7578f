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

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gemscout.errors import IntegrityError
from gemscout.state import training_state
from gemscout.state.codec import decode

# torch.distributed.checkpoint is imported where it is used: importing it imports DTensor, ~45 MiB of resident memory
# and seconds of import time that a job without the durable tier (or without DTensors) should not pay.
log = logging.getLogger("gemscout.gemini")
SIDECAR = "gemscout-sidecar.json"
_DIR = re.compile(r"^step-(\d{9})$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class DurableTier:
    """Promotions under ``directory`` (shared by every rank)."""

    def __init__(self, directory: Path, *, run_id: str, fsync: bool = True, group: dist.ProcessGroup | None = None,
                 rank: int = 0) -> None:
        self.directory, self.run_id, self.fsync = Path(directory), run_id, fsync
        self.group, self.rank = group, rank
        """``group``: the dedicated gloo group of collective (sharded) promotions and loads; None for DDP state."""

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:09d}"

    def verify(self, step: int) -> dict[str, Any]:
        """Check the sidecar against the directory: exactly its files, each with its SHA-256. Returns the sidecar."""
        folder = self.path(step)
        try:
            sidecar = json.loads((folder / SIDECAR).read_text())
            files = sidecar["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"durable step {step}: sidecar missing or unreadable ({exc})") from None
        present = {p.name for p in folder.iterdir() if p.is_file() and p.name != SIDECAR}
        if present != set(files):
            raise IntegrityError(f"durable step {step}: files {sorted(present ^ set(files))} differ from the sidecar")
        for name, meta in files.items():
            if (folder / name).stat().st_size != meta["size"] or _sha256(folder / name) != meta["sha256"]:
                raise IntegrityError(f"durable step {step}: {name} does not match its SHA-256")
        return sidecar

    def steps(self) -> list[int]:
        if not self.directory.exists():
            return []
        return sorted((int(m.group(1)) for p in self.directory.iterdir() if (m := _DIR.match(p.name))), reverse=True)

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
                log.warning("gemini: durable step %d belongs to run %r, not %r; skipped", step,
                            sidecar.get("run_id"), self.run_id)
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
        sidecar = self.verify(step)
        if sidecar.get("sharded"):
            from gemscout.gemini import durable_sharded

            durable_sharded.load(self.path(step), sidecar, sources, group=self.group, rank=self.rank)
            return
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(self.path(step)))
        meta = reader.read_metadata()
        tensors: dict[str, torch.Tensor] = {}
        for i in range(int(sidecar["tensors"])):
            md = meta.state_dict_metadata[f"t{i}"]
            tensors[f"t{i}"] = torch.empty(md.size, dtype=md.properties.dtype)  # type: ignore[union-attr]
        dcp.load(tensors, checkpoint_id=str(self.path(step)), no_dist=True)
        state = decode(sidecar["skeleton"], [tensors[f"t{i}"] for i in range(len(tensors))])
        training_state.restore(sources, state)

"""A run's identity on disk: which run a checkpoint folder belongs to, and whether this job may use it.

``enable_resiliency`` calls these at attach time, in this order, before any checkpoint is read:

- :func:`resolve_run_id`: the run id (explicit from the config or ``GEMSCOUT_RUN_ID``; otherwise the one recorded in
  ``<directory>/run.json``, the launcher's job id or a fresh one, agreed over the group);
- :func:`check_recorded_run`: refuse (``RunMismatchError``) a folder recorded for another run when the id is explicit;
- :func:`record_run`: mark the folder as this run's in ``<directory>/run.json`` (once);
- :func:`topology_digest`: the job's shape (world, nodes, every rank's state names and shapes), which every
  checkpoint and replica carries so one of another topology is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gemscout._modules import unwrap
from gemscout.errors import RunMismatchError
from gemscout.files import recorded_run_id
from gemscout.gemini.config import CheckpointConfig
from gemscout.gemini.replication import Placement

log = logging.getLogger("gemscout")


def resolve_run_id(
    config: CheckpointConfig, group: dist.ProcessGroup, timeout: timedelta
) -> tuple[str, bool]:
    """The run identity and whether it was given explicitly (explicit ids are checked strictly)."""
    explicit = config.run_id or os.environ.get("GEMSCOUT_RUN_ID")
    if explicit:
        return explicit, True
    from gemscout import _dist as comm

    recorded = recorded_run_id(
        config.directory
    )  # never hangs or raises: a bad run.json reads as none
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    launcher = (elastic if elastic not in ("", "none") else "") or os.environ.get(
        "SLURM_JOB_ID", ""
    )
    mine = recorded or launcher or uuid.uuid4().hex
    chosen = comm.gather_json(mine, group=group, timeout=timeout)
    run_id = next((c for c in chosen if recorded and c == recorded), chosen[0])
    return run_id, False


def check_recorded_run(directory: Path, run_id: str, explicit: bool) -> None:
    """Refuse ``directory`` when ``run_id`` was given explicitly and its ``run.json`` records another run.

    An id that was not explicit is never refused (:func:`resolve_run_id` already prefers the recorded one); a
    missing or unreadable ``run.json`` records none. Raises RunMismatchError naming both ids."""
    if not explicit:
        return
    recorded = recorded_run_id(directory)
    if recorded and recorded != run_id:
        raise RunMismatchError(
            f"{directory} holds checkpoints of run {recorded!r}, not {run_id!r}; resume with run_id={recorded!r} "
            "or use a fresh directory"
        )


def record_run(directory: Path, run_id: str, *, fsync: bool) -> None:
    """Mark ``directory`` as this run's (once); a later run with another explicit id is then refused up front."""
    marker = directory / "run.json"
    if marker.exists():
        return
    from gemscout.gemini.store import write_json_atomic

    try:
        write_json_atomic(marker, {"run_id": run_id}, fsync=fsync)
    except OSError as exc:
        log.warning("gemscout: cannot record the run id in %s: %s", marker, exc)


def topology_digest(
    model: nn.Module,
    world_size: int,
    placement: Placement,
    group: dist.ProcessGroup,
    timeout: timedelta,
) -> str:
    """A digest of the job's shape: world, nodes and every rank's state names and shapes. Collective over ``group``.

    Every rank's, not this rank's own: pipeline stages hold different modules, and a rank checks the replicas it
    holds for its peers against its own digest, so the digest must be the same on every rank."""
    from gemscout import _dist as comm

    # Megatron modules keep non-tensor ``_extra_state`` entries (None) in their state dicts: named, without a shape.
    shapes = [
        [n, list(p.shape), str(p.dtype)]
        if isinstance(p, torch.Tensor)
        else [n, None, type(p).__name__]
        for n, p in unwrap(model).state_dict().items()
    ]
    every = comm.gather_json(shapes, group=group, timeout=timeout)
    doc = {
        "world_size": world_size,
        "ranks_per_node": placement.ranks_per_node,
        "model": shapes if all(s == shapes for s in every) else every,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]

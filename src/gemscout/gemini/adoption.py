"""A rank's memory tier at start: opened (or none, where its folder cannot be), and what a killed earlier process of
the same rank left there adopted: its sealed slots and the replicas it held.

The checkpointer calls both once, while it is built; adoption checks each file's identity (owner, run, topology) and
removes one that is not this run's, and recovery verifies every digest when it loads one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gemscout.errors import IntegrityError, RunMismatchError
from gemscout.gemini import shm
from gemscout.gemini.config import CheckpointConfig

if TYPE_CHECKING:
    from pathlib import Path

    from gemscout.gemini.replication import ReplicaBuffers
    from gemscout.gemini.slots import SlotPool

log = logging.getLogger("gemscout.gemini")


def open_memory(
    config: CheckpointConfig, *, run_id: str, node: int, rank: int, disk_root: Path
) -> shm.MemoryTier | None:
    """This rank's memory tier under ``config.memory_directory``; None without one, or when the default folder's
    parent (``/dev/shm``) does not exist here (slots then stay in process memory)."""
    base = config.memory_directory
    if base is None:
        return None
    if (
        base == CheckpointConfig.__dataclass_fields__["memory_directory"].default
        and not base.parent.is_dir()
    ):
        log.warning("gemini: %s does not exist here; slots stay in process memory", base.parent)
        return None
    return shm.MemoryTier.open(
        base,
        run_id=run_id,
        directory=config.directory,
        node=node,
        rank=rank,
        disk_root=disk_root,
        stale_after_s=config.stale_memory_after.total_seconds(),
        fsync=config.fsync,
    )


def adopt(
    memory: shm.MemoryTier,
    *,
    rank: int,
    slots: int,
    pool: SlotPool,
    held: Callable[[int], ReplicaBuffers],
    check_identity: Callable[..., None],
) -> None:
    """Take what a killed earlier process of this rank left in ``memory``: its sealed slots into ``pool``, and the
    replicas it held into ``held(owner)``, at most ``slots`` of each. ``check_identity(identity, where=...)``
    raises for another run's file, which is removed."""

    def mine(found: list[shm.Adopted], owner: int) -> list[shm.Adopted]:
        ok = []
        for got in found:
            try:
                if got.parsed.identity.get("owner") != owner:
                    raise IntegrityError(
                        f"owner {got.parsed.identity.get('owner')}, expected {owner}"
                    )
                check_identity(got.parsed.identity, where=str(got.file.path))
                ok.append(got)
            except (IntegrityError, RunMismatchError) as exc:
                log.warning(
                    "gemini: memory file %s is not this run's, removed: %s", got.file.path, exc
                )
                got.file.unlink()
        return ok

    pool.adopt(mine(memory.adopt(memory.paths.own, slots), rank))
    for owner in memory.paths.held_owners():
        found = mine(memory.adopt(memory.paths.replicas(owner), slots), owner)
        if found:
            held(owner).adopt(found)

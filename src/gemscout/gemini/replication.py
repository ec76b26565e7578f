"""Where replicas go, and the buffers that hold the replicas this rank keeps for its peers.

Placement is a ring over nodes: rank ``r`` sends its checkpoint to the rank with the same local index ``jump`` nodes
further on, so a replica never shares a node with its owner when there is more than one node. With one node it
goes to the rank ``jump`` places further on (protects against a process loss, not a node loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gemscout.errors import ConfigError

if TYPE_CHECKING:
    from gemscout.gemini.shm import Adopted, MemoryTier, ShmFile


@dataclass(frozen=True, slots=True)
class Placement:
    """Ring placement of replicas. ``target(r)`` holds r's replica; ``source(r)`` is the owner r holds."""

    world_size: int
    ranks_per_node: int
    jump: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ConfigError(
                f"ranks_per_node={self.ranks_per_node} must divide world_size={self.world_size}; "
                "set CheckpointConfig(ranks_per_node=...) or LOCAL_WORLD_SIZE"
            )
        span = self.nodes if self.nodes > 1 else self.world_size
        if self.world_size > 1 and not 1 <= self.jump < span:
            raise ConfigError(
                f"replication_jump must be in 1..{span - 1} for this topology, got {self.jump}"
            )

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def _shift(self) -> int:
        return self.jump * (self.ranks_per_node if self.nodes > 1 else 1)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def target(self, rank: int) -> int:
        return (rank + self._shift) % self.world_size

    def source(self, rank: int) -> int:
        return (rank - self._shift) % self.world_size


class ReplicaBuffers:
    """The last ``keep`` replicas received from one owner, in memory. Buffers are reused when sizes match.

    With a memory tier (``memory``), each buffer is the mapping of a file in shared memory: a replica is received
    straight into its file, the verified prefix is written in front of it and the file is published under the
    step's name, so a restarted holder still has it and no copy is made on receipt. The buffer a transfer lands in
    is never one of the entries, so the newest complete replica stays whole while the next one arrives.

    Backpressure's other half (see :class:`gemscout.gemini.slots.SlotPool`): the replica of the agreed
    ``frontier`` step, and one received whose agreement has not run yet, are never the buffer the next transfer
    lands in nor dropped for a newer one — a lost owner comes back from them."""

    def __init__(self, keep: int = 2, memory: MemoryTier | None = None, owner: int = -1) -> None:
        self.keep = keep
        self.memory, self.owner = memory, owner
        self.entries: list[
            tuple[int, bytes, torch.Tensor]
        ] = []  # (step, prefix, data), newest first
        self._files: dict[int, ShmFile] = {}  # step -> its published file (memory tier)
        self._landing: ShmFile | None = None  # the unpublished file a transfer is landing in
        self.frontier = -1
        """The newest step every rank agreed has landed everywhere (set by the io thread after each agreement)."""
        self._unsettled: int | None = None  # received, agreement not yet run

    def adopt(self, found: list[Adopted]) -> None:
        """The published replicas a killed earlier process of this rank left (newest first)."""
        for got in found[: self.keep]:
            step = int(got.parsed.identity["step"])
            self.entries.append((step, got.prefix, got.file.data))
            self._files[step] = got.file
        for got in found[self.keep :]:
            got.file.unlink()

    def settle(self, frontier: int) -> None:
        """The ranks agreed on the newest transfer: ``frontier`` is the newest step every rank holds."""
        self.frontier = max(self.frontier, frontier)
        self._unsettled = None

    def reset_frontier(self, step: int) -> None:
        self.frontier, self._unsettled = step, None

    def _protected(self, step: int) -> bool:
        return step == self.frontier or step == self._unsettled

    def _reusable_entry(self, nbytes: int, prefix_nbytes: int | None) -> int | None:
        """Index of the oldest entry the next transfer may land in (full, not protected, the same size)."""
        if len(self.entries) < self.keep:
            return None
        for i in range(len(self.entries) - 1, -1, -1):
            step, _, data = self.entries[i]
            if self._protected(step) or data.numel() != nbytes:
                continue
            if prefix_nbytes is not None:
                f = self._files.get(step)
                if f is None or f.data_offset != prefix_nbytes:
                    continue
            return i
        return None

    def buffer_for(self, nbytes: int, prefix_nbytes: int = 0) -> torch.Tensor:
        """A buffer to receive into: the oldest unprotected entry's when full and equal in size, else a new one."""
        if self.memory is not None and prefix_nbytes > 0:
            return self._file_for(nbytes, prefix_nbytes)
        i = self._reusable_entry(nbytes, None)
        if i is not None:
            return self.entries.pop(i)[2]
        return torch.empty(nbytes, dtype=torch.uint8)

    def _file_for(self, nbytes: int, prefix_nbytes: int) -> torch.Tensor:
        assert self.memory is not None
        if self._landing is not None:  # an earlier transfer that did not complete
            if self._landing.data.numel() == nbytes and self._landing.data_offset == prefix_nbytes:
                return self._landing.data
            self._landing.unlink()
            self._landing = None
        i = self._reusable_entry(nbytes, prefix_nbytes)
        if i is not None:
            step = self.entries.pop(i)[0]
            f = self._files.pop(step)
            self.memory.unpublish(f)  # out of view before the transfer overwrites it
            self._landing = f
            return f.data
        self._landing = self.memory.new_file(
            self.memory.paths.replicas(self.owner), nbytes, prefix_nbytes
        )
        return self._landing.data

    def add(self, step: int, prefix: bytes, data: torch.Tensor) -> None:
        """Keep a verified replica. If it landed in a memory-tier file, its prefix is written and it is published."""
        landing = self._landing
        if (
            self.memory is not None
            and landing is not None
            and landing.data.data_ptr() == data.data_ptr()
            and landing.data_offset == len(prefix)
        ):
            landing.write_prefix(prefix)
            old = self._files.pop(step, None)
            if old is not None:
                old.unlink()
            self.memory.publish(landing, self.memory.paths.replicas(self.owner), step)
            self._files[step] = landing
            self._landing = None
        self.entries = [e for e in self.entries if e[0] != step]
        self.entries.insert(0, (step, prefix, data))
        self.entries.sort(key=lambda e: -e[0])
        self._unsettled = step
        while len(self.entries) > self.keep:
            # the oldest unprotected one goes (the frontier's stays while a newer one waits for its agreement)
            drop = next(
                (
                    i
                    for i in range(len(self.entries) - 1, -1, -1)
                    if not self._protected(self.entries[i][0])
                ),
                len(self.entries) - 1,
            )
            dropped = self.entries.pop(drop)[0]
            f = self._files.pop(dropped, None)
            if f is not None:
                f.unlink()

    def get(self, step: int) -> tuple[bytes, torch.Tensor] | None:
        for s, prefix, data in self.entries:
            if s == step:
                return prefix, data
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of the replicas held (data regions)."""
        return sum(int(e[2].numel()) for e in self.entries)

    def steps(self) -> list[int]:
        return [e[0] for e in self.entries]

    def file_of(self, step: int) -> ShmFile | None:
        return self._files.get(step)

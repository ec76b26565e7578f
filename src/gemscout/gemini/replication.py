"""Where replicas go, and the buffers that hold the replicas this rank keeps for its peers.

Placement is a ring over nodes: rank ``r`` sends its checkpoint to the rank with the same local index ``jump`` nodes
further on, so a replica never shares a node with its owner when there is more than one node. With one node it
goes to the rank ``jump`` places further on (protects against a process loss, not a node loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gemscout.errors import ConfigError


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
            raise ConfigError(f"replication_jump must be in 1..{span - 1} for this topology, got {self.jump}")

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
    """The last ``keep`` replicas received from one owner, in memory. Buffers are reused when sizes match."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.entries: list[tuple[int, bytes, torch.Tensor]] = []  # (step, prefix, data), newest first

    def buffer_for(self, nbytes: int) -> torch.Tensor:
        """A buffer to receive into: the oldest entry's when full and equal in size, else a new one."""
        if len(self.entries) >= self.keep and self.entries[-1][2].numel() == nbytes:
            return self.entries.pop()[2]
        return torch.empty(nbytes, dtype=torch.uint8)

    def add(self, step: int, prefix: bytes, data: torch.Tensor) -> None:
        self.entries = [e for e in self.entries if e[0] != step]
        self.entries.insert(0, (step, prefix, data))
        self.entries.sort(key=lambda e: -e[0])
        del self.entries[self.keep :]

    def get(self, step: int) -> tuple[bytes, torch.Tensor] | None:
        for s, prefix, data in self.entries:
            if s == step:
                return prefix, data
        return None

    def steps(self) -> list[int]:
        return [e[0] for e in self.entries]

"""Which ranks share a node.

GEMINI places each rank's replica on another node, so that losing a node never loses a capture and its replica
together. That needs the number of ranks per node. torchrun says it (``LOCAL_WORLD_SIZE``), as do DeepSpeed's and
MPI's launchers; ``srun python train.py`` (one Slurm task per GPU, no torchrun) says nothing a rank can read as
one number. Without it every rank would count as one node and replicas would land beside their owners. So when no
launcher says it, the ranks ask each other for their host names (one gather at attach).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from gemscout._dist import gather_json
from gemscout.errors import ConfigError

HOST_ENV = "GEMSCOUT_HOSTNAME"
"""Overrides the host name a rank reports (tests simulate several hosts on one machine with it)."""

LOCAL_SIZE_ENV = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
"""What torchrun, DeepSpeed's launcher and Open MPI set to the number of ranks on this node, in that order."""


def host_name() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def ranks_per_node_from_env() -> int | None:
    """The launcher's ranks-per-node, or None when no launcher set one. Raises ``ConfigError`` for a bad value."""
    for name in LOCAL_SIZE_ENV:
        raw = os.environ.get(name)
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(
                f"{name}={raw!r} is not a positive rank count; fix the launcher's environment or set "
                "CheckpointConfig(ranks_per_node=...)"
            )
        return value
    return None


def ranks_per_node_from_hosts(hosts: Sequence[str]) -> int:
    """Ranks per node from each rank's host name (index = rank).

    Ring placement needs every node to hold one contiguous block of ranks, all blocks the same size (what torchrun
    and ``srun --distribution=block`` give). Raises ``ConfigError`` naming the layout otherwise (``cyclic``
    distribution, uneven nodes), since a guess would put replicas beside their owners."""
    blocks: list[tuple[str, int]] = []
    for host in hosts:
        if blocks and blocks[-1][0] == host:
            blocks[-1] = (host, blocks[-1][1] + 1)
        else:
            blocks.append((host, 1))
    names = [host for host, _ in blocks]
    sizes = {size for _, size in blocks}
    if len(set(names)) != len(names) or len(sizes) != 1:
        layout = ", ".join(f"{host}: {size}" for host, size in blocks[:8]) + (
            ", ..." if len(blocks) > 8 else ""
        )
        raise ConfigError(
            f"GEMINI needs each node's ranks to be one contiguous block of equal size, found ({layout}); "
            "launch with block distribution (torchrun, srun --distribution=block) or set "
            "CheckpointConfig(ranks_per_node=...)"
        )
    return sizes.pop()


def ranks_per_node(group: dist.ProcessGroup, timeout: timedelta) -> int:
    """The launcher's figure when it gave one, else the host names of every rank of ``group`` (collective)."""
    from_env = ranks_per_node_from_env()
    if from_env is not None:
        return from_env
    return ranks_per_node_from_hosts(gather_json(host_name(), group=group, timeout=timeout))

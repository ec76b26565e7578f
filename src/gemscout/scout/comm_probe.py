"""Communication stragglers: timed probe collectives on overlapping process groups, intersected to a rank and host.

At a due step every rank takes part, in the same order, in a small timed all-reduce on each probe group: by default
the ring of neighbouring pairs ``(r, r+1 mod n)``, so each rank belongs to exactly two groups and any two groups share
at most one rank. A barrier on the whole group precedes each probe so that one slow probe cannot delay the next. A
group's time is the slowest member's; the times go to :class:`~gemscout.scout.stragglers.CommStragglerDetector`,
which intersects the slow groups (suspects = ranks in every slow group and no fast one), confirms over rounds and maps
the rank to its host (scope ``node`` when one host holds every suspect).

The probe runs outside the replay, so a slow network path never shows up as a compute straggler or as SDC.
"""

from __future__ import annotations

import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from gemscout.config import require, strict_fields
from gemscout.gemini.comm import gather_json, wait_all
from gemscout.scout.reports import FaultReport
from gemscout.scout.stragglers import CommStragglerDetector, GroupTiming, StragglerConfig

HOST_ENV = "GEMSCOUT_HOSTNAME"
"""Overrides the host name a rank reports (tests simulate several hosts on one machine with it)."""


@strict_fields
@dataclass(kw_only=True, slots=True, frozen=True)
class CommProbeConfig:
    """When and how communication is probed."""

    interval: int = 10
    """Probe at every N-th step (a probe costs one barrier and one small all-reduce per group)."""
    numel: int = 1 << 16
    """Elements (float32) of each probe all-reduce: big enough to measure bandwidth, small enough to be cheap."""
    stragglers: StragglerConfig | None = None
    """Margins and confirmations; default: StragglerConfig() (1.1x and 2 ms, 2 rounds)."""
    timeout: timedelta = timedelta(seconds=60)
    """Bound on each probe collective."""

    def __post_init__(self) -> None:
        c = "CommProbeConfig"
        require(isinstance(self.interval, int) and self.interval >= 1, c, "interval", "must be an int >= 1")
        require(isinstance(self.numel, int) and self.numel >= 1, c, "numel", "must be an int >= 1")


class CommProbe:
    """Probe groups over ``ranks`` (global ranks); construct on every rank of the default group (creates groups)."""

    def __init__(self, config: CommProbeConfig, *, ranks: list[int]) -> None:
        self.config = config
        self.rank = dist.get_rank()
        self.ranks = sorted(ranks)
        n = len(self.ranks)
        self._world = dist.new_group(self.ranks, backend="gloo", timeout=config.timeout)
        self.groups: dict[str, tuple[frozenset[int], dist.ProcessGroup | None]] = {}
        pairs = [(self.ranks[i], self.ranks[(i + 1) % n]) for i in range(n)] if n > 2 else []
        for a, b in pairs:
            # new_group is collective over the default group: every rank creates every group, in the same order.
            pg = dist.new_group([a, b], backend="gloo", timeout=config.timeout)
            self.groups[f"pair-{a}-{b}"] = (frozenset((a, b)), pg if self.rank in (a, b) else None)
        self.detector = CommStragglerDetector(config.stragglers)
        hosts = gather_json(os.environ.get(HOST_ENV) or socket.gethostname(), group=self._world,
                            timeout=config.timeout)
        self.rank_to_host = dict(zip(self.ranks, hosts, strict=True))
        self._before: OrderedDict[int, Callable[[str], None]] = OrderedDict()

    def register_before_collective(self, fn: Callable[[str], None]) -> RemovableHandle:
        """Fault-injection seam: ``fn(group_name)`` runs on this rank right before it enters a probe collective."""
        handle = RemovableHandle(self._before)
        self._before[handle.id] = fn
        return handle

    def due(self, step: int) -> bool:
        return bool(self.groups) and step % self.config.interval == 0

    def probe(self, step: int) -> FaultReport | None:
        """Run one probe round (collective over every probed rank) and return a confirmed straggler report."""
        mine: dict[str, float] = {}
        payload = torch.ones(self.config.numel, dtype=torch.float32)
        for name, (_members, pg) in self.groups.items():
            wait_all([dist.barrier(group=self._world, async_op=True)], self.config.timeout, "probe barrier")
            if pg is None:
                continue
            t0 = time.perf_counter()
            for fn in list(self._before.values()):
                fn(name)
            wait_all([dist.all_reduce(payload, group=pg, async_op=True)], self.config.timeout, f"probe {name}")
            mine[name] = time.perf_counter() - t0
        gathered = gather_json(mine, group=self._world, timeout=self.config.timeout)
        timings = {name: GroupTiming(members, max(g.get(name, 0.0) for g in gathered))
                   for name, (members, _) in self.groups.items()}
        return self.detector.observe(step, timings, self.rank_to_host)

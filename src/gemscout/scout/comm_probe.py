"""Communication stragglers: timed probe collectives on overlapping process groups, intersected to a rank and host.

At a due step every rank takes part, in the same order, in a small timed all-reduce on each probe group: by default
the ring of neighbouring pairs ``(r, r+1 mod n)``, so each rank belongs to exactly two groups and any two groups share
at most one rank. A barrier on the whole group precedes each probe so that one slow probe cannot delay the next. A
group's time is the slowest member's; the times go to :class:`~gemscout.scout.stragglers.CommStragglerDetector`,
which intersects the slow groups (suspects = ranks in every slow group and no fast one), confirms over rounds and maps
the rank to its host (scope ``node`` when one host holds every suspect).

The probe runs outside the replay, so a slow network path never shows up as a compute straggler or as SDC.

The job's own collectives are evidence too (:class:`JobCollectiveTimer`): a DDP comm hook times each gradient
bucket's all-reduce on every rank, from the moment this rank enters it until its future completes. Inside one group
an all-reduce finishes for everyone only when the last rank has entered it, so the rank that arrives late waits the
least and every other rank waits about as long as it was late. The SCOUT cycle carries each rank's summed wait in its
record row (no collective of its own) and turns it into one timing per rank, its *lateness* (the longest wait of the
group minus its own), which goes through the same :class:`~gemscout.scout.stragglers.CommStragglerDetector`:
suspects are the ranks common to every slow timing and in no fast one, confirmed over rounds, mapped to their host.
What one group cannot tell apart: a rank late because its own forward/backward is slow looks the same (the replay
times say whether its compute is slow), and a slow link inside a ring slows every member alike (the probe groups
above localize that).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from gemscout._dist import gather_json, wait_all
from gemscout.config import require, strict_fields
from gemscout.errors import ConfigError
from gemscout.nodes import host_name
from gemscout.reports import FaultReport
from gemscout.scout.stragglers import CommStragglerDetector, GroupTiming, StragglerConfig


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
        require(
            isinstance(self.interval, int) and self.interval >= 1,
            c,
            "interval",
            "must be an int >= 1",
        )
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
        hosts = gather_json(host_name(), group=self._world, timeout=config.timeout)
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
            wait_all(
                [dist.barrier(group=self._world, async_op=True)],
                self.config.timeout,
                "probe barrier",
            )
            if pg is None:
                continue
            t0 = time.perf_counter()
            for fn in list(self._before.values()):
                fn(name)
            wait_all(
                [dist.all_reduce(payload, group=pg, async_op=True)],
                self.config.timeout,
                f"probe {name}",
            )
            mine[name] = time.perf_counter() - t0
        gathered = gather_json(mine, group=self._world, timeout=self.config.timeout)
        timings = {
            name: GroupTiming(members, max(g.get(name, 0.0) for g in gathered))
            for name, (members, _) in self.groups.items()
        }
        return self.detector.observe(step, timings, self.rank_to_host)


def gather_hosts(group: dist.ProcessGroup, timeout: timedelta) -> dict[int, str]:
    """Every member's host name (``GEMSCOUT_HOSTNAME`` or the socket's), by global rank. Collective on ``group``."""
    hosts = gather_json(host_name(), group=group, timeout=timeout)
    return dict(zip(dist.get_process_group_ranks(group), hosts, strict=True))


class JobCollectiveTimer:
    """Times a DDP model's own gradient all-reduces (a comm hook doing what DDP does without one, bit for bit).

    Construct on every rank (it gathers host names over ``group``). Raises ``ConfigError`` when the model already
    has a comm hook (DDP takes one). :meth:`take` returns this rank's summed wait since the last call.
    """

    def __init__(
        self, ddp: torch.nn.Module, *, group: dist.ProcessGroup, timeout: timedelta
    ) -> None:
        pg = getattr(ddp, "process_group", None) or dist.group.WORLD
        assert isinstance(
            pg, dist.ProcessGroup
        )  # DDP always has one; WORLD exists once the job is initialized
        self.process_group: dist.ProcessGroup = pg
        self.rank_to_host = gather_hosts(group, timeout)
        self._lock = threading.Lock()
        self._wait_s = 0.0
        self._buckets = 0
        self._before: OrderedDict[int, Callable[[int], None]] = OrderedDict()
        self._around: OrderedDict[int, tuple[Callable[[list[int]], None], Callable[[], None]]] = (
            OrderedDict()
        )
        timer = self

        # No annotations: DDP compares them literally, and this module's are strings (postponed evaluation).
        def hook(pg, bucket):  # type: ignore[no-untyped-def]
            for fn in list(timer._before.values()):
                fn(bucket.index())
            tensor = bucket.buffer()
            for enter, _ in list(timer._around.values()):
                enter(list(tensor.shape))
            # DDP without a hook scales each gradient by the reciprocal as it fills the bucket; x * (1/n) is not x / n
            # bit for bit (n = 3), and timing must not change the training numbers.
            tensor.mul_(1.0 / pg.size())
            # Started after the seam: a rank that enters late is measured from its entry, so it waits the least.
            start = time.perf_counter()
            fut = dist.all_reduce(tensor, group=pg, async_op=True).get_future()

            def done(f):  # type: ignore[no-untyped-def]
                waited = time.perf_counter() - start
                with timer._lock:  # completes on the backend's thread
                    timer._wait_s += waited
                    timer._buckets += 1
                for _, leave in list(timer._around.values()):
                    leave()
                return f.value()[0]

            return fut.then(done)

        register = getattr(ddp, "register_comm_hook", None)
        if register is None:
            raise ConfigError(
                "time_job_collectives: the model is not a DistributedDataParallel module"
            )
        try:
            register(self.process_group, hook)
        except RuntimeError as exc:
            raise ConfigError(
                f"time_job_collectives: DDP already has a comm hook ({exc}); it takes only one"
            ) from exc

    def register_before_collective(self, fn: Callable[[int], None]) -> RemovableHandle:
        """Fault-injection seam: ``fn(bucket_index)`` runs on this rank right before it enters a bucket's
        all-reduce (a delay here is a late arrival, as a rank stuck before the collective would be)."""
        handle = RemovableHandle(self._before)
        self._before[handle.id] = fn
        return handle

    def register_around_collective(
        self, enter: Callable[[list[int]], None], leave: Callable[[], None]
    ) -> RemovableHandle:
        """Observers of each bucket's all-reduce: ``enter(shape)`` as this rank enters it, ``leave()`` when it has
        completed (on the backend's thread). How the out-of-band watch fingerprints DDP's collectives when this
        timer holds DDP's one comm hook."""
        handle = RemovableHandle(self._around)
        self._around[handle.id] = (enter, leave)
        return handle

    def take(self) -> float | None:
        """Seconds this rank waited in the job's all-reduces since the last call (None when none ran); resets."""
        with self._lock:
            waited, buckets = self._wait_s, self._buckets
            self._wait_s, self._buckets = 0.0, 0
        return waited if buckets else None


def lateness_timings(
    waits: Mapping[int, float | None], groups: Sequence[Sequence[int]] | None = None
) -> dict[str, GroupTiming] | None:
    """One timing per rank from the ranks' summed waits in the same collectives: how much later than the most
    punctual rank of its group it arrived (the group's longest wait minus its own). ``groups``: the groups that ran
    the collectives (FSDP's shard groups); None: one group of every rank (DDP). None unless every rank has a finite
    wait."""
    if not waits or any(w is None or not math.isfinite(w) for w in waits.values()):
        return None
    out = {}
    for group in groups if groups is not None else (tuple(waits),):
        longest = max(waits[r] or 0.0 for r in group)
        out.update(
            {
                f"rank-{r}-late": GroupTiming(
                    frozenset((r,)), max(0.0, longest - (waits[r] or 0.0))
                )
                for r in group
            }
        )
    return out


def job_comm_report(
    detector: CommStragglerDetector,
    step: int,
    by_rank: Mapping[int, Mapping[str, object]],
    rank_to_host: Mapping[int, str],
    groups: Sequence[Sequence[int]] | None = None,
    source: str = "DDP gradient all-reduce",
) -> FaultReport | None:
    """The communication-straggler report (or None) from one cycle's gathered entries, whose ``"comm_s"`` hold each
    rank's wait in the job's own collectives (``groups``: see :func:`lateness_timings`). A round where some rank has
    no wait (no collective ran) is skipped."""
    waits = {r: entry.get("comm_s") for r, entry in by_rank.items()}
    timings = lateness_timings(
        {r: float(w) if isinstance(w, int | float) else None for r, w in waits.items()}, groups
    )
    if timings is None:
        return None
    report = detector.observe(step, timings, rank_to_host)
    if report is None:
        return None
    evidence = {
        **report.evidence,
        "source": f"job collectives ({source}, lateness per rank)",
        "wait_s": {str(r): w for r, w in waits.items()},
    }
    return FaultReport(
        kind=report.kind,
        scope=report.scope,
        ranks=report.ranks,
        step=report.step,
        evidence=evidence,
        confirmations=report.confirmations,
        reason="late to the job's collectives: " + report.reason,
        host=report.host,
    )

"""Sustained compute stragglers: a rank that is a little slower than its peers, every time, over many replays.

The per-round detector (:mod:`.compute`) must not name a rank for one slow replay: on a loaded host a single
replay's time moves by tens of per cent, so its margins sit far above that noise, and a rank that is steadily 20 %
slower never crosses them. Noise of that kind is not persistent, though: over many replays a healthy rank's time
relative to its peers stays centred on 1 (within a few per cent in 1,000 loaded cycles on four ranks), while a
rank whose device or host is slower stays above.

This detector keeps, per rank, the log of its time over the median of the other ranks' times for the same replay,
pooled over the recipes of each cycle (a ratio is the same whatever the work: a slow GPU slows every kernel) into one
median per cycle: the newest until both ``sustained_window`` cycles and ``sustained_span_s`` seconds are covered. Once the window is full, a
rank whose median ratio is past ``sustained_margin`` is reported. The span keeps a few seconds of shared-core
contention, which makes one rank steadily slower for just as long, from reading as a straggler when cycles are fast.
The median over a full window is what makes it robust: heavy-tailed single rounds (a descheduled thread, a page
fault) move it by one sample each. Pure computation, never blocks.

Every rank runs this detector on the same gathered times and must reach the same verdict at the same cycle, or the
ranks that named a straggler act on it while the others go on into the next collective. The span is therefore
measured on one clock the whole job shares: the caller passes ``when``, one rank's clock as gathered with the
records (the engine takes the lowest rank's); a rank's own clock is used only when none is given.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping

from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.scout.stragglers._rounds import check_hosts, check_round, check_seconds
from gemscout.scout.stragglers.config import StragglerConfig

__all__ = ["SustainedStragglerDetector", "job_clock"]


def job_clock(by_rank: Mapping[int, Mapping[str, object]]) -> float | None:
    """The cycle's time on the job's shared clock: the ``"clock"`` the lowest rank gathered with its records, or
    None when no rank sent one. Pure: equal on every rank that gathered the same entries."""
    for rank in sorted(by_rank):
        value = by_rank[rank].get("clock")
        if isinstance(value, float):
            return value
    return None


class SustainedStragglerDetector:
    """Names ranks whose replays are steadily slower than their peers', pooled over recipes and rounds."""

    def __init__(
        self, config: StragglerConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config if config is not None else StragglerConfig()
        self._clock = clock
        self._ratios: dict[int, deque[tuple[float, float]]] = {}  # rank -> (when, log ratio)
        self._last_step: int | None = None
        self._last_when: float | None = None

    def ratio(self, rank: int) -> float | None:
        """``rank``'s median time over its peers' median in the window, or None before the window is full
        (``sustained_window`` cycles covering ``sustained_span_s`` seconds)."""
        window = self._ratios.get(rank)
        cfg = self.config
        if window is None or len(window) < cfg.sustained_window:
            return None
        if window[-1][0] - window[0][0] < cfg.sustained_span_s:
            return None
        return math.exp(statistics.median(r for _, r in window))

    def _add(self, rank: int, when: float, log_ratio: float) -> None:
        window = self._ratios.setdefault(rank, deque())
        window.append((when, log_ratio))
        cfg = self.config
        # Drop the oldest while the rest still holds sustained_window cycles over sustained_span_s seconds.
        while (
            len(window) > cfg.sustained_window
            and window[-1][0] - window[1][0] >= cfg.sustained_span_s
        ):
            window.popleft()

    def reset(self) -> None:
        """Forget every window (e.g. after recovery, when timings start afresh)."""
        self._ratios.clear()
        self._last_step = None
        self._last_when = None

    def observe(
        self,
        step: int,
        times_by_recipe: Mapping[str, Mapping[int, float]],
        *,
        rank_to_host: Mapping[int, str] | None = None,
        when: float | None = None,
    ) -> FaultReport | None:
        """Take one cycle's replay times (seconds, per recipe, one per rank) and return a report naming every rank
        whose window median is past ``sustained_margin``, else None. ``when``: the cycle's time on the job's shared
        clock (None: this detector's own clock); a time earlier than the last one means the clock changed (another
        rank's, after a restart), and the windows start afresh. A recipe with fewer than two ranks, or whose peers'
        median is zero, adds nothing. ``sustained_window`` 0: never reports. Raises ``ValueError`` for a negative
        or non-increasing step, a bad rank, or a time that is negative, NaN or infinite."""
        check_round(step, self._last_step)
        hosts = check_hosts(rank_to_host)
        for name, times in times_by_recipe.items():
            for rank, seconds in times.items():
                if type(rank) is not int or rank < 0:
                    raise ValueError(f"ranks must be non-negative ints, got {rank!r}")
                check_seconds(f"times_by_recipe[{name!r}][{rank}]", seconds)
        self._last_step = step
        cfg = self.config
        if cfg.sustained_window == 0:
            return None
        now = self._clock() if when is None else when
        if not math.isfinite(now):
            raise ValueError(f"when must be a finite time, got {now!r}")
        if self._last_when is not None and now < self._last_when:
            self._ratios.clear()
        self._last_when = now
        cycle: dict[int, list[float]] = {}
        for times in times_by_recipe.values():
            if len(times) < 2:
                continue
            for rank, seconds in times.items():
                peers = statistics.median(t for r, t in times.items() if r != rank)
                if peers > 0 and seconds > 0:
                    cycle.setdefault(rank, []).append(math.log(seconds / peers))
        for (
            rank,
            ratios_of_cycle,
        ) in cycle.items():  # one sample per rank and cycle: its median over recipes
            self._add(rank, now, statistics.median(ratios_of_cycle))
        ratios = {rank: r for rank in sorted(self._ratios) if (r := self.ratio(rank)) is not None}
        slow = [rank for rank, r in ratios.items() if r > cfg.sustained_margin]
        if not slow:
            return None
        worst = max(slow, key=lambda rank: ratios[rank])
        known = {rank: hosts[rank] for rank in slow if rank in hosts}
        evidence: dict[str, object] = {
            "signal": "compute",
            "criterion": "sustained",
            "median_ratio_to_peers": {str(rank): round(r, 4) for rank, r in ratios.items()},
            "sustained_margin": cfg.sustained_margin,
            "window": cfg.sustained_window,
            "span_s": cfg.sustained_span_s,
            "window_cycles": {str(rank): len(self._ratios[rank]) for rank in slow},
        }
        if known:
            evidence["hosts"] = {str(rank): host for rank, host in known.items()}
        return FaultReport(
            kind=FaultKind.STRAGGLER,
            scope=Scope.RANK,
            ranks=tuple(slow),
            step=step,
            evidence=evidence,
            confirmations=cfg.sustained_window,
            reason=(
                f"rank(s) {slow} steadily slow: over its last {len(self._ratios[worst])} cycles (at least "
                f"{cfg.sustained_span_s:g} s) rank {worst} took {ratios[worst]:.2f}x its peers' median "
                f"(margin {cfg.sustained_margin}x)"
            ),
            host=known.get(slow[0]) if len(slow) == 1 else None,
        )

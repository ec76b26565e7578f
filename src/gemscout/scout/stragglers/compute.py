"""Compute stragglers: every peer times the same replay; which rank is slow, against its peers or its own past.

A rank is slow in a round when its time is past BOTH margins over the peer median (``relative_margin`` x median and
an absolute margin above it), or when it is much slower than its own recent past (``baseline_margin`` x the rolling
median of its healthy rounds, and the absolute margin) while its peers are running at their usual speed. The relative
margin alone would flag 30 µs of jitter on a 200 µs replay; the absolute margin alone would flag nothing on long
replays; hence both. The absolute margin is ``absolute_margin_s`` or ``noise_factor`` times the replay's own measured
noise, whichever is larger: the robust spread (1.4826 x MAD) of every rank's excess over the median in the recent
healthy rounds, so a replay whose times jitter by milliseconds on a loaded machine is not judged by a margin meant for
a quiet one. The times fed in should be what the rank's work took, not how long it waited for a CPU: SCOUT subtracts
the replaying thread's run-queue wait (:func:`~gemscout.scout.stragglers.runqueue.run_queue_seconds`) before it
compares, so a rank descheduled by other load is not a compute straggler (a host whose CPUs are taken shows up late
to the job's collectives instead).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.scout.stragglers._rounds import check_hosts, check_round, check_seconds, ms
from gemscout.scout.stragglers.config import StragglerConfig
from gemscout.scout.stragglers.sustained import SustainedStragglerDetector

__all__ = ["ComputeStragglerDetector", "compute_reports"]

_MAD_TO_SIGMA = (
    1.4826  # MAD x this estimates a normal spread's standard deviation, ignoring the heavy tail
)


class ComputeStragglerDetector:
    """Finds ranks whose replay of the same work is slow, against their peers or against their own past.

    Feed one round per call with the times of one recipe (use one detector per recipe: different recipes take
    different times, and mixing them would poison the per-rank baseline).
    """

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config if config is not None else StragglerConfig()
        self._consecutive: dict[int, int] = {}
        self._history: dict[int, deque[float]] = {}
        # Healthy ranks' excess over the round's median, newest noise_window rounds, pooled over ranks.
        self._excess: deque[list[float]] = deque(maxlen=self.config.noise_window)
        self._last_step: int | None = None

    def noise(self) -> float | None:
        """The replay's measured noise in seconds (1.4826 x MAD of the recent healthy excesses), or None before two
        rounds with at least four of them."""
        pooled = [x for round_excess in self._excess for x in round_excess]
        if len(self._excess) < 2 or len(pooled) < 4:
            return None
        centre = statistics.median(pooled)
        return _MAD_TO_SIGMA * statistics.median(abs(x - centre) for x in pooled)

    def absolute_margin(self) -> float:
        """The absolute margin in force now: ``absolute_margin_s`` or ``noise_factor`` x :meth:`noise`."""
        noise = self.noise()
        cfg = self.config
        return (
            max(cfg.absolute_margin_s, cfg.noise_factor * noise)
            if noise is not None
            else cfg.absolute_margin_s
        )

    def consecutive(self, rank: int) -> int:
        """How many consecutive rounds up to now ``rank`` has been slow."""
        return self._consecutive.get(rank, 0)

    def baseline(self, rank: int) -> float | None:
        """``rank``'s temporal baseline (median of its recent healthy times), or None before baseline_min_samples."""
        history = self._history.get(rank)
        if history is None or len(history) < self.config.baseline_min_samples:
            return None
        return statistics.median(history)

    def reset(self) -> None:
        """Forget every count and baseline (e.g. after recovery, when timings start afresh)."""
        self._consecutive.clear()
        self._history.clear()
        self._excess.clear()
        self._last_step = None

    def observe(
        self,
        step: int,
        times_by_rank: Mapping[int, float],
        *,
        rank_to_host: Mapping[int, str] | None = None,
    ) -> FaultReport | None:
        """Take one round of replay times (seconds, one per peer) and return a straggler report if one is confirmed.

        The report has kind ``straggler``, scope ``rank``, the confirmed ranks, ``confirmations`` = the smallest
        consecutive count among them (>= ``config.compute_confirmations``), and the timings as evidence; ``host`` is filled
        from ``rank_to_host`` when exactly one rank is named and its host is known. Fewer than two peers give no
        comparison: every count resets and None is returned. Pure computation, never blocks. Raises ``ValueError``
        for a negative or non-increasing step, a bad rank, or a time that is negative, NaN or infinite.
        """
        check_round(step, self._last_step)
        hosts = check_hosts(rank_to_host)
        for rank, seconds in times_by_rank.items():
            if type(rank) is not int or rank < 0:
                raise ValueError(f"ranks must be non-negative ints, got {rank!r}")
            check_seconds(f"times_by_rank[{rank}]", seconds)
        self._last_step = step
        cfg = self.config
        times = {rank: float(times_by_rank[rank]) for rank in sorted(times_by_rank)}
        if len(times) < 2:
            self._consecutive.clear()
            return None

        median = statistics.median(times.values())
        baselines = {rank: self.baseline(rank) for rank in times}
        margin = self.absolute_margin()
        criteria: dict[int, list[str]] = {}
        for rank, seconds in times.items():
            reasons = []
            if cfg.past_margins(seconds, median, margin):
                reasons.append("peer_median")
            if self._slow_against_own_baseline(rank, times, baselines, margin):
                reasons.append("own_baseline")
            if reasons:
                criteria[rank] = reasons
        self._excess.append(
            [seconds - median for rank, seconds in times.items() if rank not in criteria]
        )

        # Consecutive means consecutive rounds observed: a rank missing from this round loses its count too.
        self._consecutive = {rank: self._consecutive.get(rank, 0) + 1 for rank in criteria}
        for rank, seconds in times.items():
            if rank not in criteria:
                # Only healthy rounds teach the baseline, so a persistent straggler never learns that slow is normal.
                self._history.setdefault(rank, deque(maxlen=cfg.baseline_window)).append(seconds)

        confirmed = [
            rank for rank, count in self._consecutive.items() if count >= cfg.compute_confirmations
        ]
        if not confirmed:
            return None
        return self._report(step, times, median, baselines, criteria, confirmed, hosts, margin)

    def _slow_against_own_baseline(
        self,
        rank: int,
        times: Mapping[int, float],
        baselines: Mapping[int, float | None],
        margin: float,
    ) -> bool:
        cfg = self.config
        own = baselines[rank]
        if own is None:
            return False
        seconds = times[rank]
        if not (seconds > cfg.baseline_margin * own and seconds - own > margin):
            return False
        # "While peers are not": if the peers slowed down too, the work changed, not the rank.
        peer_ratios = [
            times[peer] / base
            for peer, base in baselines.items()
            if peer != rank and base is not None and base > 0
        ]
        return bool(peer_ratios) and statistics.median(peer_ratios) <= cfg.relative_margin

    def _report(
        self,
        step: int,
        times: Mapping[int, float],
        median: float,
        baselines: Mapping[int, float | None],
        criteria: Mapping[int, list[str]],
        confirmed: list[int],
        hosts: Mapping[int, str],
        margin: float,
    ) -> FaultReport:
        cfg = self.config
        counts = {rank: self._consecutive[rank] for rank in confirmed}
        worst = max(confirmed, key=lambda rank: times[rank])
        ratio = times[worst] / median if median > 0 else math.inf
        ratio_text = f"{ratio:.2f}x" if math.isfinite(ratio) else "from a zero median"
        reason = (
            f"rank(s) {confirmed} slow on the same replay for >= {min(counts.values())} consecutive rounds; "
            f"slowest rank {worst} took {ms(times[worst])} vs peer median {ms(median)} ({ratio_text})"
        )
        evidence: dict[str, Any] = {
            "signal": "compute",
            "times_s": {str(rank): seconds for rank, seconds in times.items()},
            "peer_median_s": median,
            "relative_margin": cfg.relative_margin,
            "absolute_margin_s": cfg.absolute_margin_s,
            "effective_absolute_margin_s": margin,
            "noise_s": self.noise(),
            "noise_factor": cfg.noise_factor,
            "baseline_margin": cfg.baseline_margin,
            "baseline_s": {str(rank): baselines[rank] for rank in confirmed},
            "criteria": {str(rank): criteria[rank] for rank in confirmed},
            "consecutive_rounds": {str(rank): count for rank, count in counts.items()},
        }
        known = {rank: hosts[rank] for rank in confirmed if rank in hosts}
        if known:
            evidence["hosts"] = {str(rank): host for rank, host in known.items()}
        return FaultReport(
            kind=FaultKind.STRAGGLER,
            scope=Scope.RANK,
            ranks=tuple(confirmed),
            step=step,
            evidence=evidence,
            confirmations=min(counts.values()),
            reason=reason,
            host=known.get(confirmed[0]) if len(confirmed) == 1 else None,
        )


def compute_reports(
    detectors: dict[str, ComputeStragglerDetector],
    config: StragglerConfig | None,
    step: int,
    results: Mapping[str, Any],
    times: Mapping[str, Mapping[int, float]],
    ranks: int,
    *,
    sustained: SustainedStragglerDetector | None = None,
    when: float | None = None,
) -> list[FaultReport]:
    """One SCOUT cycle's compute-straggler reports: each recipe whose preconditions held and that every one of the
    ``ranks`` replayed feeds its own detector (created in ``detectors`` on first use), and all of them together feed
    ``sustained`` (a rank steadily slower than its peers; its report is left out when the per-round detectors
    already named the same ranks this cycle) at ``when`` on the job's shared clock. ``config`` None: none."""
    if config is None:
        return []
    reports = []
    compared: dict[str, Mapping[int, float]] = {}
    for name, result in results.items():
        # Every rank of the job replayed the same recipe at the same shapes: compare them all, across groups.
        if result.preconditions_ok and len(times[name]) == ranks:
            compared[name] = times[name]
            report = detectors.setdefault(name, ComputeStragglerDetector(config)).observe(
                step, times[name]
            )
            if report is not None:
                reports.append(dataclasses.replace(report, recipe=name))
    if sustained is not None and compared:
        report = sustained.observe(step, compared, when=when)
        named = {rank for r in reports for rank in r.ranks}
        if report is not None and not set(report.ranks) <= named:
            reports.append(report)
    return reports

"""Straggler statistics: which rank (or host) is slow, from timings alone.

No process group here: the caller gathers the timings and feeds one round at a time. Two detectors share one config.

* :class:`ComputeStragglerDetector` — every peer times the same replay. A rank is slow in a round when its time is
  past BOTH margins over the peer median (``relative_margin`` x median and an absolute margin above it), or when it
  is much slower than its own recent past (``baseline_margin`` x the rolling median of its healthy rounds, and the
  absolute margin) while its peers are running at their usual speed. The relative margin alone would flag 30 µs of
  jitter on a 200 µs replay; the absolute margin alone would flag nothing on long replays; hence both. The absolute
  margin is ``absolute_margin_s`` or ``noise_factor`` times the replay's own measured noise, whichever is larger: the
  robust spread (1.4826 x MAD) of every rank's excess over the median in the recent healthy rounds, so a replay whose
  times jitter by milliseconds on a loaded machine is not judged by a margin meant for a quiet one. The times fed in
  should be what the rank's work took, not how long it waited for a CPU: SCOUT subtracts the replaying thread's
  run-queue wait (:func:`run_queue_seconds`) before it compares, so a rank descheduled by other load is not a compute
  straggler (a host whose CPUs are taken shows up late to the job's collectives instead).
* :class:`CommStragglerDetector` — the same collective timed in several process groups. Groups past both margins over
  the fastest group are slow; the ranks common to every slow group, less any rank that also sits in a group that
  was fast, are the suspects, mapped to their host.

A rank is reported only after ``compute_confirmations`` (default 4) or, for communication, ``confirmations``
(default 2) consecutive slow rounds; one healthy round (or a round it is missing from) resets its count, so
intermittent blips never add up to a report. Measured on a loaded 2-core machine (docs/scout.md): two compute
confirmations at fixed margins reported a healthy rank about once per cycle; four, with the run-queue wait subtracted
and the noise-scaled margin, never in 1,000 cycles. Once confirmed, every further slow round
reports again with the growing count. Detectors keep state across rounds and are not thread-safe: one thread calls
``observe``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gemscout.errors import ConfigError
from gemscout.scout.reports import FaultKind, FaultReport, Scope

__all__ = [
    "CommStragglerDetector",
    "ComputeStragglerDetector",
    "GroupTiming",
    "StragglerConfig",
    "compute_reports",
    "run_queue_seconds",
    "waited_since",
]

_SCHEDSTAT = "/proc/thread-self/schedstat"
_MAD_TO_SIGMA = 1.4826  # MAD x this estimates a normal spread's standard deviation, ignoring the heavy tail


def run_queue_seconds() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU since it started (Linux schedstat), or
    None where the kernel does not say. Subtract two readings to get the wait inside a timed section: a sleep, a
    device wait or a collective is not run-queue time, only being descheduled in favour of other load is."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def waited_since(start: float | None) -> float:
    """Run-queue seconds since the reading ``start`` (0.0 when either reading is unavailable)."""
    now = run_queue_seconds() if start is not None else None
    return max(0.0, now - start) if now is not None and start is not None else 0.0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object) -> bool:
    return type(value) is int


@dataclass(kw_only=True, slots=True, frozen=True)
class StragglerConfig:
    """Thresholds for both straggler detectors. Every field is validated; a bad value raises ``ConfigError``."""

    relative_margin: float = 1.1
    """Slow means time > relative_margin x reference (peer median, or fastest group). Finite, > 1.0."""
    absolute_margin_s: float = 0.002
    """...and time - reference > absolute_margin_s seconds. Finite, >= 0."""
    confirmations: int = 2
    """Consecutive slow rounds before a communication straggler is reported (R). Int >= 1."""
    compute_confirmations: int = 4
    """Consecutive slow rounds of one recipe before a compute straggler is reported. Int >= 1. Replay times on a
    loaded host have heavy tails that can hit one rank a few rounds running: two reported healthy ranks there, four
    none in 1,000 measured cycles (docs/scout.md)."""
    baseline_window: int = 16
    """How many of a rank's own healthy rounds its temporal baseline (a rolling median) remembers. Int >= 1."""
    baseline_min_samples: int = 4
    """Healthy rounds a rank needs before its baseline counts as evidence. Int in [1, baseline_window]."""
    baseline_margin: float = 1.5
    """A rank is slow against its own baseline past baseline_margin x baseline (and the absolute margin). > 1.0."""
    noise_factor: float = 6.0
    """The absolute margin is at least noise_factor x the replay's measured noise (compute detector). Finite, >= 0;
    0 turns the noise scaling off."""
    noise_window: int = 32
    """Healthy rounds whose per-rank excess over the median the noise estimate keeps. Int >= 2."""

    def __post_init__(self) -> None:
        for name in ("relative_margin", "baseline_margin"):
            value = getattr(self, name)
            if not _is_number(value) or value <= 1.0:
                raise ConfigError(f"StragglerConfig.{name} must be a finite number > 1.0 (e.g. 1.1), got {value!r}")
        if not _is_number(self.absolute_margin_s) or self.absolute_margin_s < 0:
            raise ConfigError(
                f"StragglerConfig.absolute_margin_s must be a finite number of seconds >= 0 (e.g. 0.002), "
                f"got {self.absolute_margin_s!r}"
            )
        for name in ("confirmations", "compute_confirmations", "baseline_window"):
            value = getattr(self, name)
            if not _is_count(value) or value < 1:
                raise ConfigError(f"StragglerConfig.{name} must be an int >= 1, got {value!r}")
        if not _is_number(self.noise_factor) or self.noise_factor < 0:
            raise ConfigError(
                f"StragglerConfig.noise_factor must be a finite number >= 0 (e.g. 6), got {self.noise_factor!r}"
            )
        if not _is_count(self.noise_window) or self.noise_window < 2:
            raise ConfigError(f"StragglerConfig.noise_window must be an int >= 2, got {self.noise_window!r}")
        if not _is_count(self.baseline_min_samples) or not 1 <= self.baseline_min_samples <= self.baseline_window:
            raise ConfigError(
                f"StragglerConfig.baseline_min_samples must be an int in [1, baseline_window={self.baseline_window}], "
                f"got {self.baseline_min_samples!r}"
            )

    def past_margins(self, seconds: float, reference: float, absolute_s: float | None = None) -> bool:
        """True when ``seconds`` is past both the relative and the absolute margin over ``reference``
        (``absolute_s``: a noise-scaled absolute margin instead of ``absolute_margin_s``)."""
        margin = self.absolute_margin_s if absolute_s is None else absolute_s
        return seconds > self.relative_margin * reference and seconds - reference > margin


def _check_round(step: int, last_step: int | None) -> None:
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if last_step is not None and step <= last_step:
        # A repeated step would count one observation twice towards confirmation.
        raise ValueError(f"step must increase from round to round: got {step} after {last_step}")


def _check_seconds(what: str, seconds: object) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {seconds!r}")


def _check_hosts(rank_to_host: Mapping[int, str] | None) -> Mapping[int, str]:
    if rank_to_host is None:
        return {}
    for rank, host in rank_to_host.items():
        if not isinstance(host, str) or not host:
            raise ValueError(f"rank_to_host[{rank!r}] must be a non-empty host name, got {host!r}")
    return rank_to_host


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


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
        return max(cfg.absolute_margin_s, cfg.noise_factor * noise) if noise is not None else cfg.absolute_margin_s

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
        _check_round(step, self._last_step)
        hosts = _check_hosts(rank_to_host)
        for rank, seconds in times_by_rank.items():
            if type(rank) is not int or rank < 0:
                raise ValueError(f"ranks must be non-negative ints, got {rank!r}")
            _check_seconds(f"times_by_rank[{rank}]", seconds)
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
        self._excess.append([seconds - median for rank, seconds in times.items() if rank not in criteria])

        # Consecutive means consecutive rounds observed: a rank missing from this round loses its count too.
        self._consecutive = {rank: self._consecutive.get(rank, 0) + 1 for rank in criteria}
        for rank, seconds in times.items():
            if rank not in criteria:
                # Only healthy rounds teach the baseline, so a persistent straggler never learns that slow is normal.
                self._history.setdefault(rank, deque(maxlen=cfg.baseline_window)).append(seconds)

        confirmed = [rank for rank, count in self._consecutive.items() if count >= cfg.compute_confirmations]
        if not confirmed:
            return None
        return self._report(step, times, median, baselines, criteria, confirmed, hosts, margin)

    def _slow_against_own_baseline(
        self, rank: int, times: Mapping[int, float], baselines: Mapping[int, float | None], margin: float
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
            times[peer] / base for peer, base in baselines.items() if peer != rank and base is not None and base > 0
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
            f"slowest rank {worst} took {_ms(times[worst])} vs peer median {_ms(median)} ({ratio_text})"
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


@dataclass(frozen=True, slots=True)
class GroupTiming:
    """How long one collective took in one process group, and who is in that group."""

    members: frozenset[int]
    """Global ranks of the group; any iterable of non-negative ints is accepted and frozen."""
    seconds: float
    """Measured time of the collective in this group (finite, >= 0)."""

    def __post_init__(self) -> None:
        try:
            members = frozenset(self.members)
        except TypeError:
            raise ValueError(f"GroupTiming.members must be an iterable of ranks, got {self.members!r}") from None
        if not members or any(type(rank) is not int or rank < 0 for rank in members):
            raise ValueError(f"GroupTiming.members must be a non-empty set of non-negative int ranks, got {members!r}")
        object.__setattr__(self, "members", members)
        _check_seconds("GroupTiming.seconds", self.seconds)


class CommStragglerDetector:
    """Finds the rank (and host) that slows collectives down, from per-group timings of the same collective.

    Feed, per round, the time the same collective took in each of several process groups whose memberships overlap
    (e.g. DP groups and the groups of another mesh dimension, or pairwise rings). The groups should be comparable:
    timing an intra-node group against an inter-node one would make the network look like a straggler.
    """

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config if config is not None else StragglerConfig()
        self._consecutive: dict[int, int] = {}
        self._last_step: int | None = None

    def consecutive(self, rank: int) -> int:
        """How many consecutive rounds up to now ``rank`` has been the common member of the slow groups."""
        return self._consecutive.get(rank, 0)

    def reset(self) -> None:
        """Forget every count."""
        self._consecutive.clear()
        self._last_step = None

    def observe(
        self,
        step: int,
        timings: Mapping[str, GroupTiming],
        rank_to_host: Mapping[int, str] | None = None,
    ) -> FaultReport | None:
        """Take one round of per-group timings and return a straggler report if a suspect is confirmed.

        The reference is the fastest group, not the median: when most groups contain the straggler, the median group
        is itself slow and would hide it. Suspects = ranks in every slow group and in no fast group. When the suspects
        (confirmed for ``config.confirmations`` rounds) all live on one known host the report has scope ``node`` and
        names it; otherwise scope ``rank``, with whatever hosts are known in the evidence. Rounds with fewer than two
        groups, no slow group, or slow groups without a common suspect reset every count and return None. Pure
        computation, never blocks. Raises ``ValueError`` for a non-increasing step, an empty mapping, a group name
        that is not a string or a value that is not a :class:`GroupTiming`.
        """
        _check_round(step, self._last_step)
        hosts = _check_hosts(rank_to_host)
        if not timings:
            raise ValueError("timings must hold at least one group")
        for name, timing in timings.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"group names must be non-empty strings, got {name!r}")
            if not isinstance(timing, GroupTiming):
                raise ValueError(f"timings[{name!r}] must be a GroupTiming, got {type(timing).__name__}")
        self._last_step = step
        cfg = self.config
        if len(timings) < 2:
            self._consecutive.clear()
            return None

        reference = min(timing.seconds for timing in timings.values())
        slow = sorted(name for name, timing in timings.items() if cfg.past_margins(timing.seconds, reference))
        fast = sorted(name for name in timings if name not in slow)
        suspects: set[int] = set()
        if slow:
            suspects = set.intersection(*(set(timings[name].members) for name in slow))
            # A rank that also sat in a fast group did not slow that group down, so it cannot be the cause.
            for name in fast:
                suspects -= timings[name].members
        self._consecutive = {rank: self._consecutive.get(rank, 0) + 1 for rank in suspects}

        confirmed = sorted(rank for rank, count in self._consecutive.items() if count >= cfg.confirmations)
        if not confirmed:
            return None
        counts = {rank: self._consecutive[rank] for rank in confirmed}
        known = {rank: hosts[rank] for rank in confirmed if rank in hosts}
        node_hosts = set(known.values())
        on_one_host = len(known) == len(confirmed) and len(node_hosts) == 1
        host = node_hosts.pop() if on_one_host else None
        evidence: dict[str, Any] = {
            "signal": "communication",
            "group_seconds": {name: timings[name].seconds for name in sorted(timings)},
            "group_members": {name: sorted(timings[name].members) for name in sorted(timings)},
            "reference_s": reference,
            "relative_margin": cfg.relative_margin,
            "absolute_margin_s": cfg.absolute_margin_s,
            "slow_groups": slow,
            "fast_groups": fast,
            "consecutive_rounds": {str(rank): count for rank, count in counts.items()},
            "hosts": {str(rank): name for rank, name in known.items()},
        }
        where = f" on host {host!r}" if host is not None else ""
        reason = (
            f"rank(s) {confirmed}{where} common to every slow group {slow} (fastest group {_ms(reference)}, slowest "
            f"{_ms(max(timings[name].seconds for name in slow))}) for >= {min(counts.values())} consecutive rounds"
        )
        return FaultReport(
            kind=FaultKind.STRAGGLER,
            scope=Scope.NODE if host is not None else Scope.RANK,
            ranks=tuple(confirmed),
            step=step,
            evidence=evidence,
            confirmations=min(counts.values()),
            reason=reason,
            host=host,
        )


def compute_reports(
    detectors: dict[str, ComputeStragglerDetector],
    config: StragglerConfig | None,
    step: int,
    results: Mapping[str, Any],
    times: Mapping[str, Mapping[int, float]],
    ranks: int,
) -> list[FaultReport]:
    """One SCOUT cycle's compute-straggler reports: each recipe whose preconditions held and that every one of the
    ``ranks`` replayed feeds its own detector (created in ``detectors`` on first use). ``config`` None: none."""
    if config is None:
        return []
    reports = []
    for name, result in results.items():
        # Every rank of the job replayed the same recipe at the same shapes: compare them all, across groups.
        if result.preconditions_ok and len(times[name]) == ranks:
            report = detectors.setdefault(name, ComputeStragglerDetector(config)).observe(step, times[name])
            if report is not None:
                reports.append(dataclasses.replace(report, recipe=name))
    return reports

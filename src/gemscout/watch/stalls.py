"""DataLoader and checkpoint-I/O timing, and the detector that localizes a slow rank from those timings.

Timing primitives report into a :class:`SectionSink` (the rank's ``ProgressPublisher`` in a job, which publishes the
timings out of band; a :class:`RecordingSink` in tests). A *round* is the n-th completed section of one name on a rank;
in a data-parallel job every rank runs the same rounds, so round n can be compared across ranks.

:class:`StallDetector` takes one round's per-rank seconds and flags a rank that is above both the absolute threshold
and ``relative_factor`` times the median of the other ranks; the same rank flagged in ``confirmations`` consecutive
rounds of a section yields a :class:`~gemscout.watch.findings.StallFinding`. :class:`SectionRounds` feeds it from the
ranks' published :class:`~gemscout.watch.records.ProgressRecord` timings, each round once every rank has completed it.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, Literal, Protocol, TypeVar, runtime_checkable

from gemscout.errors import ConfigError
from gemscout.watch.findings import StallFinding, StallKind
from gemscout.watch.records import ProgressRecord

T = TypeVar("T")

DATALOADER_SECTION = "dataloader"
CHECKPOINT_KINDS: tuple[str, ...] = ("read", "write")


@runtime_checkable
class SectionSink(Protocol):
    """Receives timed sections. Implementations must be cheap and must not block: they run on the training thread."""

    def enter_section(self, section: str) -> None: ...

    def exit_section(self, section: str, seconds: float | None) -> None:
        """``seconds`` is ``None`` when the section ended without a comparable round (an error, end of data)."""
        ...


class RecordingSink:
    """A :class:`SectionSink` that keeps every completed round in memory: ``rounds[section] == [seconds, ...]``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rounds: dict[str, list[float]] = {}
        self.active: str | None = None

    def enter_section(self, section: str) -> None:
        with self._lock:
            self.active = section

    def exit_section(self, section: str, seconds: float | None) -> None:
        with self._lock:
            self.active = None
            if seconds is not None:
                self.rounds.setdefault(section, []).append(seconds)


def section_kind(section: str) -> StallKind:
    """The finding kind for a section name: ``checkpoint_*`` → ``checkpoint_stall``, anything else → ``data_stall``."""
    return "checkpoint_stall" if section.startswith("checkpoint") else "data_stall"


class InstrumentedLoader(Generic[T]):
    """Wraps an iterable (a ``DataLoader``) and times every ``next()`` as one round of section ``dataloader``.

    Iterating it iterates the wrapped loader once per ``iter()``, yielding the same items. The end-of-data
    ``StopIteration`` and any exception from the loader are not rounds (they are reported with ``seconds=None``).
    """

    def __init__(
        self, loader: Iterable[T], sink: SectionSink, *, section: str = DATALOADER_SECTION
    ) -> None:
        if not section:
            raise ConfigError("InstrumentedLoader.section must be a non-empty name")
        self.loader = loader
        self._sink = sink
        self._section = section

    def __iter__(self) -> Iterator[T]:
        iterator = iter(self.loader)
        while True:
            self._sink.enter_section(self._section)
            started = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                self._sink.exit_section(self._section, None)
                return
            except BaseException:
                self._sink.exit_section(self._section, None)
                raise
            self._sink.exit_section(self._section, time.perf_counter() - started)
            yield item

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


@contextlib.contextmanager
def checkpoint_io(sink: SectionSink, kind: Literal["read", "write"]) -> Iterator[None]:
    """Time the enclosed checkpoint read or write as one round of section ``checkpoint_<kind>``.

    Raises :class:`ConfigError` for another ``kind``. An exception inside the block is re-raised and is not a round.
    """
    if kind not in CHECKPOINT_KINDS:
        raise ConfigError(f"checkpoint_io kind must be one of {CHECKPOINT_KINDS}, got {kind!r}")
    section = f"checkpoint_{kind}"
    sink.enter_section(section)
    started = time.perf_counter()
    try:
        yield
    except BaseException:
        sink.exit_section(section, None)
        raise
    sink.exit_section(section, time.perf_counter() - started)


@dataclass(kw_only=True, slots=True, frozen=True)
class StallConfig:
    """When a section's round counts as slow on a rank, and how many slow rounds confirm it."""

    absolute_threshold: timedelta = timedelta(seconds=1)
    """A round is slow only if it took longer than this (filters noise on fast sections)."""
    relative_factor: float = 3.0
    """…and longer than this factor times the median of the other ranks' times for the same round."""
    confirmations: int = 2
    """Consecutive slow rounds of one section on one rank before a finding is emitted."""

    def __post_init__(self) -> None:
        if self.absolute_threshold <= timedelta(0):
            raise ConfigError(
                f"StallConfig.absolute_threshold must be > 0, got {self.absolute_threshold}"
            )
        if not self.relative_factor > 1.0:
            raise ConfigError(
                f"StallConfig.relative_factor must be > 1.0, got {self.relative_factor}"
            )
        if self.confirmations < 1:
            raise ConfigError(f"StallConfig.confirmations must be >= 1, got {self.confirmations}")


class StallDetector:
    """Confirms slow ranks per section across rounds. Pure logic: no threads, no I/O; not thread-safe."""

    def __init__(self, config: StallConfig | None = None) -> None:
        self._config = config or StallConfig()
        # Per (section, rank): slow rounds in the current streak, and the newest ``confirmations`` of them as evidence.
        self._counts: dict[tuple[str, int], int] = {}
        self._recent: dict[tuple[str, int], deque[dict[str, float | int]]] = {}

    @property
    def config(self) -> StallConfig:
        return self._config

    def observe(
        self,
        section: str,
        round_index: int,
        seconds_by_rank: Mapping[int, float],
        *,
        step: int | None = None,
        hosts: Mapping[int, str] | None = None,
    ) -> StallFinding | None:
        """Feed one round of ``section``; return a finding when a rank's streak reaches ``confirmations``.

        Feed rounds in order. Ranks that reach the confirmation count in the same round share one finding. A rank's
        streak ends at its first round that is not slow; a confirmed streak is reported once.
        """
        cfg = self._config
        absolute = cfg.absolute_threshold.total_seconds()
        confirmed: list[int] = []
        evidence_rounds: dict[str, list[dict[str, float | int]]] = {}
        if len(seconds_by_rank) < 2:
            return None  # nobody to compare with: detection needs peers
        for rank, seconds in seconds_by_rank.items():
            others = [s for r, s in seconds_by_rank.items() if r != rank]
            median_others = statistics.median(others)
            slow = seconds > absolute and seconds > cfg.relative_factor * median_others
            key = (section, rank)
            if not slow:
                self._counts.pop(key, None)
                self._recent.pop(key, None)
                continue
            count = self._counts[key] = self._counts.get(key, 0) + 1
            recent = self._recent.setdefault(key, deque(maxlen=cfg.confirmations))
            recent.append(
                {"round": round_index, "seconds": seconds, "median_others": median_others}
            )
            if count == cfg.confirmations:
                confirmed.append(rank)
                evidence_rounds[str(rank)] = list(recent)
        if not confirmed:
            return None
        confirmed.sort()
        host = hosts.get(confirmed[0]) if hosts else None
        return StallFinding(
            kind=section_kind(section),
            ranks=tuple(confirmed),
            step=step,
            evidence={
                "section": section,
                "round": round_index,
                "seconds_by_rank": {str(r): s for r, s in sorted(seconds_by_rank.items())},
                "slow_rounds": evidence_rounds,
                "absolute_threshold_s": absolute,
                "relative_factor": cfg.relative_factor,
                "hosts": {str(r): hosts[r] for r in confirmed if r in hosts} if hosts else {},
            },
            confirmations=cfg.confirmations,
            reason=(
                f"rank(s) {list(confirmed)} took > {absolute:g} s and > {cfg.relative_factor:g}x the other ranks' "
                f"median in section {section!r} for {cfg.confirmations} consecutive rounds"
            ),
            host=host,
            recommendation="observe",
        )


class SectionRounds:
    """Feeds a :class:`StallDetector` from the ranks' published records: each round of each section once, in order,
    when every participating rank (every rank whose record is not closed) has completed it."""

    def __init__(self, detector: StallDetector, world_size: int) -> None:
        self._detector = detector
        self._world_size = world_size
        self._fed_round: dict[str, int] = {}  # per section: the newest round fed

    def feed(self, records: Mapping[int, ProgressRecord]) -> list[StallFinding]:
        """Feed the rounds completed since the last call; return the detector's findings."""
        participants = [
            r for r in range(self._world_size) if not (r in records and records[r].closed)
        ]
        by_section: dict[str, dict[int, dict[int, tuple[float, int]]]] = {}
        for rank in participants:
            rec = records.get(rank)
            for section, entries in rec.timings.items() if rec else ():
                by_section.setdefault(section, {})[rank] = {
                    rd: (sec, st) for rd, sec, st in entries
                }
        found: list[StallFinding] = []
        hosts = {r: rec.host for r, rec in records.items()}
        for section, per_rank in sorted(by_section.items()):
            newest = {
                r: max(per_rank[r], default=-1) if r in per_rank else -1 for r in participants
            }
            last_fed = self._fed_round.get(section, -1)
            for rd in sorted(
                {rd for rounds in per_rank.values() for rd in rounds if rd > last_fed}
            ):
                have = {
                    r: per_rank[r][rd] for r in participants if r in per_rank and rd in per_rank[r]
                }
                if len(have) < len(participants) and not all(newest[r] >= rd for r in participants):
                    break  # some rank has not finished this round yet; compare it when it has
                self._fed_round[section] = rd
                finding = self._detector.observe(
                    section,
                    rd,
                    {r: sec for r, (sec, _) in have.items()},
                    step=min((st for _, st in have.values()), default=None),
                    hosts=hosts,
                )
                if finding is not None:
                    found.append(finding)
        return found

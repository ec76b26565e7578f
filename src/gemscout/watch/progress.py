"""Per-rank progress counters and collective fingerprints, published out of band.

The training thread only touches memory: :meth:`ProgressPublisher.step`, :meth:`~ProgressPublisher.enter_collective`
and friends update a few fields under an uncontended lock. A background thread publishes a :class:`ProgressRecord`
through the :class:`~gemscout.watch.channel.OobChannel` at most every ``publish_interval`` when something changed, and at
least every ``heartbeat_interval`` regardless. So a training thread blocked inside a collective still has a live
heartbeat, and its record shows exactly where it stopped; a dead process's heartbeat stops.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

from gemscout.errors import CollectiveTimeout, ConfigError
from gemscout.watch.channel import OobChannel
from gemscout.watch.records import (
    DEFAULT_GROUP,
    PROGRESS_KEY,
    CollectiveFingerprint,
    ProgressRecord,
)

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, frozen=True)
class ProgressConfig:
    """How often and what a rank publishes."""

    publish_interval: timedelta = timedelta(milliseconds=100)
    """Publish at most this often when something changed (bounds hot-path-to-store latency and store load)."""
    heartbeat_interval: timedelta = timedelta(seconds=1)
    """Publish at least this often even without change; keep it well under the watchdog's stall threshold."""
    timing_history: int = 32
    """Section timings kept per section in each record, so rounds survive between two publishes."""
    host: str | None = None
    """Host name to publish; ``None``: ``socket.gethostname()``."""

    def __post_init__(self) -> None:
        if self.publish_interval <= timedelta(0):
            raise ConfigError(
                f"ProgressConfig.publish_interval must be > 0, got {self.publish_interval}"
            )
        if self.heartbeat_interval < self.publish_interval:
            raise ConfigError("ProgressConfig.heartbeat_interval must be >= publish_interval")
        if not 1 <= self.timing_history <= 1024:
            raise ConfigError(
                f"ProgressConfig.timing_history must be in [1, 1024], got {self.timing_history}"
            )


class ProgressPublisher:
    """Hot-path progress tracking for one rank, published by a background thread.

    Implements the ``SectionSink`` protocol of :mod:`gemscout.watch.stalls`, so an ``InstrumentedLoader`` or
    ``checkpoint_io`` can report into it directly.
    """

    def __init__(self, channel: OobChannel, *, config: ProgressConfig | None = None) -> None:
        if channel.rank is None:
            raise ConfigError(
                "ProgressPublisher needs a channel with a rank (OobConfig.rank), not an observer"
            )
        self._channel = channel
        self._rank: int = channel.rank
        self._config = config or ProgressConfig()
        self._host = self._config.host or socket.gethostname()
        self._state = threading.Lock()
        self._step = 0
        self._events = 0
        self._collective: CollectiveFingerprint | None = None
        self._group_seqs: dict[str, int] = {}
        self._section: str | None = None
        self._rounds: dict[str, int] = {}
        self._timings: dict[str, deque[tuple[int, float, int]]] = {}
        self._closed = False
        self._heartbeat = 0
        self._published_events = -1
        self._last_publish = float("-inf")
        self._cond = threading.Condition()
        self._stopping = False
        self._flush_requested = 0
        self._flush_done = 0
        self._thread: threading.Thread | None = None
        self._last_error_log = float("-inf")

    # -- hot path: memory only -------------------------------------------------------------------------------------

    def step(self, n: int) -> None:
        """Record that training reached step ``n``."""
        with self._state:
            if n != self._step:
                self._step = n
                self._events += 1

    def enter_collective(
        self, op: str, group: str = DEFAULT_GROUP, shapes: Sequence[Sequence[int]] = ()
    ) -> None:
        """Record entry into collective ``op`` on ``group`` with tensor ``shapes``; call right before issuing it."""
        dims = tuple(tuple(int(d) for d in s) for s in shapes)
        with self._state:
            seq = self._group_seqs.get(group, 0) + 1
            self._group_seqs[group] = seq
            self._collective = CollectiveFingerprint(
                op=op, group=group, shapes=dims, seq=seq, active=True
            )
            self._events += 1

    def exit_collective(self) -> None:
        """Record that the collective entered last has returned. A no-op when none is active."""
        with self._state:
            coll = self._collective
            if coll is not None and coll.active:
                self._collective = CollectiveFingerprint(
                    op=coll.op, group=coll.group, shapes=coll.shapes, seq=coll.seq, active=False
                )
                self._events += 1

    @contextlib.contextmanager
    def collective(
        self, op: str, group: str = DEFAULT_GROUP, shapes: Sequence[Sequence[int]] = ()
    ) -> Iterator[None]:
        """``enter_collective`` … ``exit_collective`` around a block (exit also on error)."""
        self.enter_collective(op, group, shapes)
        try:
            yield
        finally:
            self.exit_collective()

    def enter_section(self, section: str) -> None:
        """``SectionSink``: the rank entered timed section ``section``."""
        with self._state:
            self._section = section
            self._events += 1

    def exit_section(self, section: str, seconds: float | None) -> None:
        """``SectionSink``: the rank left ``section``; ``seconds`` is a comparable round, ``None`` is not (error, end)."""
        with self._state:
            self._section = None
            self._events += 1
            if seconds is not None:
                round_index = self._rounds.get(section, 0)
                self._rounds[section] = round_index + 1
                history = self._timings.setdefault(
                    section, deque(maxlen=self._config.timing_history)
                )
                history.append((round_index, float(seconds), self._step))

    # -- background publishing -------------------------------------------------------------------------------------

    def start(self) -> ProgressPublisher:
        """Start the publishing thread (idempotent) and return ``self``."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"gemscout-oob-progress-{self._rank}", daemon=True
                )
                self._thread.start()
        return self

    def flush(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Publish the current record now. Blocks until it is written; raises :class:`CollectiveTimeout` after
        ``timeout``. Without a running thread it publishes on the caller's thread (one store round trip)."""
        with self._cond:
            running = self._thread is not None and not self._stopping
            if running:
                self._flush_requested += 1
                target = self._flush_requested
                self._cond.notify_all()
                if not self._cond.wait_for(
                    lambda: self._flush_done >= target, timeout.total_seconds()
                ):
                    raise CollectiveTimeout(
                        f"progress flush of rank {self._rank} did not finish within {timeout}"
                    )
        if not running:
            self._publish(force=True)

    def stop(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Publish a final ``closed`` record and stop the thread. Raises :class:`CollectiveTimeout` if the thread has
        not ended after ``timeout`` (it is a daemon and will not hold the process)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout.total_seconds())
            if thread.is_alive():
                raise CollectiveTimeout(
                    f"progress publisher of rank {self._rank} did not stop within {timeout}"
                )
        with self._state:
            self._closed = True
        self._publish(force=True)

    def snapshot(self) -> ProgressRecord:
        """The record that would be published now."""
        with self._state:
            return ProgressRecord(
                rank=self._rank,
                host=self._host,
                step=self._step,
                events=self._events,
                heartbeat=self._heartbeat,
                closed=self._closed,
                collective=self._collective,
                group_seqs=dict(self._group_seqs),
                section=self._section,
                timings={name: tuple(entries) for name, entries in self._timings.items()},
            )

    def _run(self) -> None:
        interval = self._config.publish_interval.total_seconds()
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._stopping or self._flush_requested > self._flush_done, interval
                )
                if self._stopping:
                    self._flush_done = (
                        self._flush_requested
                    )  # release waiters; stop() publishes the last record
                    self._cond.notify_all()
                    return
                target = self._flush_requested
            self._publish(force=target > self._flush_done)
            with self._cond:
                self._flush_done = target
                self._cond.notify_all()

    def _publish(self, *, force: bool) -> None:
        now = time.monotonic()
        with self._state:
            changed = self._events != self._published_events
            due = now - self._last_publish >= self._config.heartbeat_interval.total_seconds()
            if not (force or changed or due):
                return
            self._heartbeat += 1
        record = self.snapshot()
        try:
            self._channel.publish(PROGRESS_KEY, record.to_payload())
        except (
            Exception
        ) as exc:  # the store may be gone at shutdown; never let publishing kill training
            if now - self._last_error_log > 10.0:
                self._last_error_log = now
                logger.warning("rank %d could not publish progress: %s", self._rank, exc)
            return
        with self._state:
            self._published_events = record.events
            self._last_publish = now

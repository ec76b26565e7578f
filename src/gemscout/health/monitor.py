"""The health monitor: polls health sources on a background thread and delivers classified events to callbacks."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from gemscout.errors import CollectiveTimeout, ConfigError
from gemscout.health.events import (
    SEVERITIES,
    ClassifiedHealthEvent,
    HealthSource,
    HealthThresholds,
    Severity,
    classify,
)

logger = logging.getLogger(__name__)

HealthCallback = Callable[[ClassifiedHealthEvent], None]


@dataclass(kw_only=True, slots=True, frozen=True)
class HealthMonitorConfig:
    """How the monitor polls and what it delivers."""

    period: timedelta = timedelta(seconds=5)
    """Time between two polls of every source."""
    thresholds: HealthThresholds = field(default_factory=HealthThresholds)
    min_severity: Severity = "info"
    """Events below this severity are kept in history but not delivered to callbacks."""
    history: int = 1000
    """Classified events kept in :attr:`HealthMonitor.events`."""

    def __post_init__(self) -> None:
        if self.period <= timedelta(0):
            raise ConfigError(f"HealthMonitorConfig.period must be > 0, got {self.period}")
        if self.min_severity not in SEVERITIES:
            raise ConfigError(
                f"HealthMonitorConfig.min_severity must be one of {SEVERITIES}, got {self.min_severity!r}"
            )
        if self.history < 1:
            raise ConfigError(f"HealthMonitorConfig.history must be >= 1, got {self.history}")


class HealthMonitor:
    """Polls ``sources`` every ``period`` on a daemon thread and delivers classified events to callbacks.

    A source whose ``poll()`` raises, and a callback that raises, are logged and skipped; the thread keeps going.
    The monitor does not close its sources: whoever made them does.
    """

    def __init__(
        self,
        sources: Sequence[HealthSource],
        *,
        config: HealthMonitorConfig | None = None,
        callbacks: Iterable[HealthCallback] = (),
    ) -> None:
        self._sources = list(sources)
        self._config = config or HealthMonitorConfig()
        self._callbacks: list[HealthCallback] = list(callbacks)
        self._lock = threading.Lock()
        self._events: deque[ClassifiedHealthEvent] = deque(maxlen=self._config.history)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.source_errors = 0
        self.callback_errors = 0

    @property
    def events(self) -> list[ClassifiedHealthEvent]:
        """Classified events seen so far (newest ``history``), oldest first."""
        with self._lock:
            return list(self._events)

    def add_callback(self, callback: HealthCallback) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def start(self) -> HealthMonitor:
        """Start the polling thread (idempotent); return ``self``."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="gemscout-health-monitor", daemon=True
                )
                self._thread.start()
        return self

    def stop(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop polling; raises :class:`CollectiveTimeout` if the thread is still running after ``timeout``."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout.total_seconds())
            if thread.is_alive():
                raise CollectiveTimeout(f"health monitor did not stop within {timeout}")

    def poll_once(self) -> list[ClassifiedHealthEvent]:
        """Poll every source once on the caller's thread; classify, record, deliver and return the events."""
        rank = SEVERITIES.index
        classified: list[ClassifiedHealthEvent] = []
        for source in self._sources:
            try:
                raw = source.poll()
            except Exception:
                self.source_errors += 1
                logger.exception("health source %r failed to poll", getattr(source, "name", source))
                continue
            classified.extend(classify(event, self._config.thresholds) for event in raw)
        with self._lock:
            self._events.extend(classified)
            callbacks = list(self._callbacks)
        floor = rank(self._config.min_severity)
        for item in classified:
            if rank(item.severity) < floor:
                continue
            for callback in callbacks:
                try:
                    callback(item)
                except Exception:
                    self.callback_errors += 1
                    logger.exception("health callback %r raised; continuing", callback)
        return classified

    def _run(self) -> None:
        # Poll once immediately, then every period: a fault present at start is reported without a period's delay.
        while True:
            try:
                self.poll_once()
            except Exception:  # belt and braces: nothing may end the monitor but stop()
                logger.exception("health monitor poll failed")
            if self._stop.wait(self._config.period.total_seconds()):
                return

"""Hardware health: events, the source protocol, the injectable source and the classifier.

A :class:`HealthSource` returns the events that happened since its last ``poll()``. :class:`InjectedHealthSource` is
the source for machines without NVIDIA GPUs and for tests; the NVML source is
:class:`gemscout.health.nvml.NvmlHealthSource` (``pynvml`` is imported only when one is made). :func:`classify` assigns
a severity; :class:`gemscout.health.monitor.HealthMonitor` polls sources on a thread and delivers classified events.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from gemscout.errors import ConfigError

Severity = Literal["info", "degraded", "fatal"]
SEVERITIES: tuple[str, ...] = ("info", "degraded", "fatal")

HEALTH_KINDS: tuple[str, ...] = (
    "ecc_corrected",  # value: new corrected errors since the last poll; total: the device's count
    "ecc_uncorrected",  # value: new uncorrected errors; total: the device's count
    "xid",  # value: the XID code
    "temperature",  # value: degrees C, reported when crossing the source's reporting threshold either way
    "thermal_throttle",  # value: the clock-event reason bitmask (a thermal bit is set)
    "clock_throttle",  # value: the clock-event reason bitmask (no thermal bit; 0 means throttling ended)
    "gpu_lost",  # the driver lost the device (NVML_ERROR_GPU_IS_LOST)
)

# Clock-event reason bits (NVML nvmlClocksEventReason*), kept here so the classifier needs no pynvml.
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SW_THERMAL = 0x20
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80
THROTTLE_THERMAL = THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL
THROTTLE_NOTABLE = (
    THROTTLE_SW_POWER_CAP | THROTTLE_HW_SLOWDOWN | THROTTLE_THERMAL | THROTTLE_HW_POWER_BRAKE
)


@dataclass(kw_only=True, slots=True, frozen=True)
class HealthEvent:
    """One observation from a health source. ``kind`` is one of :data:`HEALTH_KINDS` or a source-defined name."""

    kind: str
    device: int | None
    """Device index on this host, or ``None`` for a host-wide event."""
    value: float
    total: float | None = None
    detail: str = ""
    source: str = ""
    host: str = ""
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "device": self.device,
            "value": self.value,
            "total": self.total,
            "detail": self.detail,
            "source": self.source,
            "host": self.host,
            "timestamp": self.timestamp,
        }


@dataclass(kw_only=True, slots=True, frozen=True)
class ClassifiedHealthEvent:
    """An event with the severity the classifier gave it and why."""

    event: HealthEvent
    severity: Severity
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event.to_dict(), "severity": self.severity, "reason": self.reason}


@runtime_checkable
class HealthSource(Protocol):
    """A source of hardware-health events.

    Contract: ``poll()`` returns the events new since the previous call (a list, possibly empty), never blocks for
    long (well under a second), and reports a cumulative counter as the increase since the previous poll.
    ``close()`` releases the source and may be called twice; ``poll()`` after ``close()`` returns ``[]``.
    """

    name: str

    def poll(self) -> list[HealthEvent]: ...

    def close(self) -> None: ...


class InjectedHealthSource:
    """A :class:`HealthSource` fed by :meth:`inject`: for tests, fault campaigns, and hosts without NVML."""

    def __init__(self, name: str = "injected") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._queue: list[HealthEvent] = []
        self._closed = False

    def inject(self, event: HealthEvent) -> None:
        """Queue ``event`` for the next ``poll()``. Thread-safe; ignored after ``close()``."""
        with self._lock:
            if not self._closed:
                self._queue.append(event)

    def poll(self) -> list[HealthEvent]:
        with self._lock:
            events, self._queue = self._queue, []
            return events

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queue = []


@dataclass(kw_only=True, slots=True, frozen=True)
class HealthThresholds:
    """Where the classifier draws the lines between info, degraded and fatal."""

    temperature_degraded_c: float = 85.0
    """At or above: degraded (close to the slowdown temperature of current data-center GPUs)."""
    temperature_fatal_c: float = 95.0
    """At or above: fatal (at or past the shutdown temperature)."""
    ecc_corrected_degraded: int = 1000
    """A device whose corrected-ECC count reaches this is degraded; below, corrected errors are info."""
    fatal_xids: frozenset[int] = frozenset({48, 61, 62, 64, 74, 79, 95, 119, 120, 140})
    """XIDs that mean the device or its memory/links cannot be trusted (double-bit ECC, fell off the bus, ...)."""
    info_xids: frozenset[int] = frozenset({13, 31, 43, 45})
    """XIDs usually caused by the application itself. Any XID in neither set is degraded."""

    def __post_init__(self) -> None:
        if not self.temperature_degraded_c < self.temperature_fatal_c:
            raise ConfigError(
                "HealthThresholds.temperature_degraded_c must be < temperature_fatal_c"
            )
        if self.ecc_corrected_degraded < 1:
            raise ConfigError(
                f"HealthThresholds.ecc_corrected_degraded must be >= 1, got {self.ecc_corrected_degraded}"
            )
        if self.fatal_xids & self.info_xids:
            raise ConfigError(
                f"HealthThresholds.fatal_xids and info_xids overlap: {sorted(self.fatal_xids & self.info_xids)}"
            )


def classify(
    event: HealthEvent, thresholds: HealthThresholds | None = None
) -> ClassifiedHealthEvent:
    """Give ``event`` a severity. Unknown kinds are ``degraded``: surfaced, but never enough to stop a job alone."""
    t = thresholds or HealthThresholds()
    kind, value = event.kind, event.value

    def result(severity: Severity, reason: str) -> ClassifiedHealthEvent:
        return ClassifiedHealthEvent(event=event, severity=severity, reason=reason)

    if kind in ("ecc_uncorrected", "gpu_lost"):
        return result("fatal", f"{kind}: device results cannot be trusted")
    if kind == "ecc_corrected":
        total = event.total if event.total is not None else value
        if total >= t.ecc_corrected_degraded:
            return result(
                "degraded", f"{total:g} corrected ECC errors (>= {t.ecc_corrected_degraded})"
            )
        return result("info", f"{total:g} corrected ECC errors")
    if kind == "xid":
        xid = int(value)
        if xid in t.fatal_xids:
            return result("fatal", f"XID {xid} marks a hardware fault")
        if xid in t.info_xids:
            return result("info", f"XID {xid} is usually raised by the application")
        return result("degraded", f"XID {xid} is not known to be benign")
    if kind == "temperature":
        if value >= t.temperature_fatal_c:
            return result("fatal", f"{value:g} C >= {t.temperature_fatal_c:g} C")
        if value >= t.temperature_degraded_c:
            return result("degraded", f"{value:g} C >= {t.temperature_degraded_c:g} C")
        return result("info", f"{value:g} C")
    if kind == "thermal_throttle":
        return result("degraded", f"thermal clock slowdown (reasons 0x{int(value):x})")
    if kind == "clock_throttle":
        if int(value) & (THROTTLE_HW_SLOWDOWN | THROTTLE_HW_POWER_BRAKE):
            return result("degraded", f"hardware clock slowdown (reasons 0x{int(value):x})")
        return result("info", f"clock reasons 0x{int(value):x}")
    return result("degraded", f"unknown health event kind {kind!r}")

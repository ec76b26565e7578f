"""Health sources (one contract, every implementation), the classifier, and the monitor thread."""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from gemscout.errors import CollectiveTimeout, ConfigError
from gemscout.health.events import (
    THROTTLE_HW_SLOWDOWN,
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_POWER_CAP,
    ClassifiedHealthEvent,
    HealthEvent,
    HealthSource,
    HealthThresholds,
    InjectedHealthSource,
    classify,
)
from gemscout.health.monitor import HealthMonitor, HealthMonitorConfig
from gemscout.health.nvml import NvmlHealthSource

pytestmark = pytest.mark.timeout(30)

HAVE_PYNVML = importlib.util.find_spec("pynvml") is not None


class FakeNvml:
    """A stand-in for the ``pynvml`` module: the functions NvmlHealthSource calls, with settable device state."""

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    @dataclass
    class Device:
        index: int
        ecc: tuple[int, int] = (0, 0)
        temp: int = 40
        reasons: int = 0x1  # GPU idle: not notable
        lost: bool = False
        ecc_supported: bool = True

    @dataclass
    class EventData:
        device: Any
        eventData: int  # noqa: N815 - pynvml's field name

    def __init__(self, devices: int = 2) -> None:
        self.devices = [FakeNvml.Device(i) for i in range(devices)]
        self.xids: list[tuple[int, int]] = []
        self.initialized = 0

    def nvmlInit(self) -> None:  # noqa: N802
        self.initialized += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialized -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Device:  # noqa: N802
        return self.devices[index]

    def nvmlDeviceGetIndex(self, handle: Device) -> int:  # noqa: N802
        return handle.index

    def _live(self, handle: Device) -> Device:
        if handle.lost:
            raise FakeNvml.NVMLError(15)
        return handle

    def nvmlDeviceGetTotalEccErrors(self, handle: Device, error_type: int, counter: int) -> int:  # noqa: N802
        if not handle.ecc_supported:
            raise FakeNvml.NVMLError(3)
        return self._live(handle).ecc[error_type]

    def nvmlDeviceGetTemperature(self, handle: Device, sensor: int) -> int:  # noqa: N802
        return self._live(handle).temp

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Device) -> int:  # noqa: N802
        return self._live(handle).reasons

    def nvmlEventSetCreate(self) -> object:  # noqa: N802
        return object()

    def nvmlDeviceRegisterEvents(self, handle: Device, types: int, event_set: object) -> None:  # noqa: N802
        assert types == 0x8

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> EventData:  # noqa: N802
        assert timeout_ms == 0  # polling must never block
        if not self.xids:
            raise FakeNvml.NVMLError(10)
        index, xid = self.xids.pop(0)
        return FakeNvml.EventData(device=self.devices[index], eventData=xid)

    def nvmlEventSetFree(self, event_set: object) -> None:  # noqa: N802
        pass


def _event(kind: str, value: float, **kw: Any) -> HealthEvent:
    return HealthEvent(kind=kind, device=0, value=value, **kw)


# -- the HealthSource contract, run against every implementation -----------------------------------------------------


@dataclass
class SourceCase:
    source: HealthSource
    provoke: Callable[[], None] | None
    """Make the source have exactly one event for its next poll; None when a real device cannot be provoked."""


def _injected() -> SourceCase:
    src = InjectedHealthSource()
    return SourceCase(src, lambda: src.inject(_event("xid", 79)))


def _nvml_fake() -> SourceCase:
    fake = FakeNvml()

    def provoke() -> None:
        fake.devices[1].ecc = (fake.devices[1].ecc[0] + 3, 0)

    return SourceCase(NvmlHealthSource(nvml=fake), provoke)


def _nvml_real() -> SourceCase:
    if not HAVE_PYNVML:
        pytest.skip("pynvml (nvidia-ml-py) is not installed")
    try:
        return SourceCase(NvmlHealthSource(), None)
    except ConfigError as exc:
        pytest.skip(f"NVML unavailable: {exc}")


SOURCES: dict[str, Callable[[], SourceCase]] = {
    "injected": _injected,
    "nvml-fake": _nvml_fake,
    "nvml": _nvml_real,
}


@pytest.fixture(params=SOURCES.values(), ids=SOURCES.keys())
def case(request: pytest.FixtureRequest) -> Iterator[SourceCase]:
    made: SourceCase = request.param()
    yield made
    made.source.close()


def test_source_contract(case: SourceCase) -> None:
    src = case.source
    assert isinstance(src, HealthSource) and isinstance(src.name, str)
    started = time.monotonic()
    first = src.poll()
    assert isinstance(first, list) and all(isinstance(e, HealthEvent) for e in first)
    assert time.monotonic() - started < 1.0, "poll() must not block"
    if case.provoke is not None:
        assert src.poll() == []  # nothing new happened
        case.provoke()
        events = src.poll()
        assert len(events) == 1 and isinstance(events[0], HealthEvent)
        assert src.poll() == []  # reported once, as news
    src.close()
    src.close()
    assert src.poll() == []


# -- NVML source logic (with the stand-in module) -------------------------------------------------------------------


def test_nvml_missing_is_a_clear_error() -> None:
    if HAVE_PYNVML:
        pytest.skip("pynvml is installed here")
    with pytest.raises(ConfigError, match="nvidia-ml-py"):
        NvmlHealthSource()
    assert "pynvml" not in sys.modules


def test_nvml_reports_changes_not_levels() -> None:
    fake = FakeNvml()
    fake.devices[0].ecc = (5, 0)  # errors from before the source started are not news
    src = NvmlHealthSource(nvml=fake, temperature_report_c=80)
    assert fake.initialized == 1 and src.poll() == []
    fake.devices[0].ecc = (7, 1)
    fake.devices[1].temp = 83
    fake.devices[1].reasons = THROTTLE_HW_THERMAL | 0x1
    fake.xids.append((1, 48))
    events = {(e.kind, e.device): e for e in src.poll()}
    assert set(events) == {
        ("ecc_corrected", 0),
        ("ecc_uncorrected", 0),
        ("temperature", 1),
        ("thermal_throttle", 1),
        ("xid", 1),
    }
    assert events[("ecc_corrected", 0)].value == 2 and events[("ecc_corrected", 0)].total == 7
    assert (
        events[("xid", 1)].value == 48
        and events[("thermal_throttle", 1)].value == THROTTLE_HW_THERMAL
    )
    assert src.poll() == []
    fake.devices[1].temp, fake.devices[1].reasons = 60, 0
    assert sorted(e.kind for e in src.poll()) == [
        "clock_throttle",
        "temperature",
    ]  # both back to normal
    src.close()
    assert fake.initialized == 0


def test_nvml_lost_gpu_and_unsupported_metrics() -> None:
    fake = FakeNvml()
    fake.devices[0].ecc_supported = False
    src = NvmlHealthSource(nvml=fake, devices=[0, 1])
    fake.devices[1].lost = True
    events = src.poll()
    assert [(e.kind, e.device) for e in events] == [("gpu_lost", 1)]
    assert classify(events[0]).severity == "fatal"
    assert src.poll() == []  # lost once, reported once
    with pytest.raises(ConfigError, match="devices"):
        NvmlHealthSource(nvml=FakeNvml(), devices=[5])


# -- classifier -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "severity"),
    [
        (_event("ecc_uncorrected", 1), "fatal"),
        (_event("ecc_corrected", 2, total=10), "info"),
        (_event("ecc_corrected", 2, total=1000), "degraded"),
        (_event("xid", 79), "fatal"),
        (_event("xid", 48), "fatal"),
        (_event("xid", 13), "info"),
        (_event("xid", 94), "degraded"),
        (_event("temperature", 70), "info"),
        (_event("temperature", 88), "degraded"),
        (_event("temperature", 97), "fatal"),
        (_event("thermal_throttle", THROTTLE_HW_THERMAL), "degraded"),
        (_event("clock_throttle", THROTTLE_HW_SLOWDOWN), "degraded"),
        (_event("clock_throttle", THROTTLE_SW_POWER_CAP), "info"),
        (_event("clock_throttle", 0), "info"),
        (_event("gpu_lost", 1), "fatal"),
        (_event("something_new", 1), "degraded"),
    ],
)
def test_classify(event: HealthEvent, severity: str) -> None:
    result = classify(event)
    assert result.severity == severity and result.event is event and result.reason


def test_thresholds_are_configurable_and_validated() -> None:
    strict = HealthThresholds(
        temperature_degraded_c=60, temperature_fatal_c=70, fatal_xids=frozenset({94})
    )
    assert classify(_event("temperature", 65), strict).severity == "degraded"
    assert classify(_event("xid", 94), strict).severity == "fatal"
    with pytest.raises(ConfigError, match="temperature_degraded_c"):
        HealthThresholds(temperature_degraded_c=90, temperature_fatal_c=80)
    with pytest.raises(ConfigError, match="overlap"):
        HealthThresholds(fatal_xids=frozenset({13}))
    with pytest.raises(ConfigError, match="HealthMonitorConfig.period"):
        HealthMonitorConfig(period=timedelta(0))


# -- monitor --------------------------------------------------------------------------------------------------------


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_monitor_delivers_and_survives_raising_callbacks_and_sources(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        name = "broken"

        def poll(self) -> list[HealthEvent]:
            raise RuntimeError("driver hiccup")

        def close(self) -> None:
            pass

    source = InjectedHealthSource()
    got: list[ClassifiedHealthEvent] = []

    def explode(_: ClassifiedHealthEvent) -> None:
        raise ValueError("callback bug")

    monitor = HealthMonitor(
        [Broken(), source],
        config=HealthMonitorConfig(period=timedelta(milliseconds=20)),
        callbacks=[explode, got.append],
    )
    with caplog.at_level(logging.ERROR):
        monitor.start()
        try:
            source.inject(_event("xid", 79))
            assert _wait_for(lambda: len(got) == 1)
            source.inject(_event("temperature", 50))
            assert _wait_for(lambda: len(got) == 2)  # the thread lived through both failures
        finally:
            monitor.stop(timeout=timedelta(seconds=5))
    assert [g.severity for g in got] == ["fatal", "info"]
    assert monitor.callback_errors >= 2 and monitor.source_errors >= 1
    assert any(
        "callback bug" in (r.exc_text or "") or "raised" in r.getMessage() for r in caplog.records
    )
    assert [e.event.kind for e in monitor.events] == ["xid", "temperature"]


def test_monitor_min_severity_filters_delivery_not_history() -> None:
    source = InjectedHealthSource()
    got: list[ClassifiedHealthEvent] = []
    monitor = HealthMonitor(
        [source], config=HealthMonitorConfig(min_severity="degraded"), callbacks=[got.append]
    )
    source.inject(_event("temperature", 50))
    source.inject(_event("ecc_uncorrected", 1))
    assert len(monitor.poll_once()) == 2
    assert [g.event.kind for g in got] == ["ecc_uncorrected"] and len(monitor.events) == 2


def test_monitor_stop_times_out_on_a_stuck_callback() -> None:
    release = threading.Event()
    entered = threading.Event()

    def stuck(_: ClassifiedHealthEvent) -> None:
        entered.set()
        release.wait(10)

    source = InjectedHealthSource()
    source.inject(_event("xid", 79))
    monitor = HealthMonitor(
        [source], config=HealthMonitorConfig(period=timedelta(milliseconds=10)), callbacks=[stuck]
    )
    monitor.start()
    assert entered.wait(5)
    with pytest.raises(CollectiveTimeout):
        monitor.stop(timeout=timedelta(milliseconds=100))
    release.set()
    monitor.stop(timeout=timedelta(seconds=5))

"""The NVML health source: ECC counts, XID events, temperature and clock-event (throttle) reasons per GPU.

``pynvml`` (package ``nvidia-ml-py``, extra ``gemscout[nvml]``) is imported only when a source is constructed, so the
runtime imports without it. What a device does not support is skipped quietly; what fails otherwise is logged once.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import socket
from collections.abc import Sequence
from typing import Any

from gemscout.errors import ConfigError
from gemscout.health.events import THROTTLE_NOTABLE, THROTTLE_THERMAL, HealthEvent

logger = logging.getLogger(__name__)

_ERROR_NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED
_ERROR_TIMEOUT = 10  # NVML_ERROR_TIMEOUT: no event waiting
_ERROR_GPU_IS_LOST = 15  # NVML_ERROR_GPU_IS_LOST
_MEMORY_ERROR_CORRECTED, _MEMORY_ERROR_UNCORRECTED = 0, 1
_VOLATILE_ECC = 0
_TEMPERATURE_GPU = 0
_EVENT_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
_MAX_XIDS_PER_POLL = 64


class NvmlHealthSource:
    """A :class:`~gemscout.health.events.HealthSource` over NVML for local GPUs ``devices`` (default: all).

    Reports: increases of the volatile corrected/uncorrected ECC counts; XID critical errors (when the driver allows
    event registration); temperature crossing ``temperature_report_c`` in either direction; changes of the notable
    clock-event reasons (power cap, hardware slowdown, thermal, power brake). ``nvml`` replaces the ``pynvml`` module
    (tests pass a stand-in with the same functions). Raises :class:`ConfigError` when ``pynvml`` is missing or NVML
    cannot start (no driver).
    """

    def __init__(
        self,
        devices: Sequence[int] | None = None,
        *,
        temperature_report_c: float = 80.0,
        nvml: Any = None,
    ) -> None:
        if nvml is None:
            if importlib.util.find_spec("pynvml") is None:
                raise ConfigError(
                    "NvmlHealthSource needs the nvidia-ml-py package (pip install 'gemscout[nvml]'); "
                    "use InjectedHealthSource on hosts without NVIDIA GPUs"
                )
            nvml = importlib.import_module("pynvml")
        self.name = "nvml"
        self._nvml = nvml
        self._host = socket.gethostname()
        self._report_c = temperature_report_c
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise ConfigError(f"NVML could not start ({exc}); is an NVIDIA driver loaded?") from exc
        self._closed = False
        try:
            count = nvml.nvmlDeviceGetCount()
            indices = list(range(count)) if devices is None else list(devices)
            if any(not 0 <= i < count for i in indices):
                raise ConfigError(
                    f"NvmlHealthSource devices must be in [0, {count}), got {indices}"
                )
            self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        except BaseException:
            nvml.nvmlShutdown()
            raise
        self._unsupported: set[tuple[int, str]] = set()
        self._warned: set[tuple[int, str]] = set()
        self._lost: set[int] = set()
        self._ecc: dict[tuple[int, int], int] = {}
        self._hot: dict[int, bool] = {}
        self._reasons: dict[int, int] = {}
        self._events = self._register_xid_events()
        # Baseline the cumulative ECC counters so that the first poll reports only errors that happen from now on.
        for index in self._handles:
            for kind in (_MEMORY_ERROR_CORRECTED, _MEMORY_ERROR_UNCORRECTED):
                count_now = self._call(
                    index, f"ecc{kind}", nvml.nvmlDeviceGetTotalEccErrors, kind, _VOLATILE_ECC
                )
                if count_now is not None:
                    self._ecc[(index, kind)] = int(count_now)

    def poll(self) -> list[HealthEvent]:
        """Events since the previous poll. Never blocks: XID events are drained with a zero wait."""
        if self._closed:
            return []
        events: list[HealthEvent] = []
        for index in self._handles:
            if index not in self._lost:
                events.extend(self._poll_device(index))
        events.extend(self._drain_xids())
        return events

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._events is not None:
            try:
                self._nvml.nvmlEventSetFree(self._events)
            except self._nvml.NVMLError:
                pass
        self._nvml.nvmlShutdown()

    def _event(self, kind: str, index: int | None, value: float, **extra: Any) -> HealthEvent:
        return HealthEvent(
            kind=kind, device=index, value=value, source=self.name, host=self._host, **extra
        )

    def _poll_device(self, index: int) -> list[HealthEvent]:
        nvml, found = self._nvml, []
        for error_type, name in (
            (_MEMORY_ERROR_CORRECTED, "ecc_corrected"),
            (_MEMORY_ERROR_UNCORRECTED, "ecc_uncorrected"),
        ):
            now = self._call(
                index,
                f"ecc{error_type}",
                nvml.nvmlDeviceGetTotalEccErrors,
                error_type,
                _VOLATILE_ECC,
            )
            if now is None:
                continue
            before = self._ecc.get((index, error_type), 0)
            self._ecc[(index, error_type)] = int(now)
            if int(now) > before:
                found.append(self._event(name, index, int(now) - before, total=float(now)))
        temp = self._call(index, "temperature", nvml.nvmlDeviceGetTemperature, _TEMPERATURE_GPU)
        if temp is not None:
            hot = float(temp) >= self._report_c
            if hot != self._hot.get(index, False):
                where = "above" if hot else "back below"
                found.append(
                    self._event(
                        "temperature", index, float(temp), detail=f"{where} {self._report_c:g} C"
                    )
                )
            self._hot[index] = hot
        reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        reasons = None if reasons_fn is None else self._call(index, "clocks", reasons_fn)
        if reasons is not None:
            notable = int(reasons) & THROTTLE_NOTABLE
            if notable != self._reasons.get(index, 0):
                kind = "thermal_throttle" if notable & THROTTLE_THERMAL else "clock_throttle"
                found.append(
                    self._event(
                        kind, index, float(notable), detail=f"clock event reasons 0x{notable:x}"
                    )
                )
            self._reasons[index] = notable
        if index in self._lost:
            found.append(self._event("gpu_lost", index, 1.0, detail="NVML reports the GPU is lost"))
        return found

    def _call(self, index: int, metric: str, fn: Any, *args: Any) -> Any:
        """``fn(handle, *args)``, or ``None`` when unsupported, failed, or the GPU is lost (recorded in ``_lost``)."""
        if (index, metric) in self._unsupported or index in self._lost:
            return None
        try:
            return fn(self._handles[index], *args)
        except self._nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == _ERROR_NOT_SUPPORTED:
                self._unsupported.add((index, metric))
            elif code == _ERROR_GPU_IS_LOST:
                self._lost.add(index)
            elif (index, metric) not in self._warned:
                self._warned.add((index, metric))
                logger.warning("NVML %s on GPU %d failed: %s", metric, index, exc)
            return None

    def _register_xid_events(self) -> Any:
        nvml = self._nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            logger.info("NVML events unavailable (%s); XIDs will not be reported", exc)
            return None
        registered = 0
        for index, handle in self._handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, _EVENT_XID_CRITICAL, event_set)
                registered += 1
            except nvml.NVMLError as exc:
                logger.info("XID events unavailable on GPU %d (%s)", index, exc)
        if not registered:
            nvml.nvmlEventSetFree(event_set)
            return None
        return event_set

    def _drain_xids(self) -> list[HealthEvent]:
        if self._events is None:
            return []
        nvml, found = self._nvml, []
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        for _ in range(_MAX_XIDS_PER_POLL):
            try:
                data = wait(self._events, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != _ERROR_TIMEOUT:
                    logger.warning("NVML XID wait failed: %s", exc)
                break
            try:
                index: int | None = int(nvml.nvmlDeviceGetIndex(data.device))
            except (nvml.NVMLError, AttributeError):
                index = None
            found.append(
                self._event(
                    "xid", index, float(data.eventData), detail=f"XID {int(data.eventData)}"
                )
            )
        return found

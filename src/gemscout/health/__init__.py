"""Hardware health: events read from the accelerator (NVML) or injected, classified against thresholds, and a
monitor that turns notable ones into fault reports and a job-wide decision."""

from gemscout.health.events import (
    ClassifiedHealthEvent,
    HealthEvent,
    HealthSource,
    HealthThresholds,
    InjectedHealthSource,
    classify,
)
from gemscout.health.monitor import HealthMonitor, HealthMonitorConfig
from gemscout.health.nvml import NvmlHealthSource

__all__ = [
    "ClassifiedHealthEvent",
    "HealthEvent",
    "HealthMonitor",
    "HealthMonitorConfig",
    "HealthSource",
    "HealthThresholds",
    "InjectedHealthSource",
    "NvmlHealthSource",
    "classify",
]

"""Out-of-band (OOB) channel, progress, hang/stall watchdog and hardware health for SCOUT.

Everything here talks through an authenticated :class:`OobChannel` over a torch ``TCPStore`` and never through the
training process group, so it keeps working while training threads are blocked in a collective.
"""

from gemscout.oob.channel import ChannelStats, OobChannel, OobStore, TamperEvent, serve_store
from gemscout.oob.config import OobConfig
from gemscout.oob.findings import StallFinding
from gemscout.oob.health import (
    ClassifiedHealthEvent,
    HealthEvent,
    HealthSource,
    HealthThresholds,
    InjectedHealthSource,
    classify,
)
from gemscout.oob.monitor import HealthMonitor, HealthMonitorConfig
from gemscout.oob.nvml import NvmlHealthSource
from gemscout.oob.progress import ProgressConfig, ProgressPublisher
from gemscout.oob.records import CollectiveFingerprint, ProgressRecord
from gemscout.oob.secret import SECRET_ENV, generate_secret
from gemscout.oob.stalls import InstrumentedLoader, StallConfig, StallDetector, checkpoint_io
from gemscout.oob.store_server import StoreServer, StoreServerConfig, StoreServerError, StoreStatus
from gemscout.oob.watchdog import Watchdog, WatchdogConfig

__all__ = [
    "ChannelStats",
    "ClassifiedHealthEvent",
    "CollectiveFingerprint",
    "HealthEvent",
    "HealthMonitor",
    "HealthMonitorConfig",
    "HealthSource",
    "HealthThresholds",
    "InjectedHealthSource",
    "InstrumentedLoader",
    "NvmlHealthSource",
    "OobChannel",
    "OobConfig",
    "OobStore",
    "ProgressConfig",
    "ProgressPublisher",
    "ProgressRecord",
    "SECRET_ENV",
    "StallConfig",
    "StallDetector",
    "StallFinding",
    "StoreServer",
    "StoreServerConfig",
    "StoreServerError",
    "StoreStatus",
    "TamperEvent",
    "Watchdog",
    "WatchdogConfig",
    "checkpoint_io",
    "classify",
    "generate_secret",
    "serve_store",
]

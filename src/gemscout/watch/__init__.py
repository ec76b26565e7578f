"""Out-of-band watching: the authenticated channel, progress, the hang/stall watchdog, and the session service.

Everything here talks through an authenticated :class:`OobChannel` over a torch ``TCPStore`` and never through the
training process group, so it keeps working while training threads are blocked in a collective.
"""

from gemscout.watch.bound_store import serve_store
from gemscout.watch.channel import OobChannel, OobStore
from gemscout.watch.config import OobConfig
from gemscout.watch.findings import StallFinding
from gemscout.watch.progress import ProgressConfig, ProgressPublisher
from gemscout.watch.records import CollectiveFingerprint, ProgressRecord
from gemscout.watch.secret import SECRET_ENV, generate_secret
from gemscout.watch.service import Watch, WatchConfig
from gemscout.watch.stalls import InstrumentedLoader, StallConfig, StallDetector, checkpoint_io
from gemscout.watch.store_health import StoreStatus
from gemscout.watch.store_server import StoreServer, StoreServerConfig, StoreServerError
from gemscout.watch.tamper import ChannelStats, TamperEvent
from gemscout.watch.watchdog import Watchdog, WatchdogConfig

__all__ = [
    "ChannelStats",
    "CollectiveFingerprint",
    "InstrumentedLoader",
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
    "Watch",
    "WatchConfig",
    "Watchdog",
    "WatchdogConfig",
    "checkpoint_io",
    "generate_secret",
    "serve_store",
]

"""gemscout: resiliency for distributed PyTorch training.

The public face: :func:`enable_resiliency`, its configs, the decision and trust types, and the errors.
Everything else is reachable by module path. Importing gemscout never imports the harness or an optional framework.
"""

from gemscout.api import Session, enable_resiliency
from gemscout.config import TrustState
from gemscout.elastic import init_process_group
from gemscout.errors import (
    CollectiveTimeout,
    ConfigError,
    GemscoutError,
    IntegrityError,
    RecoveryError,
    ReplicaUnavailable,
    RunMismatchError,
)
from gemscout.gemini.config import CheckpointConfig
from gemscout.gemini.recovery import RecoveryDecision, RecoveryMode
from gemscout.reports import FaultReport
from gemscout.scout.config import ScoutConfig
from gemscout.watch import WatchConfig

__version__ = "0.1.0"

__all__ = [
    "CheckpointConfig",
    "CollectiveTimeout",
    "ConfigError",
    "FaultReport",
    "GemscoutError",
    "IntegrityError",
    "RecoveryDecision",
    "RecoveryError",
    "RecoveryMode",
    "ReplicaUnavailable",
    "RunMismatchError",
    "ScoutConfig",
    "Session",
    "TrustState",
    "WatchConfig",
    "enable_resiliency",
    "init_process_group",
]

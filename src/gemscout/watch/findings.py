"""What the out-of-band detectors conclude: :class:`StallFinding`.

The SCOUT session turns each finding into a ``gemscout.reports.FaultReport`` (same kind, ``scope="rank"``, the
finding's ranks, step, evidence, confirmations, reason and host; the session adds the recipe and its own timestamp
policy). Keeping this small type here lets the OOB package stand alone: it imports nothing from ``scout``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gemscout.errors import ConfigError

StallKind = Literal["hang", "data_stall", "checkpoint_stall", "tamper"]
"""``hang``: no progress past the threshold; ``data_stall``: DataLoader fetches; ``checkpoint_stall``: checkpoint I/O;
``tamper``: a slot of the out-of-band store held a message that failed authentication (or was replayed, deleted,
oversized), or the store held keys that are not the job's. A tamper finding is about the channel, never about the
named rank's training: ``ranks`` are the ranks whose slots were touched, and the recommendation is ``observe``."""

Recommendation = Literal["observe", "restart_from_verified"]
"""Conservative advice. ``observe``: the job still progresses, keep watching and report; ``restart_from_verified``: the
job no longer progresses, restart every rank from the newest recovery-verified checkpoint. Nothing here ever advises
excluding a node: a stall alone is not proof of broken hardware."""

STALL_KINDS: tuple[str, ...] = ("hang", "data_stall", "checkpoint_stall", "tamper")
RECOMMENDATIONS: tuple[str, ...] = ("observe", "restart_from_verified")


@dataclass(kw_only=True, slots=True, frozen=True)
class StallFinding:
    """One confirmed stall, localized to ranks where the evidence allows.

    ``ranks`` is empty when the stall is real but no rank could be named (every rank waits in the same collective and
    none lags): detection without a culprit. ``evidence`` holds only JSON values (numbers, strings, lists, dicts).
    """

    kind: StallKind
    """What stalled: see :data:`StallKind`."""
    ranks: tuple[int, ...]
    """The root ranks, ascending; empty when the stall could not be localized."""
    step: int | None
    """The training step the root ranks had reached, when known."""
    evidence: Mapping[str, Any]
    """The observations behind the verdict (per-rank positions, timings, thresholds), JSON-serializable."""
    confirmations: int
    """How many consecutive polls or rounds agreed before this finding was emitted."""
    reason: str
    """One sentence a person can act on."""
    host: str | None = None
    """Host name of the first root rank, when it published one."""
    recommendation: Recommendation = "observe"
    """Conservative recovery advice; see :data:`Recommendation`."""
    timestamp: float = field(default_factory=time.time)
    """Wall-clock seconds since the epoch when the finding was made."""

    def __post_init__(self) -> None:
        if self.kind not in STALL_KINDS:
            raise ConfigError(f"StallFinding.kind must be one of {STALL_KINDS}, got {self.kind!r}")
        if self.recommendation not in RECOMMENDATIONS:
            raise ConfigError(
                f"StallFinding.recommendation must be one of {RECOMMENDATIONS}, got {self.recommendation!r}"
            )
        if list(self.ranks) != sorted(set(self.ranks)):
            raise ConfigError(
                f"StallFinding.ranks must be ascending and unique, got {self.ranks!r}"
            )
        if self.confirmations < 1:
            raise ConfigError(f"StallFinding.confirmations must be >= 1, got {self.confirmations}")
        if self.kind == "tamper" and self.recommendation != "observe":
            raise ConfigError(
                "StallFinding: a tamper finding can only recommend 'observe' (forged data decides nothing)"
            )

    def to_dict(self) -> dict[str, Any]:
        """A plain-JSON dict of every field."""
        return {
            "kind": self.kind,
            "ranks": list(self.ranks),
            "step": self.step,
            "evidence": dict(self.evidence),
            "confirmations": self.confirmations,
            "reason": self.reason,
            "host": self.host,
            "recommendation": self.recommendation,
            "timestamp": self.timestamp,
        }

    def to_json(self) -> str:
        """Canonical JSON (sorted keys). Raises ``ValueError`` if the evidence holds a non-JSON value or a NaN."""
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

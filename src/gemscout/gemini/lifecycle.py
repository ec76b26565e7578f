"""Trust states of captured steps, kept per rank in an atomically written status file.

CANDIDATE (captured) → RECOVERY_VERIFIED (certified by SCOUT or the caller) → DURABLE (promoted), or REJECTED
(corruption seen before certification). Transitions are decided collectively by the session, then every rank records
the same outcome, so recovery can take the union of every rank's records: a step any rank saw rejected is never
restored, even if that rank's files are gone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemscout.config import TrustState
from gemscout.gemini.store import write_json_atomic


@dataclass
class TrustLedger:
    """One rank's record: trust state per step, recovery attempts per step, and the last decision."""

    path: Path
    run_id: str = ""
    states: dict[int, TrustState] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    last_decision: dict[str, Any] | None = None
    fsync: bool = True

    @classmethod
    def load(cls, path: Path, *, fsync: bool = True) -> TrustLedger:
        """Read the ledger; a missing or unreadable file yields an empty one (the union with peers fills it in)."""
        ledger = cls(path=path, fsync=fsync)
        try:
            doc = json.loads(path.read_text())
            ledger.run_id = str(doc.get("run_id", ""))
            ledger.states = {int(k): TrustState(v) for k, v in doc.get("states", {}).items()}
            ledger.attempts = {int(k): int(v) for k, v in doc.get("attempts", {}).items()}
            ledger.last_decision = doc.get("last_decision")
        except (OSError, ValueError, TypeError, AttributeError):
            pass
        return ledger

    def save(self) -> None:
        write_json_atomic(self.path, {
            "run_id": self.run_id,
            "states": {str(k): v.value for k, v in sorted(self.states.items())},
            "attempts": {str(k): v for k, v in sorted(self.attempts.items())},
            "last_decision": self.last_decision,
        }, fsync=self.fsync)

    def add_candidate(self, step: int) -> None:
        self.states.setdefault(step, TrustState.CANDIDATE)

    def certify_through(self, step: int) -> list[int]:
        """Mark every candidate at or before ``step`` RECOVERY_VERIFIED; returns the steps changed."""
        changed = [s for s, st in self.states.items() if s <= step and st == TrustState.CANDIDATE]
        for s in changed:
            self.states[s] = TrustState.RECOVERY_VERIFIED
        return sorted(changed)

    def reject_uncertified(self) -> list[int]:
        """Mark every CANDIDATE REJECTED; returns the steps rejected."""
        changed = [s for s, st in self.states.items() if st == TrustState.CANDIDATE]
        for s in changed:
            self.states[s] = TrustState.REJECTED
        return sorted(changed)

    def mark(self, step: int, state: TrustState) -> None:
        self.states[step] = state

    def forget_before(self, step: int, keep_rejected: bool = True) -> None:
        """Drop records older than ``step`` (their files are pruned), keeping rejections as a safety net."""
        self.states = {s: st for s, st in self.states.items() if s >= step or (keep_rejected and st == TrustState.REJECTED)}
        self.attempts = {s: n for s, n in self.attempts.items() if s >= step}

    def summary(self) -> dict[str, Any]:
        return {
            "rejected": sorted(s for s, st in self.states.items() if st == TrustState.REJECTED),
            "trust": {str(s): st.value for s, st in self.states.items()},
            "attempts": {str(s): n for s, n in self.attempts.items()},
        }

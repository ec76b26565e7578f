"""Trust states of captured steps, kept per rank in an atomically written status file.

CANDIDATE (captured) → RECOVERY_VERIFIED (certified by SCOUT or the caller) → DURABLE (promoted), or REJECTED
(corruption seen before certification). Transitions are decided collectively by the session, then every rank records
the same outcome, so recovery can take the union of every rank's records: a step any rank saw rejected is never
restored, even if that rank's files are gone.

With the job's integrity key the file carries a MAC (:mod:`gemscout.record_mac`): a ledger written without the key
(forged, or another rank's) is refused at load like a malformed one — this rank starts from an empty record, names
the refusal in ``load_problem``, and recovery decides from its peers' ledgers and the files that verify, never from
the forged states.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gemscout import record_mac
from gemscout.config import TrustState
from gemscout.errors import IntegrityError
from gemscout.files import is_int, load_json
from gemscout.gemini import store
from gemscout.gemini.store import write_json_atomic

log = logging.getLogger("gemscout.gemini")
MAX_LEDGER_BYTES = 16 << 20
_STEP_KEY = re.compile(r"0|[1-9][0-9]{0,17}")  # ASCII, canonical: what str(int) writes
_STATES = {s.value for s in TrustState}


def parse_ledger(
    doc: Any,
) -> tuple[str, dict[int, TrustState], dict[int, int], dict[str, Any] | None]:
    """``(run_id, states, attempts, last_decision)`` of a parsed status.json, every field checked (step keys
    canonical non-negative integers, states known, attempts non-negative integers). Raises IntegrityError."""
    if not isinstance(doc, dict):
        raise IntegrityError("status.json is not a JSON object")
    run_id, states, attempts, last = (
        doc.get(k) for k in ("run_id", "states", "attempts", "last_decision")
    )
    if not isinstance(run_id, str | None):
        raise IntegrityError("status.json run_id is not a string")
    if not isinstance(states, dict | None) or not all(
        isinstance(k, str) and _STEP_KEY.fullmatch(k) and v in _STATES
        for k, v in (states or {}).items()
    ):
        raise IntegrityError("status.json states are not step -> trust state")
    if not isinstance(attempts, dict | None) or not all(
        isinstance(k, str) and _STEP_KEY.fullmatch(k) and is_int(v)
        for k, v in (attempts or {}).items()
    ):
        raise IntegrityError("status.json attempts are not step -> count")
    if not isinstance(last, dict | None):
        raise IntegrityError("status.json last_decision is not an object")
    return (
        run_id or "",
        {int(k): TrustState(v) for k, v in (states or {}).items()},
        {int(k): v for k, v in (attempts or {}).items()},
        last,
    )


@dataclass
class TrustLedger:
    """One rank's record: trust state per step, recovery attempts per step, and the last decision.

    Writing it never raises: a full, read-only or failing disk (ENOSPC, EROFS, EIO) must not break the training
    step that certifies or rejects. The change stays in memory (recovery in this process uses it), every later
    :meth:`save` retries the whole record, and the failure goes to the callback of :meth:`report_to` (a
    FaultReport). What a restart reads is only what the disk recorded: a certification the disk never recorded
    reads as CANDIDATE (never trusted more than recorded); a rejection it never recorded would read as CANDIDATE
    too, so the rejected steps' files of this rank are deleted instead (an unlink needs no free space)."""

    path: Path
    run_id: str = ""
    states: dict[int, TrustState] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    last_decision: dict[str, Any] | None = None
    fsync: bool = True
    unsaved: str | None = None
    """Why the newest save failed; None when the disk holds what memory holds."""
    load_problem: str | None = None
    """Why the file on disk was refused at load (malformed, not a regular file, ...); None if it loaded or was
    missing."""
    _recorded_rejections: set[int] = field(default_factory=set, repr=False)
    _on_failure: Callable[[str, dict[str, Any]], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _retry_at: float = field(default=0.0, repr=False)

    @classmethod
    def load(cls, path: Path, *, fsync: bool = True) -> TrustLedger:
        """Read the ledger; a missing, unreadable or malformed file yields an empty one (the union with peers fills
        it in; a malformed one is logged and named in ``load_problem``)."""
        ledger = cls(path=path, fsync=fsync)
        try:
            doc = load_json(path, max_bytes=MAX_LEDGER_BYTES)
            if isinstance(doc, dict):
                record_mac.check(doc, ledger.scope, str(path))
            ledger.run_id, ledger.states, ledger.attempts, ledger.last_decision = parse_ledger(doc)
        except FileNotFoundError:
            pass
        except (OSError, IntegrityError) as exc:
            ledger.load_problem = str(exc)
            log.warning("gemini: trust ledger %s refused, starting empty: %s", path, exc)
        ledger._recorded_rejections = {
            s for s, st in ledger.states.items() if st == TrustState.REJECTED
        }
        return ledger

    @property
    def scope(self) -> str:
        """What the ledger's MAC binds it to: this file of this rank folder (:mod:`gemscout.record_mac`)."""
        return record_mac.rank_scope("status.json", self.path.parent)

    def report_to(self, callback: Callable[[str, dict[str, Any]], None]) -> None:
        """Call ``callback(reason, evidence)`` when a save fails (once per run of failures, not at every retry)."""
        self._on_failure = callback

    def save(self) -> bool:
        """Write the record atomically. Returns False (and keeps it in memory, to be retried by the next save) when
        the disk refuses it; never raises OSError."""
        with self._lock:
            states = sorted(self.states.items())
            doc = {
                "run_id": self.run_id,
                "states": {str(k): v.value for k, v in states},
                "attempts": {str(k): v for k, v in sorted(self.attempts.items())},
                "last_decision": self.last_decision,
            }
            try:
                write_json_atomic(self.path, record_mac.sign(doc, self.scope), fsync=self.fsync)
            except OSError as exc:
                self._failed(exc, {s for s, st in states if st == TrustState.REJECTED})
                return False
            if self.unsaved is not None:
                log.warning(
                    "gemini: trust ledger %s written again after: %s", self.path, self.unsaved
                )
            self.unsaved = None
            self._recorded_rejections = {s for s, st in states if st == TrustState.REJECTED}
            return True

    def retry(self, min_interval_s: float = 1.0) -> bool:
        """Save again if the last save failed and ``min_interval_s`` passed since; True when the disk is current."""
        if self.unsaved is None:
            return True
        if time.monotonic() < self._retry_at:
            return False
        return self.save()

    def _failed(self, exc: OSError, rejected: set[int]) -> None:
        first = self.unsaved is None
        code = errno.errorcode.get(exc.errno or 0, "error")
        self.unsaved = f"{code}: {exc.strerror or exc}"
        self._retry_at = time.monotonic() + 1.0
        unrecorded = sorted(rejected - self._recorded_rejections)
        removed = self._drop_files(unrecorded) if unrecorded else []
        if not first:
            return
        reason = (
            f"trust ledger {self.path} could not be written ({self.unsaved}); training continues, the trust "
            "change is kept in memory and every later save retries it; until one succeeds a restart reads "
            "only what the disk recorded"
        )
        if unrecorded:
            reason += f"; the files of unrecorded rejected steps {unrecorded} were deleted so no restart restores them"
        log.error("gemini: %s", reason)
        if self._on_failure is not None:
            try:
                self._on_failure(
                    reason,
                    {
                        "file": str(self.path),
                        "errno": code,
                        "unrecorded_rejections": unrecorded,
                        "deleted_files": removed,
                    },
                )
            except Exception as cb_exc:  # a report callback must never break the training step
                log.warning("gemini: trust ledger failure callback raised: %s", cb_exc)

    def _drop_files(self, steps: list[int]) -> list[str]:
        """Delete this rank's files (own and held replicas) of ``steps``: a rejected step the ledger could not record
        must not be restorable after a restart. Returns the paths deleted."""
        paths = store.RankPaths(self.path.parent)
        removed: list[str] = []
        try:
            folders = [paths.own] + [paths.replicas(o) for o in paths.held_owners()]
        except OSError:
            folders = [paths.own]
        for folder in folders:
            for step in steps:
                target = store.step_file(folder, step)
                try:
                    target.unlink()
                    removed.append(str(target))
                except FileNotFoundError:
                    continue
                except (
                    OSError
                ) as exc:  # EROFS: nothing on this disk can change; the peers' ledgers remain
                    log.error("gemini: cannot delete rejected %s: %s", target, exc)
        return removed

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
        self.states = {
            s: st
            for s, st in self.states.items()
            if s >= step or (keep_rejected and st == TrustState.REJECTED)
        }
        self.attempts = {s: n for s, n in self.attempts.items() if s >= step}

    def stats(self) -> dict[str, int | None]:
        """Counts for ``Session.metrics()``: the newest verified and durable steps, candidates and rejections."""
        states = dict(self.states)
        verified = (TrustState.RECOVERY_VERIFIED, TrustState.DURABLE)
        return {
            "newest_verified_step": max(
                (s for s, st in states.items() if st in verified), default=None
            ),
            "newest_durable_step": max(
                (s for s, st in states.items() if st == TrustState.DURABLE), default=None
            ),
            "candidates": sum(st == TrustState.CANDIDATE for st in states.values()),
            "rejected": sum(st == TrustState.REJECTED for st in states.values()),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "rejected": sorted(s for s, st in self.states.items() if st == TrustState.REJECTED),
            "trust": {str(s): st.value for s, st in self.states.items()},
            "attempts": {str(s): n for s, n in self.attempts.items()},
        }

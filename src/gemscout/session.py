"""The session handle: optimizer hooks that run SCOUT, gate GEMINI's captures on its verdicts, and deliver reports.

Per optimizer step ``s``:

- **pre-hook** (backward done, update not yet applied): wait for any background copy still reading the parameters;
  run the SCOUT cycle of ``s`` if it is due (replay on the peers, C3 verdicts);
- **post-hook** (update applied): count the step; publish progress out of band; then, by SCOUT's verdict on ``s``:
  clean → GEMINI captures ``s`` and certifies what the rotation has now covered; SDC → no capture, every uncertified
  candidate is rejected job-wide, and a FaultReport plus a RecoveryDecision naming the newest recovery-verified step
  go to the callbacks; inconclusive → reported, captured as an uncertified candidate (``capture_on_inconclusive``).

With :meth:`Session.check_alltoall` the pre-hook also replays and verifies the step's recorded AllToAlls (MoE
dispatch/combine); a mismatch anywhere in the job gates the step like SDC, and nothing is certified past the newest
step whose AllToAll check came back clean.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from gemscout import _teardown, metrics
from gemscout.config import TrustState
from gemscout.errors import ConfigError
from gemscout.faultlog import FILE_NAME, FaultLog
from gemscout.gating import gate
from gemscout.gemini.checkpointer import Checkpointer
from gemscout.gemini.recovery import RecoveryDecision, RecoveryMode
from gemscout.health import HealthMonitor
from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.scout.alltoall import AllToAllCheck, AllToAllConfig
from gemscout.scout.comm_probe import CommProbe
from gemscout.scout.cycle import CycleResult
from gemscout.scout.engine import Scout
from gemscout.signals import SignalHandlers
from gemscout.state.training_state import StateSources
from gemscout.watch import Watch

log = logging.getLogger("gemscout")
LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


class Session:
    """The handle returned by :func:`enable_resiliency`. Use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        *,
        sources: StateSources,
        interval: int,
        checkpointer: Checkpointer | None,
        rank: int,
        world_size: int,
    ) -> None:
        self.sources, self.interval, self.checkpointer = sources, interval, checkpointer
        self.rank, self.world_size = rank, world_size
        self.watch: Watch | None = None
        self.scout: Scout | None = None
        self.comm_probe: CommProbe | None = None
        self.health: HealthMonitor | None = None
        self.alltoall: AllToAllCheck | None = None
        self._a2a_mismatch_step = -1
        self._a2a_clean_step = -1
        self.capture_on_inconclusive = True
        self.last_cycle: CycleResult | None = None
        self.quarantine: set[str] = set()
        """Recipes that disagreed and have not passed clean since: no capture while any is listed."""
        self.reports: list[FaultReport] = []
        self.fault_log = (
            FaultLog(checkpointer.paths.root / FILE_NAME, fsync=checkpointer.config.fsync)
            if checkpointer is not None
            else None
        )
        """Where every report is also kept on disk (the rank's checkpoint folder), for ``gemscout inspect``."""
        if (
            checkpointer is not None
        ):  # a full or read-only disk under the trust ledger is reported, never raised
            checkpointer.ledger.report_to(self._ledger_unwritable)
        self.on_fault_report: Callable[[FaultReport], None] | None = None
        self.on_recovery_decision: Callable[[RecoveryDecision], None] | None = None
        self.step = 0
        self.resume_step = 0
        self.last_decision: RecoveryDecision | None = None
        self.closed = False
        self.cycles, self.cycle_s_total, self.last_cycle_s = 0, 0.0, 0.0
        """SCOUT cycles run by this session and their wall seconds on the training thread (see :meth:`metrics`)."""
        self._handles: list[Any] = []
        self._signals: SignalHandlers | None = None

    # -- hooks ----------------------------------------------------------------------------------------------
    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait_copied()
        if self.scout is not None:
            # Parameters are still those the forward used: the update has not run yet.
            t0 = time.perf_counter()
            self.last_cycle = self.scout.before_step(self.step + 1)
            if self.last_cycle is not None:
                self.cycles += 1
                self.last_cycle_s = time.perf_counter() - t0
                self.cycle_s_total += self.last_cycle_s
        if self.alltoall is not None and self.alltoall.before_step(self.step + 1) is not None:
            if self.alltoall.job_mismatch:
                self._a2a_mismatch_step = self.step + 1
            else:
                self._a2a_clean_step = self.step + 1
        if self.comm_probe is not None and self.comm_probe.due(self.step + 1):
            report = self.comm_probe.probe(self.step + 1)
            if report is not None:
                self._report(report)

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step += 1
        if self.checkpointer is not None:
            self.checkpointer.ledger.retry()  # a no-op unless a ledger write failed (then at most once a second)
        if self.watch is not None:
            self.watch.step(self.step)
        settled = self.scout.last_result if self.scout is not None else None
        if (
            self.last_cycle is not None
            and settled is not None
            and settled.step == self.last_cycle.step
        ):
            # A Scout may settle the verdict after the update (DeepSpeed ZeRO's optimizer slices): take its newest.
            self.last_cycle = settled
        cycle = (
            self.last_cycle
            if self.last_cycle is not None and self.last_cycle.step == self.step
            else None
        )
        self.last_cycle = None
        for report in cycle.reports if cycle is not None else ():
            self._report(report)
        mismatches = (
            [r.reason for r in self.alltoall.last_results if r.verdict == "mismatch"]
            if self.alltoall is not None and self._a2a_mismatch_step == self.step
            else None
        )
        decided = gate(
            self.step,
            cycle,
            frozenset(self.quarantine),
            due=self.step % self.interval == 0,
            capture_on_inconclusive=self.capture_on_inconclusive,
            alltoall_mismatches=mismatches,
            alltoall_clean_step=self._a2a_clean_step if self.alltoall is not None else None,
        )
        self.quarantine = set(decided.quarantine)
        if decided.reject is not None:
            self._reject_and_decide(*decided.reject)
            return  # a contaminated step is never captured
        if self.checkpointer is None:
            return
        if decided.capture:
            self.checkpointer.capture(self.step, durable=decided.durable)
        rotation = getattr(self.scout, "rotation", None)
        if decided.retain and rotation is not None:
            self.checkpointer.retain(rotation.open_steps())
        if decided.certify is not None:
            self.checkpointer.certify(decided.certify)

    def _reject_and_decide(self, kind: str, reason: str) -> None:
        """Collective: reject every uncertified candidate job-wide and deliver a RecoveryDecision of ``kind`` naming
        the newest recovery-verified step (STOP when none exists yet)."""
        if self.checkpointer is None:
            return
        rejected = self.checkpointer.reject_candidates(reason)
        ledger = self.checkpointer.ledger
        verified = [
            s for s, st in ledger.states.items() if st.rank >= TrustState.RECOVERY_VERIFIED.rank
        ]
        step = max(verified) if verified else None
        decision = RecoveryDecision(
            kind,
            RecoveryMode.RESTORE if step is not None else RecoveryMode.STOP,
            step,
            f"{self.checkpointer.run_id}:{step}" if step is not None else None,
            {},
            self.checkpointer.topology_digest,
            f"{reason}; rejected candidates {rejected}; restore the newest recovery-verified step"
            + ("" if step is not None else " (none exists yet)"),
        )
        ledger.last_decision = decision.to_dict()
        ledger.save()
        self.last_decision = decision
        if self.on_recovery_decision is not None:
            try:
                self.on_recovery_decision(decision)
            except Exception as exc:
                log.warning("gemscout: on_recovery_decision raised: %s", exc)

    def _attach(self) -> None:
        opt = self.sources.optimizer
        self._handles = [
            opt.register_step_pre_hook(self._pre_step),
            opt.register_step_post_hook(self._post_step),
        ]

    # -- public ---------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, int | float | None]:
        """A flat snapshot for the loop's logger: step, GEMINI's captures, stalls, io times, bytes, newest steps in
        memory / on disk / verified / durable, SCOUT's cycles and their cost, fault reports by kind
        (:mod:`gemscout.metrics`). No lock, no collective."""
        return metrics.snapshot(self)

    def flush(self, timeout: timedelta | None = None, *, wait_for_peers: bool = True) -> int:
        """Persist the newest captured state (no collective). Returns the newest step on disk, or -1.
        ``wait_for_peers`` False: stop waiting for io stuck in an exchange with a gone or stalled peer (what the
        signal handler does; see ``Checkpointer.flush``)."""
        return (
            self.checkpointer.flush(timeout, wait_for_peers=wait_for_peers)
            if self.checkpointer
            else -1
        )

    def certify(self, step: int) -> list[int]:
        """Collective: mark candidates up to ``step`` RECOVERY_VERIFIED. SCOUT drives this; callers may too."""
        return self.checkpointer.certify(step) if self.checkpointer else []

    def reject_candidates(self, reason: str) -> list[int]:
        """Collective: reject every uncertified candidate job-wide."""
        return self.checkpointer.reject_candidates(reason) if self.checkpointer else []

    def recover(
        self, failure_kind: str = "restart", *, min_trust: TrustState | None = None
    ) -> RecoveryDecision:
        """Collective: choose and restore the newest restorable step now (e.g. after an SDC report, with
        ``min_trust=TrustState.RECOVERY_VERIFIED``). Returns the decision; ``session.step`` is the restored step."""
        if self.checkpointer is None:
            raise ConfigError(
                "recover() needs GEMINI: pass checkpoint=CheckpointConfig(directory=...)"
            )
        decision = self.checkpointer.recover(failure_kind=failure_kind, min_trust=min_trust)
        self.last_decision = decision
        if decision.step is not None and decision.mode != RecoveryMode.FRESH:
            self.step = self.resume_step = decision.step
        if self.scout is not None:
            self.scout.set_next_step(self.step + 1)
        return decision

    def check_alltoall(self, *modules: Any, config: AllToAllConfig | None = None) -> AllToAllCheck:
        """Verify the AllToAlls that the forwards of ``modules`` issue (an MoE layer's token dispatch and combine).

        Each ``dist.all_to_all_single`` inside those forwards is recorded (group, dtype, row shape, split sizes; no
        payload). At every due step (``config.interval``), before the update, every rank of each EP group replays a
        bounded representative set (the largest recorded call with its own splits, a balanced split and a cyclic
        permutation) with deterministic payloads and compares digests: a wrong send names the sender, bytes changed on
        the way name the (sender, receiver) pair. A mismatch anywhere in the job is treated like SDC: the step is not
        captured, every uncertified candidate is rejected job-wide, a FaultReport and a RecoveryDecision go to the
        callbacks; and nothing is certified past the newest clean check. Collective: every rank calls it, with the
        same config, after ``enable_resiliency`` and before its first step. Returns the check (its
        ``last_results`` hold the newest due step's verdicts)."""
        if not modules:
            raise ConfigError(
                "check_alltoall: pass the module(s) whose forward issues the AllToAlls (e.g. each MoE "
                "layer)"
            )
        if self.alltoall is not None:
            raise ConfigError(
                "check_alltoall: already enabled on this session; pass every module in one call"
            )
        check = AllToAllCheck(config, on_report=self._report)
        for module in modules:
            self._handles.append(check.install(module))
        self.alltoall = check
        return check

    def instrument_dataloader(self, loader: Iterable[Any]) -> Iterable[Any]:
        """Wrap ``loader`` so each fetch is timed and compared across ranks (needs ``watch=WatchConfig(...)``)."""
        if self.watch is None:
            raise ConfigError(
                "instrument_dataloader needs watch=gemscout.WatchConfig(...) in enable_resiliency"
            )
        return self.watch.instrument_dataloader(loader)

    def checkpoint_io(self, kind: str) -> Any:
        """Context manager timing your own checkpoint ``"read"`` or ``"write"`` (needs ``watch=``)."""
        if self.watch is None:
            raise ConfigError(
                "checkpoint_io needs watch=gemscout.WatchConfig(...) in enable_resiliency"
            )
        if kind not in ("read", "write"):
            raise ConfigError(f"checkpoint_io: kind must be 'read' or 'write', got {kind!r}")
        return self.watch.checkpoint_io(kind)

    def _report(self, report: FaultReport) -> None:
        self.reports.append(report)
        if self.fault_log is not None:
            self.fault_log.append({**report.to_dict(), "reported_by": self.rank})
        if self.on_fault_report is not None:
            try:
                self.on_fault_report(report)
            except Exception as exc:  # a callback must never break training or a watchdog thread
                log.warning("gemscout: on_fault_report raised: %s", exc)

    def _ledger_unwritable(self, reason: str, evidence: dict[str, Any]) -> None:
        self._report(
            FaultReport(
                kind=FaultKind.HEALTH,
                scope=Scope.RANK,
                ranks=(self.rank,),
                step=self.step,
                reason=reason,
                evidence=evidence,
            )
        )

    def _on_stall(self, report: FaultReport, finding: Any) -> None:
        self._report(report)
        if (
            finding.recommendation == "restart_from_verified"
            and self.on_recovery_decision is not None
        ):
            ledger = self.checkpointer.ledger if self.checkpointer else None
            floor = (
                self.checkpointer.config.min_trust
                if self.checkpointer
                else TrustState.RECOVERY_VERIFIED
            )
            steps = [
                s for s, st in (ledger.states.items() if ledger else []) if st.rank >= floor.rank
            ]
            step = max(steps) if steps else None
            decision = RecoveryDecision(
                report.kind,
                RecoveryMode.RESTORE if step is not None else RecoveryMode.STOP,
                step,
                f"{self.checkpointer.run_id}:{step}"
                if (self.checkpointer and step is not None)
                else None,
                {},
                self.checkpointer.topology_digest if self.checkpointer else "",
                f"{report.reason}; restart every rank from the newest {floor.value} step",
            )
            try:
                self.on_recovery_decision(decision)
            except Exception as exc:
                log.warning("gemscout: on_recovery_decision raised: %s", exc)

    def close(
        self,
        timeout: timedelta | None = None,
        *,
        release_memory: bool = True,
        wait_for_peers: bool = True,
    ) -> None:
        """Flush, stop threads and remove hooks. Idempotent; runs before process-group teardown.

        ``release_memory``: delete this rank's GEMINI memory tier (the job is done). A signal and exit cleanup pass
        False: a job ending that way may be restarted, and the restart recovers from that memory.
        ``wait_for_peers``: as for :meth:`flush`."""
        if self.closed:
            return
        self.closed = True
        for h in self._handles:
            h.remove()
        if self.scout is not None:
            self.scout.close()
        if self.watch is not None:
            self.watch.close()
        if self.health is not None:
            try:
                self.health.stop()
            except Exception as exc:
                log.warning("gemscout: health monitor: %s", exc)
        if self.checkpointer is not None:
            self.checkpointer.close(
                timeout, release_memory=release_memory, wait_for_peers=wait_for_peers
            )
        if self._signals is not None:
            self._signals.restore()
        LIVE.discard(self)
        if not LIVE:
            _teardown.release()  # the last live session: torch's destroy_process_group is its own again

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- signals --------------------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        """Handle SIGTERM / SIGINT (:class:`~gemscout.signals.SignalHandlers`): flush without waiting on peers
        within ``CheckpointConfig.signal_timeout``, close, then chain to the previous handler."""
        budget = (
            self.checkpointer.config.signal_timeout
            if self.checkpointer is not None
            else timedelta(seconds=2)
        )
        self._signals = SignalHandlers(flush=self.flush, close=self.close, budget=budget)
        self._signals.install()

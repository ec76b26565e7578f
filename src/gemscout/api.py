"""``enable_resiliency``: one call that attaches GEMINI to an existing training loop.

The loop stays unchanged: an optimizer step post-hook counts steps and captures on due steps; a pre-hook makes the
next update wait for any background copy still reading the parameters. Recovery runs at attach time, before the first
step, when a checkpoint exists.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import signal
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemscout.config import TrustState
from gemscout.errors import ConfigError, RunMismatchError
from gemscout.gemini.checkpointer import Checkpointer
from gemscout.gemini.config import CheckpointConfig
from gemscout.gemini.recovery import RecoveryDecision, RecoveryMode
from gemscout.gemini.replication import Placement
from gemscout.scout.reports import FaultReport
from gemscout.state.training_state import StateSources, _unwrap
from gemscout.watch import Watch, WatchConfig

log = logging.getLogger("gemscout")
_LIVE: weakref.WeakSet[Session] = weakref.WeakSet()


class Session:
    """The handle returned by :func:`enable_resiliency`. Use as a context manager or call :meth:`close`."""

    def __init__(self, *, sources: StateSources, interval: int, checkpointer: Checkpointer | None,
                 rank: int, world_size: int) -> None:
        self.sources, self.interval, self.checkpointer = sources, interval, checkpointer
        self.rank, self.world_size = rank, world_size
        self.watch: Watch | None = None
        self.reports: list[FaultReport] = []
        self.on_fault_report: Callable[[FaultReport], None] | None = None
        self.on_recovery_decision: Callable[[RecoveryDecision], None] | None = None
        self.step = 0
        self.resume_step = 0
        self.last_decision: RecoveryDecision | None = None
        self.closed = False
        self._handles: list[Any] = []
        self._prev_signals: dict[int, Any] = {}

    # -- hooks ----------------------------------------------------------------------------------------------
    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait_copied()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step += 1
        if self.watch is not None:
            self.watch.step(self.step)
        if self.checkpointer is not None and self.step % self.interval == 0:
            self.checkpointer.capture(self.step)

    def _attach(self) -> None:
        opt = self.sources.optimizer
        self._handles = [opt.register_step_pre_hook(self._pre_step), opt.register_step_post_hook(self._post_step)]

    # -- public ---------------------------------------------------------------------------------------------
    def flush(self, timeout: timedelta | None = None) -> int:
        """Persist the newest captured state (no collective). Returns the newest step on disk, or -1."""
        return self.checkpointer.flush(timeout) if self.checkpointer else -1

    def certify(self, step: int) -> list[int]:
        """Collective: mark candidates up to ``step`` RECOVERY_VERIFIED. SCOUT drives this; callers may too."""
        return self.checkpointer.certify(step) if self.checkpointer else []

    def reject_candidates(self, reason: str) -> list[int]:
        """Collective: reject every uncertified candidate job-wide."""
        return self.checkpointer.reject_candidates(reason) if self.checkpointer else []

    def recover(self, failure_kind: str = "restart") -> RecoveryDecision:
        """Collective: choose and restore the newest restorable step now (e.g. after a detected fault)."""
        if self.checkpointer is None:
            raise ConfigError("recover() needs GEMINI: pass checkpoint=CheckpointConfig(directory=...)")
        decision = self.checkpointer.recover(failure_kind=failure_kind)
        self.last_decision = decision
        if decision.step is not None and decision.mode != RecoveryMode.FRESH:
            self.step = self.resume_step = decision.step
        return decision

    def instrument_dataloader(self, loader: Iterable[Any]) -> Iterable[Any]:
        """Wrap ``loader`` so each fetch is timed and compared across ranks (needs ``watch=WatchConfig(...)``)."""
        if self.watch is None:
            raise ConfigError("instrument_dataloader needs watch=gemscout.WatchConfig(...) in enable_resiliency")
        return self.watch.instrument_dataloader(loader)

    def checkpoint_io(self, kind: str) -> Any:
        """Context manager timing your own checkpoint ``"read"`` or ``"write"`` (needs ``watch=``)."""
        if self.watch is None:
            raise ConfigError("checkpoint_io needs watch=gemscout.WatchConfig(...) in enable_resiliency")
        if kind not in ("read", "write"):
            raise ConfigError(f"checkpoint_io: kind must be 'read' or 'write', got {kind!r}")
        return self.watch.checkpoint_io(kind)

    def _report(self, report: FaultReport) -> None:
        self.reports.append(report)
        if self.on_fault_report is not None:
            try:
                self.on_fault_report(report)
            except Exception as exc:  # a callback must never break training or a watchdog thread
                log.warning("gemscout: on_fault_report raised: %s", exc)

    def _on_stall(self, report: FaultReport, finding: Any) -> None:
        self._report(report)
        if finding.recommendation == "restart_from_verified" and self.on_recovery_decision is not None:
            ledger = self.checkpointer.ledger if self.checkpointer else None
            floor = self.checkpointer.config.min_trust if self.checkpointer else TrustState.RECOVERY_VERIFIED
            steps = [s for s, st in (ledger.states.items() if ledger else []) if st.rank >= floor.rank]
            step = max(steps) if steps else None
            decision = RecoveryDecision(
                report.kind, RecoveryMode.RESTORE if step is not None else RecoveryMode.STOP, step,
                f"{self.checkpointer.run_id}:{step}" if (self.checkpointer and step is not None) else None, {},
                self.checkpointer.topology_digest if self.checkpointer else "",
                f"{report.reason}; restart every rank from the newest {floor.value} step")
            try:
                self.on_recovery_decision(decision)
            except Exception as exc:
                log.warning("gemscout: on_recovery_decision raised: %s", exc)

    def close(self, timeout: timedelta | None = None) -> None:
        """Flush, stop threads and remove hooks. Idempotent; runs before process-group teardown."""
        if self.closed:
            return
        self.closed = True
        for h in self._handles:
            h.remove()
        if self.watch is not None:
            self.watch.close()
        if self.checkpointer is not None:
            self.checkpointer.close(timeout)
        if threading.current_thread() is threading.main_thread():
            for sig, prev in self._prev_signals.items():
                signal.signal(sig, prev)
        _LIVE.discard(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- signals --------------------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._prev_signals[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        try:
            step = self.flush()
            log.warning("gemscout: signal %d: flushed step %d", signum, step)
        finally:
            prev = self._prev_signals.get(signum, signal.SIG_DFL)
            self.close(timedelta(seconds=5))
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)


def _close_all() -> None:
    for s in list(_LIVE):
        try:
            s.close()
        except Exception as exc:  # never let exit cleanup raise
            log.warning("gemscout: close at exit failed: %s", exc)


atexit.register(_close_all)
_orig_destroy = dist.destroy_process_group


def _destroy_process_group(*args: Any, **kwargs: Any) -> None:
    _close_all()
    _orig_destroy(*args, **kwargs)


dist.destroy_process_group = _destroy_process_group  # sessions stop their threads before their groups go away


def _resolve_run_id(config: CheckpointConfig, group: dist.ProcessGroup, timeout: timedelta) -> tuple[str, bool]:
    """The run identity and whether it was given explicitly (explicit ids are checked strictly)."""
    explicit = config.run_id or os.environ.get("GEMSCOUT_RUN_ID")
    if explicit:
        return explicit, True
    from gemscout.gemini import comm

    marker = config.directory / "run.json"
    recorded = ""
    try:
        recorded = json.loads(marker.read_text()).get("run_id", "")
    except (OSError, ValueError):
        pass
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    mine = recorded or (elastic if elastic not in ("", "none") else "") or uuid.uuid4().hex
    chosen = comm.gather_json(mine, group=group, timeout=timeout)
    run_id = next((c for c in chosen if recorded and c == recorded), chosen[0])
    if not marker.exists():
        from gemscout.gemini.store import write_json_atomic

        try:
            write_json_atomic(marker, {"run_id": run_id}, fsync=config.fsync)
        except OSError:
            pass
    return run_id, False


def _topology_digest(model: nn.Module, world_size: int, placement: Placement) -> str:
    shapes = [[n, list(p.shape), str(p.dtype)] for n, p in _unwrap(model).state_dict().items()]
    doc = {"world_size": world_size, "ranks_per_node": placement.ranks_per_node, "model": shapes}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def enable_resiliency(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    interval: int = 1,
    checkpoint: CheckpointConfig | None = None,
    extra_state_fn: Callable[[], Any] | None = None,
    load_extra_state_fn: Callable[[Any], None] | None = None,
    schedulers: Sequence[Any] = (),
    load_fallback: Callable[[], int] | None = None,
    on_recovery_decision: Callable[[RecoveryDecision], None] | None = None,
    watch: WatchConfig | None = None,
    on_fault_report: Callable[[FaultReport], None] | None = None,
    group: dist.ProcessGroup | None = None,
    **unknown: Any,
) -> Session:
    """Attach resiliency to a training loop. Collective: every rank of ``group`` must call it.

    - ``interval``: capture every N optimizer steps.
    - ``checkpoint``: GEMINI settings (None disables GEMINI).
    - ``extra_state_fn`` / ``load_extra_state_fn``: caller state taken inside ``optimizer.step()`` right after the
      update (return the state your loop needs to run the next step) and given back on recovery before RNG.
    - ``schedulers``: LR schedulers your loop steps after ``optimizer.step()``; captured, and advanced once on
      restore to replay that step.
    - ``load_fallback``: called on every rank when no gemscout checkpoint can be restored; returns the step it
      restored.
    - ``on_recovery_decision``: receives the :class:`RecoveryDecision` before anything is restored (and a
      conservative one when the watchdog finds a hang).
    - ``watch``: out-of-band hang / DataLoader / checkpoint-I/O watching (:class:`WatchConfig`).
    - ``on_fault_report``: receives every :class:`FaultReport` (from any thread; keep it quick).

    If a checkpoint exists, it is restored before this returns; ``session.resume_step`` says which step.
    Raises ConfigError for bad arguments, RecoveryError when recovery must STOP, RunMismatchError for a
    checkpoint of another run or topology.
    """
    if unknown:
        raise ConfigError(f"enable_resiliency: unknown argument {sorted(unknown)[0]!r}; see help(enable_resiliency)")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(f"enable_resiliency.interval: must be an int >= 1, got {interval!r}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"enable_resiliency.model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"enable_resiliency.optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
        raise ConfigError("enable_resiliency.checkpoint: pass a gemscout.CheckpointConfig(directory=...)")
    if (extra_state_fn is None) != (load_extra_state_fn is None):
        raise ConfigError("enable_resiliency: give both extra_state_fn and load_extra_state_fn, or neither")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("enable_resiliency: call torch.distributed.init_process_group() first")
    rank, world = dist.get_rank(), dist.get_world_size()
    _warn_ddp_bucket_rebuild(model, world)
    sources = StateSources(model, optimizer, extra_state_fn, load_extra_state_fn, tuple(schedulers))
    checkpointer = None
    if checkpoint is not None:
        timeout = checkpoint.timeout
        rep_group = dist.new_group(backend="gloo", timeout=timeout)
        rpn = checkpoint.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        placement = Placement(world, rpn, checkpoint.replication_jump)
        run_id, explicit = _resolve_run_id(checkpoint, rep_group, timeout)
        _check_recorded_run(checkpoint.directory, run_id, explicit)
        checkpointer = Checkpointer(sources, checkpoint, group=rep_group, rank=rank, placement=placement,
                                    run_id=run_id, topology_digest=_topology_digest(model, world, placement),
                                    on_decision=on_recovery_decision)
    if watch is not None and not isinstance(watch, WatchConfig):
        raise ConfigError("enable_resiliency.watch: pass a gemscout.WatchConfig(...)")
    session = Session(sources=sources, interval=interval, checkpointer=checkpointer, rank=rank, world_size=world)
    session.on_fault_report, session.on_recovery_decision = on_fault_report, on_recovery_decision
    if checkpointer is not None:
        decision = checkpointer.recover(failure_kind="restart", fallback=load_fallback)
        session.last_decision = decision
        if decision.mode != RecoveryMode.FRESH and decision.step is not None:
            session.step = session.resume_step = decision.step
        if checkpoint is not None and checkpoint.handle_signals:
            session._install_signals()
    if watch is not None:
        session.watch = Watch(watch, rank=rank, world_size=world, on_report=session._on_stall)
        from torch.nn.parallel import DistributedDataParallel

        if watch.instrument_collectives and isinstance(model, DistributedDataParallel):
            session.watch.ddp_comm_hook(model)
    session._attach()
    _LIVE.add(session)
    return session


def _warn_ddp_bucket_rebuild(model: nn.Module, world: int) -> None:
    """DDP re-buckets after each process's first iteration; with 3+ ranks that shifts one step's reduction order."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and world >= 3 and not model.find_unused_parameters:
        log.warning(
            "gemscout: DDP rebuilds its gradient buckets after the first iteration of every process, so with %d ranks "
            "the first step after a restart reduces gradients in another order and the trajectory differs in the "
            "last bits; construct DDP with find_unused_parameters=True for bit-exact recovery (docs/gemini.md)", world
        )


def _check_recorded_run(directory: Path, run_id: str, explicit: bool) -> None:
    if not explicit:
        return
    try:
        recorded = json.loads((directory / "run.json").read_text()).get("run_id")
    except (OSError, ValueError):
        return
    if recorded and recorded != run_id:
        raise RunMismatchError(
            f"{directory} holds checkpoints of run {recorded!r}, not {run_id!r}; resume with run_id={recorded!r} "
            "or use a fresh directory"
        )

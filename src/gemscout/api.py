"""``enable_resiliency``: one call that attaches GEMINI to an existing training loop.

The loop stays unchanged: an optimizer step post-hook counts steps and captures on due steps; a pre-hook makes the
next update wait for any background copy still reading the parameters. Recovery runs at attach time, before the first
step, when a checkpoint exists.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemscout import _teardown, elastic, nodes
from gemscout.errors import ConfigError, RecoveryError
from gemscout.gemini.checkpointer import Checkpointer
from gemscout.gemini.config import CheckpointConfig
from gemscout.gemini.recovery import RecoveryDecision, RecoveryMode
from gemscout.gemini.replication import Placement
from gemscout.health import (
    ClassifiedHealthEvent,
    HealthMonitor,
    HealthMonitorConfig,
    HealthSource,
    NvmlHealthSource,
)
from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.run_identity import (
    check_recorded_run,
    record_run,
    resolve_run_id,
    topology_digest,
)
from gemscout.scout.comm_probe import CommProbe
from gemscout.scout.config import DEFAULT_MIN_CADENCE, ScoutConfig
from gemscout.scout.engine import Scout
from gemscout.scout.fsdp_comms import fsdp_modules
from gemscout.session import LIVE, Session
from gemscout.state.training_state import StateSources
from gemscout.watch import Watch, WatchConfig

log = logging.getLogger("gemscout")


def _close_all() -> None:
    # At exit or process-group teardown the job may be ending on an error: keep the memory tier for a restart.
    for s in list(LIVE):
        try:
            s.close(release_memory=False)
        except Exception as exc:  # never let exit cleanup raise
            log.warning("gemscout: close at exit failed: %s", exc)


atexit.register(_close_all)


def _scout_cadence(asked: int | None, interval: int) -> int:
    """SCOUT's cadence: a multiple of the capture ``interval`` (a cycle runs where GEMINI captures, so a clean cycle
    can certify that capture); by default the smallest one of at least ``DEFAULT_MIN_CADENCE`` steps."""
    if asked is None:
        return interval * -(-DEFAULT_MIN_CADENCE // interval)
    if asked % interval:
        raise ConfigError(
            f"ScoutConfig.interval={asked} is not a multiple of enable_resiliency(interval={interval}); "
            f"SCOUT replays at capture steps: use a multiple such as {interval * max(1, asked // interval)}, "
            "or None for the default"
        )
    return asked


def enable_resiliency(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    interval: int = 1,
    checkpoint: CheckpointConfig | None = None,
    extra_state_fn: Callable[[], Any] | None = None,
    load_extra_state_fn: Callable[[Any], None] | None = None,
    schedulers: Sequence[Any] = (),
    stateful: Mapping[str, Any] | None = None,
    load_fallback: Callable[[], int] | None = None,
    on_recovery_decision: Callable[[RecoveryDecision], None] | None = None,
    scout: ScoutConfig | None = None,
    capture_on_inconclusive: bool = True,
    watch: WatchConfig | None = None,
    health: HealthMonitorConfig | None = None,
    health_sources: Sequence[HealthSource] | None = None,
    on_fault_report: Callable[[FaultReport], None] | None = None,
    group: dist.ProcessGroup | None = None,
    **unknown: Any,
) -> Session:
    """Attach resiliency to a training loop. Collective: every rank of ``group`` must call it.

    - ``model`` / ``optimizer``: a torch ``nn.Module`` (DDP, FSDP2, HSDP, TP) and its ``torch.optim.Optimizer``, or a
      ``DeepSpeedEngine`` (ZeRO-1/2/3) and ``engine.optimizer``, a Megatron Core model (or its list of chunks) and
      its torch optimizer or MegatronOptimizer, or a TorchTitan ``Trainer`` (optimizer None). See docs/torchrun.md.
    - ``interval``: capture every N optimizer steps.
    - ``checkpoint``: GEMINI settings (None disables GEMINI).
    - ``extra_state_fn`` / ``load_extra_state_fn``: caller state taken inside ``optimizer.step()`` right after the
      update (return the state your loop needs to run the next step) and given back on recovery before RNG.
    - ``schedulers``: LR schedulers your loop steps after ``optimizer.step()``; captured, and advanced once on
      restore to replay that step.
    - ``stateful``: your objects with ``state_dict()`` / ``load_state_dict()`` by name, e.g.
      ``{"loader": StatefulDataLoader(...)}``: each one's ``state_dict()`` is taken with every capture (inside
      ``optimizer.step()``, so fetch the step's batch before it) and loaded back on restore, after the schedulers and
      before ``load_extra_state_fn``. What ``state_dict()`` returns must be tensors, numbers, strings, None, lists,
      tuples and dicts (nothing is pickled).
    - ``load_fallback``: called on every rank when no gemscout checkpoint can be restored; returns the step it
      restored.
    - ``on_recovery_decision``: receives the :class:`RecoveryDecision` before anything is restored (and a
      conservative one when the watchdog finds a hang).
    - ``scout``: SCOUT replay on data-parallel peers (:class:`ScoutConfig`); its verdicts gate GEMINI's trust.
      SCOUT replays at capture steps: by default every 10th step (the smallest multiple of ``interval`` >= 10;
      ``ScoutConfig.interval`` sets another multiple, ``ScoutConfig.recipe_intervals`` slows single kinds down).
    - ``capture_on_inconclusive``: still capture (as an uncertified candidate) when SCOUT cannot decide.
    - ``watch``: out-of-band hang / DataLoader / checkpoint-I/O watching (:class:`WatchConfig`).
    - ``health`` / ``health_sources``: poll hardware health (default source: NVML, when ``nvidia-ml-py`` is installed
      and a GPU is present) on a background thread; degraded and fatal events become ``health`` FaultReports.
    - ``on_fault_report``: receives every :class:`FaultReport` (from any thread; keep it quick).

    If a checkpoint exists, it is restored before this returns; ``session.resume_step`` says which step.
    Raises ConfigError for bad arguments, RecoveryError when recovery must STOP (recorded in
    ``<directory>/STOP.json``: a relaunch raises the same error at once until the file is deleted; see
    :mod:`gemscout.elastic`), RunMismatchError for a checkpoint of another run or topology.
    """
    if unknown:
        raise ConfigError(
            f"enable_resiliency: unknown argument {sorted(unknown)[0]!r}; see help(enable_resiliency)"
        )
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ConfigError(f"enable_resiliency.interval: must be an int >= 1, got {interval!r}")
    if checkpoint is not None and not isinstance(checkpoint, CheckpointConfig):
        raise ConfigError(
            "enable_resiliency.checkpoint: pass a gemscout.CheckpointConfig(directory=...)"
        )
    if (extra_state_fn is None) != (load_extra_state_fn is None):
        raise ConfigError(
            "enable_resiliency: give both extra_state_fn and load_extra_state_fn, or neither"
        )
    stateful = _check_stateful(stateful)
    if scout is not None and not isinstance(scout, ScoutConfig):
        raise ConfigError("enable_resiliency.scout: pass a gemscout.ScoutConfig(...)")
    if scout is not None:
        scout = dataclasses.replace(scout, interval=_scout_cadence(scout.interval, interval))
    from gemscout.adapters.registry import resolve  # here: importing gemscout loads no adapter

    # The adapter registry picks the framework's adapter (a DeepSpeed engine becomes its module, a step-hooked view
    # of its ZeRO optimizer and its counters as extra state; plain PyTorch passes through, type-checked there).
    target = resolve(
        model,
        optimizer,
        extra_state_fn=extra_state_fn,
        load_extra_state_fn=load_extra_state_fn,
        schedulers=schedulers,
        scout=scout,
        group=group,
    )
    model, optimizer, scout = target.model, target.optimizer, target.scout
    extra_state_fn, load_extra_state_fn, schedulers = (
        target.extra_state_fn,
        target.load_extra_state_fn,
        target.schedulers,
    )
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("enable_resiliency: call torch.distributed.init_process_group() first")
    rank, world = dist.get_rank(), dist.get_world_size()
    from gemscout.adapters import ddp_buckets

    # Plain DDP rebuilds its gradient buckets after each process's first backward: the layout travels with every
    # capture and is put back on a restart, so the resumed step reduces as the uninterrupted run did.
    buckets = ddp_buckets.attach(model) if checkpoint is not None else None
    if buckets is not None:
        extra_state_fn, load_extra_state_fn = buckets.wrap_state(
            extra_state_fn, load_extra_state_fn
        )
    # Rank-local state (an adapter says so: ZeRO partitions) makes the durable tier promote every rank's.
    sources = StateSources(
        model,
        optimizer,
        extra_state_fn,
        load_extra_state_fn,
        tuple(schedulers),
        stateful=stateful,
        rank_local=target.rank_local,
    )
    checkpointer = None
    if checkpoint is not None:
        timeout = checkpoint.timeout
        # An earlier attempt's STOP stands (torchrun would otherwise relaunch into it): before any collective.
        elastic.check_stop(
            checkpoint.directory, checkpoint.run_id or os.environ.get("GEMSCOUT_RUN_ID")
        )
        rep_group = dist.new_group(backend="gloo", timeout=timeout)
        rpn = checkpoint.ranks_per_node or nodes.ranks_per_node(rep_group, timeout)
        placement = Placement(world, rpn, checkpoint.replication_jump)
        run_id, explicit = resolve_run_id(checkpoint, rep_group, timeout)
        check_recorded_run(checkpoint.directory, run_id, explicit)
        record_run(checkpoint.directory, run_id, fsync=checkpoint.fsync)
        checkpointer = Checkpointer(
            sources,
            checkpoint,
            group=rep_group,
            rank=rank,
            placement=placement,
            run_id=run_id,
            topology_digest=topology_digest(model, world, placement, rep_group, timeout),
            on_decision=on_recovery_decision,
        )
    if watch is not None and not isinstance(watch, WatchConfig):
        raise ConfigError("enable_resiliency.watch: pass a gemscout.WatchConfig(...)")
    session = Session(
        sources=sources, interval=interval, checkpointer=checkpointer, rank=rank, world_size=world
    )
    session.on_fault_report, session.on_recovery_decision = on_fault_report, on_recovery_decision
    session.capture_on_inconclusive = capture_on_inconclusive
    if checkpointer is not None:
        try:
            decision = checkpointer.recover(failure_kind="restart", fallback=load_fallback)
        except RecoveryError as exc:
            raise elastic.record_stop(
                checkpointer.config.directory,
                exc,
                checkpointer.run_id,
                fsync=checkpointer.config.fsync,
            ) from None
        session.last_decision = decision
        if decision.mode != RecoveryMode.FRESH and decision.step is not None:
            session.step = session.resume_step = decision.step
        else:
            # A fresh start takes step 0 now and waits for its replica: until the first step's replica lands, the
            # initial state is the only thing a rank that loses its node can come back to. No computation has run
            # yet, so nothing can have corrupted it: it is certified at once.
            checkpointer.capture(0, initial=True)
            checkpointer.drain()
            checkpointer.certify(0)
        if buckets is not None:
            buckets.start(
                restored=decision.mode in (RecoveryMode.RESTORE, RecoveryMode.DURABLE),
                group=checkpointer.group,
                timeout=checkpointer.config.timeout,
            )
        if checkpoint is not None and checkpoint.handle_signals:
            session._install_signals()
    if scout is not None:
        scout_cls = target.scout_factory or Scout
        session.scout = scout_cls(scout).attach(
            model,
            optimizer,
            group=group,
            topology=target.scout_topology,
            first_step=session.step + 1,
        )
        if scout.comm_probe is not None:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
            session.comm_probe = CommProbe(scout.comm_probe, ranks=ranks)
    from torch.nn.parallel import DistributedDataParallel

    job_timer = None
    if (
        session.scout is not None
        and scout is not None
        and scout.job_collectives
        and (isinstance(model, DistributedDataParallel) or fsdp_modules(model))
    ):
        try:
            job_timer = session.scout.time_job_collectives(model)
        except (
            ConfigError
        ) as exc:  # a caller's own DDP comm hook wins (DDP takes one); FSDP2 per-param meshes
            log.info("gemscout: job-collective timing not installed: %s", exc)
    if watch is not None:
        session.watch = Watch(watch, rank=rank, world_size=world, on_report=session._on_stall)
        if watch.instrument_collectives and isinstance(model, DistributedDataParallel):
            if job_timer is not None:  # DDP takes one comm hook: the watch rides SCOUT's timer
                session.watch.ride(job_timer)
            else:
                session.watch.ddp_comm_hook(model)
    if health is not None or health_sources:
        session.health = _start_health(session, rank, health, health_sources)
    adapter_handles = (
        target.install_hooks() if target.install_hooks is not None else []
    )  # before the session's
    session._attach()
    session._handles += adapter_handles + ([buckets] if buckets is not None else [])
    LIVE.add(session)
    _teardown.hold(
        _close_all
    )  # while a session is live, destroy_process_group closes it first (gemscout._teardown)
    return session


def _check_stateful(stateful: Mapping[str, Any] | None) -> dict[str, Any]:
    """``enable_resiliency.stateful`` as a plain dict, or ``ConfigError`` naming the entry that is not a Stateful."""
    if stateful is None:
        return {}
    if not isinstance(stateful, Mapping):
        raise ConfigError(
            "enable_resiliency.stateful: pass a dict of name -> object with state_dict() and "
            f"load_state_dict(), e.g. {{'loader': loader}}; got {type(stateful).__name__}"
        )
    for name, obj in stateful.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(
                f"enable_resiliency.stateful: names must be non-empty strings, got {name!r}"
            )
        if not callable(getattr(obj, "state_dict", None)) or not callable(
            getattr(obj, "load_state_dict", None)
        ):
            raise ConfigError(
                f"enable_resiliency.stateful[{name!r}]: a {type(obj).__name__} has no state_dict() and "
                "load_state_dict(); pass an object that has both (torchdata's StatefulDataLoader, "
                "an LR scheduler, your own class)"
            )
    return dict(stateful)


def _start_health(
    session: Session,
    rank: int,
    config: HealthMonitorConfig | None,
    sources: Sequence[HealthSource] | None,
) -> HealthMonitor:
    if not sources:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "enable_resiliency.health: no health source given and no GPU for NVML; pass "
                "health_sources=[...] (e.g. gemscout.watch.InjectedHealthSource()) or leave health unset"
            )
        sources = [NvmlHealthSource()]

    def deliver(event: ClassifiedHealthEvent) -> None:
        if event.severity == "info":
            return
        e = event.event
        session._report(
            FaultReport(
                kind=FaultKind.HEALTH,
                scope=Scope.NODE,
                ranks=(rank,),
                step=session.step,
                recipe=None,
                evidence={"event": e.to_dict(), "severity": event.severity},
                confirmations=1,
                reason=f"{event.severity}: {event.reason}",
                host=e.host or None,
            )
        )

    return HealthMonitor(
        sources, config=config or HealthMonitorConfig(), callbacks=[deliver]
    ).start()

"""The SCOUT cycle for data-parallel peers: capture on the source, replay everywhere, judge.

Where the cycle runs: in the optimizer step **pre**-hook of a due step ``s``. Backward has finished, so the output
gradients are captured, and the update has not run, so the live parameters are still those the forward used: the
forward recipes replay on them directly, and the optimizer recipe's inputs (pre-update parameters, effective
gradients, state) can be read there; it replays on private copies. The verdict for ``s`` is known before the update
of ``s``; the session reads it in its post-hook to gate GEMINI's capture of ``s``.

One cycle, on every peer, always the same collectives in the same order whatever the local state (a rank never skips
a collective alone; local failures become records that everyone sees). The collectives live in
:mod:`~gemscout.scout.exchange`; this module does what lies between them:

1. the step's source peer (``peers[s % n]``) collects the captured inputs of the due recipes (or the errors that
   stopped it); hello all-gather and one broadcast of them (:meth:`PeerExchange.send_inputs`);
2. every peer replays each due recipe on its own parameters from the source's inputs and RNG state and digests what
   it produced (output, input and parameter gradients), with its precondition record;
3. one fixed-size all-gather of the records (:meth:`PeerExchange.gather_records`); every peer then judges each
   recipe with the same pure functions (:mod:`~gemscout.scout.judging`): the same verdicts and reports everywhere.

Who the peers are and what crosses them is the *peer domain*'s (:class:`~gemscout.scout.domain.PeerDomain`): one
group of replicas (:class:`~gemscout.scout.domain.FlatDomain`, DDP), or a DeviceMesh (FSDP2, HSDP, FSDP2 x TP) with
one peer group per model-parallel coordinate or HSDP shard (:class:`~gemscout.scout.mesh_domain.MeshDomain`: a
mesh-wide step agreement, parameter gathers before replay, a readiness check before replays that run TP collectives,
and the records gathered over the whole mesh so every rank judges every group). A framework refines one
(``Scout(config, flat_domain=...)``; DeepSpeed ZeRO-3 gathers its partitioned blocks around the cycle). The cycle
below is the same for all of them; where the peers come from at attach is :mod:`~gemscout.scout.peers`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from gemscout._modules import unwrap
from gemscout.errors import ConfigError
from gemscout.scout.capture import Captured, CaptureHooks, capture_optimizer
from gemscout.scout.comm_probe import JobCollectiveTimer
from gemscout.scout.config import ScoutConfig
from gemscout.scout.cycle import CycleResult, inconclusive
from gemscout.scout.domain import JOB_TIMER_NEEDS, FlatDomain, PeerDomain
from gemscout.scout.fsdp_comms import FsdpCollectiveTimer
from gemscout.scout.judging import cycle_reports, judge_records, name_unreplayable
from gemscout.scout.local_replay import LocalReplay
from gemscout.scout.peers import FlatDomainFactory, find_topology, peer_domain
from gemscout.scout.recipes import Catalog, Recipe, build_catalog, optimizer_params
from gemscout.scout.replay import ReplayContext
from gemscout.scout.rotation import RotationTracker
from gemscout.scout.seams import ReplaySeams
from gemscout.scout.stragglers import (
    CommStragglerDetector,
    ComputeStragglerDetector,
    SustainedStragglerDetector,
)
from gemscout.topology import Topology

__all__ = ["CycleResult", "Scout"]


class Scout(ReplaySeams):
    """SCOUT for one model and optimizer on one data-parallel peer group. Create, :meth:`attach`, then call
    :meth:`before_step` in the optimizer step pre-hook of every step (or :meth:`register_step_hook` once).

    ``flat_domain``: what a group of replicas becomes (:class:`~gemscout.scout.domain.FlatDomain`, or a framework's
    refinement of it, e.g. DeepSpeed ZeRO-3's gather of partitioned blocks around the cycle)."""

    def __init__(
        self, config: ScoutConfig | None = None, *, flat_domain: FlatDomainFactory = FlatDomain
    ) -> None:
        super().__init__()
        self.config = config if config is not None else ScoutConfig()
        self._flat_domain = flat_domain
        self.last_result: CycleResult | None = None
        """The newest cycle's result (also returned by :meth:`before_step`)."""
        self._attached = False
        self._closed = False
        self._step_handle: RemovableHandle | None = None
        self._next_step = 1
        self._last_cycle_step: int | None = None
        self.unreplayable: dict[str, str] = {}
        """Recipes whose inputs SCOUT could not reproduce on the peers, with the newest reason (docs/scout.md,
        "Capture"); each stays INCONCLUSIVE while it is listed. Counted in ``session.metrics()``."""

    # -- setup ------------------------------------------------------------------------------------------------------
    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        group: dist.ProcessGroup | None = None,
        topology: Topology | None = None,
        first_step: int = 1,
    ) -> Scout:
        """Find the recipes, register the capture hooks and set up the peer groups. Returns ``self``.

        Peers: with neither ``group`` nor ``topology``, SCOUT reads the model. Plain parameters (DDP): every rank is a
        peer, over a new gloo group. DTensor parameters (FSDP2, HSDP, TP, FSDP2 x TP): the peer groups come from
        their DeviceMesh (:func:`~gemscout.topology_discovery.discover`; ``ScoutConfig.data_parallel_dims`` names the
        data-parallel dims when there is no ``fully_shard``), and a topology without data-parallel peers (pure TP)
        leaves SCOUT attached but unable to compare: every due step is INCONCLUSIVE with the reason
        (``disabled_reason``). ``topology``: an explicit one (:func:`~gemscout.topology_discovery.from_mesh`).
        ``group``: a ready-made peer group of replicas (not for sharded models). Collective: every rank must call
        attach (it creates process groups). ``first_step``: the number of the next optimizer step
        (``resume_step + 1`` after a recovery). Raises ``ConfigError`` when the process group is not initialized,
        the model has no boundary for an enabled recipe, the mesh cannot be read, or attach is called twice.
        """
        if self._attached or self._closed:
            raise ConfigError(
                "Scout.attach: this Scout is already attached (or closed); create a new one"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("Scout.attach: call torch.distributed.init_process_group() first")
        root = unwrap(model)
        self._optimizer = optimizer
        self.rank = dist.get_rank()
        topology = find_topology(root, self.config, self.rank, group=group, topology=topology)
        # On a pipeline stage the catalog is the stage's own, its names qualified by the stage (pp1.hidden.0); an
        # nn.ModuleList of stage modules (several stages per rank) names each module's recipes by its own stage.
        stage = topology.stage_label if topology is not None else ""
        chunks = (
            topology.chunk_labels(len(root), order=self.config.stage_order)
            if topology and stage and isinstance(root, nn.ModuleList)
            else ()
        )
        self.catalog: Catalog = build_catalog(
            root, optimizer, self.config, stage=stage, chunk_labels=chunks
        )
        self.topology: Topology | None = topology
        """The mesh as SCOUT sees it (None for a replicated model without a mesh)."""
        self.domain: PeerDomain | None = peer_domain(
            topology, group, self.rank, self.config.timeout, self._flat_domain
        )
        """Where the peers are and what crosses them (None when SCOUT cannot compare)."""
        self.disabled_reason: str | None = None
        """Why SCOUT cannot compare on this topology (no data-parallel peers), or None."""
        self.peers: tuple[int, ...] = (self.rank,)
        self.peer_groups: tuple[tuple[int, ...], ...] = ()
        if self.domain is not None:
            self.peers, self.peer_groups = self.domain.peers, self.domain.peer_groups
        elif topology is not None:
            self.disabled_reason, self.peer_groups = topology.reason, topology.peer_groups
        self._modules = {
            r.name: [root.get_submodule(p) for p in r.modules] for r in self.catalog.recipes
        }
        self._params = optimizer_params(root, optimizer)
        self._fingerprint = self.catalog.fingerprint()
        if self.domain is not None:
            self.domain.plan(self.catalog, self._modules)
        self._capture = CaptureHooks(self._modules, {r.name: r for r in self.catalog.recipes})
        self._local = LocalReplay(
            rank=self.rank,
            modules=self._modules,
            params=self._params,
            optimizer=optimizer,
            capture=self._capture,
            hooks=self._hooks,
            collective_hooks=self._collective_hooks,
            domain=self.domain,
            mark=self._mark_replay,
        )
        self.rotation = RotationTracker(
            self.domain.job_names if self.domain is not None else self.catalog.names
        )
        """Trust gating over this model's catalog (see :class:`~gemscout.scout.rotation.RotationTracker`)."""
        self._detectors: dict[str, ComputeStragglerDetector] = {}
        self._sustained = SustainedStragglerDetector(self.config.stragglers)
        self._job_timer: JobCollectiveTimer | FsdpCollectiveTimer | None = None
        self._comm_detector = CommStragglerDetector(self.config.stragglers)
        self._attached = True
        self.set_next_step(first_step)
        return self

    def close(self) -> None:
        """Remove every hook SCOUT registered; idempotent. The peer group is left to process-group teardown."""
        self._closed = True
        if self._attached:
            self._capture.remove()
        if self._step_handle is not None:
            self._step_handle.remove()
            self._step_handle = None
        if isinstance(self._job_timer, FsdpCollectiveTimer):
            self._job_timer.remove()

    # -- public state and seams -------------------------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The step number the next forward belongs to (what capture is armed for)."""
        return self._next_step

    def set_next_step(self, step: int) -> None:
        """Say which step the next forward belongs to. A rewind (after a recovery) resets the rotation and the
        straggler baselines: what they recorded belongs to an abandoned timeline."""
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self._require_attached()
        if self._last_cycle_step is not None and step <= self._last_cycle_step:
            self._rewind()
        self._next_step = step
        source = self.peers[step % len(self.peers)]
        capture = source == self.rank and self.disabled_reason is None
        armed = {r.name for r in self.catalog.due(step) if r.has_module} if capture else set()
        self._capture.arm(step, armed)

    def time_job_collectives(self, model: nn.Module) -> JobCollectiveTimer | FsdpCollectiveTimer:
        """Time the job's own collectives (DDP's or FSDP2's, the domain's ``job_timer`` says what raises
        ``ConfigError``): each cycle then reports a rank late to them as a communication straggler. Collective: call
        on every rank, after :meth:`attach`; a second call returns the same timer."""
        self._require_attached()
        if self.domain is None:
            raise ConfigError(JOB_TIMER_NEEDS)
        if self._job_timer is None:
            self._job_timer = self.domain.job_timer(model, self.config)
        return self._job_timer

    # -- the step hook ----------------------------------------------------------------------------------------------
    def step_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An ``optimizer.register_step_pre_hook`` hook: ``before_step(self.next_step)``; result in ``last_result``."""
        self.before_step(self._next_step)

    def register_step_hook(self) -> RemovableHandle:
        """Register :meth:`step_pre_hook` on the optimizer (once; a second call returns the same handle). Use this
        *or* call :meth:`before_step` from your own pre-hook, never both."""
        self._require_attached()
        if self._step_handle is None:
            self._step_handle = self._optimizer.register_step_pre_hook(self.step_pre_hook)
        return self._step_handle

    def before_step(self, step: int) -> CycleResult | None:
        """Run the SCOUT cycle for ``step`` if it is due; call it at *every* step, before the update.

        Returns None when nothing is due (no collective runs), else the :class:`CycleResult` (identical on every
        peer). Collective on the peer group when due. Local failures (a missing capture, a replay error) never raise:
        they become INCONCLUSIVE verdicts with the reason. Raises ``CollectiveTimeout`` when a peer misses a
        collective by ``config.timeout``. Afterwards capture is armed for ``step + 1``.
        """
        self._require_attached()
        if self._last_cycle_step is not None and step <= self._last_cycle_step:
            self._rewind()
        try:
            due = self.catalog.due(step)
            if not due:
                return None
            result = self._cycle(step, due)
            self.last_result = result
            return result
        finally:
            self.set_next_step(step + 1)

    # -- the cycle --------------------------------------------------------------------------------------------------
    def _cycle(self, step: int, due: Sequence[Recipe]) -> CycleResult:
        domain = self.domain
        if domain is None:
            return self._cannot_compare(step, due)
        with domain.scope(due, self._modules):
            return self._compare(domain, step, due)

    def _compare(self, domain: PeerDomain, step: int, due: Sequence[Recipe]) -> CycleResult:
        source = self.peers[step % len(self.peers)]
        # Agree on the step across the whole domain first: on a mesh what comes next gathers along the shard dims,
        # across peer groups, and a rank that stopped while its shard partners went on would leave them waiting.
        disagreement = domain.agree(step, self._fingerprint)
        if disagreement is not None:
            return self._stopped(step, due, source, disagreement)
        slices = domain.gather_slices(due, self._params, self._optimizer, step)
        received, wire_error, in_step = self._send_inputs(
            step, due, source, {k: c for k, (c, _) in slices.items()}
        )
        if not in_step and domain.stops_on_wire_error:
            return self._stopped(step, due, source, str(wire_error))
        blocked = domain.blocked(due, received, wire_error)
        records = {}
        for recipe in due:
            modules = self._modules[recipe.name]
            params, seconds = (
                domain.gather_params(recipe, modules) if recipe.has_module else (None, None)
            )
            own = None
            if recipe.name in slices:
                own, seconds = slices[recipe.name]
            with domain.replaying(recipe, modules if recipe.has_module else ()):
                records[recipe.name] = self._local.record(
                    recipe,
                    step,
                    source,
                    received.get(recipe.name),
                    wire_error,
                    params=params,
                    own_slice=own,
                    blocked=blocked.get(recipe.name),
                )
            if seconds is not None:
                records[recipe.name]["gather_s"] = seconds
        names = [r.name for r in due]
        comm_s = self._job_timer.take() if self._job_timer is not None else None
        by_rank = domain.gather_records(names, records, comm_s, time.monotonic())
        results, times = judge_records(domain, step, due, by_rank)
        name_unreplayable(
            step, received, results, self.unreplayable, announce=self.rank == min(self.peers)
        )
        reports = cycle_reports(
            domain,
            step,
            due,
            results,
            times,
            by_rank,
            config=self.config.stragglers,
            detectors=self._detectors,
            sustained=self._sustained,
            comm_detector=self._comm_detector,
            timer=self._job_timer,
        )
        certified = self.rotation.record(step, results)
        self._last_cycle_step = step
        return CycleResult(
            step=step,
            source_rank=source,
            peers=self.peers,
            results=results,
            replay_s=times,
            reports=tuple(reports),
            certified_step=certified,
            peer_groups=self.peer_groups,
            **domain.cycle_fields(due, by_rank),
        )

    def _stopped(self, step: int, due: Sequence[Recipe], source: int, reason: str) -> CycleResult:
        # Every peer saw the same disagreement in the first gather and stops here together; nothing is recorded for
        # the rotation or the stragglers, since the peers were not even replaying the same step.
        return CycleResult(
            step=step,
            source_rank=source,
            peers=self.peers,
            results=inconclusive(due, step, reason),
            replay_s={r.name: {} for r in due},
            peer_groups=self.peer_groups,
        )

    def _cannot_compare(self, step: int, due: Sequence[Recipe]) -> CycleResult:
        """A due step on a topology without peers: no collective, every recipe INCONCLUSIVE with the reason."""
        results = inconclusive(
            due,
            step,
            f"SCOUT cannot compare on this topology: {self.disabled_reason}; nothing was replayed",
        )
        certified = self.rotation.record(step, results)
        self._last_cycle_step = step
        return CycleResult(
            step=step,
            source_rank=self.rank,
            peers=self.peers,
            results=results,
            replay_s={r.name: {} for r in due},
            certified_step=certified,
            peer_groups=self.peer_groups,
        )

    def _send_inputs(
        self, step: int, due: Sequence[Recipe], source: int, slices: Mapping[str, Captured]
    ) -> tuple[dict[str, Captured], str | None, bool]:
        """The source's captures to every peer (:meth:`PeerExchange.send_inputs`). ``slices``: optimizer slices
        already gathered on a sharded model (sent instead of the live shards)."""
        assert self.domain is not None
        captures = None
        if self.rank == source:
            try:
                captures = {
                    r.name: slices[r.name] if r.name in slices else self._capture_source(r, step)
                    for r in due
                }
            except Exception as exc:  # the source still sends: a header that carries the error
                failed = Captured(step=step, error=f"capture failed: {type(exc).__name__}: {exc}")
                captures = {r.name: failed for r in due}
        return self.domain.exchange.send_inputs(step, self._fingerprint, source, captures)

    def _capture_source(self, recipe: Recipe, step: int) -> Captured:
        if recipe.has_module:
            return self._capture.take(recipe.name, step)
        try:
            # Flat: a few tensors to pack, send and digest instead of several per parameter of the slice.
            return capture_optimizer(recipe, self._params, self._optimizer, step, flat=True)
        except (TypeError, KeyError) as exc:
            return Captured(step=step, error=str(exc))

    def _mark_replay(self, ctx: ReplayContext | None) -> None:
        # What current_replay reports to the harness's fault hooks while a replay runs.
        self._current = ctx

    def _rewind(self) -> None:
        self.rotation.reset()
        self._detectors.clear()
        self._sustained.reset()
        self._comm_detector.reset()
        if self.domain is not None:
            self.domain.reset()
        self._last_cycle_step = None

    def _require_attached(self) -> None:
        if not self._attached or self._closed:
            raise ConfigError("Scout: call attach(model, optimizer) first (and not after close())")

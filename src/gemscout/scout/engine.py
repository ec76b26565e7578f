"""The SCOUT cycle for data-parallel peers: capture on the source, broadcast, replay everywhere, agree, judge.

Where the cycle runs: in the optimizer step **pre**-hook of a due step ``s``. Backward has finished, so the output
gradients are captured, and the update has not run, so the live parameters are still those the forward used: the
forward recipes can be replayed on them directly, and the optimizer recipe's inputs (pre-update parameters, effective
gradients, state) can be read there. The optimizer recipe is replayed on private copies, so it does not need the live
update. The verdict for ``s`` is therefore known before the update of ``s``, and the session reads it in its post-hook
to gate GEMINI's capture of ``s``.

One cycle, on every peer, always the same collectives in the same order whatever the local state (a rank never skips
a collective alone; local failures become records that everyone sees):

1. the step's source peer (``peers[s % n]``) packs the captured inputs of the due recipes (or the errors that stopped
   it); broadcast of the sizes, the JSON header and the flat payload;
2. every peer replays each due recipe on its own parameters from the source's inputs and RNG state and digests what
   it produced (output, input and parameter gradients), with its precondition record;
3. one JSON all-gather of the records; every peer then judges each recipe with the same pure function
   (:func:`~gemscout.scout.preconditions.judge`), so every peer reaches the same verdicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from gemscout.errors import ConfigError
from gemscout.gemini.comm import gather_json, wait_all
from gemscout.scout.capture import Captured, CaptureHooks, capture_optimizer, pack, unpack
from gemscout.scout.config import ScoutConfig
from gemscout.scout.consensus import C3Result, Verdict
from gemscout.scout.cycle import CycleResult, judge_gathered, param_digest, precondition_for
from gemscout.scout.digests import digest_many
from gemscout.scout.recipes import Catalog, Recipe, build_catalog, optimizer_params, unwrap
from gemscout.scout.replay import ReplayContext, ReplayHook, ReplayHooks, replay_forward, replay_optimizer
from gemscout.scout.reports import FaultReport
from gemscout.scout.rotation import RotationTracker
from gemscout.scout.stragglers import ComputeStragglerDetector

__all__ = ["CycleResult", "Scout"]


class Scout:
    """SCOUT for one model and optimizer on one data-parallel peer group. Create, :meth:`attach`, then call
    :meth:`before_step` in the optimizer step pre-hook of every step (or :meth:`register_step_hook` once)."""

    def __init__(self, config: ScoutConfig | None = None) -> None:
        self.config = config if config is not None else ScoutConfig()
        self.last_result: CycleResult | None = None
        """The newest cycle's result (also returned by :meth:`before_step`)."""
        self._hooks = ReplayHooks()
        self._current: ReplayContext | None = None
        self._attached = False
        self._closed = False
        self._step_handle: RemovableHandle | None = None
        self._next_step = 1
        self._last_cycle_step: int | None = None

    # -- setup ------------------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, group: dist.ProcessGroup | None = None,
               first_step: int = 1) -> Scout:
        """Find the recipes, register the capture hooks and set up the peer group. Returns ``self``.

        ``group``: the data-parallel peer group, used for SCOUT's collectives only; pass a dedicated gloo group (for
        HSDP/TP, the DP group this rank belongs to). None creates one over the whole world with
        ``dist.new_group(backend="gloo")`` — collective: every rank must call attach then. ``first_step``: the number
        of the next optimizer step (``resume_step + 1`` after a recovery). Raises ``ConfigError`` when the process
        group is not initialized, the model has no boundary for an enabled recipe, or attach is called twice.
        """
        if self._attached or self._closed:
            raise ConfigError("Scout.attach: this Scout is already attached (or closed); create a new one")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("Scout.attach: call torch.distributed.init_process_group() first")
        root = unwrap(model)
        self.catalog: Catalog = build_catalog(root, optimizer, self.config)
        self._optimizer = optimizer
        self._group = group if group is not None else dist.new_group(backend="gloo", timeout=self.config.timeout)
        self.peers: tuple[int, ...] = tuple(dist.get_process_group_ranks(self._group))
        self.rank = dist.get_rank()
        self._modules = {r.name: [root.get_submodule(p) for p in r.modules] for r in self.catalog.recipes}
        self._params = optimizer_params(root, optimizer)
        self._fingerprint = self.catalog.fingerprint()
        self._capture = CaptureHooks(self._modules, {r.name: r for r in self.catalog.recipes})
        self.rotation = RotationTracker(self.catalog.names)
        """Trust gating over this model's catalog (see :class:`~gemscout.scout.rotation.RotationTracker`)."""
        self._detectors: dict[str, ComputeStragglerDetector] = {}
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

    # -- public state and seams -------------------------------------------------------------------------------------
    @property
    def current_replay(self) -> ReplayContext | None:
        """The replay running on this rank right now (recipe, step, rank, source), or None outside replay."""
        return self._current

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
        armed = {r.name for r in self.catalog.due(step) if r.has_module} if source == self.rank else set()
        self._capture.arm(step, armed)

    def register_replay_input_hook(self, hook: ReplayHook) -> RemovableHandle:
        """Call ``hook(ctx, inputs)`` before each replay on this rank; it may return replacement inputs. The
        precondition digests are taken before it runs. For fault injection and instrumentation."""
        return ReplayHooks.add(self._hooks.inputs, hook)

    def register_replay_output_hook(self, hook: ReplayHook) -> RemovableHandle:
        """Call ``hook(ctx, outputs)`` after each replay on this rank with every tensor about to be digested
        (``output``, ``grad.*``; ``param.*``/``state.*`` for optimizer slices); it may return replacements."""
        return ReplayHooks.add(self._hooks.outputs, hook)

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
        source = self.peers[step % len(self.peers)]
        received, wire_error, in_step = self._exchange(step, due, source)
        if not in_step:
            # Every peer saw the same disagreement in the first gather and stops here together; nothing is recorded
            # for the rotation or the stragglers, since the peers were not even replaying the same step.
            results = {r.name: C3Result(verdict=Verdict.INCONCLUSIVE, recipe=r.name, step=step, reason=str(wire_error),
                                        preconditions_ok=False) for r in due}
            return CycleResult(step=step, source_rank=source, peers=self.peers, results=results,
                               replay_s={r.name: {} for r in due})
        records = {r.name: self._replay_local(r, step, source, received.get(r.name), wire_error) for r in due}
        gathered = gather_json({"threads": torch.get_num_threads(), "records": records}, group=self._group,
                               timeout=self.config.timeout)
        results = {}
        times: dict[str, dict[int, float]] = {}
        for recipe in due:
            results[recipe.name], times[recipe.name] = judge_gathered(recipe.name, step, self.peers, gathered)
        reports = [report for result in results.values() if (report := result.fault_report()) is not None]
        reports += self._stragglers(step, results, times)
        certified = self.rotation.record(step, results)
        self._last_cycle_step = step
        return CycleResult(step=step, source_rank=source, peers=self.peers, results=results, replay_s=times,
                           reports=tuple(reports), certified_step=certified)

    def _exchange(self, step: int, due: Sequence[Recipe],
                  source: int) -> tuple[dict[str, Captured], str | None, bool]:
        """Send the source's captures to every peer. Returns (captures, error for all recipes, peers in step)."""
        timeout = self.config.timeout
        header, payload = b"", torch.empty(0, dtype=torch.uint8)
        if self.rank == source:
            try:
                header, payload = pack(step, {r.name: self._capture_source(r, step) for r in due})
            except Exception as exc:  # the source still sends: a header that carries the error
                failed = Captured(step=step, error=f"packing failed: {type(exc).__name__}: {exc}")
                header, payload = pack(step, {r.name: failed for r in due})
        # A gather, not a broadcast, comes first: peers that disagree on the step would disagree on the source, and a
        # broadcast from two different roots never completes. Here every peer sees every step and stops together.
        hello = torch.tensor([step, self._fingerprint, len(header), payload.numel()], dtype=torch.int64)
        hellos = [torch.zeros(4, dtype=torch.int64) for _ in self.peers]
        wait_all([dist.all_gather(hellos, hello, group=self._group, async_op=True)], timeout, "scout hello")
        steps = {rank: int(h[0]) for rank, h in zip(self.peers, hellos, strict=True)}
        if len(set(steps.values())) > 1 or len({int(h[1]) for h in hellos}) > 1:
            what = "step" if len(set(steps.values())) > 1 else "recipe catalog"
            return {}, f"peers disagree on the {what} (steps by rank {steps}); nothing was replayed", False
        sizes = hellos[self.peers.index(source)]
        if self.rank != source:
            header_t = torch.empty(int(sizes[2]), dtype=torch.uint8)
            payload = torch.empty(int(sizes[3]), dtype=torch.uint8)
        else:
            header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        wait_all([dist.broadcast(header_t, source, group=self._group, async_op=True)], timeout, "scout header")
        if payload.numel() > 0:
            wait_all([dist.broadcast(payload, source, group=self._group, async_op=True)], timeout, "scout payload")
        try:
            return unpack(bytes(header_t.numpy()), payload, step), None, True
        except (ValueError, KeyError, TypeError) as exc:
            return {}, f"the inputs from source rank {source} could not be read: {exc}", True

    def _capture_source(self, recipe: Recipe, step: int) -> Captured:
        if recipe.has_module:
            return self._capture.take(recipe.name, step)
        try:
            return capture_optimizer(recipe, self._params, self._optimizer, step)
        except (TypeError, KeyError) as exc:
            return Captured(step=step, error=str(exc))

    def _replay_local(self, recipe: Recipe, step: int, source: int, captured: Captured | None,
                      wire_error: str | None) -> dict[str, Any]:
        record: dict[str, Any] = {"error": None, "precondition": None, "digest": None, "replay_s": None}
        try:
            if wire_error is not None:
                raise RuntimeError(wire_error)
            if captured is None:
                raise RuntimeError(f"source rank {source} sent no inputs for {recipe.name!r}")
            if captured.error is not None:
                raise RuntimeError(f"source rank {source} has no capture: {captured.error}")
            own = param_digest(recipe, self._modules[recipe.name], self._params, self._optimizer)
            record["precondition"] = precondition_for(recipe, step, captured, own).to_dict()
            ctx = ReplayContext(recipe=recipe.name, kind=recipe.kind.value, step=step, rank=self.rank,
                                source_rank=source)
            self._current, self._capture.paused = ctx, True
            try:
                if recipe.has_module:
                    outcome = replay_forward(self._modules[recipe.name], recipe.modules, captured, ctx, self._hooks)
                else:
                    outcome = replay_optimizer(type(self._optimizer), self._optimizer.defaults, captured, ctx,
                                               self._hooks, self._params[recipe.params[0]].device)
            finally:
                self._current, self._capture.paused = None, False
            record["digest"] = digest_many(outcome.outputs)
            record["replay_s"] = outcome.seconds
        except Exception as exc:  # recorded and agreed on, never raised mid-sequence
            record["error"] = f"{type(exc).__name__}: {exc}"
        return record

    def _stragglers(self, step: int, results: Mapping[str, C3Result],
                    times: Mapping[str, Mapping[int, float]]) -> list[FaultReport]:
        if self.config.stragglers is None:
            return []
        reports = []
        for name, result in results.items():
            if result.preconditions_ok and len(times[name]) == len(self.peers):
                detector = self._detectors.setdefault(name, ComputeStragglerDetector(self.config.stragglers))
                report = detector.observe(step, times[name])
                if report is not None:
                    reports.append(dataclasses.replace(report, recipe=name))
        return reports

    def _rewind(self) -> None:
        self.rotation.reset()
        self._detectors.clear()
        self._last_cycle_step = None

    def _require_attached(self) -> None:
        if not self._attached or self._closed:
            raise ConfigError("Scout: call attach(model, optimizer) first (and not after close())")


"""SCOUT's optimizer recipe on DeepSpeed ZeRO-1/2: source-broadcast replay against the partitioned optimizer.

Under ZeRO-1/2 the fp32 master partition and its optimizer state live on one rank only, so the DDP recipe (every peer
updates the same slice of its own replica) has nothing common to replay. Here the source of a slice is its
**partition owner**:

* the catalog lists, for every rank of the data-parallel group, slices of that rank's flat fp32 partition (the
  plan of :mod:`~gemscout.adapters.deepspeed.zero_slices`);
* at a due step the owner is ``peers[(s // every) % n]`` (the rotation walks over owners, then over their slices);
  during ``engine.step()`` the inner torch optimizer's step pre-hook copies, on the owner, the slice's pre-update
  master values, the reduced (unscaled, clipped) gradient partition, the optimizer state and the hyper-parameters
  (:mod:`~gemscout.adapters.deepspeed.zero_capture`);
* after ``engine.step()`` (an ``EngineOptimizer`` post-hook that runs before the session's) the owner broadcasts
  that capture, every rank replays the update on private copies, and each rank's vote is gathered: a non-owner votes
  with its replay, the owner with its **actual** post-update slice (master values and state) — or, when its own
  replay does not reproduce its actual update, with a value no one else holds, since either way the owner computed
  something wrong. Strict majority (C3): a real update that deviates names the owner; a replay-only fault names the
  replaying rank. The slices' replay times feed the compute-straggler detector like a forward recipe's (one detector
  per slice size: every rank replays the same slices of one owner in a round).

The verdict settles after the update, so :class:`ZeroScout` defers the rotation's bookkeeping of the step until the
optimizer slices are judged, and replaces its ``last_result`` with the settled cycle; the session reads that before
gating GEMINI's capture. Forward recipes run unchanged (the base :class:`~gemscout.scout.engine.Scout` cycle).
Nothing here imports deepspeed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from gemscout.adapters.deepspeed.zero_capture import (
    blake3_digest,
    capture_slice,
    hyper_digest,
    live_slice,
)
from gemscout.adapters.deepspeed.zero_slices import ZeroSlice, plan_slices
from gemscout.errors import ConfigError
from gemscout.reports import FaultReport
from gemscout.scout.capture import Captured
from gemscout.scout.consensus import C3Result
from gemscout.scout.cycle import CycleResult, judge_gathered, precondition_for
from gemscout.scout.digests import digest_many
from gemscout.scout.domain import FlatDomain
from gemscout.scout.engine import Scout
from gemscout.scout.recipes import Catalog, RecipeKind
from gemscout.scout.replay import ReplayContext, replay_optimizer
from gemscout.scout.rotation import RotationTracker
from gemscout.scout.stragglers import ComputeStragglerDetector

__all__ = ["ZeroScout"]


class _DeferredRotation(RotationTracker):
    """The base cycle records its forward verdicts here in the pre-hook; they are held until the optimizer slices of
    the same step are judged after the update, then recorded together (a step is recorded once)."""

    def __init__(self, catalog: tuple[str, ...]) -> None:
        super().__init__(catalog)
        self.held: tuple[int, dict[str, C3Result]] | None = None

    def record(self, step: int, results: Mapping[str, C3Result]) -> int | None:
        self.held = (step, dict(results))
        return None

    def settle(self, step: int, results: Mapping[str, C3Result]) -> int | None:
        held = self.held[1] if self.held is not None and self.held[0] == step else {}
        self.held = None
        return super().record(step, {**held, **results})

    def reset(self) -> None:
        super().reset()
        self.held = None


class ZeroScout(Scout):
    """:class:`~gemscout.scout.engine.Scout` for a DeepSpeed ZeRO-1/2 engine with the optimizer recipe.

    ``attach(model, optimizer)`` takes the adapter's :class:`~gemscout.adapters.deepspeed.EngineOptimizer` as
    ``optimizer``. Same contract as the base class otherwise; the optimizer slices' collectives (one broadcast of the
    owner's capture, one all-gather of the records) run after ``engine.step()`` on every rank of the group.
    """

    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        group: dist.ProcessGroup | None = None,
        topology: Any = None,
        first_step: int = 1,
    ) -> ZeroScout:
        view: Any = optimizer
        zero, inner = getattr(view, "zero", None), getattr(view, "inner", None)
        if zero is None or not isinstance(inner, torch.optim.Optimizer):
            raise ConfigError(
                "ZeroScout.attach: optimizer must be the DeepSpeed adapter's EngineOptimizer "
                "(enable_resiliency builds it from the engine)"
            )
        super().attach(model, optimizer, group=group, topology=topology, first_step=first_step)
        if not isinstance(self.domain, FlatDomain):
            raise ConfigError(
                "ScoutConfig.recipes: the ZeRO optimizer recipe needs the data-parallel ranks as peers"
            )
        self._flat = self.domain
        self._zero, self._inner = zero, inner
        # Inside engine.step() DeepSpeed swaps the inner optimizer's param_groups for one group at a time; the masters
        # are told apart by identity, never by their position in that temporary list.
        self._masters = [g["params"][0] for g in inner.param_groups]
        groups = list(getattr(zero, "real_dp_process_group", [None] * len(inner.param_groups)))
        for g, pg in enumerate(groups):
            ranks = (
                tuple(dist.get_process_group_ranks(pg))
                if pg is not None
                else tuple(range(dist.get_world_size()))
            )
            if sorted(ranks) != sorted(self.peers):
                raise ConfigError(
                    f"ScoutConfig.recipes: ZeRO param group {g} is partitioned over ranks {list(ranks)}"
                    f", SCOUT's peers are {list(self.peers)}; the optimizer recipe needs them equal "
                    "(no model parallelism), or drop 'optimizer' from ScoutConfig.recipes"
                )
        numel = [int(g["params"][0].numel()) for g in inner.param_groups]
        self._plan = plan_slices(self.peers, numel, self.config.optimizer_slice_numel)
        # The forward recipes stay with the base cycle; the base catalog's DDP slices (of this rank's own partition,
        # which no peer holds) are dropped.
        self.catalog = Catalog(tuple(r for r in self.catalog.recipes if r.has_module), self.config)
        self._fingerprint = self.catalog.fingerprint()
        names = [*self.catalog.names, *(s.name for owner in self.peers for s in self._plan[owner])]
        self.rotation = _DeferredRotation(tuple(names))
        text = json.dumps(
            [[s.name, s.group, s.start, s.stop] for o in self.peers for s in self._plan[o]]
        )
        self._zero_fingerprint = int.from_bytes(
            hashlib.sha256(text.encode()).digest()[:8], "little", signed=True
        )
        self._pending: tuple[int, list[ZeroSlice]] | None = None
        self._captured: dict[str, Captured] = {}
        self._own_hyper: dict[int, str] = {}
        self._settle_step: int | None = None
        self._zero_handles: list[RemovableHandle] = [
            inner.register_step_pre_hook(self._capture_partition),
            view.register_step_post_hook(self._settle_hook),
        ]
        return self

    def close(self) -> None:
        for handle in getattr(self, "_zero_handles", []):
            handle.remove()
        super().close()

    # -- schedule -----------------------------------------------------------------------------------------------
    def zero_due(self, step: int) -> list[ZeroSlice]:
        """The optimizer slices to check at ``step`` (all of one owner). Pure: every rank gets the same answer."""
        every = self.config.interval_of("optimizer")
        if step % every:
            return []
        turn = step // every
        owner = self.peers[turn % len(self.peers)]
        members = self._plan[owner]
        take = self.config.optimizer_slices_per_cycle
        if take is None or take >= len(members):
            return list(members)
        start = (turn // len(self.peers)) * take
        return [members[(start + j) % len(members)] for j in range(take)]

    # -- the step -----------------------------------------------------------------------------------------------
    def before_step(self, step: int) -> CycleResult | None:
        """The base cycle for the forward recipes, then arm the optimizer slices due at ``step``; the verdict is
        provisional until the post-hook after ``engine.step()`` settles it (``last_result``)."""
        if self._last_cycle_step is not None and step <= self._last_cycle_step:
            self._rewind()
        due = self.zero_due(step)
        self._pending = (step, due) if due else None
        self._captured = {}
        # Every rank digests its own hyper-parameters now: after engine.step() its lr scheduler has moved on.
        self._own_hyper = {s.group: hyper_digest(self._inner, s.group) for s in due}
        result = super().before_step(step)
        self._settle_step = step
        if due and result is None:
            result = CycleResult(
                step=step,
                source_rank=due[0].owner,
                peers=self.peers,
                results={},
                replay_s={},
                peer_groups=self.peer_groups,
            )
        if result is not None:
            self.last_result = result
            self._last_cycle_step = step
        return result

    def _capture_partition(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Inner optimizer step pre-hook (DeepSpeed steps it once per param group, that group alone): on the owner,
        copy the due slices of this group before the update. No collective: only the owner runs this part."""
        pending = self._pending
        if pending is None or not optimizer.param_groups:
            return
        step, due = pending
        master = optimizer.param_groups[0]["params"][0]
        for g, known in enumerate(self._masters):
            if known is not master:
                continue
            for piece in (s for s in due if s.group == g and s.owner == self.rank):
                try:
                    self._captured[piece.name] = capture_slice(
                        self._inner, piece, optimizer.param_groups[0], master, step
                    )
                except Exception as exc:  # the owner still sends: a capture that carries the error
                    self._captured[piece.name] = Captured(step=step, error=f"capture failed: {exc}")

    def _settle_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        step, self._settle_step = self._settle_step, None
        pending, self._pending = self._pending, None
        assert isinstance(self.rotation, _DeferredRotation)
        if step is None or (pending is None and self.rotation.held is None):
            return
        due = pending[1] if pending is not None and pending[0] == step else []
        results: dict[str, C3Result] = {}
        times: dict[str, dict[int, float]] = {}
        if due:
            results, times = self._zero_cycle(step, due)
        certified = self.rotation.settle(step, results)
        base = self.last_result
        if base is None or base.step != step:
            return
        reports = tuple(
            r for r in (res.fault_report() for res in results.values()) if r is not None
        )
        reports += self._compute_reports(step, due, results, times)
        self.last_result = dataclasses.replace(
            base,
            results={**base.results, **results},
            replay_s={**base.replay_s, **times},
            reports=base.reports + reports,
            certified_step=certified,
        )

    def _compute_reports(
        self,
        step: int,
        due: list[ZeroSlice],
        results: Mapping[str, C3Result],
        times: Mapping[str, Mapping[int, float]],
    ) -> tuple[FaultReport, ...]:
        """Compute stragglers over the optimizer slices: every rank replayed the same slices of one owner, so their
        summed times are the same work. Slices rotate over owners from one cycle to the next; the detector is keyed
        by the total element count (equal-sized slices are the same work whoever owns them), so consecutive rounds
        compare like with like and the per-rank baseline is never fed a different amount of work."""
        if not due or self.config.stragglers is None:
            return ()
        if not all(
            results[s.name].preconditions_ok and len(times.get(s.name, {})) == len(self.peers)
            for s in due
        ):
            return ()
        totals = {rank: sum(times[s.name][rank] for s in due) for rank in self.peers}
        numel = sum(s.stop - s.start for s in due)
        detector = self._detectors.setdefault(
            f"optimizer-slices[{numel}]", ComputeStragglerDetector(self.config.stragglers)
        )
        report = detector.observe(step, totals)
        if report is None:
            return ()
        return (dataclasses.replace(report, recipe=due[0].name if len(due) == 1 else "optimizer"),)

    def _zero_cycle(
        self, step: int, due: list[ZeroSlice]
    ) -> tuple[dict[str, C3Result], dict[str, dict[int, float]]]:
        owner = due[0].owner
        captures = None
        if self.rank == owner:
            captures = {
                s.name: self._captured.get(s.name)
                or Captured(
                    step=step,
                    error=f"engine.step() never reached param group {s.group} on the owner",
                )
                for s in due
            }
        received, wire_error, _ = self._flat.exchange.send_inputs(
            step, self._zero_fingerprint, owner, captures
        )
        self._captured = {}
        records = {s.name: self._record(s, step, received.get(s.name), wire_error) for s in due}
        names = [s.name for s in due]
        by_rank = self._flat.exchange.gather_records(names, records)
        results, times = {}, {}
        for name in names:
            results[name], times[name] = judge_gathered(
                name, step, self.peers, [by_rank[r] for r in self.peers]
            )
        return results, times

    def _record(
        self, piece: ZeroSlice, step: int, captured: Captured | None, wire_error: str | None
    ) -> dict[str, Any]:
        """Replay ``piece`` here; the vote is the replay (a peer) or the actual update (the owner)."""
        record: dict[str, Any] = {
            "error": None,
            "precondition": None,
            "digest": None,
            "replay_s": None,
        }
        try:
            if wire_error is not None:
                raise RuntimeError(wire_error)
            if captured is None or captured.error is not None:
                why = "sent nothing" if captured is None else f"has no capture: {captured.error}"
                raise RuntimeError(f"owner rank {piece.owner} {why}")
            recipe = piece.recipe
            record["precondition"] = precondition_for(
                recipe, step, captured, self._own_hyper[piece.group]
            ).to_dict()
            ctx = ReplayContext(
                recipe=piece.name,
                kind=RecipeKind.OPTIMIZER.value,
                step=step,
                rank=self.rank,
                source_rank=piece.owner,
            )
            self._current = ctx
            try:
                start = time.perf_counter()
                outcome = replay_optimizer(
                    type(self._inner), self._inner.defaults, captured, ctx, self._hooks
                )
                replayed = digest_many(outcome.outputs)
                record["replay_s"] = time.perf_counter() - start
            finally:
                self._current = None
            if self.rank != piece.owner:
                record["digest"] = replayed
            else:
                actual = digest_many(live_slice(self._inner, self._masters[piece.group], piece))
                # The owner's replay disagreeing with its own update means the owner computed one of them wrongly:
                # a vote that matches no peer names it.
                record["digest"] = (
                    actual
                    if replayed == actual
                    else blake3_digest("self-inconsistent", actual, replayed)
                )
        except Exception as exc:  # recorded and agreed on, never raised mid-sequence
            record["error"] = f"{type(exc).__name__}: {exc}"
        return record

"""Step 2 of the SCOUT cycle, on one rank: replay one recipe from the source's inputs and record what it produced.

The record is what the cycle's fixed-size all-gather of records carries
(:meth:`~gemscout.scout.exchange.PeerExchange.gather_records`): the precondition (this peer's own parameters and the
inputs' digests), the digest of the replay's outputs and gradients, and the replay's compute time with its own
collectives and the CPU wait taken out. A local failure never raises: it becomes the record's ``error``, which every
peer then sees.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gemscout.scout.capture import Captured, CaptureHooks
from gemscout.scout.cycle import param_digest, precondition_for
from gemscout.scout.digests import digest_many
from gemscout.scout.domain import PeerDomain
from gemscout.scout.materialize import CollectiveTimer, local_tensor, without_wrapper_hooks
from gemscout.scout.recipes import Recipe
from gemscout.scout.replay import ReplayContext, ReplayHooks, replay_forward, replay_optimizer
from gemscout.scout.stragglers import run_queue_seconds, waited_since

__all__ = ["LocalReplay"]


class LocalReplay:
    """Replays due recipes on this rank for :class:`~gemscout.scout.engine.Scout`, which builds it at attach from
    its parts: the recipes' modules, the optimizer's parameters by name, the capture hooks (paused during a replay,
    so the replay's own forward is not captured), the replay seams' hooks, and ``mark``, which tells the engine
    which replay runs now (``None`` after it)."""

    def __init__(
        self,
        *,
        rank: int,
        modules: Mapping[str, Sequence[nn.Module]],
        params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        capture: CaptureHooks,
        hooks: ReplayHooks,
        collective_hooks: Mapping[int, Callable[[ReplayContext, str], None]],
        domain: PeerDomain | None,
        mark: Callable[[ReplayContext | None], None],
    ) -> None:
        self._rank = rank
        self._modules = modules
        self._params = params
        self._optimizer = optimizer
        self._capture = capture
        self._hooks = hooks
        self._collective_hooks = (
            collective_hooks  # read at each replay: hooks registered after attach count
        )
        self._domain = domain
        self._mark = mark

    def record(
        self,
        recipe: Recipe,
        step: int,
        source: int,
        captured: Captured | None,
        wire_error: str | None,
        *,
        params: list[dict[str, torch.Tensor]] | None = None,
        own_slice: Captured | None = None,
        blocked: str | None = None,
    ) -> dict[str, Any]:
        """Replay ``recipe`` on this rank and return its record. ``params``: the gathered parameters of a sharded
        model (replayed on instead of the live shards, and digested for the precondition); ``own_slice``: this
        rank's own gathered optimizer slice; ``blocked``: why the replay must not run on any rank. Blocks on the
        replay's own collectives only (TP all-reduces of a TP-sharded block); never raises."""
        record: dict[str, Any] = {
            "error": None,
            "precondition": None,
            "digest": None,
            "replay_s": None,
        }
        try:
            if wire_error is not None:
                raise RuntimeError(wire_error)
            if captured is None:
                raise RuntimeError(f"source rank {source} sent no inputs for {recipe.name!r}")
            if captured.error is not None:
                raise RuntimeError(f"source rank {source} has no capture: {captured.error}")
            if blocked is not None:
                raise RuntimeError(blocked)
            gathered = None
            if params is not None:
                gathered = {
                    f"{path}.{n}": local_tensor(t)
                    for path, named in zip(recipe.modules, params, strict=True)
                    for n, t in named.items()
                }
            elif own_slice is not None and own_slice.error is None:
                gathered = own_slice.tensors
            own = param_digest(
                recipe, self._modules[recipe.name], self._params, self._optimizer, gathered
            )
            record["precondition"] = precondition_for(recipe, step, captured, own).to_dict()
            ctx = ReplayContext(
                recipe=recipe.name,
                kind=recipe.kind.value,
                step=step,
                rank=self._rank,
                source_rank=source,
            )
            timer = None
            if self._domain is not None and recipe.name in self._domain.collective_recipes:
                timer = CollectiveTimer(
                    [functools.partial(hook, ctx) for hook in self._collective_hooks.values()]
                )
            self._mark(ctx)
            self._capture.paused = True
            queued, window = run_queue_seconds(), time.perf_counter()
            try:
                if recipe.has_module:
                    modules = self._modules[recipe.name]
                    with (
                        without_wrapper_hooks(modules)
                        if params is not None
                        else contextlib.nullcontext(),
                        timer if timer is not None else contextlib.nullcontext(),
                    ):
                        outcome = replay_forward(
                            modules, recipe.modules, captured, ctx, self._hooks, params=params
                        )
                else:
                    # The received inputs are views of the exchange's buffer, read by no one after this replay.
                    # A view over several torch optimizers (TorchTitan's container) names the class that updates.
                    cls = getattr(self._optimizer, "replay_class", None) or type(self._optimizer)
                    outcome = replay_optimizer(
                        cls,
                        self._optimizer.defaults,
                        captured,
                        ctx,
                        self._hooks,
                        self._params[recipe.params[0]].device,
                        consume=True,
                    )
            finally:
                self._mark(None)
                self._capture.paused = False
            queued, window = waited_since(queued), time.perf_counter() - window
            record["digest"] = digest_many(outcome.outputs)
            # Time in the replay's own collectives is communication, and time waiting for a CPU is the host's other
            # load, not this rank's work: compute is compared without either. The run-queue wait is read around a
            # window a little wider than the replay's own timer; only what cannot have fallen outside it is removed.
            queued_inside = max(0.0, queued - max(0.0, window - outcome.seconds))
            record["replay_s"] = max(
                0.0, outcome.seconds - (timer.seconds if timer is not None else 0.0) - queued_inside
            )
            if timer is not None:
                record["collective_s"] = timer.seconds
        except Exception as exc:  # recorded and agreed on, never raised mid-sequence
            record["error"] = f"{type(exc).__name__}: {exc}"
        return record

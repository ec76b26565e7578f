"""DeepSpeed ZeRO-1/2/3: what GEMINI captures from a ``DeepSpeedEngine`` and where the step hooks go.

This module holds ZeRO-1/2 and the checks common to every stage; stage 3 (partitioned parameters) is
:mod:`gemscout.adapters.deepspeed.zero3`.

The engine owns the step: ``engine.step()`` runs the ZeRO optimizer (each rank updates its own flat fp32 partition
with the client's torch optimizer), copies the partition into the module's parameters, all-gathers them, then steps
the engine's lr scheduler and counters. The torch optimizer inside fires its own step hooks halfway through that
(once per param group, before the all-gather), where the module still holds the old weights — so gemscout hooks
``engine.step()`` itself instead: the pre-hooks run at the accumulation boundary before the update, the post-hooks
after ``engine.step()`` has finished, when module, partition, scheduler and counters all belong to the same step.

What one rank's checkpoint holds (the codec stores it without pickle):

- ``model``: ``engine.module.state_dict()`` — every rank holds all parameters under ZeRO-1/2;
- ``optimizer``: this rank's partition — the fp32 master partition of each param group, the torch optimizer's state
  for it (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``), the group hyper-parameters and where each parameter's
  fragment lies in the partition (:func:`~gemscout.adapters.deepspeed.layout.partition_table`); DeepSpeed's own
  ``state_dict()`` is not used (it holds a loss-scaler object, enums and slice mappings that need pickle);
- ``extra``: the engine's counters (``global_steps``, ``global_samples``, ``micro_steps``, ``skipped_steps``), its lr
  scheduler's state, and the caller's own extra state.

The local tier restores a partition on the rank and world size that took it. The durable tier stores the partition
state per parameter (:mod:`gemscout.adapters.deepspeed.layout`), so a job resumes from it on any world size.

Nothing here imports deepspeed: the adapter reads the live engine the caller built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gemscout.adapters._step_hooks import EngineStepView
from gemscout.adapters.classes import class_names
from gemscout.adapters.deepspeed import layout as deepspeed_layout
from gemscout.adapters.target import Request, Target, with_framework_state
from gemscout.errors import ConfigError, RunMismatchError
from gemscout.scout.config import ScoutConfig
from gemscout.state.codec import encode

__all__ = [
    "EngineOptimizer",
    "SUPPORTED_STAGES",
    "capture_engine",
    "resolve_engine",
    "restore_engine",
]

SUPPORTED_STAGES = (1, 2, 3)
FORMAT = deepspeed_layout.FORMAT
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


class EngineOptimizer(EngineStepView):
    """A ZeRO-1/2 engine's optimizer as gemscout's session and GEMINI see it.

    It offers the part of the ``torch.optim.Optimizer`` interface gemscout uses: ``register_step_pre_hook`` /
    ``register_step_post_hook`` (run around ``engine.step()`` at accumulation boundaries, called as
    ``hook(self, args, kwargs)``), ``state_dict`` / ``load_state_dict`` (this rank's partition, see the module doc),
    and ``param_groups`` / ``state`` / ``defaults`` of the torch optimizer DeepSpeed wraps (one flat fp32 partition
    per group).
    """

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.inner: torch.optim.Optimizer = engine.optimizer.optimizer
        self._table = deepspeed_layout.partition_table(self.zero)  # fixed once the engine is built

    # -- this rank's partition ------------------------------------------------------------------------------------
    def partition_table(self) -> dict[str, Any]:
        """Parameter names per group and this rank's fragment of each (see ``deepspeed_layout.partition_table``)."""
        return {
            "params": [list(g) for g in self._table["params"]],
            "fragments": [[list(r) for r in g] for g in self._table["fragments"]],
        }

    def partition_numel(self) -> list[int]:
        """Elements of this rank's flat fp32 partition, per group (DeepSpeed's padding included)."""
        return [int(g["params"][0].numel()) for g in self.inner.param_groups]

    def layout(self) -> dict[str, Any]:
        # The partition index is part of the layout: a partition restored on another rank (a durable promotion
        # written by rank 0 alone, a folder copied by hand) would load cleanly and be silently wrong.
        groups = getattr(self.zero, "real_dp_process_group", [None] * len(self.inner.param_groups))
        index = [int(dist.get_rank(group=g)) if dist.is_initialized() else 0 for g in groups]
        return {
            "zero_stage": int(self.engine.zero_optimization_stage()),
            "partition_count": [int(c) for c in self.zero.partition_count],
            "partition_index": index,
            "partition_numel": self.partition_numel(),
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's partition. Tensors are the live ones (GEMINI copies them); nothing needs pickle."""
        groups = self.inner.param_groups
        return {
            "format": FORMAT,
            **self.layout(),
            **self.partition_table(),
            "master": [g["params"][0] for g in groups],
            "state": {
                i: dict(self.inner.state[g["params"][0]])
                for i, g in enumerate(groups)
                if self.inner.state.get(g["params"][0])
            },
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a partition taken by :meth:`state_dict` into the live optimizer, bitwise.

        Raises RunMismatchError when it was taken with another ZeRO stage or partitioning (world size, groups)."""
        if state.get("format") != FORMAT:
            raise RunMismatchError(
                f"the optimizer state is not a DeepSpeed ZeRO partition ({state.get('format')!r}); "
                "it was taken from another kind of job"
            )
        here = self.layout()
        if "fragments" in state:  # taken by this version (older partitions lack the table)
            here.update(self._table)
        there = {k: state.get(k) for k in here}
        if there != here:
            diff = sorted(k for k in here if there[k] != here[k])
            small = [k for k in diff if k not in ("params", "fragments")]
            raise RunMismatchError(
                f"the DeepSpeed checkpoint's partition differs from this engine's in {diff} (taken "
                f"with { ({k: there[k] for k in small}) }, here { ({k: here[k] for k in small}) }); "
                "a local checkpoint resumes "
                "with the same ZeRO stage, world size and param groups, each rank from its own "
                "partition (the durable tier resumes on any world size)"
            )
        with torch.no_grad():
            for i, group in enumerate(self.inner.param_groups):
                master = group["params"][0]
                master.copy_(state["master"][i])
                for key, value in state["param_groups"][i].items():
                    group[key] = value.clone() if isinstance(value, torch.Tensor) else value
                self._restore_entry(self.inner.state[master], state["state"].get(i, {}))


def capture_engine(engine: Any) -> dict[str, Any]:
    """The engine's own state after ``engine.step()``: its counters and its lr scheduler."""
    counters = {name: int(getattr(engine, name)) for name in _COUNTERS}
    scheduler = engine.lr_scheduler
    return {**counters, "lr_scheduler": scheduler.state_dict() if scheduler is not None else None}


def restore_engine(engine: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`capture_engine` took. The scheduler is not stepped: it was taken after its step."""
    for name in _COUNTERS:
        setattr(engine, name, int(state[name]))
    if engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineParts:
    """What ``enable_resiliency`` attaches to for a DeepSpeed engine."""

    model: nn.Module
    """``engine.module``: the parameters, forward hooks, SCOUT's recipes."""
    optimizer: EngineOptimizer
    """Step hooks around ``engine.step()`` and this rank's partition."""
    extra_state_fn: Callable[[], Any]
    """Engine counters + lr scheduler + the caller's extra state."""
    load_extra_state_fn: Callable[[Any], None]
    """The inverse of ``extra_state_fn``."""
    scout_factory: Callable[[Any], Any] | None = None
    """The Scout class to attach (``ZeroScout`` when the optimizer recipe is enabled), or None for the default."""


def _check_engine(engine: Any) -> None:
    """Refuse what the adapter has not been built for, naming the setting to change."""
    names = class_names(engine)
    for unsupported in ("PipelineEngine", "DeepSpeedHybridEngine"):
        if unsupported in names:
            raise ConfigError(
                f"enable_resiliency.model: a DeepSpeed {unsupported} is not supported; gemscout supports "
                "the plain DeepSpeedEngine with ZeRO stage 1, 2 or 3"
            )
    stage = int(engine.zero_optimization_stage())
    if stage not in SUPPORTED_STAGES:
        raise ConfigError(
            f"DeepSpeed zero_optimization.stage={stage} is not supported; gemscout supports stages "
            f"{SUPPORTED_STAGES} (stage 0 has no ZeRO optimizer: use plain PyTorch DDP instead)"
        )
    if engine.fp16_enabled():
        raise ConfigError(
            "DeepSpeed fp16 is not supported (its dynamic loss scaler is not captured yet); use "
            "bf16 or fp32"
        )
    if engine.zero_offload_optimizer() is not None or engine.zero_offload_param() is not None:
        raise ConfigError(
            "DeepSpeed zero_optimization.offload_optimizer / offload_param is not supported yet; "
            "turn offloading off"
        )
    if stage == 3:
        from gemscout.adapters.deepspeed.zero3 import check_zero3

        check_zero3(engine)
        return
    zero = engine.optimizer
    if "DeepSpeedZeroOptimizer" not in class_names(zero) or not isinstance(
        getattr(zero, "optimizer", None), torch.optim.Optimizer
    ):
        raise ConfigError(
            f"the engine's optimizer is a {type(zero).__name__}, not a DeepSpeedZeroOptimizer around a "
            "torch optimizer; gemscout supports ZeRO-1/2 as built by deepspeed.initialize "
            "(deepspeed==0.19.8)"
        )
    groups = zero.optimizer.param_groups
    if any(len(g["params"]) != 1 for g in groups) or len(groups) != len(
        zero.single_partition_of_fp32_groups
    ):
        raise ConfigError(
            "the ZeRO optimizer does not hold one flat fp32 partition per param group; this "
            "DeepSpeed version is not supported (tested: deepspeed==0.19.8)"
        )


def _extra_fns(
    engine: Any,
    extra_state_fn: Callable[[], Any] | None,
    load_extra_state_fn: Callable[[Any], None] | None,
) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """The engine's counters and lr scheduler plus the caller's own state, and the inverse."""
    return with_framework_state(
        "engine",
        lambda: capture_engine(engine),
        lambda saved: restore_engine(engine, saved),
        extra_state_fn,
        load_extra_state_fn,
    )


def _resolve_zero3(
    engine: Any,
    *,
    extra_state_fn: Callable[[], Any] | None,
    load_extra_state_fn: Callable[[Any], None] | None,
    scout: Any,
) -> EngineParts:
    """Stage 3: the module's partitions and the optimizer's fp32 master partitions (``deepspeed_zero3``)."""
    from gemscout.adapters.deepspeed import zero3_layout as deepspeed_zero3_layout
    from gemscout.adapters.deepspeed.zero3 import Zero3EngineOptimizer, Zero3ModuleState

    scout_factory = None
    if scout is not None:
        if "optimizer" in getattr(scout, "recipes", ()):
            raise ConfigError(
                "ScoutConfig.recipes: the optimizer recipe is not supported under DeepSpeed ZeRO stage 3 "
                "yet; pass recipes=('embedding', 'hidden', 'output') (the forward recipes replay on "
                "the gathered parameters), or scout=None"
            )
        # The forward recipes replay on the replayed blocks' gathered parameters (adapters/deepspeed/zero3_scout.py).
        from gemscout.adapters.deepspeed.zero3_scout import Zero3Scout

        scout_factory = Zero3Scout
    deepspeed_zero3_layout.register()  # durable promotions of this job are stored per parameter
    view = Zero3EngineOptimizer(engine)
    model = Zero3ModuleState(cast(nn.Module, engine.module))
    extra, load_extra = _extra_fns(engine, extra_state_fn, load_extra_state_fn)
    encode(capture_engine(engine), path="deepspeed.engine")
    encode(view.state_dict(), path="deepspeed.optimizer")
    encode(model.state_dict(), path="deepspeed.model")
    return EngineParts(
        model=model,
        optimizer=cast(EngineOptimizer, view),
        extra_state_fn=extra,
        load_extra_state_fn=load_extra,
        scout_factory=scout_factory,
    )


def resolve_engine(
    engine: Any,
    optimizer: Any,
    *,
    extra_state_fn: Callable[[], Any] | None,
    load_extra_state_fn: Callable[[Any], None] | None,
    schedulers: Sequence[Any],
    scout: Any,
) -> EngineParts:
    """Check ``enable_resiliency``'s arguments for a DeepSpeed engine and build what it attaches to.

    ``optimizer`` must be what ``deepspeed.initialize`` returned (``engine.optimizer``), the client optimizer it wraps,
    or None. Raises ConfigError for an engine setting or argument the adapter cannot take, naming the fix.
    """
    _check_engine(engine)
    zero = engine.optimizer
    if optimizer is not None and optimizer is not zero and optimizer is not zero.optimizer:
        raise ConfigError(
            f"enable_resiliency.optimizer: with a DeepSpeedEngine pass engine.optimizer (the second "
            f"value deepspeed.initialize returned) or None, got a {type(optimizer).__name__}"
        )
    if engine.lr_scheduler is not None and any(s is engine.lr_scheduler for s in schedulers):
        raise ConfigError(
            "enable_resiliency.schedulers: engine.lr_scheduler is stepped by engine.step() and captured "
            "by the DeepSpeed adapter; list only schedulers your loop steps itself"
        )
    if int(engine.zero_optimization_stage()) == 3:
        return _resolve_zero3(
            engine,
            extra_state_fn=extra_state_fn,
            load_extra_state_fn=load_extra_state_fn,
            scout=scout,
        )
    deepspeed_layout.register()  # durable promotions of this job are stored per parameter
    scout_factory = None
    if "optimizer" in getattr(scout, "recipes", ()):
        # Each rank updates a different partition: the optimizer recipe replays the partition owner's update
        # (adapters/deepspeed/scout.py) instead of the DDP one.
        from gemscout.adapters.deepspeed.scout import ZeroScout

        scout_factory = ZeroScout
    view = EngineOptimizer(engine)
    extra, load_extra = _extra_fns(engine, extra_state_fn, load_extra_state_fn)

    # Fail at attach, not inside the first engine.step(), when the scheduler holds something only pickle could store.
    encode(capture_engine(engine), path="deepspeed.engine")
    encode(view.state_dict(), path="deepspeed.optimizer")
    return EngineParts(
        model=cast(nn.Module, engine.module),
        optimizer=view,
        extra_state_fn=extra,
        load_extra_state_fn=load_extra,
        scout_factory=scout_factory,
    )


def adapt(engine: Any, optimizer: Any, request: Request) -> Target:
    """The registry's entry point: a DeepSpeed engine becomes its module, a step-hooked view of its ZeRO optimizer
    and its counters as extra state."""
    parts = resolve_engine(
        engine,
        optimizer,
        extra_state_fn=request.extra_state_fn,
        load_extra_state_fn=request.load_extra_state_fn,
        schedulers=request.schedulers,
        scout=request.scout if isinstance(request.scout, ScoutConfig) else None,
    )
    # EngineOptimizer offers exactly the optimizer interface the session, GEMINI and SCOUT's forward recipes use.
    return Target(
        framework="deepspeed",
        model=parts.model,
        optimizer=cast(torch.optim.Optimizer, parts.optimizer),
        extra_state_fn=parts.extra_state_fn,
        load_extra_state_fn=parts.load_extra_state_fn,
        schedulers=tuple(request.schedulers),
        scout=request.scout,
        scout_factory=parts.scout_factory,
        rank_local=True,  # each rank's ZeRO partition is its own
    )

"""Megatron Core: what GEMINI captures from a Megatron model and optimizer, and who SCOUT's peers are.

What a Megatron job hands to ``enable_resiliency``:

- ``model``: a Megatron module (``GPTModel``, possibly wrapped in Megatron's ``DistributedDataParallel`` /
  ``Float16Module``, unwrapped through ``.module``) or the list of model chunks ``get_model`` returns. One chunk is
  used as is; several chunks (virtual pipeline stages) are held in an ``nn.ModuleList`` so their state is one dict.
- ``optimizer``: a ``torch.optim.Optimizer`` (used as is: its own step hooks), or a ``MegatronOptimizer``
  (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``, ``ChainedOptimizer``), which
  is not a torch optimizer: :class:`~gemscout.adapters.megatron.optimizer_view.MegatronOptimizerView` gives it step
  hooks and a pickle-free per-rank state.

SCOUT's peers come from ``megatron.core.parallel_state``: ranks that share this rank's tensor-, context- and
pipeline-parallel coordinates and differ only along data parallelism (the data-parallel group). The layout is read
as a mesh ``(pp, dp, cp, tp)`` — Megatron's default order ``tp-cp-ep-dp-pp`` — and checked against the live
data-parallel group, so a custom order is refused instead of pairing the wrong ranks. Megatron's TP shards (plain
tensors flagged ``tensor_model_parallel``) lie on that mesh's ``tp`` dim
(:data:`~gemscout.adapters.megatron.topology.MEGATRON_PLACEMENT_FLAGS`, the topology's placement rule), so a block whose replay all-reduces with its TP partners
replays on every rank or on none.

Expert parallelism (MoE layers with ``expert_model_parallel_size > 1``; tp = cp = 1) reads the layout as
``(pp, dp, ep)`` with ``dp`` Megatron's expert-data-parallel size: expert weights are replicated only over the
expert-data-parallel group (the ranks with this rank's ``ep`` coordinate), so that group is SCOUT's peers, for the
dense recipes too (their weights are replicated over it as over the whole data-parallel group). Megatron flags expert
weights ``allreduce=False``: they lie on the ``ep`` dim, so a MoE layer, whose replay dispatches tokens with AllToAlls
over the expert-parallel group, replays on every rank or on none; the EP partners of a replaying rank replay their
own peer group's source inputs, the same in every peer group, so peers still compute the same thing. The dispatch
itself is verified by SCOUT's AllToAll check: pass :func:`moe_layers` to ``session.check_alltoall``. Refused with a
ConfigError: expert parallelism with tensor or context parallelism, and an expert TP size of its own.

Pipeline parallelism (``pipeline_model_parallel_size > 1``) goes through SCOUT's pipeline machinery: ``pp`` is the
topology's stage dim, so each rank replays its own stage's recipes, named by the stage (``pp0.embedding``,
``pp0.hidden.<i>`` on the first stage; ``pp1.hidden.<i>``, ``pp1.output`` — final norm and output layer, backward from
the loss's gradient — on the last), and every rank judges every stage's recipes over that stage's dp group. The
module paths are GPTModel's (``embedding``, ``decoder.layers``, ``decoder.final_layernorm``, ``output_layer``): named
on every stage, a stage skips those it does not hold. Virtual pipeline stages (``get_model`` returns one chunk per
virtual stage; Megatron's interleaved schedule gives the rank at pp coordinate ``c`` of ``n`` the virtual stages
``c, c + n, ...``) are ScoutConfig's ``stage_order="loop"``: each chunk's recipes are named by its own virtual stage
(``pp1``, ``pp3`` on coordinate 1 of 2). Refused with a ConfigError: ``stage_order="v"``, several chunks without
pipeline parallelism or other than ``virtual_pipeline_model_parallel_size``, ``ScoutConfig.mesh`` (the stages come
from parallel_state), and — as without pipelining — a custom ``order=``, ``data_parallel_dims``
and the ``optimizer`` recipe with a MegatronOptimizer (with a torch optimizer each stage slices its own parameters).

Megatron's RNG tracker is captured with every step and restored with it, and SCOUT's replays do not move it
(:mod:`~gemscout.adapters.megatron.rng_tracker`). Nothing here imports megatron at import time; ``parallel_state`` is
imported when a Megatron object was detected, i.e. when megatron is already loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from gemscout._modules import unwrap
from gemscout.adapters.classes import class_names
from gemscout.adapters.megatron.optimizer_view import MegatronOptimizerView
from gemscout.adapters.megatron.rng_tracker import (
    TrackerGuard,
    capture_rng_tracker,
    restore_rng_tracker,
)
from gemscout.adapters.megatron.topology import megatron_topology, moe_layers
from gemscout.adapters.target import Request, Target, with_framework_state
from gemscout.errors import ConfigError
from gemscout.topology import Topology

__all__ = [
    "MegatronParts",
    "megatron_topology",
    "moe_layers",
    "resolve_megatron",
]


# -- resolve ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class MegatronParts:
    """What ``enable_resiliency`` attaches to for a Megatron job."""

    model: nn.Module
    """The model chunk (or a ModuleList of the chunks)."""
    optimizer: Any
    """The torch optimizer, or a :class:`MegatronOptimizerView`."""
    extra_state_fn: Callable[[], Any]
    """Megatron's RNG tracker + the caller's extra state."""
    load_extra_state_fn: Callable[[Any], None]
    """The inverse of ``extra_state_fn``."""
    scout: Any
    """The ScoutConfig with Megatron's module paths filled in (None when SCOUT is off)."""
    topology: Topology | None
    """SCOUT's peers from parallel_state (None when SCOUT is off)."""
    schedulers: tuple[Any, ...] = ()
    """The caller's schedulers, each OptimizerParamScheduler in a ParamSchedulerReplay."""
    install_hooks: Callable[[], list[Any]] | None = None
    """Registers the adapter's own step hooks (the RNG tracker guard) and returns their handles; called right before
    the session registers its hooks, so these run first. The session removes them on close."""


_SCOUT_PATHS = {
    "embedding": "embedding",
    "blocks": "decoder.layers",
    "norm": "decoder.final_layernorm",
    "head": "output_layer",
}


def _model(model: Any) -> nn.Module:
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise ConfigError(
            "enable_resiliency.model: with Megatron Core pass the model (a MegatronModule) or the list "
            "of model chunks get_model() returned"
        )
    # Several chunks are held unwrapped: Megatron's DistributedDataParallel and Float16Module return their inner
    # module's state_dict (no "module." prefix) but a parent's load_state_dict recurses through them by attribute
    # ("0.module.embedding..."), so a list of wrapped chunks would save keys its own load refuses.
    return chunks[0] if len(chunks) == 1 else nn.ModuleList(unwrap(c) for c in chunks)


def _stage_paths(scout: Any, roots: Sequence[nn.Module]) -> dict[str, str]:
    """The module paths to fill on a pipeline stage: every field the caller left unset gets Megatron's path, present
    here or not. SCOUT's stage catalog skips a named path the stage does not hold (stage 0 has no ``output_layer``),
    whereas an unset field would send it looking for an ``nn.Embedding`` / ``nn.Linear`` elsewhere in the stage.
    The final norm is named only where a chunk holding the head has it (``post_layer_norm=False`` has none)."""
    fill = {
        field: path
        for field, path in _SCOUT_PATHS.items()
        if field != "norm" and getattr(scout, field) is None
    }
    head = scout.head or _SCOUT_PATHS["head"]
    names = [dict(root.named_modules()) for root in roots]
    if scout.norm is None and any(head in n and _SCOUT_PATHS["norm"] in n for n in names):
        fill["norm"] = _SCOUT_PATHS["norm"]
    if "blocks" in fill and any(
        fill["blocks"] in n and not isinstance(n[fill["blocks"]], nn.ModuleList) for n in names
    ):
        del fill["blocks"]
    return fill


def _scout_config(
    scout: Any, model: nn.Module, chunks: int, pp: int, vpp: int | None = None
) -> Any:
    """Megatron's module paths for the recipes SCOUT looks for (GPTModel's layout), unless the caller named them.

    ``chunks``: model chunks on this rank (virtual pipeline stages); ``pp``: pipeline_model_parallel_size; ``vpp``:
    parallel_state's virtual pipeline size (None when unset). Raises ConfigError for what SCOUT cannot map: several
    chunks without pipeline parallelism or other than the virtual pipeline size, ``stage_order="v"``, a
    ``ScoutConfig.mesh`` or ``data_parallel_dims`` (the layout comes from parallel_state)."""
    if scout.data_parallel_dims is not None:
        raise ConfigError(
            "ScoutConfig.data_parallel_dims: Megatron's data-parallel peers come from "
            "megatron.core.parallel_state, not a DeviceMesh; leave it unset"
        )
    if scout.mesh is not None:
        raise ConfigError(
            "ScoutConfig.mesh: under Megatron Core the pipeline stages come from "
            "megatron.core.parallel_state (pipeline_model_parallel_size); leave mesh unset"
        )
    if chunks > 1 and (pp == 1 or chunks != (vpp or 1)):
        raise ConfigError(
            f"enable_resiliency.model: {chunks} model chunks on this rank, but parallel_state has "
            f"pipeline_model_parallel_size={pp} and virtual_pipeline_model_parallel_size={vpp}; pass "
            "the list get_model() returned (one chunk per virtual stage) with the same settings"
        )
    if chunks > 1 and scout.stage_order != "loop":
        raise ConfigError(
            f"ScoutConfig.stage_order: Megatron's interleaved schedule places virtual stages in the "
            f"loop order (pp rank c of n holds stages c, c + n, ...), got {scout.stage_order!r}; "
            "leave stage_order='loop'"
        )
    if pp > 1:
        roots = list(model.children()) if chunks > 1 else [unwrap(model)]
        return replace(scout, **_stage_paths(scout, roots))
    root = unwrap(model)
    names = dict(root.named_modules())
    fill = {
        field: path
        for field, path in _SCOUT_PATHS.items()
        if getattr(scout, field) is None and path in names
    }
    if "blocks" in fill and not isinstance(names[fill["blocks"]], nn.ModuleList):
        del fill["blocks"]
    return replace(scout, **fill)


def resolve_megatron(
    model: Any,
    optimizer: Any,
    *,
    extra_state_fn: Callable[[], Any] | None,
    load_extra_state_fn: Callable[[Any], None] | None,
    schedulers: Sequence[Any],
    scout: Any,
    group: Any,
) -> MegatronParts:
    """Check ``enable_resiliency``'s arguments for Megatron Core and build what it attaches to.

    Raises ConfigError for an argument Megatron cannot take, naming it and the fix."""
    module = _model(model)
    chunks = (
        len(module) if isinstance(module, nn.ModuleList) and isinstance(model, list | tuple) else 1
    )
    view: Any
    if isinstance(optimizer, torch.optim.Optimizer):
        view = optimizer
    elif all(
        hasattr(optimizer, a) for a in ("step", "optimizer", "state_dict", "load_state_dict")
    ) and "MegatronOptimizer" in class_names(optimizer):
        view = MegatronOptimizerView(optimizer)
        if any(not isinstance(inner, torch.optim.Optimizer) for inner in view.inner):
            raise ConfigError(
                "enable_resiliency.optimizer: this MegatronOptimizer holds no torch optimizer on this "
                "rank (frozen sub-model?); gemscout needs one on every rank"
            )
    else:
        raise ConfigError(
            f"enable_resiliency.optimizer: with Megatron Core pass a torch.optim.Optimizer or the "
            f"MegatronOptimizer get_megatron_optimizer() returned, got {type(optimizer).__name__}"
        )
    from gemscout.adapters.megatron.scheduler import ParamSchedulerReplay

    # Megatron's OptimizerParamScheduler is stepped with an increment: a replay wrapper records it (see its module).
    replays = [
        ParamSchedulerReplay(s) for s in schedulers if "OptimizerParamScheduler" in class_names(s)
    ]
    wrapped = iter(replays)
    schedulers = tuple(
        next(wrapped) if "OptimizerParamScheduler" in class_names(s) else s for s in schedulers
    )
    if group is not None:
        raise ConfigError(
            "enable_resiliency.group: with Megatron Core SCOUT's peers come from "
            "megatron.core.parallel_state's data-parallel groups; leave group unset"
        )
    topology = None
    guard: TrackerGuard | None = None
    if scout is not None:
        from megatron.core import parallel_state as ps

        ready = ps.model_parallel_is_initialized()
        pp = ps.get_pipeline_model_parallel_world_size() if ready else 1
        vpp = ps.get_virtual_pipeline_model_parallel_world_size() if ready else None
        scout = _scout_config(scout, module, chunks, pp, vpp)
        if "optimizer" in scout.recipes and isinstance(view, MegatronOptimizerView):
            raise ConfigError(
                "ScoutConfig.recipes: the 'optimizer' recipe is not supported with a MegatronOptimizer "
                "(its main parameters are not the model's, and the distributed optimizer shards "
                "them); pass recipes=('embedding', 'hidden', 'output')"
            )
        topology = megatron_topology()
        guard = TrackerGuard()

    def install_hooks() -> list[Any]:
        handles: list[Any] = [r.install() for r in replays]
        if guard is not None:
            # Registered before the session's hooks, so they run first on both sides of the update (TrackerGuard).
            handles += [
                view.register_step_pre_hook(guard.before),
                view.register_step_post_hook(guard.after),
            ]
        return handles

    extra, load_extra = with_framework_state(
        "megatron",
        lambda: {"rng_tracker": capture_rng_tracker()},
        lambda saved: restore_rng_tracker(saved["rng_tracker"]),
        extra_state_fn,
        load_extra_state_fn,
    )

    return MegatronParts(
        model=module,
        optimizer=view,
        extra_state_fn=extra,
        load_extra_state_fn=load_extra,
        scout=scout,
        topology=topology,
        install_hooks=install_hooks,
        schedulers=schedulers,
    )


def adapt(model: Any, optimizer: Any, request: Request) -> Target:
    """The registry's entry point: Megatron Core model chunks and optimizer, with parallel_state's topology."""
    mc = resolve_megatron(
        model,
        optimizer,
        extra_state_fn=request.extra_state_fn,
        load_extra_state_fn=request.load_extra_state_fn,
        schedulers=request.schedulers,
        scout=request.scout,
        group=request.group,
    )
    # MegatronOptimizerView offers the optimizer interface the session, GEMINI and SCOUT use (see its docstring).
    return Target(
        framework="megatron",
        model=mc.model,
        optimizer=cast(torch.optim.Optimizer, mc.optimizer),
        extra_state_fn=mc.extra_state_fn,
        load_extra_state_fn=mc.load_extra_state_fn,
        schedulers=mc.schedulers,
        scout=mc.scout,
        scout_topology=mc.topology,
        install_hooks=mc.install_hooks,
    )

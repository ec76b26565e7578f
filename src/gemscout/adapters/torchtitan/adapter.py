"""TorchTitan: what GEMINI captures from a ``Trainer`` and where the step hooks go (written against torchtitan 0.3.0).

Pass the trainer itself: ``enable_resiliency(trainer, None, checkpoint=...)`` after ``Trainer(config)`` and before
``trainer.train()``. The adapter reads the trainer's public attributes:

- ``model_parts`` (one module per pipeline stage on this rank): one part is used as is, several are held in an
  ``nn.ModuleList``; FSDP2 / TP parameters are DTensors, captured as this rank's local shards;
- ``optimizers`` (an ``OptimizersContainer``, a ``torch.optim.Optimizer`` subclass whose ``step()`` steps every
  part's optimizer): its step hooks fire once per ``train_step``; its state is taken from the optimizers inside, in
  torch's own format (:class:`~gemscout.adapters.torchtitan.optimizers.OptimizersView`), not from the container's
  ``state_dict()`` (which builds a flattened distributed state dict, FQN-keyed, meant for DCP);
- ``lr_schedulers`` (``LRSchedulersContainer``): stepped by ``train_step`` right after the optimizers, so it is
  captured like any scheduler the loop steps after the update and advanced once on restore;
- caller state: ``trainer.step`` (incremented *before* ``train_step``, so in the post-hook it is the step just
  taken), ``trainer.ntokens_seen`` and the dataloader's ``state_dict()`` (a ``StatefulDataLoader``; bytes it holds
  are stored as uint8 tensors), plus the caller's own extra state;
- ``parallel_dims``: SCOUT reads its peers from the parameters' DeviceMesh (``fully_shard`` dims are data-parallel;
  :mod:`gemscout.adapters.torchtitan.topology`); with DDP x TP (``dp_replicate`` > 1 without ``dp_shard``) the
  replicate dim is named for it;
- pipeline parallelism (``pp`` > 1): ``pp`` is SCOUT's stage dim
  (:func:`~gemscout.adapters.torchtitan.topology.pipeline_topology`), recipe names carry the stage
  (``pp1.hidden.0``), the first stage replays its embedding and blocks, the last its blocks (and its norm + head,
  unless the loss applies the head in chunks: ChunkedLossWrapper, whose ``_skip_lm_head`` turns the output recipe
  off, as without PP); ``ScoutConfig.stage_order`` is set from the schedule's stages. Refused for SCOUT, with the
  reason: PP x TP and PP x CP (not validated) and expert parallelism; GEMINI covers all of them.

Nothing here imports torchtitan. A real ``Trainer`` runs on CPU only through the test-only shims of
qualification/frameworks/torchtitan_cpu.py (tests/distributed/test_torchtitan_cpu.py); GPU: tests/gpu/test_torchtitan.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from gemscout.adapters.target import Request, Target, with_framework_state
from gemscout.adapters.torchtitan.optimizers import OptimizersView, _from_storable, _to_storable
from gemscout.adapters.torchtitan.topology import (
    _stage_order,
    param_mesh_topology,
    pipeline_topology,
)
from gemscout.errors import ConfigError
from gemscout.topology import Topology

__all__ = ["TrainerParts", "resolve_trainer"]

log = logging.getLogger("gemscout")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerParts:
    """What ``enable_resiliency`` attaches to for a TorchTitan trainer."""

    model: nn.Module
    optimizer: OptimizersView
    extra_state_fn: Callable[[], Any]
    load_extra_state_fn: Callable[[Any], None]
    schedulers: tuple[Any, ...]
    scout: Any
    topology: Topology | None = None
    """SCOUT's peers when they cannot be read from the parameters' root mesh (see :func:`param_mesh_topology`)."""


def _model(trainer: Any) -> nn.Module:
    parts = list(getattr(trainer, "model_parts", None) or [])
    if not parts or not all(isinstance(p, nn.Module) for p in parts):
        raise ConfigError(
            "enable_resiliency.model: a TorchTitan Trainer is accepted once built (its __init__ sets "
            "model_parts); this one has no model_parts — call enable_resiliency after Trainer(config)"
        )
    return parts[0] if len(parts) == 1 else nn.ModuleList(parts)


def _scout_config(scout: Any, dims: Any, parts: int, model_skips_head: bool = False) -> Any:
    pp = int(getattr(dims, "pp", 1))
    if parts > 1 and pp == 1:
        raise ConfigError(
            f"enable_resiliency.model: the trainer has {parts} model_parts but parallel_dims.pp is 1; "
            "SCOUT reads several model parts as pipeline stages only"
        )
    if int(getattr(dims, "ep", 1)) > 1:
        raise ConfigError(
            "enable_resiliency.scout: SCOUT under TorchTitan expert parallelism is not supported yet; "
            "pass scout=None"
        )
    if pp > 1:
        other = {name: int(getattr(dims, name, 1)) for name in ("tp", "cp")}
        if any(size > 1 for size in other.values()):
            raise ConfigError(
                f"enable_resiliency.scout: SCOUT under TorchTitan pipeline parallelism is validated with "
                f"data parallelism only (dp_shard / dp_replicate); this trainer also has "
                f"{', '.join(f'{k}={v}' for k, v in other.items() if v > 1)}: pass scout=None (GEMINI "
                "covers every stage)"
            )
    if scout.recipes and model_skips_head:
        # ChunkedLossWrapper (the llama3 configs' loss): the model's forward stops before lm_head and the loss applies
        # the head to sequence chunks after it, so no forward of the recipe (norm + head) on one input exists.
        log.info(
            "gemscout: SCOUT's output recipe is off under TorchTitan's ChunkedLossWrapper (the head runs on "
            "sequence chunks inside the loss)"
        )
        scout = replace(scout, recipes=tuple(r for r in scout.recipes if r != "output"))
    replicate_only = (
        int(getattr(dims, "dp_replicate", 1)) > 1 and int(getattr(dims, "dp_shard", 1)) == 1
    )
    if scout.data_parallel_dims is None and replicate_only and int(getattr(dims, "tp", 1)) > 1:
        return replace(
            scout, data_parallel_dims=("dp_replicate",)
        )  # DDP x TP: no fully_shard names the dp dim
    return scout


def resolve_trainer(
    trainer: Any,
    optimizer: Any,
    *,
    extra_state_fn: Callable[[], Any] | None,
    load_extra_state_fn: Callable[[Any], None] | None,
    schedulers: Sequence[Any],
    scout: Any,
    group: Any,
) -> TrainerParts:
    """Check ``enable_resiliency``'s arguments for a TorchTitan trainer and build what it attaches to.

    Raises ConfigError for an argument a trainer cannot take, naming it and the fix."""
    model = _model(trainer)
    container = trainer.optimizers
    if optimizer is not None and optimizer is not container:
        raise ConfigError(
            f"enable_resiliency.optimizer: with a TorchTitan Trainer pass None (or trainer.optimizers); "
            f"got a {type(optimizer).__name__}"
        )
    if not isinstance(container, torch.optim.Optimizer) or not hasattr(container, "optimizers"):
        raise ConfigError(
            "enable_resiliency.model: trainer.optimizers is not an OptimizersContainer of torch "
            "optimizers (optimizers-in-backward is not supported); use the default container"
        )
    if schedulers:
        raise ConfigError(
            "enable_resiliency.schedulers: trainer.lr_schedulers is stepped by train_step and captured "
            "by the TorchTitan adapter; leave schedulers empty"
        )
    if group is not None:
        raise ConfigError(
            "enable_resiliency.group: with a TorchTitan Trainer SCOUT's peers come from the model's "
            "DeviceMesh (trainer.parallel_dims); leave group unset"
        )
    dims = trainer.parallel_dims
    topology = None
    if scout is not None:
        skips_head = bool(getattr(trainer.model_parts[-1], "_skip_lm_head", False))
        scout = _scout_config(scout, dims, len(trainer.model_parts), skips_head)
        if int(getattr(dims, "pp", 1)) > 1:
            topology = pipeline_topology(model, dims, scout.data_parallel_dims)
            scout = replace(
                scout, stage_order=_stage_order(trainer, topology, len(trainer.model_parts))
            )
        else:
            topology = param_mesh_topology(model, scout.data_parallel_dims)
    if getattr(getattr(getattr(trainer, "config", None), "checkpoint", None), "enable", False):
        log.warning(
            "gemscout: TorchTitan's own checkpointing is enabled; Trainer.train() loads its newest DCP "
            "checkpoint at start, which would replace the step gemscout restored"
        )
    loader = trainer.dataloader

    def save() -> dict[str, Any]:
        # ntokens_seen exists from torchtitan 0.3.0 on; earlier trainers count only steps.
        return {
            "step": int(trainer.step),
            "ntokens_seen": getattr(trainer, "ntokens_seen", None),
            "dataloader": _to_storable(loader.state_dict()),
        }

    def load(titan: dict[str, Any]) -> None:
        trainer.step = int(titan["step"])
        if titan["ntokens_seen"] is not None:
            trainer.ntokens_seen = int(titan["ntokens_seen"])
        loader.load_state_dict(_from_storable(titan["dataloader"]))

    extra, load_extra = with_framework_state(
        "titan", save, load, extra_state_fn, load_extra_state_fn
    )

    return TrainerParts(
        model=model,
        optimizer=OptimizersView(container),
        extra_state_fn=extra,
        load_extra_state_fn=load_extra,
        schedulers=(trainer.lr_schedulers,),
        scout=scout,
        topology=topology,
    )


def adapt(trainer: Any, optimizer: Any, request: Request) -> Target:
    """The registry's entry point: a TorchTitan Trainer becomes its model parts, optimizers and schedulers."""
    tt = resolve_trainer(
        trainer,
        optimizer,
        extra_state_fn=request.extra_state_fn,
        load_extra_state_fn=request.load_extra_state_fn,
        schedulers=request.schedulers,
        scout=request.scout,
        group=request.group,
    )
    return Target(
        framework="torchtitan",
        model=tt.model,
        optimizer=cast(torch.optim.Optimizer, tt.optimizer),
        extra_state_fn=tt.extra_state_fn,
        load_extra_state_fn=tt.load_extra_state_fn,
        schedulers=tt.schedulers,
        scout=tt.scout,
        scout_topology=tt.topology,
    )

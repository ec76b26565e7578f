"""TorchTitan: what GEMINI captures from a ``Trainer`` and where the step hooks go (written against torchtitan 0.3.0).

Pass the trainer itself: ``enable_resiliency(trainer, None, checkpoint=...)`` after ``Trainer(config)`` and before
``trainer.train()``. The adapter reads the trainer's public attributes:

- ``model_parts`` (one module per pipeline stage on this rank): one part is used as is, several are held in an
  ``nn.ModuleList``; FSDP2 / TP parameters are DTensors, captured as this rank's local shards;
- ``optimizers`` (an ``OptimizersContainer``, a ``torch.optim.Optimizer`` subclass whose ``step()`` steps every
  part's optimizer): its step hooks fire once per ``train_step``; its state is taken from the optimizers inside, in
  torch's own format (:class:`OptimizersView`), not from the container's ``state_dict()`` (which builds a flattened
  distributed state dict, FQN-keyed, meant for DCP);
- ``lr_schedulers`` (``LRSchedulersContainer``): stepped by ``train_step`` right after the optimizers, so it is
  captured like any scheduler the loop steps after the update and advanced once on restore;
- caller state: ``trainer.step`` (incremented *before* ``train_step``, so in the post-hook it is the step just
  taken), ``trainer.ntokens_seen`` and the dataloader's ``state_dict()`` (a ``StatefulDataLoader``; bytes it holds
  are stored as uint8 tensors), plus the caller's own extra state;
- ``parallel_dims``: SCOUT reads its peers from the parameters' DeviceMesh (``fully_shard`` dims are data-parallel);
  with DDP x TP (``dp_replicate`` > 1 without ``dp_shard``) the replicate dim is named for it. TorchTitan 0.3.0 builds
  every named mesh (``fsdp``, ``dp_replicate``, ``tp`` ...) by unflattening one 1-D ``world`` mesh, so the parameters'
  mesh is not a slice of its root and SCOUT cannot read the data-parallel dims from the root: when the parameters
  share one mesh that holds those dims (FSDP, HSDP), SCOUT's topology is that mesh (:func:`param_mesh_topology`);
- pipeline parallelism (``pp`` > 1): SCOUT's topology is ``parallel_dims``' mesh over ``pp`` and the parameters'
  dims (``("pp", "fsdp")``, or ``("pp", "dp_replicate", "fsdp")`` with ``dp_replicate`` > 1), with ``pp`` as the
  stage dim (:func:`pipeline_topology`): peers vary along the data-parallel dims only and keep their stage, recipe
  names carry the stage (``pp1.hidden.0``), the first stage replays its embedding and blocks, the last its blocks
  (and its norm + head, unless the loss applies the head in chunks: ChunkedLossWrapper, whose ``_skip_lm_head``
  turns the output recipe off, as without PP). Several ``model_parts`` are named by their own stages, in the order
  the schedule's stages say (``ScoutConfig.stage_order`` is set from it: ``"loop"`` for Interleaved1F1B, run on
  CPU; ``"v"`` for ZBV / DualPipeV, read the same way, not run). Without a data-parallel dim (``pp`` alone) SCOUT
  has no peers and says so (every verdict INCONCLUSIVE). Refused for SCOUT, with the reason: PP x TP and PP x CP
  (not validated) and expert parallelism; GEMINI covers all of them.

Nothing here imports torchtitan. A real ``Trainer`` runs on CPU only through the test-only shims of
qualification/frameworks/torchtitan_cpu.py (tests/distributed/test_torchtitan_cpu.py); GPU: tests/gpu/test_torchtitan.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from gemscout.adapters._optim_view import InnerOptimizers
from gemscout.adapters.target import Request, Target
from gemscout.errors import ConfigError
from gemscout.topology import Topology
from gemscout.topology_discovery import from_mesh, fsdp_data_dims

__all__ = [
    "OptimizersView",
    "TrainerParts",
    "param_mesh_topology",
    "pipeline_topology",
    "resolve_trainer",
]

log = logging.getLogger("gemscout")


def _to_storable(value: Any) -> Any:
    """The dataloader state with ``bytes`` (StatefulDataLoader pickles its worker state) as uint8 tensors."""
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": torch.frombuffer(bytearray(value), dtype=torch.uint8).clone()}
    if isinstance(value, dict):
        return {k: _to_storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_storable(v) for v in value)
    return value


def _from_storable(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__bytes__"}:
        return bytes(value["__bytes__"].numpy().tobytes())
    if isinstance(value, dict):
        return {k: _from_storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_from_storable(v) for v in value)
    return value


class OptimizersView(InnerOptimizers):
    """An ``OptimizersContainer`` as gemscout sees it: the container's own step hooks, and the state of the torch
    optimizers inside in torch's format, their parameters numbered in order across all of them (what
    ``param_groups`` lists)."""

    def __init__(self, container: Any) -> None:
        self.container = container
        self.inner: list[torch.optim.Optimizer] = list(container.optimizers)
        classes = {type(opt) for opt in self.inner}
        # SCOUT's optimizer recipe replays one update in a private optimizer of the class that did it: the inner one.
        self.replay_class: type[torch.optim.Optimizer] | None = (
            classes.pop() if len(classes) == 1 else None
        )

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self.container.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self.container.register_step_post_hook(hook)

    def state_dict(self) -> dict[str, Any]:
        """One torch-format state dict over every inner optimizer (indices offset per optimizer)."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.inner:
            sd = opt.state_dict()
            state.update({offset + int(i): s for i, s in sd["state"].items()})
            groups += [
                {**g, "params": [offset + int(i) for i in g["params"]]} for g in sd["param_groups"]
            ]
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Split a :meth:`state_dict` back over the inner optimizers and load each (torch copies every tensor)."""
        groups, offset, g = state["param_groups"], 0, 0
        for opt in self.inner:
            count = sum(len(group["params"]) for group in opt.param_groups)
            mine = groups[g : g + len(opt.param_groups)]
            g += len(opt.param_groups)
            opt.load_state_dict(
                {
                    "state": {
                        int(i) - offset: s
                        for i, s in state["state"].items()
                        if offset <= int(i) < offset + count
                    },
                    "param_groups": [
                        {**group, "params": [int(i) - offset for i in group["params"]]}
                        for group in mine
                    ],
                }
            )
            offset += count


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


def _one_param_mesh(model: nn.Module) -> Any:
    """The one DeviceMesh every DTensor parameter of ``model`` lives on, or None (plain parameters, several meshes)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    meshes = {
        (
            tuple(p.device_mesh.mesh_dim_names or ()),
            tuple(p.device_mesh.mesh.flatten().tolist()),
        ): p.device_mesh
        for p in params
    }
    return next(iter(meshes.values())) if len(meshes) == 1 else None


def _data_and_shard_dims(
    model: nn.Module, names: Sequence[str], data_dims: Sequence[str] | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The data-parallel dims (``data_dims``, else every ``fully_shard`` mesh's) and those some parameter is sharded
    over, among ``names`` (the parameters' mesh dims)."""
    from torch.distributed.tensor import DTensor

    data = tuple(data_dims) if data_dims is not None else tuple(sorted(fsdp_data_dims(model) or ()))
    sharded = {
        n
        for p in model.parameters()
        if isinstance(p, DTensor)
        for n, pl in zip(names, p.placements, strict=True)
        if not pl.is_replicate()
    }
    return data, tuple(sorted(sharded & set(data)))


def param_mesh_topology(model: nn.Module, data_dims: Sequence[str] | None) -> Topology | None:
    """SCOUT's topology from the one DeviceMesh every DTensor parameter lives on, when that mesh is not its own root
    (TorchTitan 0.3.0 unflattens its named meshes from a 1-D ``world`` mesh) and holds the data-parallel dims
    (``data_dims``, else the dims of every ``fully_shard`` module's mesh). None otherwise: SCOUT then reads the model
    itself (plain parameters, a mesh that is its own root), as for any PyTorch model."""
    mesh = _one_param_mesh(model)
    if mesh is None:
        return None  # plain parameters, or several meshes (TP beside FSDP): SCOUT's own reading decides
    names = tuple(mesh.mesh_dim_names or ())
    if not names or mesh._get_root_mesh() is mesh:
        return None
    data, sharded = _data_and_shard_dims(model, names, data_dims)
    if not data or not set(data) <= set(names):
        return None
    return from_mesh(mesh, data_dims=data, shard_dims=sharded)


def pipeline_topology(model: nn.Module, dims: Any, data_dims: Sequence[str] | None) -> Topology:
    """SCOUT's topology under TorchTitan pipeline parallelism: ``parallel_dims``' mesh over ``pp`` and the dims of
    the one mesh the stage's FSDP2 parameters live on, ``pp`` its stage dim. TorchTitan unflattens ``pp`` and those
    dims from the same ``world`` mesh, so ``dims.get_optional_mesh(["pp", ...])`` is that layout over every rank;
    the parameters' own mesh is this stage's slice of it. Data-parallel dims whose sizes multiply to 1 (``pp``
    alone: FSDP2 over one rank) are none: SCOUT then has no peers (every verdict INCONCLUSIVE with the reason).

    Raises ConfigError when the parameters are not DTensors on one mesh (TorchTitan applies ``fully_shard`` to every
    stage) or when that mesh and ``pp`` do not cover every rank."""
    mesh = _one_param_mesh(model)
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    if mesh is None or not names or "pp" in names:
        raise ConfigError(
            "enable_resiliency.scout: SCOUT under TorchTitan pipeline parallelism reads each stage's "
            "peers from its FSDP2 parameters (DTensors on one data-parallel mesh); these model_parts' "
            "parameters are not: keep TorchTitan's fully_shard of every stage, or pass scout=None"
        )
    try:
        full = dims.get_optional_mesh(["pp", *names], include_singleton_axes=True)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"enable_resiliency.scout: SCOUT could not read the pipeline mesh ('pp' x {list(names)}) "
            f"from trainer.parallel_dims ({exc}); pass scout=None"
        ) from None
    world = int(getattr(dims, "world_size", full.mesh.numel() if full is not None else 0))
    if (
        full is None
        or tuple(full.mesh_dim_names or ()) != ("pp", *names)
        or full.mesh.numel() != world
    ):
        raise ConfigError(
            f"enable_resiliency.scout: the pipeline mesh 'pp' x {list(names)} does not cover the "
            f"{world} ranks of this TorchTitan job; SCOUT supports PP with data parallelism only: "
            "pass scout=None"
        )
    data, sharded = _data_and_shard_dims(model, names, data_dims)
    if not set(data) <= set(names):
        raise ConfigError(
            f"ScoutConfig.data_parallel_dims: {sorted(set(data) - set(names))} are not dims of the "
            f"stage parameters' mesh {list(names)}"
        )
    if math.prod(full.mesh.shape[1 + names.index(d)] for d in data) == 1:
        # Pipeline only (FSDP2 over one rank per stage): no rank holds another's stage, so no peers.
        return from_mesh(full["pp"], data_dims=(), stage_dims=("pp",))
    return from_mesh(full, data_dims=data, shard_dims=sharded, stage_dims=("pp",))


def _stage_order(trainer: Any, topology: Topology, parts: int) -> str:
    """``"loop"`` or ``"v"``: the order of this rank's stages in ``model_parts``, read from the schedule's stages
    (``stage_index``; TorchTitan builds ``model_parts`` in the same order), else from its class (ZBV, DualPipeV:
    ``"v"``). Raises ConfigError when the stages follow neither order."""
    schedule = getattr(trainer, "pp_schedule", None)
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    indices = [getattr(s, "stage_index", None) for s in stages]
    if len(indices) != parts or any(type(i) is not int for i in indices):
        return (
            "v"
            if type(schedule).__name__ in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
            else "loop"
        )
    held = tuple(f"pp{i}" for i in indices)
    for order in ("loop", "v"):
        if (order == "loop" or parts == 2) and topology.chunk_labels(parts, order) == held:
            return order
    raise ConfigError(
        f"enable_resiliency.scout: this rank holds pipeline stages {list(indices)}, neither the looped "
        f"nor the V order SCOUT names stages by ({list(topology.chunk_labels(parts, 'loop'))}); "
        "pass scout=None"
    )


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

    def extra() -> dict[str, Any]:
        # ntokens_seen exists from torchtitan 0.3.0 on; earlier trainers count only steps.
        return {
            "titan": {
                "step": int(trainer.step),
                "ntokens_seen": getattr(trainer, "ntokens_seen", None),
                "dataloader": _to_storable(loader.state_dict()),
            },
            "caller": extra_state_fn() if extra_state_fn else None,
        }

    def load_extra(state: dict[str, Any]) -> None:
        titan = state["titan"]
        trainer.step = int(titan["step"])
        if titan["ntokens_seen"] is not None:
            trainer.ntokens_seen = int(titan["ntokens_seen"])
        loader.load_state_dict(_from_storable(titan["dataloader"]))
        if load_extra_state_fn is not None and state["caller"] is not None:
            load_extra_state_fn(state["caller"])

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

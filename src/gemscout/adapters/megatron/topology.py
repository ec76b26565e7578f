"""SCOUT's view of a Megatron Core job's layout, read from ``megatron.core.parallel_state``: the mesh, the peers (the
data-parallel group, or the expert-data-parallel group under expert parallelism) and the MoE layers whose token
dispatch the AllToAll check records. Imported by :mod:`gemscout.adapters.megatron.adapter`; megatron is imported only inside
the functions, from the job that already runs it."""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist
from torch import nn

from gemscout.adapters.classes import class_names
from gemscout.errors import ConfigError
from gemscout.topology import PlacementFlag, Topology, derive

__all__ = ["MEGATRON_PLACEMENT_FLAGS", "megatron_topology", "moe_layers"]

MEGATRON_PLACEMENT_FLAGS = (
    PlacementFlag("tensor_model_parallel", True, "tp"),
    PlacementFlag("allreduce", False, "ep"),
)
"""How Megatron Core marks its plain-tensor shards: ``tensor_model_parallel=True`` on a TP shard (ColumnParallel /
RowParallel linears, the vocab-parallel embedding; its module all-reduces over the TP group, the topology's ``tp``
dim) and ``allreduce=False`` on an expert weight under expert parallelism (its layer dispatches tokens with AllToAlls
over ``ep``). Megatron sets ``tensor_model_parallel=False`` on replicated tensors, and only the bool counts."""


def megatron_topology(rank: int | None = None) -> Topology:
    """This rank's SCOUT topology from ``megatron.core.parallel_state``: mesh ``(pp, dp, cp, tp)``, peers along dp.
    With ``pipeline_model_parallel_size > 1``, ``pp`` is the topology's stage dim (``stage_label`` ``pp<c>``).

    Expert parallelism (``expert_model_parallel_size > 1``, tp = cp = 1): mesh ``(pp, dp, ep)`` with ``dp`` the
    expert-data-parallel size, so peers are Megatron's expert-data-parallel group (the ranks holding the same experts;
    dense weights are replicated over them too) and ``ep`` is a model dim along which a MoE layer's replay runs its
    AllToAlls (expert weights are flagged ``allreduce=False``: :data:`MEGATRON_PLACEMENT_FLAGS`).

    Raises ConfigError when model parallelism is not initialised, for expert parallelism combined with tensor or
    context parallelism or with an expert TP size of its own, and when the live data-parallel (or expert) groups are
    not the ones the default order ``tp-cp-ep-dp-pp`` gives (a custom ``order=``)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise ConfigError(
            "Megatron: call megatron.core.parallel_state.initialize_model_parallel(...) before "
            "enable_resiliency; SCOUT reads its data-parallel groups"
        )
    rank = dist.get_rank() if rank is None else rank
    world = dist.get_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    sizes = {
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
    }
    etp = ps.get_expert_tensor_parallel_world_size()
    if etp not in (None, sizes["tp"]) or (ep > 1 and (sizes["tp"] > 1 or sizes["cp"] > 1)):
        experts = {
            "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": etp,
            "tensor_model_parallel_size": sizes["tp"],
            "context_parallel_size": sizes["cp"],
        }
        raise ConfigError(
            f"Megatron: SCOUT does not support this expert layout yet ({experts}): it supports expert "
            "parallelism with tensor_model_parallel_size=1 and context_parallel_size=1 (peers: the "
            "expert-data-parallel group), and an expert TP size only equal to the TP size; pass "
            "scout=None (GEMINI alone works) or initialize_model_parallel with such a layout"
        )
    if ep > 1:
        sizes = {"pp": sizes["pp"], "dp": ps.get_expert_data_parallel_world_size(), "ep": ep}
    if math.prod(sizes.values()) != world:
        raise ConfigError(
            f"Megatron: parallel sizes {sizes} do not multiply to the world size {world}"
        )
    dims = tuple(d for d in sizes if d == "dp" or sizes[d] > 1)
    # pp is a stage dim: ranks at other pp coordinates hold other layers, so peers keep it and recipe names carry it.
    topology = derive(
        dims=dims,
        shape=[sizes[d] for d in dims],
        ranks=range(world),
        data_dims=("dp",),
        shard_dims=(),
        rank=rank,
        stage_dims=("pp",) if "pp" in dims else (),
        placement_flags=MEGATRON_PLACEMENT_FLAGS,
    )
    live = {
        "data-parallel": ps.get_expert_data_parallel_group()
        if ep > 1
        else ps.get_data_parallel_group()
    }
    expect = {"data-parallel": topology.peers}
    if ep > 1:
        live["expert-model-parallel"] = ps.get_expert_model_parallel_group()
        expect["expert-model-parallel"] = topology.group_of(rank, ("ep",))
    for name, group in live.items():
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        if ranks != tuple(sorted(expect[name])):
            kind = f"expert-{name}" if ep > 1 and name == "data-parallel" else name
            raise ConfigError(
                f"Megatron: the {kind} group of rank {rank} is {list(ranks)}, but the default order "
                f"tp-cp-ep-dp-pp gives {sorted(expect[name])}; initialize_model_parallel with the "
                "default order (or leave scout unset)"
            )
    return topology


def moe_layers(model: Any) -> list[nn.Module]:
    """Every Megatron ``MoELayer`` of ``model`` (a module or a list of chunks), in module order: what
    ``session.check_alltoall`` records the token dispatch of (the alltoall dispatcher calls ``all_to_all_single``
    inside the layer's forward)."""
    chunks = list(model) if isinstance(model, list | tuple) else [model]
    return [m for chunk in chunks for m in chunk.modules() if "MoELayer" in class_names(m)]

"""Reading a job's :class:`~gemscout.topology.Topology` off live objects: the DeviceMesh a model's DTensor parameters
live on, the meshes its ``fully_shard`` modules were built over, and the gloo groups SCOUT compares over.

:mod:`gemscout.topology` holds the rule (which dims are data-parallel, who the peers are); this module feeds it what a
running job has. Which dims are data-parallel comes from ``fully_shard``: the dims of every FSDP module's mesh. A mesh
used without FSDP (DDP over a sub-mesh, a hand-written TP + DP layout) needs ``ScoutConfig.data_parallel_dims``.

:func:`discover` reads the model, :func:`from_mesh` an explicit mesh, and :func:`create_groups` makes the gloo groups
(collective: every rank creates every group in the same order).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from gemscout._tensors import is_dtensor
from gemscout.errors import ConfigError
from gemscout.topology import Topology, derive

__all__ = [
    "create_groups",
    "discover",
    "fsdp_data_dims",
    "from_mesh",
    "has_dtensor_params",
    "mesh_dims",
]


UNNAMED_DIM = "dp"


def mesh_dims(mesh: Any) -> tuple[str, ...]:
    """The dim names of ``mesh``. A 1-D mesh without names is labelled ``("dp",)``: it is what ``fully_shard(model)``
    builds when it is given no mesh. :func:`discover` accepts that label only when ``fully_shard`` is what shards
    along the mesh (an unnamed 1-D mesh under TP stays refused). Raises ``ConfigError`` for an unnamed n-D mesh."""
    names = mesh.mesh_dim_names
    if names:
        return tuple(names)
    if mesh.ndim == 1:
        return (UNNAMED_DIM,)
    raise ConfigError(
        "SCOUT needs named mesh dims to find the data-parallel ones: build the mesh with "
        "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
    )


def _mesh_facts(mesh: Any) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    return (
        mesh_dims(mesh),
        tuple(mesh.mesh.shape),
        tuple(int(r) for r in mesh.mesh.flatten().tolist()),
    )


def from_mesh(
    mesh: Any,
    *,
    data_dims: Sequence[str],
    shard_dims: Sequence[str] = (),
    rank: int | None = None,
    stage_dims: Sequence[str] = (),
) -> Topology:
    """The topology of an explicit DeviceMesh: ``data_dims`` name the data-parallel dims, ``shard_dims`` those of
    them over which parameters are sharded, ``stage_dims`` the pipeline dims. Raises ``ConfigError`` for a name that
    is not a mesh dim."""
    names, shape, ranks = _mesh_facts(mesh)
    for field, value in (
        ("data_dims", data_dims),
        ("shard_dims", shard_dims),
        ("stage_dims", stage_dims),
    ):
        unknown = [d for d in value if d not in names]
        if unknown:
            raise ConfigError(
                f"SCOUT topology: {field} {unknown} are not dims of the mesh {list(names)}"
            )
    return derive(
        dims=names,
        shape=shape,
        ranks=ranks,
        data_dims=data_dims,
        shard_dims=shard_dims,
        rank=dist.get_rank() if rank is None else rank,
        stage_dims=stage_dims,
    )


def has_dtensor_params(model: nn.Module) -> bool:
    """True when some parameter of ``model`` is a DTensor (FSDP2, TP: the model lives on a DeviceMesh)."""
    return any(is_dtensor(p) for p in model.parameters())


def fsdp_data_dims(model: nn.Module) -> set[str] | None:
    """The dim names of every ``fully_shard`` module's mesh, or None when the model has no FSDP module.

    FSDP2 keeps its mesh on the module state; that attribute path is not public API, so a change in torch raises a
    ConfigError that says how to name the dims by hand instead of guessing."""
    from torch.distributed.fsdp import FSDPModule

    found: set[str] | None = None
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            groups = module._get_fsdp_state()._fsdp_param_groups
            meshes = [group.mesh_info.mesh for group in groups]
        except AttributeError as exc:
            raise ConfigError(
                "SCOUT could not read the mesh of a fully_shard module from this torch version "
                f"({exc}); set ScoutConfig.data_parallel_dims to the data-parallel mesh dim "
                "names"
            ) from None
        found = found if found is not None else set()
        for mesh in meshes:
            found.update(mesh_dims(mesh))
    return found


def discover(
    model: nn.Module,
    *,
    data_dims: Sequence[str] | None = None,
    rank: int | None = None,
    mesh: Any = None,
) -> Topology | None:
    """The topology of ``model`` from its DTensor parameters, or None when it has none (DDP or a plain module:
    every rank is a replica, the classic case).

    ``mesh``: the DeviceMesh of a pipeline stage (``ScoutConfig.mesh``). With plain parameters its ``data_dims``
    are the data-parallel dims (none: a pure pipeline, no peers) and every other dim is a stage dim. With DTensor
    parameters (a stage ``fully_shard``ed over ``dp``, or TP-sharded) it must be their root mesh, and its stage dims
    are the model dims no parameter is placed on (``pp``). Raises ``ConfigError`` when it is another mesh.

    ``data_dims``: the data-parallel mesh dim names; None derives them from ``fully_shard`` (the dims of every FSDP
    module's mesh; none at all when the model has no FSDP module, e.g. pure TP). Raises ``ConfigError`` when the
    parameters live on different root meshes, a mesh dim is unnamed, or a named data dim is not on the mesh.
    """
    from torch.distributed.tensor import DTensor

    root = None
    sharded: set[str] = set()
    placements = []
    unnamed = False
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        param_mesh = param.device_mesh
        unnamed = unnamed or not param_mesh.mesh_dim_names
        this_root = param_mesh._get_root_mesh()
        if root is None:
            root = this_root
        elif this_root is not root and _mesh_facts(this_root) != _mesh_facts(root):
            raise ConfigError(
                f"SCOUT: parameter {name!r} lives on another device mesh than the others; one mesh "
                "per model is supported"
            )
        names, _, _ = _mesh_facts(param_mesh)
        placements.append((names, param.placements))
    if mesh is not None and root is None:
        names, _, _ = _mesh_facts(mesh)
        data = tuple(data_dims or ())
        return from_mesh(
            mesh, data_dims=data, rank=rank, stage_dims=[d for d in names if d not in data]
        )
    if root is None:
        return None
    if mesh is not None and _mesh_facts(mesh) != _mesh_facts(root):
        raise ConfigError(
            f"ScoutConfig.mesh {list(_mesh_facts(mesh)[0])} is not the mesh the model's DTensor "
            f"parameters live on ({list(_mesh_facts(root)[0])}): pass the root mesh the stage was "
            "sharded from, or leave ScoutConfig.mesh unset"
        )
    if data_dims is None:
        found = fsdp_data_dims(model)
        data_dims = tuple(sorted(found)) if found else ()
    if unnamed and UNNAMED_DIM not in data_dims:
        # An unnamed 1-D mesh that fully_shard does not shard along (TP, say): its dim is no data-parallel dim, and
        # the label would make SCOUT compare shards that differ by design.
        raise ConfigError(
            "SCOUT needs named mesh dims to find the data-parallel ones: build the mesh with "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    for names, kinds in placements:
        sharded.update(
            n for n, p in zip(names, kinds, strict=True) if not p.is_replicate() and n in data_dims
        )
    # Sharded pipeline stages (FSDP2 or TP inside each stage): the dims no parameter lives on are the stage dims.
    used = {n for names, _ in placements for n in names}
    stages = (
        [d for d in _mesh_facts(root)[0] if d not in used and d not in data_dims]
        if mesh is not None
        else []
    )
    return from_mesh(
        root, data_dims=data_dims, shard_dims=sorted(sharded), rank=rank, stage_dims=stages
    )


def create_groups(
    topology: Topology, timeout: timedelta
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Create SCOUT's gloo groups for ``topology``: (the domain — every mesh rank —, this rank's peer group).

    Collective over the default group: every rank calls it with an equal topology, and every rank creates every
    group in the same order (``new_group`` must be called by all ranks, members or not). With a single peer group
    over the whole domain the two are the same group. Raises ``ConfigError`` when the mesh does not cover every rank
    of the default group.
    """
    world = dist.get_world_size()
    if sorted(topology.ranks) != list(range(world)):
        raise ConfigError(
            f"SCOUT needs one device mesh over every rank: the mesh holds {sorted(topology.ranks)}, "
            f"the job has {world} ranks"
        )
    domain = dist.new_group(backend="gloo", timeout=timeout)
    groups = topology.peer_groups
    if len(groups) == 1:
        return domain, domain
    mine = None
    for group in groups:
        created = dist.new_group(sorted(group), backend="gloo", timeout=timeout)
        if topology.rank in group:
            mine = created
    assert mine is not None  # Topology validates that its rank is on the mesh
    return domain, mine

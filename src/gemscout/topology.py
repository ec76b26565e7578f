"""Who SCOUT compares with: each rank's peer group, derived from the DeviceMesh the model's parameters live on.

Peers are ranks that hold the same parameters and differ only in the data they see. A DeviceMesh names its
dimensions; SCOUT splits them in two:

* **data-parallel dims** — ranks along them read different batches: DDP's replicas, FSDP's shard dim, HSDP's
  replicate and shard dims. Among them, a *replicate* dim is one over which every parameter is replicated (an
  independent copy on each rank); a *shard* dim is one over which some parameter is sharded (FSDP);
* **model-parallel dims** (tp, pp, cp, ep, ...) — everything else. Peers never differ along them: a TP rank's shard
  is a different computation from its TP partner's, not a replica of it.

The peer group of a rank is the set of ranks that share its coordinates on every dim except the *peer dims*:

* the replicate dims when there are any (HSDP: the replicate group, ranks holding the same shard);
* otherwise the shard dims (pure FSDP, or FSDP along ``dp`` of a ``(dp, tp)`` mesh). No rank holds a replica of
  another's shard there, so SCOUT gathers the parameters it replays along the shard dims first (see
  :mod:`gemscout.scout.materialize`) and compares what each rank computes with the gathered copy;
* none when no dim is data-parallel (pure TP): each rank is alone, and SCOUT cannot compare anything.

Which dims are data-parallel comes from ``fully_shard``: the dims of every FSDP module's mesh. A mesh used without
FSDP (DDP over a sub-mesh, a hand-written TP + DP layout) needs ``ScoutConfig.data_parallel_dims``.

**Pipeline stages** have plain parameters, so the mesh cannot be read from them: ``ScoutConfig.mesh`` gives it, and
every dim that is not data-parallel is a *stage dim* — ranks with different coordinates there hold different modules
(stage 0 the embedding and first blocks, the last stage the remaining blocks and the head). Peers then keep the stage
coordinate, and :attr:`Topology.stage_label` (``pp1``) qualifies recipe names so that a recipe of one stage is never
compared with, or combined with, another stage's. A rank that holds several stages (interleaved schedules) names each
by its own stage, in the looped order (:meth:`Topology.chunk_labels`: ``pp0`` and ``pp2`` on a pp=2 mesh).

:func:`derive` is pure (no process group) so the whole rule is unit-tested; :func:`discover` reads the model and
:func:`create_groups` makes the gloo groups (collective: every rank creates every group in the same order).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from gemscout._tensors import is_dtensor
from gemscout.errors import ConfigError

__all__ = ["Topology", "create_groups", "derive", "discover", "from_mesh", "has_dtensor_params"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """The mesh as SCOUT sees it, for one rank. Build it with :func:`derive`, :func:`from_mesh` or :func:`discover`."""

    kind: str
    """Short label: ``fsdp``, ``hsdp``, ``dp`` (replicated data parallel), plus ``+<model dim>`` parts, e.g.
    ``fsdp+tp``; ``tp`` alone when no dim is data-parallel."""
    dims: tuple[str, ...]
    """Mesh dim names, outermost first."""
    shape: tuple[int, ...]
    """Mesh size along each dim."""
    ranks: tuple[int, ...]
    """Global ranks of the mesh in row-major order (``mesh.mesh.flatten()``)."""
    data_dims: tuple[str, ...]
    """Dims along which ranks read different data."""
    shard_dims: tuple[str, ...]
    """Data dims over which some parameter is sharded: SCOUT gathers parameters along them before replay."""
    peer_dims: tuple[str, ...]
    """Dims along which this rank's peers differ (empty: no peers)."""
    rank: int
    """This rank (global)."""
    stage_dims: tuple[str, ...] = ()
    """Model dims along which ranks hold different modules (pipeline stages); empty unless the mesh came from
    ``ScoutConfig.mesh`` for a model with plain parameters."""

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.shape) or len(set(self.dims)) != len(self.dims):
            raise ValueError(f"Topology: dims {self.dims} and shape {self.shape} do not match")
        if math.prod(self.shape) != len(self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(
                f"Topology: {len(self.ranks)} ranks do not fill a mesh of shape {self.shape}"
            )
        for name in ("data_dims", "shard_dims", "peer_dims", "stage_dims"):
            unknown = [d for d in getattr(self, name) if d not in self.dims]
            if unknown:
                raise ValueError(f"Topology.{name}: {unknown} are not mesh dims {self.dims}")
        if self.rank not in self.ranks:
            raise ValueError(f"Topology: rank {self.rank} is not in the mesh {self.ranks}")

    # -- derived views ------------------------------------------------------------------------------------------
    @property
    def model_dims(self) -> tuple[str, ...]:
        """Dims that are not data-parallel (tp, pp, cp, ep, ...): peers keep this rank's coordinate on them."""
        return tuple(d for d in self.dims if d not in self.data_dims)

    @property
    def stage_label(self) -> str:
        """This rank's coordinates along the stage dims, e.g. ``pp1`` (empty when there are none): the prefix that
        makes recipe names unique across pipeline stages."""
        coord = self._coords()
        return "-".join(f"{d}{coord[self.dims.index(d)]}" for d in self.stage_dims)

    def chunk_labels(self, count: int, order: str = "loop") -> tuple[str, ...]:
        """The stage labels of ``count`` stage modules on this rank (multi-stage schedules). Along the stage dim of
        size ``n`` the rank at coordinate ``c`` holds, in ``order`` ``"loop"`` (interleaved / looped schedules), stages
        ``c, c + n, c + 2n, ...`` (``pp0``, ``pp2`` on a pp=2 mesh); in ``order`` ``"v"`` (ZBV, DualPipeV) the two
        stages ``c`` and ``2n - 1 - c`` (``pp0``, ``pp3``). Raises ``ConfigError`` unless the mesh has exactly one
        stage dim, or for a V order of other than two stages."""
        if len(self.stage_dims) != 1:
            raise ConfigError(
                f"SCOUT: several stage modules per rank need exactly one pipeline dim on the mesh; "
                f"ScoutConfig.mesh has stage dims {list(self.stage_dims)}"
            )
        dim = self.stage_dims[0]
        axis = self.dims.index(dim)
        coord, size = self._coords()[axis], self.shape[axis]
        if order == "v":
            if count != 2:
                raise ConfigError(
                    f"SCOUT: ScoutConfig.stage_order='v' holds two stages per rank (c and 2n - 1 - c); "
                    f"this rank gave an nn.ModuleList of {count}"
                )
            return (f"{dim}{coord}", f"{dim}{2 * size - 1 - coord}")
        return tuple(f"{dim}{coord + k * size}" for k in range(count))

    def _coords(self) -> tuple[int, ...]:
        flat, out = self.ranks.index(self.rank), []
        for size in reversed(self.shape):
            flat, c = divmod(flat, size)
            out.append(c)
        return tuple(reversed(out))

    @property
    def replicate_dims(self) -> tuple[str, ...]:
        """Data dims over which every parameter is replicated (independent replicas)."""
        return tuple(d for d in self.data_dims if d not in self.shard_dims)

    @property
    def peer_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every peer group of the mesh (each rank alone when there are no peer dims), in a fixed order."""
        return self.groups_along(self.peer_dims)

    @property
    def peers(self) -> tuple[int, ...]:
        """This rank's peer group, ordered by coordinate along the peer dims (source order)."""
        return next(group for group in self.peer_groups if self.rank in group)

    @property
    def comparable(self) -> bool:
        """True when this rank has at least one peer to compare with."""
        return len(self.peers) >= 2

    @property
    def materializes(self) -> bool:
        """True when parameters must be gathered along the shard dims before replay."""
        return bool(self.shard_dims)

    @property
    def replicated(self) -> bool:
        """True for plain data parallelism (one peer group over every rank, nothing sharded, no model dims)."""
        return not self.shard_dims and not self.model_dims

    def groups_along(self, dims: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Groups of ranks that share their coordinates on every dim except ``dims`` (each group row-major along
        ``dims``). ``dims=()`` gives every rank alone; all dims give one group. Pure."""
        along = [self.dims.index(d) for d in self.dims if d in dims]
        fixed = [i for i in range(len(self.dims)) if i not in along]
        strides = [math.prod(self.shape[i + 1 :]) for i in range(len(self.shape))]
        groups = []
        for outer in itertools.product(*(range(self.shape[i]) for i in fixed)):
            group = []
            for inner in itertools.product(*(range(self.shape[i]) for i in along)):
                coord = dict(zip(fixed, outer, strict=True)) | dict(zip(along, inner, strict=True))
                group.append(self.ranks[sum(coord[i] * strides[i] for i in range(len(self.dims)))])
            groups.append(tuple(group))
        return tuple(groups)

    def group_of(self, rank: int, dims: Sequence[str]) -> tuple[int, ...]:
        """The group of :meth:`groups_along` ``dims`` that holds ``rank``."""
        return next(group for group in self.groups_along(dims) if rank in group)

    @property
    def reason(self) -> str:
        """One sentence: who the peers are and why, or why SCOUT cannot compare here."""
        if not self.peer_dims and self.stage_dims:
            return (
                f"no data-parallel dim in mesh {self._mesh_text()} (pipeline stages along {list(self.stage_dims)}): "
                "each rank runs its own stage and no other rank holds it, so no rank has a peer whose computation "
                "it can replay; SCOUT cannot compare here (replicate the pipeline along a dp dim)"
            )
        if not self.peer_dims:
            return (
                f"no data-parallel dim in mesh {self._mesh_text()} (every dim is model-parallel: "
                f"{list(self.model_dims)}): each rank holds its own shard and sees the same data as its partners, "
                "so no rank has a peer whose computation it can replay; SCOUT cannot compare here"
            )
        text = (
            f"peers {list(self.peers)} vary along {list(self.peer_dims)} of mesh {self._mesh_text()}"
            + (
                f", keeping this rank's {list(self.model_dims)} coordinate"
                if self.model_dims
                else ""
            )
        )
        if self.replicate_dims:
            text += "; they hold independent replicas of the same parameters"
        if self.shard_dims and not self.replicate_dims:
            text += (
                f"; parameters are sharded along {list(self.shard_dims)} with no replica, so SCOUT gathers them "
                "before replay and a corrupted shard itself is outside what the peers can outvote"
            )
        elif self.shard_dims:
            text += f"; each peer gathers its own replica's shards along {list(self.shard_dims)} before replay"
        if len(self.peers) == 2:
            text += "; with two peers a mismatch is detected but no culprit can be named"
        if self.stage_dims:
            text += f"; recipes are this stage's ({self.stage_label}) only"
        return text

    def _mesh_text(self) -> str:
        return "(" + ", ".join(f"{d}={n}" for d, n in zip(self.dims, self.shape, strict=True)) + ")"

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form, for reports and evidence."""
        return {
            "kind": self.kind,
            "dims": list(self.dims),
            "shape": list(self.shape),
            "ranks": list(self.ranks),
            "data_dims": list(self.data_dims),
            "shard_dims": list(self.shard_dims),
            "model_dims": list(self.model_dims),
            "peer_dims": list(self.peer_dims),
            "rank": self.rank,
            "peers": list(self.peers),
            "peer_groups": [list(g) for g in self.peer_groups],
            "reason": self.reason,
            "stage_dims": list(self.stage_dims),
            "stage_label": self.stage_label,
        }


def derive(
    *,
    dims: Sequence[str],
    shape: Sequence[int],
    ranks: Sequence[int],
    data_dims: Sequence[str],
    shard_dims: Sequence[str],
    rank: int,
    stage_dims: Sequence[str] = (),
) -> Topology:
    """The topology of a mesh for ``rank``, from its dim names, shape, row-major ranks, the data-parallel dims, the
    data dims some parameter is sharded over and the pipeline stage dims (model dims along which modules differ).
    Pure; raises ``ValueError`` for inconsistent inputs (a stage dim that is also data-parallel)."""
    if any(d in data_dims for d in stage_dims):
        raise ValueError(
            f"stage dims {list(stage_dims)} overlap the data-parallel dims {list(data_dims)}"
        )
    data = tuple(d for d in dims if d in data_dims)
    shard = tuple(d for d in data if d in shard_dims)
    replicate = tuple(d for d in data if d not in shard)
    peer_dims = replicate if replicate else shard
    model = [d for d in dims if d not in data]
    part = "" if not data else ("hsdp" if shard and replicate else "fsdp" if shard else "dp")
    kind = "+".join(([part] if part else []) + model) or "dp"
    return Topology(
        kind=kind,
        dims=tuple(dims),
        shape=tuple(int(n) for n in shape),
        ranks=tuple(ranks),
        data_dims=data,
        shard_dims=shard,
        peer_dims=peer_dims,
        rank=rank,
        stage_dims=tuple(d for d in dims if d in stage_dims),
    )


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


def _fsdp_data_dims(model: nn.Module) -> set[str] | None:
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
        found = _fsdp_data_dims(model)
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

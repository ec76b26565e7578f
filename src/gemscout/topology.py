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

Which dims are data-parallel comes from ``fully_shard`` (:mod:`gemscout.topology_discovery` reads it off the model);
a mesh used without FSDP (DDP over a sub-mesh, a hand-written TP + DP layout) needs ``ScoutConfig.data_parallel_dims``.

**Pipeline stages** have plain parameters, so the mesh cannot be read from them: ``ScoutConfig.mesh`` gives it, and
every dim that is not data-parallel is a *stage dim* — ranks with different coordinates there hold different modules
(stage 0 the embedding and first blocks, the last stage the remaining blocks and the head). Peers then keep the stage
coordinate, and :attr:`Topology.stage_label` (``pp1``) qualifies recipe names so that a recipe of one stage is never
compared with, or combined with, another stage's. A rank that holds several stages (interleaved schedules) names each
by its own stage, in the looped order (:meth:`Topology.chunk_labels`: ``pp0`` and ``pp2`` on a pp=2 mesh).

**Plain tensors a framework places on a model dim.** A DTensor names the mesh dims it lives on; a framework that
shards with plain tensors marks them with attributes instead. Its adapter says which in
:attr:`Topology.placement_flags` (a :class:`PlacementFlag` per attribute), so SCOUT knows which replays run the
framework's collectives without knowing the framework.

This module is pure (no process group, no model): :func:`derive` is the whole rule, unit-tested as such. Reading
the mesh off a live model and creating SCOUT's gloo groups is :mod:`gemscout.topology_discovery`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gemscout.errors import ConfigError

__all__ = ["PlacementFlag", "Topology", "derive"]


@dataclass(frozen=True, slots=True)
class PlacementFlag:
    """A plain parameter whose attribute ``attribute`` is ``value`` (by identity: ``True`` is not ``1``) lies on the
    model dim ``dim``: its module runs collectives along that dim. A flag whose dim the mesh lacks places nothing."""

    attribute: str
    value: bool
    dim: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """The mesh as SCOUT sees it, for one rank. Build it with :func:`derive`, or from live objects with
    :func:`~gemscout.topology_discovery.from_mesh` or :func:`~gemscout.topology_discovery.discover`."""

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
    placement_flags: tuple[PlacementFlag, ...] = ()
    """How the framework marks plain tensors that lie on a model dim (its adapter's rule; empty: every plain tensor
    is replicated along the model dims)."""

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
            "placement_flags": [[f.attribute, f.value, f.dim] for f in self.placement_flags],
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
    placement_flags: Sequence[PlacementFlag] = (),
) -> Topology:
    """The topology of a mesh for ``rank``, from its dim names, shape, row-major ranks, the data-parallel dims, the
    data dims some parameter is sharded over, the pipeline stage dims (model dims along which modules differ) and the
    framework's :class:`PlacementFlag` rule for plain tensors.
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
        placement_flags=tuple(placement_flags),
    )

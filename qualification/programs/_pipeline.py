"""Pipeline parallelism for the rank programs: ``torch.distributed.pipelining`` stages, optionally replicated along dp.

Topologies (:data:`PIPELINE_TOPOLOGIES`; rank = (pp coordinate * dp + replica) * tp + tp coordinate):

* ``pp``, ``pp-dp``, ``pp-dp3`` — two stages, 1, 2 or 3 data-parallel replicas; ``pp3``, ``pp3-dp2`` — three stages
  (the middle one has neither embedding nor head), 1 or 2 replicas. One stage per rank: GPipe or 1F1B.
* ``pp-virtual``, ``pp-virtual-dp`` — four stages over two pp ranks, two per rank in the looped order the
  multi-stage schedules use (rank ``c`` holds stages ``c`` and ``c + 2``), 1 or 2 replicas: Interleaved 1F1B or
  Looped BFS. The rank's stage modules are held in one ``nn.ModuleList`` (one optimizer, one gemscout session).
* ``pp-virtual`` / ``pp-virtual-dp`` also run Interleaved Zero Bubble (``interleaved-zb``: each backward split into
  an input-gradient and a weight-gradient pass).
* ``pp-v``, ``pp-v-dp`` — four stages over two pp ranks in the V order of ``ScheduleZBVZeroBubble`` (``zbv``) and
  ``ScheduleDualPipeV`` (``dualpipev``): rank ``c`` holds stages ``c`` and ``3 - c`` (the first and the last stage
  on the same rank), 1 or 2 replicas.
* ``pp-dp-ddp`` — ``pp-dp`` with each stage module wrapped in ``DistributedDataParallel`` over its dp group (DDP
  reduces the accumulated gradients once, in the last micro-batch's backward; no hand-written average).
* ``pp-fsdp`` — two stages x 2, each stage module ``fully_shard``ed (each block, then the stage) over the dp dim of
  the ("pp", "dp") mesh: FSDP2 reduce-scatters the averaged gradients (no hand-written average); GPipe or 1F1B.
* ``pp-tp`` — two stages x tensor parallelism 2 on a ("pp", "tp") mesh: each block's MLP is sharded over tp (fc1
  column-wise, fc2 row-wise); the tp partners read the same batch. No dp dim, so SCOUT has no peers.
* ``pp-dp-tp``, ``pp-dp3-tp`` — two stages x dp 2 or 3 x tp 2 on a ("pp", "dp", "tp") mesh (8 or 12 ranks):
  ``pp-tp``'s TP-sharded MLPs, each (stage, tp) shard replicated along dp, gradients averaged by hand over the dp
  sub-mesh (the local part of a DTensor gradient: the dp replicas of one shard hold the same part). SCOUT's peers
  keep the pp and tp coordinates.

Each rank builds only its stage(s) (:func:`qualification.workloads.pipeline.build_stage`), runs its schedule with
:data:`MICROBATCHES` micro-batches and — with replicas and neither DDP nor FSDP2 — averages its gradients over the dp
group with one all-reduce of a flat buffer (deterministic: gloo's all-reduce leaves the same bits on every member, run
after run).
The loss exists on the rank of the last stage only; it is broadcast along the pipeline so every rank records it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from qualification.workloads import lm_loss
from qualification.workloads.pipeline import build_stage

__all__ = [
    "MICROBATCHES",
    "PIPELINE_TOPOLOGIES",
    "SCHEDULES",
    "Layout",
    "Pipeline",
    "build_pipeline",
    "fitting_schedules",
    "replica_of",
    "stage_ids",
]


class Layout(NamedTuple):
    """How a pipeline topology cuts the job."""

    stages: int
    """Pipeline stages in all (virtual stages with ``per_rank`` > 1)."""
    replicas: int
    """Data-parallel replicas of the whole pipeline (the dp dim; 1: a pure pipeline)."""
    per_rank: int = 1
    """Stages each rank holds."""
    ddp: bool = False
    """Wrap each stage module in DistributedDataParallel over its dp group."""
    order: str = "loop"
    """Which stages a rank holds when it holds several: ``loop`` (coordinate ``c``: ``c, c + pp, ...``) or ``v``
    (``c`` and ``2 pp - 1 - c``)."""
    fsdp: bool = False
    """``fully_shard`` each stage module over the dp dim (its parameters become DTensors)."""
    tp: int = 1
    """Tensor-parallel degree inside each stage (a ``tp`` mesh dim, innermost: beside ``dp`` when replicas > 1)."""


PIPELINE_TOPOLOGIES: dict[str, Layout] = {
    "pp": Layout(2, 1),
    "pp-dp": Layout(2, 2),
    "pp-dp3": Layout(2, 3),
    "pp3": Layout(3, 1),
    "pp3-dp2": Layout(3, 2),
    "pp-virtual": Layout(4, 1, per_rank=2),
    "pp-virtual-dp": Layout(4, 2, per_rank=2),
    "pp-v": Layout(4, 1, per_rank=2, order="v"),
    "pp-v-dp": Layout(4, 2, per_rank=2, order="v"),
    "pp-dp-ddp": Layout(2, 2, ddp=True),
    "pp-fsdp": Layout(2, 2, fsdp=True),
    "pp-tp": Layout(2, 1, tp=2),
    "pp-dp-tp": Layout(2, 2, tp=2),
    "pp-dp3-tp": Layout(2, 3, tp=2),
}
"""Topology name → layout. ``PIPELINE_TOPOLOGIES[name][1]`` is the replica count."""
SINGLE_SCHEDULES = ("gpipe", "1f1b")
MULTI_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "interleaved-zb")
V_SCHEDULES = ("zbv", "dualpipev")
SCHEDULES = SINGLE_SCHEDULES + MULTI_SCHEDULES + V_SCHEDULES
MICROBATCHES = 4


@dataclass
class Pipeline:
    """This rank's stage(s), its schedule and its groups. ``step`` runs one training step's forward and backward."""

    module: nn.Module
    """What the optimizer and gemscout get: the stage module, the ``nn.ModuleList`` of this rank's stage modules
    (several stages per rank), or the DDP wrapper of the stage module."""
    stages: tuple[int, ...]
    """The stage indices this rank runs, in ``module`` order."""
    n_stages: int
    replica: int
    """This rank's coordinate along dp: the data shard it reads."""
    replicas: int
    mesh: Any
    """The DeviceMesh: ``("pp",)``, ``("pp", "dp")``, ``("pp", "tp")`` or ``("pp", "dp", "tp")``; give it to
    ``ScoutConfig(mesh=...)``."""
    schedule: Any
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    """The group this rank averages its gradients over by hand (None: no dp dim, or DDP / FSDP2 does it)."""
    last_rank: int
    """Global rank of the last stage of this rank's pipeline (the rank that computes the loss)."""
    order: str = "loop"
    """The stage order of a rank's several stages (:attr:`Layout.order`), for ``ScoutConfig.stage_order``."""

    @property
    def stage(self) -> int:
        """The first stage this rank runs (its pp coordinate)."""
        return self.stages[0]

    @property
    def data_dims(self) -> tuple[str, ...] | None:
        """The mesh's data-parallel dims, for ``ScoutConfig.data_parallel_dims`` (None: pure pipeline)."""
        return ("dp",) if self.replicas > 1 else None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline, then the dp gradient average. Returns the mean
        micro-batch loss (every rank of the pipeline gets the last stage's value)."""
        losses: list[torch.Tensor] = []
        args = (x,) if 0 in self.stages else ()
        kwargs: dict[str, Any] = (
            {"target": y, "losses": losses} if self.n_stages - 1 in self.stages else {}
        )
        self.schedule.step(*args, **kwargs)
        loss = torch.stack([t.detach() for t in losses]).mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)
        if self.dp_group is not None:
            self._average_grads()
        return loss

    def _average_grads(self) -> None:
        # A TP-sharded parameter's gradient is a DTensor: its dp replicas hold the same part, so the local parts
        # are what is averaged (to_local is a view: the copy back lands in the gradient).
        grads = [
            g.to_local() if hasattr(g, "to_local") else g
            for p in self.module.parameters()
            if (g := p.grad) is not None
        ]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _schedule(name: str, stages: list[Any], layout: Layout) -> Any:
    import torch.distributed.pipelining as pipelining

    kind = getattr(pipelining, _SCHEDULE_CLASSES[name])
    return kind(
        stages[0] if layout.per_rank == 1 else stages, n_microbatches=MICROBATCHES, loss_fn=lm_loss
    )


_SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def fitting_schedules(layout: Layout) -> tuple[str, ...]:
    """The schedules that fit a layout: one stage per rank, several in the looped order, or two in the V order."""
    if layout.per_rank == 1:
        return SINGLE_SCHEDULES
    return V_SCHEDULES if layout.order == "v" else MULTI_SCHEDULES


def stage_ids(layout: Layout, coord: int) -> tuple[int, ...]:
    """The stages the rank at pp coordinate ``coord`` holds, in the order its schedule expects them."""
    pp_size = layout.stages // layout.per_rank
    if layout.order == "v":
        return (coord, layout.stages - 1 - coord)
    return tuple(coord + i * pp_size for i in range(layout.per_rank))


def replica_of(topology: str, rank: int) -> int:
    """The dp coordinate of global ``rank`` under ``topology``: the data shard it reads (its tp partners and the other
    stages of its pipeline read the same one)."""
    layout = PIPELINE_TOPOLOGIES[topology]
    return rank // layout.tp % layout.replicas


def build_pipeline(topology: str, workload: str, *, seed: int, schedule: str) -> Pipeline:
    """Build the mesh, this rank's stage(s) and the schedule. Collective over every rank (it creates the mesh groups,
    and DDP broadcasts its module). Raises ``SystemExit`` naming the fix for an unknown topology or schedule, a
    schedule that does not fit the stages per rank, or a world size that does not fit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.nn.parallel import DistributedDataParallel as DDP

    if topology not in PIPELINE_TOPOLOGIES:
        raise SystemExit(
            f"unknown pipeline topology {topology!r}; choose one of {sorted(PIPELINE_TOPOLOGIES)}"
        )
    if schedule not in SCHEDULES:
        raise SystemExit(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    layout = PIPELINE_TOPOLOGIES[topology]
    if schedule not in (fits := fitting_schedules(layout)):
        raise SystemExit(
            f"schedule {schedule!r} does not fit {topology} ({layout.per_rank} stage(s) per rank, "
            f"{layout.order} order); choose one of {fits}"
        )
    pp_size, replicas = layout.stages // layout.per_rank, layout.replicas
    inner = replicas * layout.tp  # ranks per pp coordinate
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != pp_size * inner:
        raise SystemExit(f"topology {topology} needs {pp_size * inner} ranks, the job has {world}")
    if inner == 1:
        mesh = init_device_mesh("cpu", (pp_size,), mesh_dim_names=("pp",))
        pp_mesh, dp_group, replica = mesh, None, 0
    else:
        dims = [
            (d, n)
            for d, n in (("pp", pp_size), ("dp", replicas), ("tp", layout.tp))
            if n > 1 or d == "pp"
        ]
        mesh = init_device_mesh(
            "cpu", tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims)
        )
        pp_mesh, replica = mesh["pp"], replica_of(topology, rank)
        dp_group = mesh["dp"].get_group() if replicas > 1 else None
    coord = rank // inner
    ids = stage_ids(layout, coord)
    mods: list[nn.Module] = [
        build_stage(workload, seed=seed, stage=s, n_stages=layout.stages) for s in ids
    ]
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        for m in mods:  # Megatron-style MLP sharding; attention, embedding and head stay plain (replicated over tp)
            for block in m.blocks:
                parallelize_module(
                    block, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
                )
    if layout.fsdp:
        from torch.distributed.fsdp import fully_shard

        for m in mods:  # each block its own unit, then the stage (its embedding, norm, head)
            for block in m.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(m, mesh=mesh["dp"])
    if layout.ddp:
        assert dp_group is not None  # every ddp layout has replicas
        mods = [DDP(m, process_group=dp_group) for m in mods]
        for m in mods:
            # The schedule arms DDP's reducer itself before the last micro-batch's backward (no_sync before it). Left
            # on, every forward arms it too, and a fresh DDP's first step then also all-reduces an earlier
            # micro-batch's gradients (torch 2.13: two all-reduces in a process's first step, one after): a relaunch
            # would differ from the uninterrupted run in the last bits. Off, every step reduces once, bitwise alike.
            m.require_backward_grad_sync = False
    pp_group = pp_mesh.get_group()
    pipe_stages = [
        PipelineStage(m, s, layout.stages, torch.device("cpu"), group=pp_group)
        for m, s in zip(mods, ids, strict=True)
    ]
    last_coord = 0 if layout.order == "v" else (layout.stages - 1) % pp_size
    return Pipeline(
        module=mods[0] if len(mods) == 1 else nn.ModuleList(mods),
        stages=ids,
        n_stages=layout.stages,
        replica=replica,
        replicas=replicas,
        mesh=mesh,
        schedule=_schedule(schedule, pipe_stages, layout),
        pp_group=pp_group,
        dp_group=None if layout.ddp or layout.fsdp else dp_group,
        last_rank=last_coord * inner + rank % inner,
        order=layout.order,
    )

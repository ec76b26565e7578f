"""Pipeline parallelism for the rank programs: ``torch.distributed.pipelining`` stages, optionally replicated along dp.

Topologies (two stages each): ``pp`` — one pipeline over every rank (a 1-D ``("pp",)`` mesh); ``pp-dp`` and
``pp-dp3`` — 2 or 3 data-parallel replicas of the pipeline on a ``("pp", "dp")`` mesh (rank = stage * dp + replica).
Each rank builds only its stage (:func:`qualification.workloads.pipeline.build_stage`), runs GPipe or 1F1B with
:data:`MICROBATCHES` micro-batches, and — with replicas — averages its stage's gradients over the dp group with one
all-reduce of a flat buffer (deterministic: gloo's all-reduce leaves the same bits on every member, run after run).
The loss exists on the last stage only; it is broadcast along the pipeline so every rank records it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qualification.workloads import lm_loss
from qualification.workloads.pipeline import StageModule, build_stage

__all__ = ["MICROBATCHES", "PIPELINE_TOPOLOGIES", "SCHEDULES", "Pipeline", "build_pipeline"]

PIPELINE_TOPOLOGIES: dict[str, tuple[int, int]] = {"pp": (2, 1), "pp-dp": (2, 2), "pp-dp3": (2, 3)}
"""Topology name → (stages, data-parallel replicas)."""
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = 4


@dataclass
class Pipeline:
    """This rank's stage, its schedule and its groups. ``step`` runs one training step's forward and backward."""

    module: StageModule
    stage: int
    n_stages: int
    replica: int
    """This rank's coordinate along dp: the data shard it reads."""
    replicas: int
    mesh: Any
    """The DeviceMesh: ``("pp",)`` or ``("pp", "dp")``; give it to ``ScoutConfig(mesh=...)``."""
    schedule: Any
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    last_rank: int
    """Global rank of the last stage of this rank's pipeline (the rank that computes the loss)."""

    @property
    def data_dims(self) -> tuple[str, ...] | None:
        """The mesh's data-parallel dims, for ``ScoutConfig.data_parallel_dims`` (None: pure pipeline)."""
        return ("dp",) if self.replicas > 1 else None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline, then the dp gradient average. Returns the mean
        micro-batch loss (every rank of the pipeline gets the last stage's value)."""
        losses: list[torch.Tensor] = []
        if self.stage == 0:
            self.schedule.step(x)
        elif self.stage == self.n_stages - 1:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        loss = torch.stack([t.detach() for t in losses]).mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=self.last_rank, group=self.pp_group)
        if self.dp_group is not None:
            self._average_grads()
        return loss

    def _average_grads(self) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def build_pipeline(topology: str, workload: str, *, seed: int, schedule: str) -> Pipeline:
    """Build the mesh, this rank's stage and its schedule. Collective over every rank (it creates the mesh groups).
    Raises ``SystemExit`` naming the fix for an unknown topology or schedule or a world size that does not fit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if topology not in PIPELINE_TOPOLOGIES:
        raise SystemExit(f"unknown pipeline topology {topology!r}; choose one of {sorted(PIPELINE_TOPOLOGIES)}")
    if schedule not in SCHEDULES:
        raise SystemExit(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    n_stages, replicas = PIPELINE_TOPOLOGIES[topology]
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != n_stages * replicas:
        raise SystemExit(f"topology {topology} needs {n_stages * replicas} ranks, the job has {world}")
    if replicas == 1:
        mesh = init_device_mesh("cpu", (n_stages,), mesh_dim_names=("pp",))
        pp_mesh, dp_group, replica = mesh, None, 0
    else:
        mesh = init_device_mesh("cpu", (n_stages, replicas), mesh_dim_names=("pp", "dp"))
        pp_mesh, dp_group, replica = mesh["pp"], mesh["dp"].get_group(), rank % replicas
    stage = rank // replicas
    module = build_stage(workload, seed=seed, stage=stage, n_stages=n_stages)
    pp_group = pp_mesh.get_group()
    pipe_stage = PipelineStage(module, stage, n_stages, torch.device("cpu"), group=pp_group)
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return Pipeline(module=module, stage=stage, n_stages=n_stages, replica=replica, replicas=replicas, mesh=mesh,
                    schedule=kind(pipe_stage, n_microbatches=MICROBATCHES, loss_fn=lm_loss), pp_group=pp_group,
                    dp_group=dp_group, last_rank=(n_stages - 1) * replicas + replica)

"""The specs of the Megatron Core rank programs: :mod:`qualification.programs.megatron_rank` (GPTModel, hand-written
loop), :mod:`qualification.programs.megatron_loop_rank` (Megatron's own DDP, optimizer and schedules) and
:mod:`qualification.programs.megatron_gpu_rank` (GPU tier).

The first two are launched by the lifecycle cell, so their specs extend :class:`LifecycleSpec`; the lifecycle fields
they cannot honour are narrowed to their defaults (the programs never accepted those flags)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import LifecycleSpec, RankSpec

GPT_TOPOLOGIES: dict[str, tuple[int, int, int]] = {
    "megatron-tp1": (1, 1, 0),
    "megatron-tp2": (2, 1, 0),
    "megatron-ep2": (1, 2, 4),
}
"""megatron_rank's topology name -> (tensor_model_parallel_size, expert_model_parallel_size, num_moe_experts)."""
LOOP_TOPOLOGIES: dict[str, dict[str, int | bool]] = {
    "megatron-ddp": {"overlap": True},
    "megatron-distopt": {"distopt": True, "overlap": True},
    "megatron-pp2": {"pp": 2, "distopt": True},
    "megatron-pp2-vpp2": {"pp": 2, "vpp": 2, "distopt": True, "overlap": True},
}
"""megatron_loop_rank's topology name -> the fields it sets (over what the spec says)."""
_UNUSED = "accepted for the lifecycle driver; unused"


@dataclass(frozen=True, kw_only=True)
class _MegatronLifecycleSpec(LifecycleSpec):
    """The lifecycle fields both CPU Megatron programs narrow: they honour none of these beyond the default."""

    workload: str = arg("gpt-megatron", help="accepted for the lifecycle driver; always GPTModel")
    kill_phase: str = arg(
        "after-step", choices=("after-step",), help="where in the step the kill lands"
    )
    kill_seed: int = arg(0, help=_UNUSED)
    replication: str = arg("ring", choices=("ring",), help="GEMINI replica placement (ring only)")
    schedule: str = arg(
        "gpipe", choices=("gpipe",), help="not used: the program picks its own schedule"
    )
    io_delay_ms: int = arg(0, choices=(0,), help="GEMINI io delay (not supported: 0 only)")
    recovery_kill_phase: str = arg("", choices=("",), help="recovery-time kills (not supported)")
    keep_generations: int = arg(2, help="GEMINI generations kept")
    scout: bool = arg(False, help="SCOUT forward recipes on the data-parallel peers")
    fault_rank: int = arg(-1, help="the rank whose replay is corrupted (-1: none)")
    fault_step: int = arg(-1, help="the step of the corrupted replay")


@dataclass(frozen=True, kw_only=True)
class MegatronSpec(_MegatronLifecycleSpec):
    """One rank of a deterministic Megatron Core GPTModel run on CPU (hand-written loop), with optional faults."""

    topology: str | None = arg(
        None,
        choices=tuple(sorted(GPT_TOPOLOGIES)),
        help="the lifecycle driver's name for the layout (sets --tp, --ep, --experts)",
    )
    tp: int = arg(1, help="tensor_model_parallel_size")
    ep: int = arg(1, help="expert_model_parallel_size")
    experts: int = arg(0, help="MoE experts per layer (0: dense MLPs)")
    etp: int | None = arg(None, help="expert_tensor_parallel_size (default: the TP size)")
    fault_recipe: str = arg("hidden.0", help="the replayed recipe corrupted at --fault-step")
    fault_kind: str = arg("bitflip", help="qualification.faults kind of the replay fault")
    drop_capture_rank: int = arg(
        -1, help="the rank whose captures of --drop-capture-step are dropped"
    )
    drop_capture_step: int = arg(-1, help="the step whose captures are dropped")
    a2a_corrupt_rank: int = arg(-1, help="the rank whose AllToAll check send buffer is corrupted")
    a2a_corrupt_step: int = arg(-1, help="the step of the corrupted AllToAll check replay")


@dataclass(frozen=True, kw_only=True)
class MegatronLoopSpec(_MegatronLifecycleSpec):
    """One rank of Megatron Core's own training loop on CPU (DDP, optimizer, schedules), with optional faults."""

    topology: str | None = arg(
        None,
        choices=tuple(sorted(LOOP_TOPOLOGIES)),
        help="the lifecycle driver's name for the layout (sets --pp / --vpp / --distopt / --overlap)",
    )
    run_id: str = arg("qualify", choices=("qualify",), help="not used: the run id is mc-loop")
    pp: int = arg(1, help="pipeline stages (1F1B schedule when > 1)")
    vpp: int = arg(1, help="virtual stages per pipeline rank (interleaved 1F1B when > 1)")
    layers: int = arg(0, help="transformer layers (0: max(2, pp * vpp))")
    distopt: bool = arg(False, help="use_distributed_optimizer=True")
    overlap: bool = arg(False, help="overlap_grad_reduce=True")
    fault_recipe: str = arg("hidden.1", help="the replayed recipe corrupted at --fault-step")
    # The lifecycle cell writes these for every program; this one has no durable tier, so it takes only "off" (the
    # cell sets durable and certify only with durable_every > 0).
    durable_every: int = arg(0, choices=(0,), help="0 only: this program has no durable tier")


@dataclass(frozen=True, kw_only=True)
class MegatronGpuSpec(RankSpec):
    """One rank of Megatron Core's own GPU training path under gemscout (NCCL, one rank per GPU)."""

    steps: int = arg(6, help="training steps")
    ckpt: Path | None = arg(None, help="GEMINI checkpoint directory; none: the baseline")
    kill_rank: int = arg(-1, help="the rank to SIGKILL (-1: none)")
    kill_step: int = arg(-1, help="the step at which --kill-rank is SIGKILLed")

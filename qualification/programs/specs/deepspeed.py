"""The specs of the DeepSpeed rank programs: :mod:`qualification.programs.ds_rank` (ZeRO-1/2/3, launched by the
lifecycle cell, :mod:`qualification.programs.ds_scout_cell` and :mod:`qualification.programs.ds_resize_cell`) and
:mod:`qualification.programs.ds_zero3_rollback`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import LifecycleSpec, RankSpec

STAGES = {"deepspeed-zero1": 1, "deepspeed-zero2": 2, "deepspeed-zero3": 3}
"""The ZeRO stage of each DeepSpeed topology."""
TOPOLOGIES = tuple(sorted(STAGES))
KILL_PHASES = "after-step | in-step | capture | persist | replicate | persist_replica"


@dataclass(frozen=True, kw_only=True)
class DeepSpeedSpec(LifecycleSpec):
    """One rank of a deterministic DeepSpeed ZeRO-1/2/3 run on CPU (gloo), with or without gemscout.

    ds_rank has no pipeline schedule, replica placement other than the ring, slow-network delay or recovery-time
    kill: those lifecycle fields accept their defaults only."""

    workload: str = arg("three-block", help="qualification.workloads model name")
    topology: str = arg("deepspeed-zero1", choices=TOPOLOGIES, help="the ZeRO stage")
    replication: str = arg("ring", choices=("ring",), help="GEMINI replica placement (ring only)")
    schedule: str = arg("gpipe", choices=("gpipe",), help="unused: no pipeline topologies")
    io_delay_ms: int = arg(0, choices=(0,), help="unused: no slow-network delay")
    recovery_kill_phase: str = arg("", choices=("",), help="unused: no kill during the recovery")
    kill_phase: str = arg("after-step", help=KILL_PHASES)
    accumulation: int = arg(1, help="micro-batches per optimizer step")
    bf16: bool = arg(False, help="bf16 module weights, fp32 master partition")
    keep_generations: int = arg(2, help="GEMINI generations kept")
    scout: bool = arg(False, help="SCOUT forward recipes on the engine's module")
    fault_rank: int = arg(-1, help="the rank whose block output is corrupted (-1: none)")
    fault_step: int = arg(-1, help="the step the module fault starts")
    heal_step: int = arg(1 << 30, help="the step the module fault is removed")
    fault_block: int = arg(1, help="the block whose output is corrupted")
    scout_recipes: str = arg(
        "embedding,hidden,output",
        help="SCOUT recipe kinds (comma-separated); 'optimizer' replays the ZeRO partition owner's update",
    )
    optimizer_slice_numel: int = arg(1 << 16, help="elements per optimizer slice at most")
    optimizer_slices_per_cycle: int = arg(1, help="0: every slice of the owner")
    replay_fault_rank: int = arg(-1, help="corrupt this rank's optimizer-slice replay")
    replay_fault_steps: str = arg("", help="comma-separated steps of the replay fault")
    update_fault_rank: int = arg(
        -1, help="flip a bit of this rank's fp32 master partition right after its real update"
    )
    update_fault_step: int = arg(-1, help="the step of the update fault")
    param_groups: int = arg(
        1, choices=(1, 2), help="2: no weight decay on vectors (two ZeRO partitions)"
    )
    straggler_margin_s: float = arg(
        0.0, help="> 0: compute-straggler detection with this absolute margin (0: off)"
    )
    replay_delay_rank: int = arg(-1, help="sleep inside this rank's slice replays")
    replay_delay_s: float = arg(0.25, help="how long each delayed replay sleeps")
    full_state: bool = arg(
        False, help="record the gathered full fp32 state's digests at resume and at the end"
    )
    dump_full: Path | None = arg(None, help="write the full state here at the end")
    load_full: Path | None = arg(
        None, help="start from a --dump-full file with DeepSpeed's own setters (no gemscout)"
    )


@dataclass(frozen=True, kw_only=True)
class ZeRO3RollbackSpec(RankSpec):
    """One rank of a DeepSpeed ZeRO-3 run that rolls back in process: session.recover() mid-run, then trains on."""

    steps: int = arg(6, help="training steps")
    ckpt: Path | None = arg(None, help="GEMINI checkpoint directory; none: the plain run")
    certify_until: int = arg(3, help="certify every capture up to this step")
    rollback_after: int = arg(
        5, help="after this step every rank recovers the newest certified step"
    )

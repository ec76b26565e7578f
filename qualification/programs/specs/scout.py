"""The specs of the SCOUT rank programs: :mod:`qualification.programs.scout_rank` (SCOUT on DDP and the native
meshes, with injected faults) and :mod:`qualification.programs.moe_rank` (expert- and context-parallel jobs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import RankSpec, RunSpec
from qualification.programs.specs.train import SCHEDULES, TOPOLOGIES

MOE_WORKLOADS = ("moe", "cp")
ETP_SIZES = (1, 2)


@dataclass(frozen=True, kw_only=True)
class ScoutSpec(RankSpec):
    """One rank of a job under GEMINI + SCOUT with injected faults (SDC, stragglers, divergence)."""

    steps: int = arg(16, help="training steps")
    fault_rank: int = arg(
        2, help="the rank whose blocks[--fault-block] output is corrupted (-1: none)"
    )
    fault_step: int = arg(6, help="the first step of the persistent fault")
    heal_step: int = arg(10, help="the fault is removed at this step (exclusive)")
    fault_block: int = arg(
        1, help="the block whose output is corrupted (a stage's own block under pp)"
    )
    fault: str = arg("bitflip", help="the corruption (qualification.faults.corrupt_module_output)")
    replay_delay_rank: int = arg(-1, help="compute straggler: sleep in every replay")
    replay_delay_s: float = arg(0.5, help="seconds of each replay delay")
    comm_delay_rank: int = arg(-1, help="slow link: sleep before every probe collective")
    comm_delay_s: float = arg(0.4, help="seconds of each probe collective delay")
    comm_probe_interval: int = arg(
        0, help="run the communication probe every this many steps (0: off)"
    )
    replay_fault_rank: int = arg(-1, help="transient fault in one replay only")
    replay_fault_step: int = arg(-1, help="the step of that replay")
    replay_fault_recipe: str = arg("hidden.0", help="the recipe of that replay")
    topology: str = arg("ddp", choices=TOPOLOGIES, help="how the model is wrapped and sharded")
    schedule: str = arg("gpipe", choices=SCHEDULES, help="pipeline schedule (pp topologies)")
    keep_ckpt: bool = arg(False, help="leave <out>/ckpt (checkpoints, trust, fault log) behind")
    baseline: bool = arg(False, help="train again without gemscout; record both digests")
    collective_delay_rank: int = arg(-1, help="sleep before each replay collective")
    collective_delay_s: float = arg(0.4, help="seconds of each replay collective delay")
    collective_delay_step: int = arg(0, help="delay the replay collectives from this step on")
    job_delay_rank: int = arg(
        -1,
        help="time the job's own collectives (ScoutConfig.job_collectives) and enter the first one of "
        "each step late on this rank: DDP's first gradient bucket, FSDP2's first all-gather",
    )
    job_delay_s: float = arg(0.4, help="seconds this rank enters late")
    job_delay_step: int = arg(1, help="enter late from this step on")
    straggler_margin_s: float = arg(
        0.25, help="StragglerConfig.absolute_margin_s of SCOUT's replays"
    )
    diverge_rank: int = arg(-1, help="corrupt this rank's own copy (its shard) of a weight")
    diverge_step: int = arg(0, help="... right before this step's forward")
    recover_on_sdc: bool = arg(
        False,
        help="after a step whose SDC decision says restore, session.recover() to the newest verified "
        "step and train on from there (the fault is injected once)",
    )
    optimizer_slice_numel: int = arg(
        1 << 16,
        help="ScoutConfig.optimizer_slice_numel (smaller: more slices, a longer certification rotation)",
    )


@dataclass(frozen=True, kw_only=True)
class MoeSpec(RunSpec):
    """One rank of an expert-parallel (MoE) or context-parallel job under GEMINI + SCOUT, with optional faults."""

    steps: int = arg(8, help="training steps")
    workload: str = arg("moe", choices=MOE_WORKLOADS, help="moe: mesh (dp, ep); cp: mesh (dp, cp)")
    etp: int = arg(1, choices=ETP_SIZES, help="expert tensor parallelism (MoE only)")
    ckpt: Path | None = arg(None, help="GEMINI checkpoint directory")
    baseline: bool = arg(
        False, help="train the same steps again without gemscout; record both digests"
    )
    kill_rank: int = arg(-1, help="the rank to SIGKILL right after --kill-step (-1: none)")
    kill_step: int = arg(-1, help="the step after which --kill-rank is SIGKILLed")
    replay_fault_rank: int = arg(-1, help="flip a bit in one SCOUT replay of this rank")
    replay_fault_step: int = arg(-1, help="the step of that replay")
    replay_fault_recipe: str = arg("hidden.1", help="the recipe of that replay")
    a2a_corrupt_rank: int = arg(
        -1, help="corrupt this rank's send buffer in the balanced AllToAll replay"
    )
    a2a_corrupt_step: int = arg(-1, help="the step of that replay")

"""The spec of :mod:`qualification.programs.torchrun_rank`: plain DDP under torchrun, with faults per attempt."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import RunSpec

KILL_PHASES = (
    "after-step | in-step | capture | persist | replicate | persist_replica | random:<max_ms>"
)


@dataclass(frozen=True, kw_only=True)
class TorchrunSpec(RunSpec):
    """One rank of the DDP run of train_rank, launched by torchrun; a relaunched attempt reads the same spec."""

    workload: str = arg("tiny-causal-lm", help="qualification.workloads model name")
    ckpt: Path | None = arg(None, help="checkpoint directory; omit for the baseline")
    run_id: str = arg("torchrun-cell", help="GEMINI run id")
    ranks_per_node: int = arg(0, help="0: gemscout reads LOCAL_WORLD_SIZE")
    find_unused_parameters: bool = arg(False, help="DDP(find_unused_parameters=True)")
    kill_rank: int = arg(-1, help="the rank to SIGKILL (-1: none)")
    kill_step: int = arg(-1, help="the step at which --kill-rank is SIGKILLed")
    kill_phase: str = arg("after-step", help=KILL_PHASES)
    kill_attempt: int = arg(
        0, help="the attempt (TORCHELASTIC_RESTART_COUNT) in which the kill fires"
    )
    lose_nodes: str = arg("", help="comma-separated node indices whose folders are deleted")
    lose_attempt: int = arg(1, help="the attempt at whose start --lose-nodes are deleted")
    step_sleep: float = arg(0.0, help="seconds each step sleeps (a kill window)")
    timeout_s: float = arg(60.0, help="the process group's timeout (s)")
    inline_baseline: bool = arg(False, help="also train uninterrupted after the run")

"""The fields every rank program shares, and the lifecycle driver's contract with the programs it launches."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg

RECOVERY_KILL_PHASES = ("", "recover-send", "recover-receive", "recover-restore")


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """What every rank program is told: where its records go."""

    out: Path = arg(help="folder for rank<r>.json and the rank's records (kill events, reports)")


@dataclass(frozen=True, kw_only=True)
class RunSpec(RankSpec):
    """A training run that a cell seeds: the seed, and how many steps to train."""

    seed: int = arg(0, help="model, data and dropout seed")
    steps: int = arg(6, help="training steps")


@dataclass(frozen=True, kw_only=True)
class FailStopSpec(RunSpec):
    """A run with GEMINI and the fail-stop faults the harness injects (:mod:`qualification.programs._kills`)."""

    ckpt: Path | None = arg(
        None, help="GEMINI checkpoint directory; none: the baseline, without gemscout"
    )
    run_id: str = arg("qualify", help="GEMINI run id")
    interval: int = arg(1, help="capture every this many steps")
    persist_every: int = arg(1, help="write every this many captures to disk")
    ranks_per_node: int = arg(1, help="ranks that share a node folder")
    kill_rank: int = arg(-1, help="the rank to SIGKILL (-1: none)")
    kill_step: int = arg(-1, help="the step at which --kill-rank is SIGKILLed")
    kill_phase: str = arg("after-step", help="where in the step the kill lands")
    kill_seed: int = arg(0, help="seed of a random:<max_ms> kill's delay")
    sigterm_step: int = arg(-1, help="rank 0 sends itself SIGTERM after this step (flush test)")
    durable: Path | None = arg(None, help="durable (DCP) directory shared by all ranks")
    durable_every: int = arg(
        0, help="promote every this many verified steps to the durable tier (0: off)"
    )
    certify: bool = arg(False, help="certify every capture (stands in for SCOUT)")


@dataclass(frozen=True, kw_only=True)
class LifecycleSpec(FailStopSpec):
    """What the GEMINI lifecycle cell tells any of the rank programs it launches (train, DeepSpeed, Megatron).

    A program's spec extends this one, so the file the cell writes is valid for it; a program that cannot honour a
    field narrows its choices, and a spec asking for more is refused with exit code 2."""

    workload: str = arg("tiny-causal-lm", help="qualification.workloads model name")
    topology: str | None = arg(None, help="the layout of the ranks (each program lists its own)")
    replication: str = arg("ring", choices=("ring", "natural"), help="GEMINI replica placement")
    schedule: str = arg("gpipe", help="pipeline schedule (pipeline topologies)")
    io_delay_ms: int = arg(0, help="GEMINI's io thread sleeps this long before each replication")
    recovery_kill_phase: str = arg(
        "",
        choices=RECOVERY_KILL_PHASES,
        help="SIGKILL --kill-rank during the recovery at attach (qualification.programs._recovery_faults)",
    )

"""The specs of the TorchTitan rank programs: :mod:`qualification.programs.titan_rank` (CPU, the harness's cells)
and :mod:`qualification.programs.torchtitan_rank` (GPU tier, torchtitan's own entry point).

Neither imports torchtitan nor torch: :mod:`qualification.programs.titan_cell` builds a :class:`TitanSpec` in the
main virtualenv, which never has torchtitan, and the rank reads it under the TorchTitan interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import RankSpec


@dataclass(frozen=True, kw_only=True)
class TitanSpec(RankSpec):
    """One rank of TorchTitan's real Trainer.train() on CPU (gloo), with or without gemscout, with optional faults."""

    steps: int = arg(6, help="training steps")
    out: Path = arg(help="folder for rank<r>.json, torchtitan's dump and the rank's records")
    assets: Path = arg(help="folder written by torchtitan_cpu.make_assets")
    seq_len: int = arg(128, help="sequence length")
    batch: int = arg(2, help="local batch size")
    dp_replicate: int = arg(1, help="HSDP replicate degree (1: FSDP over all ranks)")
    pp: int = arg(1, help="pipeline-parallel degree (TorchTitan's own split)")
    pp_schedule: str = arg("1F1B", help="TorchTitan's pipeline_parallel_schedule")
    ckpt: Path | None = arg(None, help="gemscout checkpoint directory; none: the baseline")
    interval: int = arg(1, help="capture (and, with --scout, check) every this many steps")
    kill_rank: int = arg(-1, help="the rank to SIGKILL right after --kill-step (-1: none)")
    kill_step: int = arg(-1, help="the step after which --kill-rank is SIGKILLed")
    scout: bool = arg(False, help="attach SCOUT (replay on data-parallel peers)")
    replay_fault_rank: int = arg(-1, help="with --scout: corrupt this rank's replay (-1: none)")
    replay_fault_step: int = arg(-1, help="the step of the corrupted replay")
    replay_fault_recipe: str = arg(
        "embedding", help="the recipe whose replay is corrupted (pp0.embedding, ...)"
    )
    scout_per_cycle: int = arg(
        -1,
        help="with --scout: blocks and optimizer slices replayed per due step (0: all, so each clean cycle "
        "certifies its step at once; -1: ScoutConfig's defaults)",
    )


@dataclass(frozen=True, kw_only=True)
class TorchTitanSpec(RankSpec):
    """One rank of torchtitan.train with gemscout attached (GPU tier); torchtitan's own flags follow ``--``.

    The steps and the seed are torchtitan's (``--training.steps``, ``--debug.seed`` after ``--``): this
    spec has no fields for them."""

    out: Path = arg(help="folder for rank<r>.json and the rank's records")
    ckpt: Path | None = arg(None, help="gemscout checkpoint directory; none: without gemscout")
    kill_rank: int = arg(-1, help="the rank to SIGKILL right after --kill-step (-1: none)")
    kill_step: int = arg(-1, help="the step after which --kill-rank is SIGKILLed")

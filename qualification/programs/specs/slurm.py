"""The spec of :mod:`qualification.programs.slurm_rank`: one task of a job launched with ``srun``, no torchrun."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import RankSpec


@dataclass(frozen=True, kw_only=True)
class SlurmSpec(RankSpec):
    """One srun task training plain DDP with GEMINI every step; every task may SIGKILL itself at one step."""

    steps: int = arg(6, help="training steps")
    ckpt: Path = arg(help="GEMINI checkpoint directory")
    out: Path = arg(help="folder for rank<r>.json")
    kill_step: int = arg(
        -1, help="every task SIGKILLs itself once this step is replicated (-1: none)"
    )

"""The spec of :mod:`qualification.programs.hf_rank`: SCOUT on Hugging Face causal LMs under DDP or FSDP2."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import RankSpec

FAMILIES = ("llama", "gpt2", "qwen2")
CASES = ("healthy", "persistent", "replay")


@dataclass(frozen=True, kw_only=True)
class HfSpec(RankSpec):
    """One rank of SCOUT on tiny Hugging Face causal LMs: every (family, case) pair in turn, in one process."""

    out: Path = arg(help="folder for rank<r>.json and the cases' checkpoint folders")
    family: tuple[str, ...] = arg(
        (), choices=FAMILIES, help="repeat; default: all (none with --fsdp2)"
    )
    case: tuple[str, ...] = arg((), choices=CASES, help="repeat; default: all")
    unreplayable: str | None = arg(
        None, choices=FAMILIES, help="also run the unreplayable case for this family"
    )
    fsdp2: tuple[str, ...] = arg(
        (), choices=FAMILIES, help="repeat: also run the cases under FSDP2"
    )
    steps: int = arg(6, help="training steps of each case")
    interval: int = arg(2, help="ScoutConfig.interval")
    fault_rank: int = arg(
        2, help="the rank whose decoder layer (persistent) or replay (replay) is faulty"
    )
    fault_step: int = arg(
        3, help="the step the fault starts (replay: the first due step at or after it)"
    )
    fault_block: int = arg(1, help="the decoder layer of the persistent fault")

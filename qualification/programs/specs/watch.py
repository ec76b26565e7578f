"""The spec of :mod:`qualification.programs.watch_rank`: a DDP job under the watchdog, with injected stalls."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import RankSpec


@dataclass(frozen=True, kw_only=True)
class WatchSpec(RankSpec):
    """One rank of a DDP job under enable_resiliency(watch=...), with data, checkpoint-io and hang faults."""

    out: Path = arg(help="folder for rank<r>.reports.jsonl")
    steps: int = arg(12, help="training steps")
    threshold_s: float = arg(1.5, help="WatchConfig.stall_threshold (s)")
    data_delay_rank: int = arg(-1, help="the rank whose DataLoader fetches are slowed (-1: none)")
    data_delay_s: float = arg(0.0, help="seconds each slowed fetch sleeps")
    io_delay_rank: int = arg(-1, help="the rank whose checkpoint writes are slowed (-1: none)")
    io_delay_s: float = arg(0.0, help="seconds each slowed checkpoint write sleeps")
    delay_from: int = arg(3, help="the step from which the delays apply")
    hang_rank: int = arg(-1, help="the rank that stops before a backward (-1: none)")
    hang_step: int = arg(-1, help="the step before whose backward --hang-rank stops")
    ckpt: Path | None = arg(
        None,
        help="also run GEMINI with this checkpoint directory (the session then keeps faults.jsonl there)",
    )

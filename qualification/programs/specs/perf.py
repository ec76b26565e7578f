"""The spec of :mod:`qualification.programs.perf_rank`: one workload in one mode (or several), timed per step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import RunSpec

MODES = ("baseline", "gemini", "scout", "combined")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class PerfSpec(RunSpec):
    """One rank of the healthy-path suite: one mode, or modes in segments, timed step by step."""

    mode: str | None = arg(None, choices=MODES, help="the mode of the whole run (or --segments)")
    segments: str = arg(
        "",
        help="comma-separated modes run in turn in this one process (after --warmup steps without gemscout), "
        "--segment-steps each; replaces --mode/--steps",
    )
    segment_steps: int = arg(20, help="measured steps per segment")
    workload: str = arg("three-block", help="qualification.workloads model name")
    warmup: int = arg(5, help="steps before measuring, without gemscout")
    steps: int = arg(40, help="measured steps (--mode)")
    interval: int = arg(1, help="gemscout's interval")
    ckpt: Path = arg(help="GEMINI checkpoint directory (one folder per segment under it)")
    device: str = arg(
        "cpu",
        choices=DEVICES,
        help="cuda: the model and batches on GPU 0 (every rank shares it; gloo stages CUDA tensors)",
    )
    rotate_kinds: bool = arg(False, help="ScoutConfig(rotate_kinds=True): one kind per due step")
    scout_interval: int | None = arg(
        None,
        help="ScoutConfig.interval (a multiple of --interval); default: SCOUT's own default cadence",
    )

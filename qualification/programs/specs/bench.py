"""The specs of the benchmark rank programs: :mod:`qualification.bench.goodput_rank`,
:mod:`qualification.bench.goodput_torchft_rank` and :mod:`qualification.bench.gemini_rank`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qualification.programs.specs._base import arg

GOODPUT_ARMS = ("none", "gemscout", "gemscout-skip", "dcp", "calibrate")
"""The arms :mod:`qualification.bench.goodput_rank` runs (the torchft arm has a program of its own)."""
GEMINI_ROLES = ("off", "on")


@dataclass(frozen=True, kw_only=True)
class _GoodputRun:
    """What every arm of the goodput benchmark trains: the same steps, state size, batch and failure schedule."""

    work: Path = arg(help="this arm's folder (shared by torchft's replicas): checkpoints, markers")
    events: Path = arg(help="the JSON event lines of this job (rank 0) or replica go here")
    steps: int = arg(help="training steps")
    fail_steps: str = arg(
        "", help="comma-separated steps during which a rank (a replica) is killed"
    )
    state_mib: float = arg(16.0, help="params + AdamW state per rank, MiB")
    batch: int = arg(64, help="rows per batch")


@dataclass(frozen=True, kw_only=True)
class GoodputSpec(_GoodputRun):
    """One rank of the goodput benchmark: DDP training under torchrun with a failure schedule, for one arm."""

    arm: str = arg(choices=GOODPUT_ARMS, help="the arm this job measures")
    dcp_every: int = arg(1, help="dcp and calibrate arms: async_save every this many steps")


@dataclass(frozen=True, kw_only=True)
class GoodputTorchftSpec(_GoodputRun):
    """One replica of the goodput benchmark's torchft arm: the same training, fault-tolerant the torchft way."""

    timeout_s: float = arg(30.0, help="torchft's collective timeout")


@dataclass(frozen=True, kw_only=True)
class GeminiBenchSpec:
    """One rank of the GEMINI benchmark: training without GEMINI (role off) or every measurement with it (on)."""

    role: str = arg(
        choices=GEMINI_ROLES, help="off: the peak-RSS baseline; on: GEMINI and the references"
    )
    out: Path = arg(help="folder for <role>.rank<r>.json")
    state_mib: float = arg(help="params + AdamW state per rank, MiB")
    steps: int = arg(8, help="optimizer steps per loop")
    batch: int = arg(16, help="rows per micro-batch")
    overlap_factor: float = arg(
        2.5, help="the overlap loop outlasts the capture pipeline this many times"
    )
    overlap_micro: int = arg(2, help="role off: the on run's overlap micro-batches")
    reps: int = arg(3, help="timed repetitions of each DCP operation")
    quiet_captures: int = arg(5, help="rounds of the side-by-side window")
    ckpt: Path = arg(help="GEMINI checkpoint folder; references write beside it")
    dcp: Path | None = arg(None, help="DCP checkpoint folder shared by the ranks (role on)")
    chunk_bytes: int = arg(16 * 1024 * 1024, help="replication chunk")
    no_fsync: bool = arg(False, help="turn off fsync of checkpoint files")
    persist_every: int = arg(
        5, help="write every N-th capture to disk (fsync); every capture lives in the memory tier"
    )
    timeout_s: float = arg(300.0, help="process-group and GEMINI timeout")

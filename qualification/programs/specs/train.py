"""The spec of :mod:`qualification.programs.train_rank`: native DDP, FSDP2, HSDP, TP and pipeline topologies."""

from __future__ import annotations

from dataclasses import dataclass

from qualification.programs.specs._base import arg
from qualification.programs.specs.common import LifecycleSpec

PIPELINE_TOPOLOGIES = (
    "pp",
    "pp-dp",
    "pp-dp3",
    "pp3",
    "pp3-dp2",
    "pp-virtual",
    "pp-virtual-dp",
    "pp-v",
    "pp-v-dp",
    "pp-dp-ddp",
    "pp-fsdp",
    "pp-tp",
    "pp-dp-tp",
    "pp-dp3-tp",
)
"""The names of :data:`qualification.programs._pipeline.PIPELINE_TOPOLOGIES` (a unit test keeps them equal)."""
TOPOLOGIES = ("ddp", "ddp-default", "fsdp2", "hsdp", "tp", "fsdp2-tp", *PIPELINE_TOPOLOGIES)
SCHEDULES = (
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "looped-bfs",
    "interleaved-zb",
    "zbv",
    "dualpipev",
)
KILL_PHASES = (
    "after-step | in-step | capture | persist | replicate | persist_replica | random:<max_ms>"
)


@dataclass(frozen=True, kw_only=True)
class TrainSpec(LifecycleSpec):
    """One rank of a deterministic training run on a native topology, with or without gemscout."""

    topology: str = arg("ddp", choices=TOPOLOGIES, help="how the model is wrapped and sharded")
    schedule: str = arg("gpipe", choices=SCHEDULES, help="pipeline schedule (pipeline topologies)")
    kill_phase: str = arg("after-step", help=KILL_PHASES)
    no_async: bool = arg(False, help="GEMINI copies on the training thread")
    chunk_bytes: int = arg(256 * 1024, help="GEMINI's replication chunk")
    when_busy: str = arg("wait", choices=("wait", "skip"), help="GEMINI when every slot is busy")
    full_digest: bool = arg(
        False,
        help="also record mesh-independent digests of the whole state at resume and at the end",
    )

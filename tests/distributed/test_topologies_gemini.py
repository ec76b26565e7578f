"""GEMINI on sharded topologies with real gloo groups: FSDP2 (1-D mesh) and HSDP (replicate x shard mesh).

Each rank captures its own DTensor shards (parameters and sharded AdamW state); a SIGKILL in the replication phase
plus the loss of that rank's node is recovered from the peer's replica, and every rank's shard ends bitwise equal to
the same rank's shard in an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _heavy import heavy

from qualification.programs.lifecycle import run_cell


def cell(topology: str, world: int, fault: dict) -> dict:
    return {
        "id": "t",
        "world_size": world,
        "workload": "three-block",
        "topology": topology,
        "seed": 0,
        "timeout_s": 150,
        "fault": fault,
        "params": {"steps": 6},
    }


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("topology", "world"),
    [
        ("fsdp2", 2),
        pytest.param(
            "hsdp",
            4,
            marks=heavy("lifecycle-*-hsdp-w4-*", "topologies", "4-rank HSDP, ~75 s on 2 cores"),
        ),
    ],
)
def test_sharded_lifecycle_is_bitwise(tmp_path: Path, topology: str, world: int) -> None:
    healthy = run_cell(cell(topology, world, {"kind": "none"}), tmp_path / "healthy")
    assert healthy["status"] == "passed", healthy
    assert healthy["observed"]["bitwise_equal"] and healthy["observed"]["losses_equal"]
    fault = {"kind": "sigkill", "rank": 1, "step": 4, "phase": "replicate", "node_loss": True}
    killed = run_cell(cell(topology, world, fault), tmp_path / "killed")
    obs = killed["observed"]
    assert obs["rank_exit_codes"][1] == -9
    assert obs["decision"]["sources"]["1"].startswith("peer:"), obs["decision"]
    assert obs["bitwise_equal"] and obs["losses_equal"], killed

"""HSDP natural replicas with real 2x2 HSDP launches on gloo (``CheckpointConfig(replication="natural")``): the
replica of a rank's checkpoint is rebuilt by its replicate-group peer from its own identical shards plus the few
tensors that differ, checked digest by digest. A SIGKILL in the replication phase plus the loss of that rank's node is
recovered from the peer, bit for bit, and natural mode sends a small fraction of ring mode's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _heavy import heavy

from qualification.launch import launch
from qualification.programs.lifecycle import run_cell


def cell(fault: dict) -> dict:
    return {
        "id": "natural",
        "world_size": 4,
        "workload": "three-block",
        "topology": "hsdp",
        "seed": 0,
        "timeout_s": 150,
        "fault": fault,
        "params": {"steps": 6, "replication": "natural"},
    }


@heavy("lifecycle-natural-*", "topologies", "three 4-rank HSDP launches, ~90 s on 2 cores")
@pytest.mark.timeout(600)
def test_hsdp_natural_replicas_recover_bitwise_and_send_less(tmp_path: Path) -> None:
    healthy = run_cell(cell({"kind": "none"}), tmp_path / "healthy")
    assert healthy["status"] == "passed", healthy
    assert not healthy["observed"]["errors"], healthy["observed"]["errors"]
    natural = healthy["metrics"]["stats_rank0"]
    assert natural["natural_divergent_shards"] == 0, (
        "HSDP replicate peers should hold identical shards"
    )

    ring_run = launch(
        [
            "-m",
            "qualification.programs.train_rank",
            "--out",
            str(tmp_path / "ring"),
            "--steps",
            "6",
            "--ckpt",
            str(tmp_path / "ring-ckpt"),
            "--topology",
            "hsdp",
            "--workload",
            "three-block",
        ],
        world_size=4,
        timeout_s=150,
        log_dir=tmp_path / "logs",
    )
    assert ring_run.ok, ring_run
    ring_rank0 = json.loads((tmp_path / "ring" / "rank0.json").read_text())
    assert not ring_rank0["errors"], ring_rank0["errors"]
    ring = ring_rank0["stats"]
    # Same captures (step 0 + 6 steps) in both modes; natural sends headers and the per-rank caller state only.
    assert natural["replicate_sent_bytes"] * 10 < ring["replicate_sent_bytes"], (natural, ring)

    # Rank 1 dies while replicating step 4 and its node's folder is deleted: its shard comes back from rank 3,
    # the other member of its replicate group.
    fault = {"kind": "sigkill", "rank": 1, "step": 4, "phase": "replicate", "node_loss": True}
    killed = run_cell(cell(fault), tmp_path / "killed")
    obs = killed["observed"]
    assert obs["rank_exit_codes"][1] == -9
    assert obs["decision"]["sources"]["1"] == "peer:3", obs["decision"]
    assert obs["bitwise_equal"] and obs["losses_equal"], killed
    print(
        f"\nreplicated bytes over 7 captures, rank 0: natural {natural['replicate_sent_bytes']}, "
        f"ring {ring['replicate_sent_bytes']}"
    )

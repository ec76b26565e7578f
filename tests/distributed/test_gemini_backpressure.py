"""Backpressure: a capture slot is not reused while its step may be what a node loss needs.

Real processes (3 gloo ranks, one per node), a real SIGKILL and the loss of the killed rank's node. Every rank's io
thread starts each replication 400 ms late, so the training runs ahead of the io — the case where, without
backpressure, the survivors overwrote the step the group would have to choose (its replica still in flight) and
read it from disk. Nothing but step 0 is on disk here (``persist_every=100``): recovery must find the step in memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qualification.programs.lifecycle import run_cell


@pytest.mark.timeout(300)
def test_capture_kill_with_node_loss_and_lagging_io_recovers_from_memory(tmp_path: Path) -> None:
    cell = {
        "id": "backpressure",
        "world_size": 3,
        "workload": "tiny-causal-lm",
        "seed": 0,
        "timeout_s": 150,
        "fault": {
            "kind": "sigkill",
            "rank": 1,
            "step": 4,
            "phase": "capture",
            "node_loss": True,
        },
        "params": {"steps": 7, "interval": 1, "persist_every": 100, "io_delay_ms": 400},
    }
    result = run_cell(cell, tmp_path)
    obs = result["observed"]
    assert obs["recovery_mode"] == "restore", result
    # Killed inside step 4's capture: 4 exists nowhere for rank 1; its replica of 3 may still be on the wire. The
    # survivors' capture 4 waited for the acknowledgement of 3 instead of overwriting step 2's slot, so whichever of
    # 2 and 3 the group chose, they hold it in memory (disk has only step 0).
    assert obs["recovered_step"] in (2, 3), obs
    assert obs["survivor_sources"] == ["memory"], obs
    assert obs["killed_rank_source"] == "peer", obs
    assert obs["kill"]["phase"] == "capture" and obs["rank_exit_codes"][1] == -9
    assert obs["bitwise_equal"] and obs["losses_equal"], result
    assert obs["final_step"] == 7

"""torchrun end to end, as docs/torchrun.md tells users to launch: ``python -m torch.distributed.run``, plain DDP,
``gemscout.init_process_group``, a real SIGKILL and torchrun's own ``--max-restarts`` relaunch.

The default run has one small cell (2 ranks); the STOP under ``--max-restarts=3`` and the two-agent node loss run with
``GEMSCOUT_HEAVY_TESTS=1`` (and as cells of ``qualify run torchrun``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from qualification.programs import torchrun_cell

HEAVY = pytest.mark.skipif(
    not os.environ.get("GEMSCOUT_HEAVY_TESTS"),
    reason="several torchrun launches; run `qualify run torchrun` or set GEMSCOUT_HEAVY_TESTS=1",
)


def _cell(world: int, fault: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {
        "id": "test/torchrun",
        "workload": "tiny-causal-lm",
        "world_size": world,
        "seed": 0,
        "timeout_s": 200,
        "fault": fault,
        "params": {"steps": 6, "max_restarts": 1, "find_unused_parameters": True, **params},
    }


def _left_behind(celldir: Path) -> list[str]:
    """Processes of this cell still alive: the rank program or torchrun with the cell's folder in its arguments."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
        except psutil.Error:
            continue
        if str(celldir) in cmd and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(f"{proc.pid}: {cmd[:120]}")
    return found


@pytest.mark.timeout(180)
def test_sigkill_under_max_restarts_resumes_bitwise_from_the_checkpoint(tmp_path: Path) -> None:
    # After step 3, once its checkpoint is out (replica included): the one phase whose recovered step is exact.
    fault = {"kind": "worker-kill", "rank": 1, "step": 3, "phase": "after-step", "node_loss": True}
    result = torchrun_cell.run_cell(
        _cell(2, fault, baseline="inline"), tmp_path
    )  # one launch fewer: CI budget
    obs = result["observed"]
    assert result["status"] == "passed", result["message"]
    assert obs["torchrun_exit"] == 0 and obs["attempts"] == 2  # torchrun itself relaunched, once
    # Restored from the checkpoint, not a fresh start: step 3, rank 1 from its peer's replica (its node folder was
    # deleted, and its memory tier with it), rank 0 from the memory tier its killed process left in /dev/shm.
    assert obs["mode"] == "restore" and obs["recovered_step"] == 3
    assert obs["sources"] == ["memory", "peer:0"]
    # What the ranks held when torchrun's relaunch began, read before either attached: the same step and tiers.
    assert (obs["held_step"], obs["held_sources"]) == (3, ["memory", "peer:0"])
    assert 3 in obs["held"]["0"]["memory"]["0"] and 3 in obs["held"]["0"]["memory_replica"]["1"]
    assert "1" not in obs["held"]  # rank 1's node folder (and with it its memory tier) was deleted
    assert (
        obs["bitwise_equal"]
        and obs["losses_equal"]
        and obs["replicas_equal"]
        and obs["final_step"] == 6
    )
    # The fault event is rank 1's own record of its SIGKILL, not the moment the driver launched torchrun.
    assert (obs["kill"]["rank"], obs["kill"]["step"], obs["kill"]["phase"]) == (1, 3, "after-step")
    (fault_event,) = [e for e in result["timeline"] if e["event"] == "fault"]
    launched = next(e["t"] for e in result["timeline"] if e["event"] == "launch")
    assert fault_event["rank"] == 1 and fault_event["t"] > launched
    # Then torchrun's relaunch, the restore on every rank and the first step trained after it, in that order.
    order = [e["event"] for e in result["timeline"]]
    assert order.index("fault") < order.index("relaunch") < order.index("recovery")
    assert order.index("recovery") < order.index("first-step")
    assert 0 < obs["fault_to_recovery_s"] < obs["fault_to_first_step_s"]
    assert not _left_behind(tmp_path)
    # The cell folder goes into an evidence bundle: no checkpoint file may be left in it.
    assert not [p for p in tmp_path.rglob("*.gsc")], sorted(tmp_path.rglob("*.gsc"))[:5]


@HEAVY
@pytest.mark.timeout(300)
def test_a_stop_under_max_restarts_3_is_what_the_docs_say(tmp_path: Path) -> None:
    fault = {"kind": "stop", "rank": 1, "step": 3, "phase": "after-step", "lose_nodes": [1, 2]}
    obs = torchrun_cell.run_cell(_cell(3, fault, max_restarts=3), tmp_path)["observed"]
    # docs/torchrun.md: torchrun runs 1 + 3 attempts; the failure ends the first, each relaunch ends at once with
    # exit 4 on every rank and the same line; torchrun itself exits 1 and names exit code 4.
    assert obs["torchrun_exit"] == 1 and obs["attempts"] == 4
    assert obs["stop_ranks_per_attempt"] == [3, 3, 3] and obs["stop_exit_codes"] == [4]
    assert obs["stop_lines"] == 1 and obs["console_stop_lines"] == 9
    assert obs["stop_line"].startswith(
        "gemscout: RecoveryError: recovery stopped: every source exhausted: "
    )
    assert obs["stop_line"].endswith(
        "every relaunch stops here with exit 4 until that file is deleted"
    )
    assert obs["stop_record"]
    assert (
        obs["held_step_exists"] is False
    )  # no step every rank held: STOP is the only right answer
    log = (tmp_path / "logs" / "torchrun.log").read_text()
    assert "exitcode  : 4" in log
    assert not _left_behind(tmp_path)


@HEAVY
@pytest.mark.timeout(300)
def test_two_agents_node_loss_replacement_agent_resumes_from_peers(tmp_path: Path) -> None:
    fault = {"kind": "node-loss", "step": 3, "replace": "agent"}
    obs = torchrun_cell.run_cell(
        _cell(4, fault, steps=8, max_restarts=2, step_sleep=0.3), tmp_path
    )["observed"]
    assert obs["torchrun_exit"] == [0, 0] and obs["readmitted"]
    assert obs["mode"] == "restore" and obs["recovered_step"] >= 2
    assert (obs["recovered_step"], obs["sources"]) == (obs["held_step"], obs["held_sources"])
    assert obs["node1_sources"] == ["peer:0", "peer:1"]
    assert obs["bitwise_equal"] and obs["losses_equal"] and obs["final_step"] == 8
    assert not _left_behind(tmp_path)

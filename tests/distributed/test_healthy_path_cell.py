"""The healthy-path cell measures what it says: every measured step of every mode, CPU per step beside wall time,
and a due step (SCOUT's replay) that costs more than the others. Real ranks, real SCOUT; the figures themselves are
not judged here (a shared 2-core machine cannot hold a 3 % threshold in a test), only that they are measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualification.programs.healthy_path import run_cell


@pytest.mark.timeout(300)
def test_each_mode_is_measured_step_by_step_and_a_replay_step_costs_more(tmp_path: Path) -> None:
    cell = {
        "id": "healthy-path/test",
        "world_size": 2,
        "workload": "three-block",
        "seed": 0,
        "timeout_s": 120,
        "params": {
            "modes": ["baseline", "scout"],
            "rounds": 1,
            "steps": 12,
            "warmup": 2,
            "interval": 2,
        },
    }
    result = run_cell(cell, tmp_path)
    assert result["status"] in ("passed", "failed"), result[
        "message"
    ]  # failed = over a threshold, still measured
    modes = result["metrics"]["modes"]
    for mode in ("baseline", "scout"):
        assert modes[mode]["samples"] == 12
        assert modes[mode]["process_cpu_ms"] >= modes[mode]["thread_cpu_ms"] > 0
    # Six of the twelve steps replay (embedding, a block, output, an optimizer slice): several ms each, on a ~10 ms step.
    assert modes["scout"]["due_step_extra_ms"] > 1.0, modes
    overhead = result["observed"]["overhead"]["scout"]
    assert {"throughput_pct", "p95_pct", "thread_cpu_pct", "process_cpu_pct", "within"} <= set(
        overhead
    )
    assert set(result["metrics"]["replay_ms_p50"]) == {"embedding", "hidden", "optimizer", "output"}
    json.dumps(result)  # the harness seals it as JSON


@pytest.mark.timeout(300)
def test_interleaved_modes_share_one_launch_and_are_split_step_by_step(tmp_path: Path) -> None:
    """``params.interleave``: baseline and SCOUT alternate in segments inside one launch per round (ABBA); every step
    is attributed to the mode it ran in, and only SCOUT's segments have due (replay) steps."""
    cell = {
        "id": "healthy-path/interleaved",
        "world_size": 2,
        "workload": "three-block",
        "seed": 0,
        "timeout_s": 120,
        "params": {
            "modes": ["baseline", "scout"],
            "rounds": 1,
            "warmup": 2,
            "interval": 2,
            "scout_interval": 2,
            "interleave": 1,
            "segment_steps": 6,
        },
    }
    result = run_cell(cell, tmp_path)
    assert result["status"] in ("passed", "failed"), result["message"]
    modes = result["metrics"]["modes"]
    assert (
        modes["baseline"]["samples"] == modes["scout"]["samples"] == 12
    )  # two segments of 6 steps each
    assert modes["baseline"]["due_step_extra_ms"] is None  # no gemscout attached: nothing is due
    assert modes["scout"]["due_step_extra_ms"] > 1.0, modes
    launches = [e for e in result["timeline"] if e["event"] == "measured"]
    assert len(launches) == 1, launches
    # ABBA: the two SCOUT segments are adjacent, so one session runs 12 steps and replays at every 2nd: 6 cycles.
    assert (
        len(
            json.loads((tmp_path / "modes" / "interleaved-0" / "rank0.json").read_text())[
                "replay_s"
            ]["output"]
        )
        == 6
    )

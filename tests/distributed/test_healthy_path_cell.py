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
    cell = {"id": "healthy-path/test", "world_size": 2, "workload": "three-block", "seed": 0, "timeout_s": 120,
            "params": {"modes": ["baseline", "scout"], "rounds": 1, "steps": 12, "warmup": 2, "interval": 2}}
    result = run_cell(cell, tmp_path)
    assert result["status"] in ("passed", "failed"), result["message"]  # failed = over a threshold, still measured
    modes = result["metrics"]["modes"]
    for mode in ("baseline", "scout"):
        assert modes[mode]["samples"] == 12
        assert modes[mode]["process_cpu_ms"] >= modes[mode]["thread_cpu_ms"] > 0
    # Six of the twelve steps replay (embedding, a block, output, an optimizer slice): several ms each, on a ~10 ms step.
    assert modes["scout"]["due_step_extra_ms"] > 1.0, modes
    overhead = result["observed"]["overhead"]["scout"]
    assert {"throughput_pct", "p95_pct", "thread_cpu_pct", "process_cpu_pct", "within"} <= set(overhead)
    assert set(result["metrics"]["replay_ms_p50"]) == {"embedding", "hidden", "optimizer", "output"}
    json.dumps(result)  # the harness seals it as JSON

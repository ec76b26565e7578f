"""GEMINI end to end with real processes: gloo process groups, SIGKILL, relaunch, node loss, bitwise comparison.

Each case launches real rank processes through :mod:`qualification.launch` (the same path as ``qualify run``) and
compares the final parameters and optimizer state with an uninterrupted run without gemscout, byte for byte.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from _heavy import heavy

from qualification.programs.lifecycle import run_cell


def cell(world: int, fault: dict, **params: int) -> dict:
    return {
        "id": "test",
        "world_size": world,
        "workload": "tiny-causal-lm",
        "seed": 0,
        "timeout_s": 120,
        "fault": fault,
        "params": params,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world", "interval"),
    [
        (2, 1),
        (2, 5),
        *(
            pytest.param(
                4,
                interval,
                marks=heavy(
                    f"lifecycle-healthy-i{interval}-ddp-w4-*",
                    "gemini-recovery",
                    "4 ranks twice, ~25 s on 2 cores; the 2-rank case stays",
                ),
            )
            for interval in (1, 5)
        ),
    ],
)
def test_healthy_run_is_bitwise_equal_to_baseline(
    tmp_path: Path, world: int, interval: int
) -> None:
    result = run_cell(cell(world, {"kind": "none"}, steps=20, interval=interval), tmp_path)
    obs = result["observed"]
    assert result["status"] == "passed", result
    assert obs["bitwise_equal"] and obs["losses_equal"] and obs["replicas_equal"]
    assert obs["final_step"] == 20
    assert obs["errors"] == []


@heavy(
    "lifecycle-ddp-w3-*",
    "quickstart",
    "the quickstart cell, ~23 s on 2 cores; `make demo` runs it too",
)
@pytest.mark.timeout(200)
def test_quickstart_kill_with_node_loss_recovers_from_peer_replica(tmp_path: Path) -> None:
    result = run_cell(
        cell(3, {"kind": "sigkill", "rank": 1, "step": 4, "node_loss": True}, steps=6), tmp_path
    )
    obs = result["observed"]
    assert (
        obs["recovered_step"] == 4 and obs["resume_step"] == 4 and obs["recovery_mode"] == "restore"
    )
    # The survivors were torn down with the job and restarted on their nodes: they recover from the memory tier
    # their killed processes left in /dev/shm; rank 1's node (folder and memory) is gone, so it takes its replica.
    assert obs["decision"]["sources"] == {"0": "memory", "1": "peer:2", "2": "memory"}
    assert (
        obs["rank_sources"] == ["memory", "peer:2", "memory"]
        and obs["killed_rank_source"] == "peer"
    )
    assert obs["bitwise_equal"] and obs["losses_equal"], result
    assert obs["rank_exit_codes"][1] == -9
    # The timeline runs from the kill's own record (taken by rank 1 right before os.kill), not from the launch.
    assert (
        obs["kill"]["rank"] == 1
        and obs["kill"]["step"] == 4
        and obs["kill"]["phase"] == "after-step"
    )
    assert (
        0
        <= obs["fault_to_detection_s"]
        < obs["fault_to_recovery_s"]
        <= obs["fault_to_first_step_s"]
    ), obs
    events = {
        e["event"]: e["t"] for e in reversed(result["timeline"])
    }  # each event's first occurrence
    assert (
        events["launch"]
        < events["fault"]
        <= events["detection"]
        < events["relaunch"]
        < events["first-step"]
    )
    assert abs((events["first-step"] - events["fault"]) - obs["fault_to_first_step_s"]) < 0.01


PHASES = [
    "in-step",
    "after-step",
    "capture",
    "persist",
    "replicate",
    "persist_replica",
    "random:40",
]


def _trials(n: int) -> list[tuple[int, int, int, str, bool]]:
    rng = random.Random(20261129)
    out = []
    for i in range(n):
        world = rng.choice([2, 3])
        out.append(
            (
                world,
                rng.randrange(world),
                rng.randint(2, 6),
                PHASES[i % len(PHASES)],
                rng.random() < 0.5,
            )
        )
    return out


# Six of the ten trials (~25-37 s each on 2 cores) run only with the heavy tests: the two 3-rank ones and the
# after-step, persist, persist_replica and node-loss-free capture kills. The four that stay in CI still kill in-step,
# in capture, at replicate and at random; gemini-recovery's cells kill at every phase.
_HEAVY_TRIALS = frozenset({1, 3, 5, 7, 8, 9})


def _trials_in_ci(n: int) -> list[Any]:
    """:func:`_trials`, the slowest of them only with ``GEMSCOUT_HEAVY_TESTS``."""
    slow = heavy("lifecycle-kill-ddp-w3-*", "gemini-recovery", "the slowest random kill trials")
    return [
        pytest.param(*t, marks=slow) if i in _HEAVY_TRIALS else t for i, t in enumerate(_trials(n))
    ]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "rank", "step", "phase", "node_loss"), _trials_in_ci(10))
def test_randomized_sigkill_recovers_bitwise(
    tmp_path: Path, world: int, rank: int, step: int, phase: str, node_loss: bool
) -> None:
    fault = {"kind": "sigkill", "rank": rank, "step": step, "phase": phase, "node_loss": node_loss}
    result = run_cell(cell(world, fault, steps=8), tmp_path)
    obs = result["observed"]
    assert obs["rank_exit_codes"][rank] == -9, result
    # Step 0 (taken at attach, replicated before training starts) is the floor when a rank dies before its first
    # step's replica has landed. A "random:<ms>" kill is a timer started after step S: on a quiet machine a step is
    # shorter than the delay, so the rank may die in a later step, whose capture can already be everywhere.
    # Never 0 once a step had been captured everywhere: the kill at step S can beat S's capture (and S-1's replica
    # while it is still in flight), not the steps before; step 0 only when S is 1 or 2.
    last = 8 if phase.startswith("random:") else step
    assert obs["recovery_mode"] == "restore", result
    assert (
        obs["recovered_step"] is not None and max(0, step - 2) <= obs["recovered_step"] <= last
    ), result
    assert obs["resume_step"] == obs["recovered_step"], result
    assert obs["ranks_restored"] == world and None not in obs["rank_sources"], result
    if node_loss:
        assert obs["decision"]["sources"][str(rank)].startswith("peer:"), result
    assert obs["bitwise_equal"] and obs["losses_equal"], result
    assert obs["final_step"] == 8


@pytest.mark.timeout(200)
def test_sigterm_flushes_newest_step_and_restart_resumes_there(tmp_path: Path) -> None:
    # persist_every=100: nothing is due for persistence, so only the SIGTERM flush can put step 7 on disk.
    result = run_cell(
        cell(2, {"kind": "sigterm", "step": 7}, steps=10, persist_every=100), tmp_path
    )
    obs = result["observed"]
    assert obs["recovered_step"] == 7, result
    assert obs["bitwise_equal"] and obs["losses_equal"], result


HEAVY = pytest.mark.skipif(
    not os.environ.get("GEMSCOUT_HEAVY_TESTS"),
    reason="kept out of CI's 30 minutes: the same check is the gemini-recovery campaign cell "
    "kill-during-recovery (qualify run gemini-recovery), or set GEMSCOUT_HEAVY_TESTS=1",
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("phase", "rank"),
    [
        pytest.param("recover-receive", 1, marks=HEAVY),
        pytest.param("recover-send", 2, marks=HEAVY),
        pytest.param("recover-restore", 0, marks=HEAVY),
    ],
)
def test_a_kill_during_recovery_is_survived_by_the_next_relaunch(
    tmp_path: Path, phase: str, rank: int
) -> None:
    """Rank 1 dies after step 4 and its node's files are lost; at the relaunch a rank dies again in the middle of
    the recovery: rank 1 itself while its replica streams in from rank 2, rank 2 as it starts sending it, or rank 0
    half-way through loading its state. The next relaunch recovers the same step from the same sources (the
    interrupted attempt consumed none of what it needs) and ends bitwise equal to the uninterrupted run."""
    fault = {
        "kind": "sigkill",
        "rank": 1,
        "step": 4,
        "node_loss": True,
        "recovery_kill": {"rank": rank, "phase": phase},
    }
    result = run_cell(cell(3, fault, steps=6), tmp_path)
    obs = result["observed"]
    assert obs["recovery_kill_exit_codes"][rank] == -9, result
    assert obs["recovered_step"] == 4, result
    assert obs["decision"]["sources"] == {"0": "memory", "1": "peer:2", "2": "memory"}, result
    assert obs["bitwise_equal"] and obs["losses_equal"] and obs["final_step"] == 6, result


@pytest.mark.timeout(420)
def test_a_relaunch_that_ignores_checkpoints_fails_the_kill_cell(tmp_path: Path) -> None:
    """The negative control of every kill cell: quickstart's own cell and expectations, with a relaunch that deletes
    every checkpoint first. A deterministic fresh start is bitwise equal to the baseline, so bitwise_equal alone would
    pass it; the recovery expectations (decision, step, each rank's source, resume step) must make it FAIL."""
    import dataclasses

    from qualification import campaign
    from qualification.engine import EngineOptions, run_cells

    (quick,) = campaign.load("quickstart").cells
    # A longer cell timeout than the campaign's 120 s: three launches of three ranks, on a machine shared by others.
    broken = dataclasses.replace(
        quick, params={**quick.params, "relaunch_ignores_checkpoints": True}, timeout_s=360
    )
    (outcome,) = run_cells([broken], tmp_path, EngineOptions(grace=timedelta(seconds=1)))
    assert outcome.verdict.value == "failed", outcome.reason
    observed = outcome.result["observed"] if outcome.result else {}
    assert observed.get("bitwise_equal") is True, (
        "the fresh start is bitwise equal: only the recovery checks catch it"
    )
    assert (
        "recovered_step: expected 4" in outcome.reason
        and "recovery_mode: expected 'restore'" in outcome.reason
    )

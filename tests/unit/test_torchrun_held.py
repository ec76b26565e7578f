"""The torchrun kill cells' exact restore expectation: from what each rank held when the relaunch began
(``held``), the newest step every rank held and the tier that held each rank's copy; and the campaign's own
expectation table fails a relaunch that ignored the checkpoints or restored from the wrong place."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from qualification import expect
from qualification.programs._recovery_times import recovery_events
from qualification.programs._torchrun_held import held_restore

ROOT = Path(__file__).resolve().parents[2]

# Three ranks, one per node, replicas to the next rank (0 -> 1 -> 2 -> 0); rank 1's node (and memory) was lost.
# Rank 0 trained on to step 5 (its memory slots hold 4 and 5, its disk 2..5); rank 2 reached step 4; rank 1's
# replica of step 4 never landed on rank 2, step 3's did (in memory), step 2's only on disk.
HELD: dict[str, dict[str, dict[str, list[int]]]] = {
    "0": {
        "memory": {"0": [4, 5]},
        "own": {"0": [2, 3, 4, 5]},
        "memory_replica": {"2": [3, 4]},
        "replica": {"2": [2, 3, 4]},
    },
    "2": {
        "memory": {"2": [3, 4]},
        "own": {"2": [2, 3, 4]},
        "memory_replica": {"1": [3]},
        "replica": {"1": [2, 3]},
    },
}


@pytest.mark.timeout(10)
def test_the_newest_step_every_rank_held_and_each_ranks_tier() -> None:
    # Step 4 is not held for rank 1 anywhere; step 3 is: rank 0 only on its disk now, rank 1 in rank 2's memory.
    assert held_restore(HELD, 3) == (3, ["local", "peer:2", "memory"])


@pytest.mark.timeout(10)
def test_a_replica_in_memory_is_preferred_to_one_on_disk_and_nothing_held_is_none() -> None:
    held = {
        "0": {"memory": {"0": [2]}, "replica": {"1": [2]}},
        "2": {"memory": {"2": [2]}, "memory_replica": {"1": [2]}},
    }
    assert held_restore(held, 3) == (2, ["memory", "peer:2", "memory"])
    lost = {
        "0": {"memory": {"0": [2, 3]}},
        "2": {"memory": {"2": [2, 3]}},
    }  # rank 1's copies all gone
    assert held_restore(lost, 3) == (None, [None, None, None])
    assert held_restore({}, 2) == (None, [None, None])


def _kill_cell_expect() -> dict[str, Any]:
    doc = tomllib.loads((ROOT / "campaigns" / "torchrun.toml").read_text())
    (entry,) = [m for m in doc["matrix"] if m.get("label") == "kill"]
    return dict(entry["expect"])


def _observed(**over: Any) -> dict[str, Any]:
    step, sources = held_restore(HELD, 3)
    obs = {
        "torchrun_exit": 0,
        "attempts": 2,
        "mode": "restore",
        "recovered_step": 3,
        "sources": ["local", "peer:2", "memory"],
        "held_step": step,
        "held_sources": sources,
        "recovered_step_expected": True,
        "killed_source": "peer:2",
        "bitwise_equal": True,
        "losses_equal": True,
        "replicas_equal": True,
        "final_step": 8,
    }
    return {**obs, **over}


@pytest.mark.timeout(10)
def test_the_kill_cells_expectation_holds_only_for_the_held_restore() -> None:
    want = _kill_cell_expect()
    assert expect.check(want, _observed()) == []
    # A relaunch that ignored every checkpoint: a deterministic fresh start is bitwise too, and must still fail.
    fresh = expect.check(want, _observed(mode="fresh", recovered_step=0, sources=[None] * 3))
    assert any(line.startswith("recovered_step:") for line in fresh)
    assert any(line.startswith("sources:") for line in fresh)
    assert any(line.startswith("mode:") for line in fresh)
    # An older step than every rank held, or a survivor reading its disk while its memory held the step: wrong.
    older = expect.check(want, _observed(recovered_step=2))
    assert older == ["recovered_step: expected >= 1 and == observed.held_step (= 3), observed 2"]
    wrong_tier = expect.check(want, _observed(sources=["local", "peer:2", "local"]))
    assert [line.split(":")[0] for line in wrong_tier] == ["sources"]
    # Nothing held by every rank: no recovered step can match (a restore would have come from nowhere).
    none_held = expect.check(want, _observed(held_step=None, held_sources=[None] * 3))
    assert {line.split(":")[0] for line in none_held} == {"recovered_step", "sources"}


@pytest.mark.timeout(10)
def test_recovery_and_first_step_events_are_the_last_ranks_stamps_from_the_kill() -> None:
    ranks = [
        {"times": {"restored_wall": 105.0, "first_step_wall": 106.5}},
        {"times": {"restored_wall": 105.5, "first_step_wall": 106.0}},
    ]
    events, observed = recovery_events(ranks, kill_wall=100.0, wall0=90.0, resume_step=3)
    assert [(e["event"], e["t"]) for e in events] == [("recovery", 15.5), ("first-step", 16.5)]
    assert "step 4" in events[1]["detail"]
    assert observed == {"fault_to_recovery_s": 5.5, "fault_to_first_step_s": 6.5}
    # One rank never trained after the restore: no first-step event, never one measured from a stand-in.
    ranks[1]["times"].pop("first_step_wall")
    events, observed = recovery_events(ranks, kill_wall=100.0, wall0=90.0, resume_step=3)
    assert [e["event"] for e in events] == ["recovery"] and "fault_to_first_step_s" not in observed

"""A persistent fault on one rank, end to end through enable_resiliency with GEMINI and SCOUT on real gloo ranks:
localized at the first due step of the faulty block, candidates rejected job-wide, the decision names the newest
recovery-verified step before the fault, and after the hook is removed training certifies again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qualification.launch import launch

FAULT_RANK, FAULT_STEP, HEAL_STEP, BLOCK = 2, 6, 10, 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [3, 4])
def test_persistent_fault_is_localized_rejected_and_healed(tmp_path: Path, world: int) -> None:
    res = launch(
        [
            "-m",
            "qualification.programs.scout_rank",
            "--out",
            str(tmp_path),
            "--steps",
            "16",
            "--fault-rank",
            str(FAULT_RANK),
            "--fault-step",
            str(FAULT_STEP),
            "--heal-step",
            str(HEAL_STEP),
            "--fault-block",
            str(BLOCK),
        ],
        world_size=world,
        timeout_s=200,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    due = {int(k): v for k, v in ranks[0]["due"].items()}
    first_due = min(s for s, names in due.items() if s >= FAULT_STEP and f"hidden.{BLOCK}" in names)
    for r in ranks:
        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc"]
        assert sdc, r["reports"]
        assert sdc[0]["step"] == first_due
        assert list(sdc[0]["ranks"]) == [FAULT_RANK]
        assert sdc[0]["recipe"] == f"hidden.{BLOCK}"
        assert all(rep["step"] < HEAL_STEP + 3 for rep in sdc), (
            "reports continued after the fault was removed"
        )
        stragglers = [rep for rep in r["reports"] if rep["kind"] == "straggler"]
        assert not stragglers
        assert r["decisions"][0]["mode"] == "fresh"  # at attach: nothing to restore
        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert decision["mode"] == "restore"
        assert decision["step"] is not None and decision["step"] < FAULT_STEP
        trust = {int(k): v for k, v in r["trust"].items()}
        rejected = [s for s, st in trust.items() if st == "rejected"]
        assert rejected and all(s >= decision["step"] for s in rejected)
        assert not any(
            st == "recovery_verified" for s, st in trust.items() if FAULT_STEP <= s < first_due
        )
        # healed: steps after the hook was removed are certified again
        assert any(st == "recovery_verified" for s, st in trust.items() if s > HEAL_STEP), trust
    assert len({json.dumps(r["trust"], sort_keys=True) for r in ranks}) == 1, (
        "ranks disagree on trust states"
    )


@pytest.mark.timeout(300)
def test_a_parameter_corrupted_in_memory_is_named_rolled_back_and_training_ends_bitwise(
    tmp_path: Path,
) -> None:
    """One weight of rank 2's DDP replica changes in its memory before step 6 (a silent memory corruption: no hook,
    no replay fault). Its parameters diverge from its peers', which the strict majority over parameter digests names;
    every rank rolls back to the newest recovery-verified step (session.recover) and trains on, and ends bitwise
    equal to a run that never had the fault."""
    world, diverge_step, steps = 3, 6, 14
    res = launch(
        [
            "-m",
            "qualification.programs.scout_rank",
            "--out",
            str(tmp_path),
            "--steps",
            str(steps),
            "--fault-rank",
            "-1",
            "--diverge-rank",
            str(FAULT_RANK),
            "--diverge-step",
            str(diverge_step),
            "--fault-block",
            str(BLOCK),
            "--recover-on-sdc",
            "--baseline",
        ],
        world_size=world,
        timeout_s=260,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in ranks:
        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc"]
        assert sdc and all(
            rep["ranks"] == [FAULT_RANK] and rep["scope"] == "rank" for rep in sdc
        ), sdc
        assert diverge_step <= sdc[0]["step"] <= diverge_step + 1, sdc[
            0
        ]  # the corrupted weight is checked each step
        assert "parameters diverged" in sdc[0]["reason"], sdc[0]["reason"]
        assert len(r["recoveries"]) == 1 and r["recoveries"][0]["to"] < diverge_step, r[
            "recoveries"
        ]
        assert r["state_digest"] == r["baseline_digest"], (
            f"rank {r['rank']}: rollback did not restore the trajectory"
        )
        trust = {int(k): v for k, v in r["trust"].items()}
        assert any(st == "recovery_verified" for s, st in trust.items() if s > sdc[0]["step"]), (
            trust
        )
    assert len({json.dumps(r["trust"], sort_keys=True) for r in ranks}) == 1, (
        "ranks disagree on trust states"
    )

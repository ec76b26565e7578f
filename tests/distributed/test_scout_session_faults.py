"""SCOUT faults other than persistent SDC, through enable_resiliency on 4 real gloo ranks: a compute straggler (slow
replay), a communication straggler (slow link before each collective, found by intersecting overlapping groups and
mapped to its host), and a transient replay-only fault (rejected, then clean certification resumes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _heavy import heavy

from gemscout.inventory import inventory
from qualification.launch import launch

WORLD = 4


def run(tmp_path: Path, *extra: str) -> list[dict]:
    res = launch(
        [
            "-m",
            "qualification.programs.scout_rank",
            "--out",
            str(tmp_path),
            "--steps",
            "14",
            "--fault-rank",
            "-1",
            *extra,
        ],
        world_size=WORLD,
        timeout_s=200,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def kinds(rank: dict, kind: str) -> list[dict]:
    return [rep for rep in rank["reports"] if rep["kind"] == kind]


@heavy(
    "scout_cell-compute-* and scout_cell-comm-*",
    "scout-straggler",
    "three 4-rank launches, ~75 s on 2 cores",
)
@pytest.mark.timeout(300)
def test_compute_and_communication_stragglers_are_localized_without_sdc(tmp_path: Path) -> None:
    ranks = run(tmp_path / "compute", "--replay-delay-rank", "3", "--replay-delay-s", "0.6")
    for r in ranks:
        found = kinds(r, "straggler")
        assert found and {tuple(rep["ranks"]) for rep in found} == {(3,)}, found
        assert found[0]["confirmations"] >= 2
        assert not kinds(r, "sdc")
    ranks = run(
        tmp_path / "comm",
        "--comm-delay-rank",
        "1",
        "--comm-delay-s",
        "0.4",
        "--comm-probe-interval",
        "2",
    )
    for r in ranks:
        found = kinds(r, "straggler")
        assert found, r["reports"]
        assert {tuple(rep["ranks"]) for rep in found} == {(1,)}, found
        assert all(rep["host"] == "host-1" and rep["scope"] == "node" for rep in found), found
        assert not kinds(r, "sdc")


@pytest.mark.timeout(300)
def test_transient_replay_fault_is_rejected_then_certification_resumes(tmp_path: Path) -> None:
    ranks = run(
        tmp_path,
        "--replay-fault-rank",
        "3",
        "--replay-fault-step",
        "4",
        "--replay-fault-recipe",
        "embedding",
        "--keep-ckpt",
    )
    for r in ranks:
        sdc = kinds(r, "sdc")
        assert [(rep["step"], list(rep["ranks"]), rep["recipe"]) for rep in sdc] == [
            (4, [3], "embedding")
        ]
        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert decision["step"] is None or decision["step"] < 4
        trust = {int(k): v for k, v in r["trust"].items()}
        assert trust.get(4) != "recovery_verified"
        assert any(st == "recovery_verified" for s, st in trust.items() if s > 4), trust
        m = r["metrics"]  # session.metrics(): what the loop's logger saw
        assert (
            m["reports.sdc"] == 1 and m["gemini.rejected"] >= 1 and m["scout.last_cycle_clean"] == 1
        ), m
        assert m["gemini.newest_verified_step"] > 4, m

    # Every rank kept the report beside its checkpoints; gemscout inspect lists it once, seen by all four.
    inv = inventory(tmp_path / "ckpt")
    sdc = [f for f in inv.faults if f["kind"] == "sdc"]
    assert [(f["step"], f["ranks"], f["recipe"], sorted(f["reported_by"])) for f in sdc] == [
        (4, [3], "embedding", [0, 1, 2, 3])
    ], inv.faults
    assert (
        inv.decision.step is not None and inv.decision.step != 4
    )  # a restart never takes the rejected capture

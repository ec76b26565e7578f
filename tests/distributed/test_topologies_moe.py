"""Expert parallelism (MoE, mesh ("dp", "ep") = 2x2) and context parallelism (mesh ("dp", "cp") = 2x2) under GEMINI +
SCOUT, on 4 real gloo ranks (qualification/programs/moe_rank.py). For each workload:

* the topology comes from the mesh: peers vary along ``dp`` and keep the ``ep`` / ``cp`` coordinate ({0,2}, {1,3});
* healthy trajectory: parameters, optimizer state and losses bitwise equal to the same training without gemscout;
* SCOUT: zero reports on healthy steps; a replay-only fault on rank 2 at step 5 is detected within its dp pair
  (peer-group report [0, 2], no culprit with two peers); the uncertified candidates are rejected job-wide and a
  later clean rotation certifies a step after the fault;
* MoE only, the AllToAll check: the replay of the recorded dispatch, a balanced split and a cyclic permutation
  verifies clean on every rank at every healthy step, and when rank 3 corrupts its replayed send at step 7 the
  check names the pair (3 -> 2) on both ranks of that EP group, and nothing on the other group; the session (which
  runs the check in its optimizer pre-hook, ``session.check_alltoall``) gates step 7 job-wide like SDC: no capture on
  any rank, an ``alltoall`` RecoveryDecision naming an older step;
* SIGKILL of rank 1 after step 4, relaunch: every rank recovers and ends bitwise equal to the uninterrupted run.

And MoE on a 3x2 mesh (6 ranks, three replicas of each expert): the same replay fault, on rank 4, is attributed to
exactly rank 4 by strict majority within its dp group {0, 2, 4}, while the other EP coordinate's group agrees.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _heavy import heavy

from qualification.launch import launch

STEPS, FAULT_RANK, FAULT_STEP, RECIPE = (
    9,
    2,
    5,
    "hidden.1",
)  # hidden.1 is due at odd steps (two blocks)
A2A_RANK, A2A_STEP = 3, 7  # the first capture after the quarantine of hidden.1 ends


def run(
    out: Path, workload: str, *extra: str, world: int = 4, steps: int = STEPS
) -> tuple[bool, list[int], list[dict[str, Any]]]:
    res = launch(
        [
            "-m",
            "qualification.programs.moe_rank",
            "--out",
            str(out),
            "--workload",
            workload,
            "--steps",
            str(steps),
            *extra,
        ],
        world_size=world,
        timeout_s=300,
        log_dir=out / "logs",
    )
    docs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)] if res.ok else []
    return res.ok, res.returncodes, docs


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "workload",
    [
        pytest.param(
            "moe",
            marks=heavy(
                "moe_cell-*-dp-ep-w4-*",
                "topologies",
                "the MoE mesh, ~55 s on 2 cores; test_megatron_moe keeps expert parallelism in CI",
            ),
        ),
        pytest.param(
            "cp",
            marks=heavy(
                "moe_cell-*-cp-*",
                "topologies",
                "the CP mesh, ~65 s on 2 cores",
            ),
        ),
    ],
)
def test_parallel_mesh_lifecycle(tmp_path: Path, workload: str) -> None:
    ckpt = tmp_path / "ckpt"
    ok, codes, ranks = run(
        tmp_path / "scout",
        workload,
        "--ckpt",
        str(ckpt),
        "--baseline",
        "--replay-fault-rank",
        str(FAULT_RANK),
        "--replay-fault-step",
        str(FAULT_STEP),
        "--replay-fault-recipe",
        RECIPE,
        "--a2a-corrupt-rank",
        str(A2A_RANK),
        "--a2a-corrupt-step",
        str(A2A_STEP),
    )
    assert ok, codes
    model_dim = "ep" if workload == "moe" else "cp"
    for r in ranks:
        topo = r["topology"]
        assert topo["peer_groups"] == [[0, 2], [1, 3]] and topo["model_dims"] == [model_dim], topo
        assert topo["kind"] == f"dp+{model_dim}" and r["disabled_reason"] is None
        assert r["state_digest"] == r["baseline_digest"], (
            f"rank {r['rank']}: gemscout changed training"
        )
        assert r["losses"] == r["baseline_losses"]

        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc" and rep["recipe"] != "alltoall"]
        assert [(rep["step"], rep["recipe"], rep["scope"], rep["ranks"]) for rep in sdc] == [
            (FAULT_STEP, RECIPE, "peer_group", [0, 2])
        ], sdc
        assert "detection without a culprit" in sdc[0]["reason"]
        assert not [rep for rep in r["reports"] if rep["kind"] != "sdc"], r["reports"]
        for step, cycle in r["cycles"].items():
            expect = {"inconclusive"} if int(step) == FAULT_STEP else {"agree"}
            seen = {
                v["verdict"]
                for n, v in cycle["verdicts"].items()
                if n == RECIPE or int(step) != FAULT_STEP
            }
            assert seen == expect, (step, cycle["verdicts"])

        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert decision["mode"] == "restore" and decision["step"] < FAULT_STEP
        trust = {int(k): v for k, v in r["trust"].items()}
        rejected = [s for s, st in trust.items() if st == "rejected"]
        assert rejected and all(decision["step"] < s < FAULT_STEP for s in rejected), trust
        gates = [d for d in r["decisions"] if d["failure_kind"] == "alltoall"]
        if (
            workload == "moe"
        ):  # the AllToAll mismatch gates its step job-wide, like SDC: never captured
            assert A2A_STEP not in trust, trust
            assert (
                len(gates) == 1 and gates[0]["mode"] == "restore" and gates[0]["step"] < A2A_STEP
            ), gates
        else:
            assert A2A_STEP in trust and gates == [], (trust, gates)
        assert any(st == "recovery_verified" for s, st in trust.items() if s > FAULT_STEP), trust

        a2a_reports = [rep for rep in r["reports"] if rep["recipe"] == "alltoall"]
        if workload == "cp":
            assert r["a2a"] == {} and a2a_reports == []
            continue
        group = [0, 1] if r["rank"] < 2 else [2, 3]
        assert sorted(int(s) for s in r["a2a"]) == list(range(1, STEPS + 1))
        for step, results in r["a2a"].items():
            assert [res["group"] for res in results] == [group]
            res = results[0]
            assert set(res["cases"]) == {"recorded", "balanced", "cyclic"}
            assert (
                res["cases"]["recorded"] != res["cases"]["balanced"]
            )  # top-1 routing is uneven here
            if int(step) == A2A_STEP and A2A_RANK in group:
                assert res["verdict"] == "mismatch"
                assert {(m["case"], m["src"], m["dst"], m["kind"]) for m in res["mismatches"]} == {
                    ("balanced", 3, 2, "transit")
                }
            else:
                assert res["verdict"] == "clean", (step, res)
        if A2A_RANK in group:
            assert [(rep["step"], rep["scope"], rep["ranks"]) for rep in a2a_reports] == [
                (A2A_STEP, "peer_group", [2, 3])
            ]
            assert "sent by rank 3 arrived changed at rank 2" in a2a_reports[0]["reason"]
        else:
            assert a2a_reports == []
    assert len({json.dumps(r["trust"]) for r in ranks}) == 1, "ranks disagree on trust"

    # SIGKILL rank 1 after step 4, then relaunch: recovered, and bitwise equal to the uninterrupted run.
    killed = tmp_path / "killed"
    ok, codes, _ = run(
        killed, workload, "--ckpt", str(killed / "ckpt"), "--kill-rank", "1", "--kill-step", "4"
    )
    assert not ok and codes[1] == -9, codes
    ok, codes, again = run(
        tmp_path / "again", workload, "--ckpt", str(killed / "ckpt"), "--baseline"
    )
    assert ok, codes
    for r, first in zip(again, ranks, strict=True):
        assert r["resume_step"] >= 3, r["resume_step"]
        assert r["state_digest"] == r["baseline_digest"] == first["baseline_digest"]
        assert r["losses"] == r["baseline_losses"]


@heavy("moe_cell-replay-sdc-dp3-dp3-ep-w6-*", "topologies", "6 MoE ranks, ~23 s on 2 cores")
@pytest.mark.timeout(420)
def test_moe_dp3_attributes_the_exact_rank(tmp_path: Path) -> None:
    steps, fault_rank = 6, 4
    ok, codes, ranks = run(
        tmp_path,
        "moe",
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--baseline",
        "--replay-fault-rank",
        str(fault_rank),
        "--replay-fault-step",
        str(FAULT_STEP),
        "--replay-fault-recipe",
        RECIPE,
        world=6,
        steps=steps,
    )
    assert ok, codes
    for r in ranks:
        assert r["topology"]["peer_groups"] == [[0, 2, 4], [1, 3, 5]], r["topology"]
        assert r["state_digest"] == r["baseline_digest"], (
            f"rank {r['rank']}: gemscout changed training"
        )
        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc" and rep["recipe"] != "alltoall"]
        assert [(rep["step"], rep["recipe"], rep["scope"], rep["ranks"]) for rep in sdc] == [
            (FAULT_STEP, RECIPE, "rank", [fault_rank])
        ], sdc
        verdict = r["cycles"][str(FAULT_STEP)]["verdicts"][RECIPE]
        assert verdict["verdict"] == "attributed" and verdict["ranks"] == [fault_rank], verdict
        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert decision["mode"] == "restore" and decision["step"] < FAULT_STEP
        assert not [rep for rep in r["reports"] if rep["kind"] != "sdc"], r["reports"]
    assert len({json.dumps(r["trust"]) for r in ranks}) == 1, "ranks disagree on trust"

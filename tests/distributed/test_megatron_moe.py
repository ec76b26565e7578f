"""Megatron Core MoE with expert parallelism under gemscout: real gloo ranks running Megatron's own GPTModel with MoE
layers (``[megatron]`` extra), 4 ranks, ``expert_model_parallel_size=2``, tp=1 (Megatron's expert-data-parallel
size 2, data-parallel size 4).

What runs for real: ``parallel_state.initialize_model_parallel`` (DP, EP and expert-DP groups over gloo), Megatron's
RNG tracker, ``GPTModel`` from the local layer spec with ``num_moe_experts=4`` (its ``MoELayer``: top-2 ``TopKRouter``
with the auxiliary load-balancing loss, ``SequentialMLP`` experts, the ``alltoall`` token dispatcher, whose dispatch
and combine are ``all_to_all_single`` with uneven splits over the EP group), dropout on, SIGKILL, node folder loss.
What is stood in, and why (test-only, ``qualification.programs._megatron_cpu_shims``): Megatron's CUDA calls on its
CPU path (buffers on ``torch.cuda.current_device()``, the RNG tracker on the CUDA generator), and for MoE the
dispatcher's CUDA side stream (a no-op CPU stand-in), its device-to-host copy of the split sizes (numpy arrays, as its
GPU path gives them) and the missing ``te_general_gemm`` name without Transformer Engine (its torch fallback runs).
The rank program averages gradients itself (experts over the expert-data-parallel group) and steps a torch AdamW.

- GEMINI + SCOUT on every step (a healthy trajectory for training: the fault below strikes replays only): every rank
  bitwise equal to the run without gemscout, Megatron's RNG tracker streams included.
- SCOUT: peers are Megatron's expert-data-parallel groups ({0, 2}, {1, 3}: the ranks holding the same experts);
  the MoE layers replay with their AllToAlls on every rank (collective time on all four); the AllToAll check of the
  dispatch is clean at every healthy step; a replay fault on rank 2 is detected within its pair (two peers: no
  culprit), the uncertified candidates are rejected, a later step is certified, no other report; rank 3 corrupting
  one byte of its replayed ``balanced`` AllToAll send at step 2 is named as the pair (3 -> 2) in its EP group only,
  and the session gates step 2 job-wide (an ``alltoall`` RecoveryDecision on every rank, never captured).
- (``GEMSCOUT_HEAVY_TESTS=1``: three more launches) GEMINI through the lifecycle driver: SIGKILL of rank 1 after
  step 4 plus the loss of its node folder → recovered from the peer's replica, every rank bitwise equal to the run
  without gemscout.
- (``GEMSCOUT_HEAVY_TESTS=1``) 6 ranks, ep=2 x expert-dp=3: the same fault is attributed to exactly that rank.

Skipped, with the reason, where megatron-core is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from qualification.launch import launch
from qualification.programs.lifecycle import run_cell

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core is not installed (pip install -e '.[megatron]')",
)

STEPS, FAULT_RANK, FAULT_STEP, RECIPE = (
    8,
    2,
    3,
    "hidden.1",
)  # hidden.1 is due at odd steps (two layers)
A2A_RANK, A2A_STEP = (
    3,
    2,
)  # early: a gate at step 7 would reject 5 and 6 before anything after the fault certifies
HEAVY = os.environ.get("GEMSCOUT_HEAVY_TESTS") == "1"


def ranks(folder: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def scout_run(tmp: Path, world: int, fault_rank: int, *extra: str) -> list[dict[str, Any]]:
    out = tmp / "scout"
    res = launch(
        [
            "-m",
            "qualification.programs.megatron_rank",
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--topology",
            "megatron-ep2",
            "--ckpt",
            str(tmp / "scout-ckpt"),
            "--scout",
            "--keep-generations",
            "8",
            "--fault-rank",
            str(fault_rank),
            "--fault-step",
            str(FAULT_STEP),
            "--fault-recipe",
            RECIPE,
            *extra,
        ],
        world_size=world,
        timeout_s=300,
        log_dir=tmp / "logs" / "scout",
    )
    assert res.ok, (res, sorted((tmp / "logs" / "scout").glob("*.log")))
    return ranks(out, world)


def check_sdc_handled(r: dict[str, Any]) -> None:
    """The SDC decision restores a step before the fault, the candidates after it are rejected, a later step is
    certified, and no other report was raised."""
    decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
    assert decision["mode"] == "restore" and decision["step"] < FAULT_STEP, decision
    trust = {int(k): v for k, v in r["trust"].items()}
    rejected = [s for s, st in trust.items() if st == "rejected"]
    assert rejected and all(decision["step"] < s < FAULT_STEP for s in rejected), trust
    assert any(st == "recovery_verified" for s, st in trust.items() if s > FAULT_STEP), trust
    assert not [rep for rep in r["reports"] if rep["kind"] != "sdc"], r["reports"]


@pytest.mark.timeout(600)
def test_ep2_scout_detects_a_replay_fault_in_its_pair_and_training_stays_bitwise(
    tmp_path: Path,
) -> None:
    base_run = launch(
        [
            "-m",
            "qualification.programs.megatron_rank",
            "--out",
            str(tmp_path / "baseline"),
            "--steps",
            str(STEPS),
            "--topology",
            "megatron-ep2",
        ],
        world_size=4,
        timeout_s=300,
        log_dir=tmp_path / "logs" / "baseline",
    )
    assert base_run.ok, base_run
    base = ranks(tmp_path / "baseline", 4)
    # Expert shards differ across the EP group, replicas agree across the expert-data-parallel group.
    assert (
        base[0]["state_digest"]
        == base[2]["state_digest"]
        != base[1]["state_digest"]
        == base[3]["state_digest"]
    )
    assert all(
        r["ep"] == 2 and r["ep_rank"] == i % 2 and r["replicas_equal"] for i, r in enumerate(base)
    )

    # GEMINI + SCOUT, a replay fault on rank 2 and a corrupted AllToAll replay send on rank 3: training is untouched,
    # so every rank must match the baseline.
    for i, r in enumerate(
        scout_run(
            tmp_path,
            4,
            FAULT_RANK,
            "--a2a-corrupt-rank",
            str(A2A_RANK),
            "--a2a-corrupt-step",
            str(A2A_STEP),
        )
    ):
        assert r["peers"] == r["edp_group"] == [i % 2, i % 2 + 2], r["peers"]
        assert r["topology"]["dims"] == ["dp", "ep"] and r["topology"]["peer_groups"] == [
            [0, 2],
            [1, 3],
        ]
        assert r["state_digest"] == base[i]["state_digest"] and r["losses"] == base[i]["losses"], (
            f"rank {i}"
        )
        assert r["errors"] == [] and r["closed_by_destroy"] is True
        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc" and rep["recipe"] != "alltoall"]
        assert [(rep["step"], rep["recipe"], rep["scope"], rep["ranks"]) for rep in sdc] == [
            (FAULT_STEP, RECIPE, "peer_group", [0, 2])
        ], sdc
        assert "detection without a culprit" in sdc[0]["reason"]
        check_sdc_handled(r)
        # The AllToAll mismatch names the pair in its EP group only, and gates its step job-wide (never captured).
        group = [0, 1] if i < 2 else [2, 3]
        a2a_reports = [
            (rep["step"], rep["scope"], rep["ranks"])
            for rep in r["reports"]
            if rep["recipe"] == "alltoall"
        ]
        assert a2a_reports == ([(A2A_STEP, "peer_group", [2, 3])] if A2A_RANK in group else []), (
            a2a_reports
        )
        gates = [d for d in r["decisions"] if d["failure_kind"] == "alltoall"]
        assert len(gates) == 1 and gates[0]["mode"] == "restore" and gates[0]["step"] < A2A_STEP, (
            gates
        )
        assert str(A2A_STEP) not in r["trust"], r["trust"]
        assert sorted(r["cycles"]) == [str(s) for s in range(1, STEPS + 1)]
        for step, cycle in r["cycles"].items():
            faulty = int(step) == FAULT_STEP
            for name, v in cycle["verdicts"].items():
                assert v["verdict"] == ("inconclusive" if faulty and name == RECIPE else "agree"), (
                    step,
                    name,
                    v,
                )
            # The MoE layers replay with their AllToAlls over the EP group, on every rank.
            hidden = [n for n in cycle["verdicts"] if n.startswith("hidden.")]
            assert hidden and all(
                sorted(cycle["collective_s"][n]) == ["0", "1", "2", "3"] for n in hidden
            ), cycle
        assert sorted(int(s) for s in r["a2a"]) == list(range(1, STEPS + 1))
        for step, results in r["a2a"].items():
            corrupted = int(step) == A2A_STEP and A2A_RANK in group
            verdict = "mismatch" if corrupted else "clean"
            assert [(res["group"], res["verdict"]) for res in results] == [(group, verdict)], (
                step,
                results,
            )
            assert set(results[0]["cases"]) == {"recorded", "balanced", "cyclic"}
            assert (
                results[0]["cases"]["recorded"] != results[0]["cases"]["balanced"]
            )  # top-2 routing is uneven
            found = {(m["case"], m["src"], m["dst"], m["kind"]) for m in results[0]["mismatches"]}
            assert found == ({("balanced", 3, 2, "transit")} if corrupted else set()), (step, found)
        assert bool(r["fired"]) == (i == FAULT_RANK)
    assert len({json.dumps(r["trust"]) for r in ranks(tmp_path / "scout", 4)}) == 1, (
        "ranks disagree on trust"
    )


@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not HEAVY,
    reason="three launches of 4 Megatron ranks on 2 cores: set GEMSCOUT_HEAVY_TESTS=1 "
    "(campaign cell megatron-ep2-sigkill-node-loss)",
)
def test_ep2_sigkill_and_node_loss_recover_bitwise_through_the_lifecycle_driver(
    tmp_path: Path,
) -> None:
    # The campaign path: baseline, killed run, node folder deleted, relaunch, rank-by-rank comparison.
    cell = {
        "id": "t",
        "world_size": 4,
        "workload": "gpt-megatron",
        "topology": "megatron-ep2",
        "seed": 0,
        "timeout_s": 300,
        "params": {"steps": STEPS},
        "fault": {
            "kind": "sigkill",
            "rank": 1,
            "step": 4,
            "phase": "after-step",
            "node_loss": True,
        },
    }
    result = run_cell(cell, tmp_path)
    obs = result["observed"]
    assert obs["rank_exit_codes"][1] == -9, obs
    assert obs["recovered_step"] == 4 and obs["decision"]["sources"]["1"].startswith("peer:"), obs[
        "decision"
    ]
    assert result["status"] == "passed" and obs["bitwise_equal"] and obs["losses_equal"], result
    assert obs["replicas_equal"] and obs["final_step"] == STEPS and obs["errors"] == []
    base, run = ranks(tmp_path / "baseline", 4), ranks(tmp_path / "run", 4)
    assert (
        base[0]["state_digest"] != base[1]["state_digest"]
    )  # two expert shards, each recovered to its own
    assert all(r["resume_step"] == 4 and r["ep"] == 2 for r in run)


@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not HEAVY,
    reason="6 Megatron ranks on 2 cores: set GEMSCOUT_HEAVY_TESTS=1 (campaign cell "
    "megatron-ep2-edp3-scout)",
)
def test_ep2_edp3_replay_fault_is_attributed_to_its_rank(tmp_path: Path) -> None:
    world, fault_rank = 6, 4
    results = scout_run(tmp_path, world, fault_rank)
    for i, r in enumerate(results):
        assert r["peers"] == r["edp_group"] == [i % 2, i % 2 + 2, i % 2 + 4], r["peers"]
        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc"]
        assert [(rep["step"], rep["recipe"], rep["scope"], rep["ranks"]) for rep in sdc] == [
            (FAULT_STEP, RECIPE, "rank", [fault_rank])
        ], sdc
        verdict = r["cycles"][str(FAULT_STEP)]["verdicts"][RECIPE]
        assert verdict["verdict"] == "attributed", verdict
        check_sdc_handled(r)
        assert all(res["verdict"] == "clean" for step in r["a2a"].values() for res in step), r[
            "a2a"
        ]
    assert results[fault_rank]["fired"] and not any(
        r["fired"] for r in results if r["rank"] != fault_rank
    )

"""GEMINI and SCOUT on pipeline parallelism (``torch.distributed.pipelining``, two stages, 4 micro-batches) with real
gloo ranks: each rank builds only its stage (stage 0: embedding + blocks 0-1; stage 1: block 2 + norm + head, the loss
in the schedule's loss_fn) and hands that stage module and its optimizer to ``enable_resiliency`` unchanged.

* GEMINI, ``pp`` (2 ranks, 1F1B) and ``pp-dp`` (2 stages x 2 replicas, GPipe): the healthy trajectory with GEMINI is
  bitwise the baseline without gemscout; a SIGKILL of a stage-1 rank in the replication phase plus the loss of its
  node is recovered from its peer's replica and every rank's stage ends bitwise equal to the uninterrupted run.
* SCOUT, ``pp-dp`` (1F1B): the peers are the two replicas of one stage; each stage replays its own recipes
  (``pp0.embedding``/``pp0.hidden.*``, ``pp1.hidden.0``/``pp1.output``) and every rank judges every stage's; the
  healthy steps are clean; a replay-only fault on one rank is detected in its stage's dp pair without a culprit
  (two peers); candidates are rejected job-wide; certification resumes; training is bitwise unchanged.
* SCOUT, ``pp-dp3`` (6 ranks, one launch): three replicas per stage, so the faulty rank is named exactly.
* SCOUT, ``pp`` (no dp dim): no peers; every verdict INCONCLUSIVE with the reason, nothing reported or vouched for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qualification.launch import launch
from qualification.programs.lifecycle import _rank_argv, run_cell


def cell(topology: str, world: int, schedule: str, fault: dict[str, Any]) -> dict[str, Any]:
    return {"id": "t", "world_size": world, "workload": "three-block", "topology": topology, "seed": 0,
            "timeout_s": 200, "fault": fault, "params": {"steps": 6, "schedule": schedule}}


def ranks_of(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("topology", "world", "schedule", "killed_rank"),
                         [("pp", 2, "1f1b", 1), ("pp-dp", 4, "gpipe", 2)])
def test_gemini_on_a_pipeline_is_bitwise(tmp_path: Path, topology: str, world: int, schedule: str,
                                         killed_rank: int) -> None:
    fault = {"kind": "sigkill", "rank": killed_rank, "step": 4, "phase": "replicate", "node_loss": True}
    spec = cell(topology, world, schedule, fault)
    killed = run_cell(spec, tmp_path / "killed")  # baseline, the killed run, the relaunch
    obs = killed["observed"]
    assert obs["rank_exit_codes"][killed_rank] == -9, killed
    assert obs["decision"]["mode"] == "restore" and obs["decision"]["step"] == 3, obs["decision"]
    assert obs["decision"]["sources"][str(killed_rank)].startswith("peer:"), obs["decision"]
    assert obs["bitwise_equal"] and obs["losses_equal"] and obs["errors"] == [], killed
    assert killed["status"] == "passed"

    baseline = ranks_of(tmp_path / "killed" / "baseline", world)
    replicas = world // 2
    for r in range(world):  # each rank holds its own stage; the stages of one pipeline see the same loss
        partner = (r + replicas) % world
        assert baseline[r]["state_digest"] != baseline[partner]["state_digest"]
        assert baseline[r]["losses"] == baseline[partner]["losses"] and len(baseline[r]["losses"]) == 6

    # The healthy run with GEMINI, compared with the same baseline.
    res = launch(_rank_argv(tmp_path / "healthy", spec, tmp_path / "ckpt-healthy", []), world_size=world,
                 timeout_s=200, log_dir=tmp_path / "logs-healthy")
    assert res.ok, res
    for r, rank in enumerate(ranks_of(tmp_path / "healthy", world)):
        assert rank["state_digest"] == baseline[r]["state_digest"], f"rank {r}: GEMINI changed training"
        assert rank["losses"] == baseline[r]["losses"] and rank["errors"] == []
        assert rank["stats"], rank  # it did checkpoint


def scout(tmp_path: Path, topology: str, world: int, steps: int, *extra: str) -> list[dict[str, Any]]:
    res = launch(["-m", "qualification.programs.scout_rank", "--out", str(tmp_path), "--steps", str(steps),
                  "--fault-rank", "-1", "--topology", topology, "--baseline", *extra],
                 world_size=world, timeout_s=240, log_dir=tmp_path / "logs")
    assert res.ok, res
    return ranks_of(tmp_path, world)


def check_fault_handled(ranks: list[dict[str, Any]], fault_step: int, recipe: str) -> None:
    """Every rank: one SDC report for the fault, candidates rejected job-wide, certification after the fault, the
    same trust and reports on every rank, and training bitwise the run without gemscout."""
    for r in ranks:
        assert r["state_digest"] == r["baseline_digest"], f"rank {r['rank']}: SCOUT changed training"
        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc"]
        assert [(rep["step"], rep["recipe"]) for rep in sdc] == [(fault_step, recipe)], r["reports"]
        assert all(rep["step"] >= fault_step for rep in r["reports"]), r["reports"]  # healthy steps: no report
        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert decision["mode"] == "restore" and decision["step"] < fault_step, decision
        trust = {int(k): v for k, v in r["trust"].items()}
        rejected = [s for s, st in trust.items() if st == "rejected"]
        assert rejected and all(decision["step"] < s < fault_step for s in rejected), trust
        assert trust.get(fault_step) != "recovery_verified"
        assert any(st == "recovery_verified" for s, st in trust.items() if s > fault_step), trust
    for other in ranks[1:]:
        assert other["trust"] == ranks[0]["trust"], "ranks disagree on trust"
        assert [(x["kind"], x["step"], x["ranks"]) for x in other["reports"]] == \
               [(x["kind"], x["step"], x["ranks"]) for x in ranks[0]["reports"]], "ranks saw other reports"


@pytest.mark.timeout(300)
def test_scout_on_pp_dp_detects_in_the_stage_pair(tmp_path: Path) -> None:
    fault_rank, fault_step, recipe = 1, 7, "pp0.hidden.1"  # stage 0's second block is due at odd steps
    ranks = scout(tmp_path, "pp-dp", 4, 12, "--schedule", "1f1b", "--replay-fault-rank", str(fault_rank),
                  "--replay-fault-step", str(fault_step), "--replay-fault-recipe", recipe)
    check_fault_handled(ranks, fault_step, recipe)
    for r in ranks:
        stage = r["rank"] // 2
        assert r["topology"]["peer_groups"] == [[0, 1], [2, 3]] and r["disabled_reason"] is None
        assert r["topology"]["stage_label"] == f"pp{stage}" and r["topology"]["peers"] == [2 * stage, 2 * stage + 1]
        own = {name for names in r["due"].values() for name in names}
        assert all(name.startswith(f"pp{stage}.") for name in own), own  # a stage replays its own recipes
        assert (f"pp{stage}.embedding" in own) == (stage == 0) and (f"pp{stage}.output" in own) == (stage == 1)
        assert [f["rank"] for f in r["fired"] if f["kind"] == "bitflip"] == [fault_rank] * (r["rank"] == fault_rank)
        sdc = next(rep for rep in r["reports"] if rep["kind"] == "sdc")
        assert (sdc["scope"], sdc["ranks"]) == ("peer_group", [0, 1])
        assert "detection without a culprit" in sdc["reason"]
    cycles = {int(s): c for s, c in ranks[0]["cycles"].items()}
    for step, c in cycles.items():  # every rank judges both stages' recipes, each in its own pair
        assert {n.split(".")[0] for n in c["verdicts"]} == {"pp0", "pp1"}, c["verdicts"]
        assert {"pp0.embedding", "pp1.output", "pp1.hidden.0"} <= set(c["verdicts"])
        bad = {n: v["verdict"] for n, v in c["verdicts"].items() if v["verdict"] != "agree"}
        assert bad == ({recipe: "inconclusive"} if step == fault_step else {}), (step, bad)
    assert cycles[fault_step - 1]["certified"] == fault_step - 2  # the rotation covered every recipe before


@pytest.mark.timeout(300)
def test_scout_on_pp_dp3_names_the_rank(tmp_path: Path) -> None:
    fault_rank, fault_step, recipe = 4, 4, "pp1.output"
    ranks = scout(tmp_path, "pp-dp3", 6, 7, "--replay-fault-rank", str(fault_rank),
                  "--replay-fault-step", str(fault_step), "--replay-fault-recipe", recipe)
    check_fault_handled(ranks, fault_step, recipe)
    for r in ranks:
        assert r["topology"]["peer_groups"] == [[0, 1, 2], [3, 4, 5]]
        sdc = next(rep for rep in r["reports"] if rep["kind"] == "sdc")
        assert (sdc["scope"], sdc["ranks"]) == ("rank", [fault_rank]), sdc


@pytest.mark.timeout(150)
def test_scout_on_a_pure_pipeline_has_no_peers_and_says_so(tmp_path: Path) -> None:
    ranks = scout(tmp_path, "pp", 2, 4, "--replay-fault-rank", "1", "--replay-fault-step", "2",
                  "--replay-fault-recipe", "pp1.hidden.0")
    for r in ranks:
        assert r["state_digest"] == r["baseline_digest"]
        assert r["topology"]["peer_groups"] == [[0], [1]] and r["topology"]["stage_label"] == f"pp{r['rank']}"
        assert "pipeline stages" in r["disabled_reason"]
        assert r["reports"] == [] and r["fired"] == []  # nothing replayed, nothing claimed
        for c in r["cycles"].values():
            for v in c["verdicts"].values():
                assert v["verdict"] == "inconclusive" and not v["pre_ok"] and "cannot compare" in v["reason"]
        assert {st for s, st in r["trust"].items() if int(s) >= 1} == {"candidate"}, r["trust"]

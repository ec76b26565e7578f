"""GEMINI and SCOUT on pipeline parallelism (``torch.distributed.pipelining``, 4 micro-batches) with real gloo ranks:
each rank builds only its stage(s) of the three-block workload and hands that stage module (an ``nn.ModuleList`` of
its stage modules when it holds several, the DDP wrapper when DDP replicates it) and its optimizer to
``enable_resiliency`` unchanged. Topologies: :data:`qualification.programs._pipeline.PIPELINE_TOPOLOGIES`.

* GEMINI (one parametrized test, 4 launches each: baseline, killed, relaunch, healthy): ``pp`` 1F1B, ``pp-dp`` GPipe,
  ``pp3`` 1F1B (three stages; the middle stage's rank is killed), ``pp-virtual`` (four stages over two ranks) with
  Interleaved 1F1B, ``pp-v`` with ZBV Zero Bubble (the V order: rank c holds stages c and 3 - c). Looped BFS,
  Interleaved Zero Bubble, DualPipeV, ``pp-fsdp`` GPipe, ``pp-tp`` and ``pp-dp-ddp`` kills run as cells of
  campaigns/topologies.toml only, to keep CI under its time budget. The healthy trajectory
  with GEMINI is bitwise the baseline without gemscout; a SIGKILL in the replication phase plus the loss of the rank's
  node is recovered from its peer's replica and every rank's stages end bitwise equal to the uninterrupted run.
* SCOUT on ``pp-dp`` and ``pp-dp-ddp`` (1F1B): the peers are the two replicas of one stage; each stage replays its own
  recipes (``pp0.embedding``/``pp0.hidden.*``, ``pp1.hidden.0``/``pp1.output``) and every rank judges every stage's;
  the healthy steps are clean; a replay-only fault on one rank is detected in its stage's dp pair without a culprit
  (two peers); candidates are rejected job-wide; certification resumes; training is bitwise unchanged.
* SCOUT on ``pp3-dp2`` (6 ranks): the same with the fault in the middle stage (one block, no embedding, no head).
* SCOUT on ``pp-virtual-dp`` (Interleaved 1F1B, pp=2 x dp=2, four stages): each recipe is named by its own stage
  (``pp0``/``pp2`` on pp coordinate 0, ``pp1``/``pp3`` on 1) and judged over that stage's pair.
* SCOUT on ``pp-v-dp`` (ZBV Zero Bubble, split backward, V order): recipes named by their own stage (``pp0``/``pp3``
  on coordinate 0), detection in the stage pair.
* SCOUT on ``pp-fsdp`` (FSDP2-sharded stages): parameters gathered along dp before replay, detection in the pair.
* SCOUT, ``pp-dp3`` (6 ranks, one launch): three replicas per stage, so the faulty rank is named exactly.
* SCOUT, ``pp`` (no dp dim): no peers; every verdict INCONCLUSIVE with the reason, nothing reported or vouched for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _heavy import heavy

from qualification.launch import launch
from qualification.programs._pipeline import PIPELINE_TOPOLOGIES
from qualification.programs.lifecycle import _rank_argv, run_cell


def cell(topology: str, world: int, schedule: str, fault: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "t",
        "world_size": world,
        "workload": "three-block",
        "topology": topology,
        "seed": 0,
        "timeout_s": 200,
        "fault": fault,
        "params": {"steps": 6, "schedule": schedule},
    }


def ranks_of(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("topology", "world", "schedule", "killed_rank"),
    [
        pytest.param(
            "pp",
            2,
            "1f1b",
            1,
            marks=heavy(
                "lifecycle-*-pp-w2-*", "topologies", "the plain 1F1B pipeline, ~34 s on 2 cores"
            ),
        ),
        pytest.param(
            "pp-dp",
            4,
            "gpipe",
            2,
            marks=heavy(
                "lifecycle-*-pp-dp-w4-*", "topologies", "4 pipeline ranks, ~40 s on 2 cores"
            ),
        ),
        pytest.param(
            "pp3",
            3,
            "1f1b",
            1,
            marks=heavy(
                "lifecycle-*-pp3-w3-*", "topologies", "3 pipeline stages, ~36 s on 2 cores"
            ),
        ),
        ("pp-virtual", 2, "interleaved-1f1b", 0),
        ("pp-v", 2, "zbv", 1),
    ],
)
def test_gemini_on_a_pipeline_is_bitwise(
    tmp_path: Path, topology: str, world: int, schedule: str, killed_rank: int
) -> None:
    fault = {
        "kind": "sigkill",
        "rank": killed_rank,
        "step": 4,
        "phase": "replicate",
        "node_loss": True,
    }
    spec = cell(topology, world, schedule, fault)
    killed = run_cell(spec, tmp_path / "killed")  # baseline, the killed run, the relaunch
    obs = killed["observed"]
    assert obs["rank_exit_codes"][killed_rank] == -9, killed
    assert obs["decision"]["mode"] == "restore" and obs["decision"]["step"] == 3, obs["decision"]
    assert obs["decision"]["sources"][str(killed_rank)].startswith("peer:"), obs["decision"]
    assert obs["bitwise_equal"] and obs["losses_equal"] and obs["errors"] == [], killed
    assert killed["status"] == "passed"

    baseline = ranks_of(tmp_path / "killed" / "baseline", world)
    replicas = PIPELINE_TOPOLOGIES[topology].replicas
    for r in range(
        world
    ):  # each rank holds its own stage(s); the stages of one pipeline see the same loss
        partner = (r + replicas) % world
        assert baseline[r]["state_digest"] != baseline[partner]["state_digest"]
        assert (
            baseline[r]["losses"] == baseline[partner]["losses"] and len(baseline[r]["losses"]) == 6
        )
        if replicas > 1:  # replicas of one stage end equal (DDP or the hand-written average)
            twin = r - r % replicas + (r + 1) % replicas
            assert baseline[r]["state_digest"] == baseline[twin]["state_digest"]

    # The healthy run with GEMINI, compared with the same baseline.
    res = launch(
        _rank_argv(tmp_path / "healthy", spec, tmp_path / "ckpt-healthy", []),
        world_size=world,
        timeout_s=200,
        log_dir=tmp_path / "logs-healthy",
    )
    assert res.ok, res
    for r, rank in enumerate(ranks_of(tmp_path / "healthy", world)):
        assert rank["state_digest"] == baseline[r]["state_digest"], (
            f"rank {r}: GEMINI changed training"
        )
        assert rank["losses"] == baseline[r]["losses"] and rank["errors"] == []
        assert rank["stats"], rank  # it did checkpoint


def scout(
    tmp_path: Path, topology: str, world: int, steps: int, *extra: str
) -> list[dict[str, Any]]:
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
            "--topology",
            topology,
            "--baseline",
            *extra,
        ],
        world_size=world,
        timeout_s=240,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    return ranks_of(tmp_path, world)


def check_fault_handled(ranks: list[dict[str, Any]], fault_step: int, recipe: str) -> None:
    """Every rank: one SDC report for the fault, candidates rejected job-wide, certification after the fault, the
    same trust and reports on every rank, and training bitwise the run without gemscout."""
    for r in ranks:
        assert r["state_digest"] == r["baseline_digest"], (
            f"rank {r['rank']}: SCOUT changed training"
        )
        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc"]
        assert [(rep["step"], rep["recipe"]) for rep in sdc] == [(fault_step, recipe)], r["reports"]
        assert all(rep["step"] >= fault_step for rep in r["reports"]), r[
            "reports"
        ]  # healthy steps: no report
        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert decision["mode"] == "restore" and decision["step"] < fault_step, decision
        trust = {int(k): v for k, v in r["trust"].items()}
        rejected = [s for s, st in trust.items() if st == "rejected"]
        assert rejected and all(decision["step"] < s < fault_step for s in rejected), trust
        assert trust.get(fault_step) != "recovery_verified"
        assert any(st == "recovery_verified" for s, st in trust.items() if s > fault_step), trust
    for other in ranks[1:]:
        assert other["trust"] == ranks[0]["trust"], "ranks disagree on trust"
        assert [(x["kind"], x["step"], x["ranks"]) for x in other["reports"]] == [
            (x["kind"], x["step"], x["ranks"]) for x in ranks[0]["reports"]
        ], "ranks saw other reports"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("topology", ["pp-dp", "pp-dp-ddp"])
def test_scout_on_pp_dp_detects_in_the_stage_pair(tmp_path: Path, topology: str) -> None:
    fault_rank, fault_step, recipe = (
        1,
        7,
        "pp0.hidden.1",
    )  # stage 0's second block is due at odd steps
    ranks = scout(
        tmp_path,
        topology,
        4,
        12,
        "--schedule",
        "1f1b",
        "--replay-fault-rank",
        str(fault_rank),
        "--replay-fault-step",
        str(fault_step),
        "--replay-fault-recipe",
        recipe,
    )
    check_fault_handled(ranks, fault_step, recipe)
    for r in ranks:
        stage = r["rank"] // 2
        assert r["topology"]["peer_groups"] == [[0, 1], [2, 3]] and r["disabled_reason"] is None
        assert r["topology"]["stage_label"] == f"pp{stage}" and r["topology"]["peers"] == [
            2 * stage,
            2 * stage + 1,
        ]
        own = {name for names in r["due"].values() for name in names}
        assert all(name.startswith(f"pp{stage}.") for name in own), (
            own
        )  # a stage replays its own recipes
        assert (f"pp{stage}.embedding" in own) == (stage == 0) and (f"pp{stage}.output" in own) == (
            stage == 1
        )
        assert [f["rank"] for f in r["fired"] if f["kind"] == "bitflip"] == [fault_rank] * (
            r["rank"] == fault_rank
        )
        sdc = next(rep for rep in r["reports"] if rep["kind"] == "sdc")
        assert (sdc["scope"], sdc["ranks"]) == ("peer_group", [0, 1])
        assert "detection without a culprit" in sdc["reason"]
    cycles = {int(s): c for s, c in ranks[0]["cycles"].items()}
    for step, c in cycles.items():  # every rank judges both stages' recipes, each in its own pair
        assert {n.split(".")[0] for n in c["verdicts"]} == {"pp0", "pp1"}, c["verdicts"]
        assert {"pp0.embedding", "pp1.output", "pp1.hidden.0"} <= set(c["verdicts"])
        bad = {n: v["verdict"] for n, v in c["verdicts"].items() if v["verdict"] != "agree"}
        assert bad == ({recipe: "inconclusive"} if step == fault_step else {}), (step, bad)
    assert (
        cycles[fault_step - 1]["certified"] == fault_step - 2
    )  # the rotation covered every recipe before


@pytest.mark.timeout(300)
def test_scout_on_pp_dp3_names_the_rank(tmp_path: Path) -> None:
    fault_rank, fault_step, recipe = 4, 4, "pp1.output"
    ranks = scout(
        tmp_path,
        "pp-dp3",
        6,
        7,
        "--replay-fault-rank",
        str(fault_rank),
        "--replay-fault-step",
        str(fault_step),
        "--replay-fault-recipe",
        recipe,
    )
    check_fault_handled(ranks, fault_step, recipe)
    for r in ranks:
        assert r["topology"]["peer_groups"] == [[0, 1, 2], [3, 4, 5]]
        sdc = next(rep for rep in r["reports"] if rep["kind"] == "sdc")
        assert (sdc["scope"], sdc["ranks"]) == ("rank", [fault_rank]), sdc


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("topology", "schedule"), [("pp", "gpipe"), ("pp-virtual", "looped-bfs")])
def test_scout_on_a_pure_pipeline_has_no_peers_and_says_so(
    tmp_path: Path, topology: str, schedule: str
) -> None:
    ranks = scout(
        tmp_path,
        topology,
        2,
        4,
        "--schedule",
        schedule,
        "--replay-fault-rank",
        "1",
        "--replay-fault-step",
        "2",
        "--replay-fault-recipe",
        "pp1.hidden.0",
    )
    for r in ranks:
        assert r["state_digest"] == r["baseline_digest"]
        assert (
            r["topology"]["peer_groups"] == [[0], [1]]
            and r["topology"]["stage_label"] == f"pp{r['rank']}"
        )
        assert "pipeline stages" in r["disabled_reason"]
        assert r["reports"] == [] and r["fired"] == []  # nothing replayed, nothing claimed
        own = {name.split(".")[0] for names in r["due"].values() for name in names}
        assert own == (
            {f"pp{r['rank']}", f"pp{r['rank'] + 2}"}
            if topology == "pp-virtual"
            else {f"pp{r['rank']}"}
        )
        for c in r["cycles"].values():
            for v in c["verdicts"].values():
                assert (
                    v["verdict"] == "inconclusive"
                    and not v["pre_ok"]
                    and "cannot compare" in v["reason"]
                )
        assert {st for s, st in r["trust"].items() if int(s) >= 1} == {"candidate"}, r["trust"]


def check_stage_pairs(
    ranks: list[dict[str, Any]],
    fault_rank: int,
    fault_step: int,
    recipe: str,
    groups: list[list[int]],
    stages_of: dict[int, set[str]],
) -> None:
    """Peers are each pp coordinate's dp pair; a rank replays only its own stages' recipes; every rank judges every
    stage's; the fault's stage pair is reported without a culprit; only the faulty recipe is INCONCLUSIVE."""
    pair = next(g for g in groups if fault_rank in g)
    for r in ranks:
        coord = r["rank"] // 2
        assert r["topology"]["peer_groups"] == groups and r["disabled_reason"] is None
        assert (
            r["topology"]["stage_label"] == f"pp{coord}" and r["topology"]["peers"] == groups[coord]
        )
        own = {name.split(".")[0] for names in r["due"].values() for name in names}
        assert own == stages_of[coord], (r["rank"], own)
        sdc = next(rep for rep in r["reports"] if rep["kind"] == "sdc")
        assert (sdc["scope"], sdc["ranks"]) == ("peer_group", pair)
        assert "detection without a culprit" in sdc["reason"]
    every, judged = set().union(*stages_of.values()), set()
    for step, c in {int(s): c for s, c in ranks[0]["cycles"].items()}.items():
        judged |= {
            n.split(".")[0] for n in c["verdicts"]
        }  # (several stages per rank: they take turns)
        assert {n.split(".")[0] for n in c["verdicts"]} <= every, (step, c["verdicts"])
        bad = {n: v["verdict"] for n, v in c["verdicts"].items() if v["verdict"] != "agree"}
        assert bad == ({recipe: "inconclusive"} if step == fault_step else {}), (step, bad)
    assert judged == every, judged


@pytest.mark.timeout(400)
def test_scout_on_pp3_dp2_detects_in_the_middle_stage(tmp_path: Path) -> None:
    """Three stages x two replicas (6 ranks): the middle stage holds one block and no embedding or head; a replay
    fault on one of its ranks is detected in its pair. Optimizer slices of 20000 elements make the certification
    rotation span 4 steps, so candidates exist between the newest certified step and the fault."""
    fault_rank, fault_step, recipe = 3, 6, "pp1.hidden.0"
    ranks = scout(
        tmp_path,
        "pp3-dp2",
        6,
        10,
        "--schedule",
        "1f1b",
        "--optimizer-slice-numel",
        "20000",
        "--replay-fault-rank",
        str(fault_rank),
        "--replay-fault-step",
        str(fault_step),
        "--replay-fault-recipe",
        recipe,
    )
    check_fault_handled(ranks, fault_step, recipe)
    check_stage_pairs(
        ranks,
        fault_rank,
        fault_step,
        recipe,
        [[0, 1], [2, 3], [4, 5]],
        {0: {"pp0"}, 1: {"pp1"}, 2: {"pp2"}},
    )
    middle = {name for names in ranks[2]["due"].values() for name in names}
    assert {n.split(".")[1] for n in middle} == {"hidden", "optimizer"}, (
        middle
    )  # no embedding, no output
    assert {"pp0.embedding", "pp2.output"} <= set(ranks[0]["cycles"][str(fault_step)]["verdicts"])


@pytest.mark.timeout(300)
def test_scout_on_interleaved_stages_names_each_stage(tmp_path: Path) -> None:
    """Four stages over pp=2 x dp=2 with Interleaved 1F1B: each rank gives gemscout an nn.ModuleList of its two
    stage modules (pp coordinate c holds stages c and c + 2); every recipe is named by its own stage and judged over
    that stage's dp pair; a replay fault in the last stage's block is detected in pair [2, 3]."""
    fault_rank, fault_step, recipe = (
        3,
        5,
        "pp3.hidden.0",
    )  # pp1's blocks alternate: pp3.hidden.0 at odd steps
    ranks = scout(
        tmp_path,
        "pp-virtual-dp",
        4,
        8,
        "--schedule",
        "interleaved-1f1b",
        "--replay-fault-rank",
        str(fault_rank),
        "--replay-fault-step",
        str(fault_step),
        "--replay-fault-recipe",
        recipe,
    )
    check_fault_handled(ranks, fault_step, recipe)
    check_stage_pairs(
        ranks,
        fault_rank,
        fault_step,
        recipe,
        [[0, 1], [2, 3]],
        {0: {"pp0", "pp2"}, 1: {"pp1", "pp3"}},
    )
    due = {name for names in ranks[0]["due"].values() for name in names}
    assert {
        "pp0.embedding",
        "pp0.hidden.0",
        "pp2.hidden.0",
        "pp0.optimizer.0",
        "pp2.optimizer.0",
    } == due
    last = {name for names in ranks[3]["due"].values() for name in names}
    assert {
        "pp1.hidden.0",
        "pp3.hidden.0",
        "pp3.output",
        "pp1.optimizer.0",
        "pp3.optimizer.0",
    } == last


@pytest.mark.timeout(300)
def test_scout_on_v_shaped_zero_bubble_stages(tmp_path: Path) -> None:
    """ScheduleZBVZeroBubble (backward split into input- and weight-gradient passes) over pp=2 x dp=2: pp coordinate 0
    holds stages 0 and 3 (the embedding and the head on one rank), coordinate 1 stages 1 and 2; gemscout gets the
    nn.ModuleList and ``ScoutConfig(stage_order="v")``. Each recipe is named by its own stage, the healthy steps are
    clean (captures of the split backward replay bitwise), and a replay fault in stage 2's block is detected in pair
    [2, 3]; GEMINI + SCOUT leave training bitwise the schedule's own."""
    fault_rank, fault_step, recipe = (
        3,
        5,
        "pp2.hidden.0",
    )  # coordinate 1 alternates blocks: pp2's at odd steps
    ranks = scout(
        tmp_path,
        "pp-v-dp",
        4,
        8,
        "--schedule",
        "zbv",
        "--replay-fault-rank",
        str(fault_rank),
        "--replay-fault-step",
        str(fault_step),
        "--replay-fault-recipe",
        recipe,
    )
    check_fault_handled(ranks, fault_step, recipe)
    check_stage_pairs(
        ranks,
        fault_rank,
        fault_step,
        recipe,
        [[0, 1], [2, 3]],
        {0: {"pp0", "pp3"}, 1: {"pp1", "pp2"}},
    )
    first = {name for names in ranks[0]["due"].values() for name in names}
    assert {
        "pp0.embedding",
        "pp0.hidden.0",
        "pp3.hidden.0",
        "pp3.output",
        "pp0.optimizer.0",
        "pp3.optimizer.0",
    } == first
    middle = {name for names in ranks[2]["due"].values() for name in names}
    assert {"pp1.hidden.0", "pp2.hidden.0", "pp1.optimizer.0", "pp2.optimizer.0"} == middle


@pytest.mark.timeout(300)
def test_scout_on_fsdp_sharded_stages_gathers_and_detects(tmp_path: Path) -> None:
    """pp=2 x dp=2 with each stage module ``fully_shard``ed over dp (1F1B): the parameters are DTensors on the dp
    sub-mesh and ``ScoutConfig.mesh`` is their root (pp, dp) mesh, so pp is the stage dim and dp the shard dim. Peers
    are a stage's dp pair; each gathers the stage's parameters along dp before replay (gather times recorded), the
    healthy steps are clean, and a replay fault on rank 1 is detected in pair [0, 1] without a culprit."""
    fault_rank, fault_step, recipe = (
        1,
        6,
        "pp0.hidden.0",
    )  # stage 0's first block is due at even steps
    ranks = scout(
        tmp_path,
        "pp-fsdp",
        4,
        10,
        "--schedule",
        "1f1b",
        "--replay-fault-rank",
        str(fault_rank),
        "--replay-fault-step",
        str(fault_step),
        "--replay-fault-recipe",
        recipe,
    )
    check_fault_handled(ranks, fault_step, recipe)
    check_stage_pairs(
        ranks, fault_rank, fault_step, recipe, [[0, 1], [2, 3]], {0: {"pp0"}, 1: {"pp1"}}
    )
    for r in ranks:
        t = r["topology"]
        assert (t["kind"], t["stage_dims"], t["shard_dims"], t["peer_dims"]) == (
            "fsdp+pp",
            ["pp"],
            ["dp"],
            ["dp"],
        )
        own = {name for names in r["due"].values() for name in names}
        gathered = {name for c in r["cycles"].values() for name in c["gather_s"]}
        assert own <= gathered, (
            own,
            gathered,
        )  # every replayed recipe (forward and optimizer) was gathered first

"""SCOUT under Megatron Core pipeline parallelism: Megatron's own loop on real gloo ranks (``[megatron]`` extra).

What runs for real (``qualification.programs.megatron_loop_rank``): ``parallel_state`` with two pipeline stages (and
virtual stages), a ``GPTModel`` split by Megatron across them (``pre_process`` / ``post_process`` / ``vp_stage``),
Megatron's ``DistributedDataParallel`` around every chunk (overlapped grad reduce), the ``DistributedOptimizer``, and
the schedule ``get_forward_backward_func()`` picks: 1F1B, or the interleaved 1F1B with virtual stages. gemscout gets
the chunk list and the MegatronOptimizer and reads its topology from ``parallel_state``: the ``pp`` coordinate is a
stage (``pp<c>``), peers vary along dp only. What is stood in, and why: Megatron's hard-coded CUDA is redirected to the
CPU by the test-only ``qualification.frameworks.megatron_cpu``; the replay fault is the harness's seam
(``qualification.faults``: a bit flipped in what one rank computes when replaying one recipe, training untouched).

- PP=2 x DP=2 (4 layers: two blocks per stage): GEMINI + SCOUT every step is bitwise equal to the run without
  gemscout; stage 0 replays ``pp0.embedding`` / ``pp0.hidden.*``, stage 1 ``pp1.hidden.*`` / ``pp1.output`` (the
  final norm + output layer, backward from the loss's gradient), every rank judges both; no report; captures are
  certified. A replay fault on rank 1 in ``pp0.hidden.1`` is detected in pair [0, 1] without a culprit
  (INCONCLUSIVE), candidates are rejected job-wide, stage 1's pair stays clean, certification resumes.
- PP=2 x DP=3 (6 ranks, one launch): the fault on rank 4 in ``pp1.output`` is attributed to rank 4 exactly.
- PP=2 x 2 virtual stages x DP=2 (Megatron's interleaved 1F1B), through the campaign driver
  ``megatron_scout_cell``: pp coordinate c holds virtual stages c and c + 2 (``pp0``/``pp2`` on ranks 0-1,
  ``pp1``/``pp3`` on 2-3); bitwise equal to the run without gemscout; a fault in ``pp3.hidden.0`` on rank 3 is
  detected in pair [2, 3].

Skipped, with the reason, where megatron-core is not installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from _heavy import heavy

from qualification.launch import launch
from qualification.programs.megatron_scout_cell import run_cell

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core is not installed (pip install -e '.[megatron]')",
)

STEPS = 8
LAYOUT = ["--pp", "2", "--distopt", "--overlap"]
ONE_F_ONE_B, INTERLEAVED = (
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


def _run(
    tmp: Path, name: str, world: int, args: list[str], *, scout: bool = True
) -> list[dict[str, Any]]:
    extra = (
        ["--ckpt", str(tmp / f"ck-{name}"), "--scout", "--keep-generations", "16"] if scout else []
    )
    res = launch(
        [
            "-m",
            "qualification.programs.megatron_loop_rank",
            "--out",
            str(tmp / name),
            "--steps",
            str(STEPS),
        ]
        + args
        + extra,
        world_size=world,
        timeout_s=240,
        log_dir=tmp / "logs" / name,
    )
    assert res.ok, (res, sorted((tmp / "logs" / name).glob("*.log")))
    return _read(tmp / name, world)


def _read(folder: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def _check_layout(
    ranks: list[dict[str, Any]],
    groups: list[list[int]],
    schedule: str,
    catalogs: dict[int, list[str]],
) -> None:
    """Peers are a pp coordinate's dp group; each rank's catalog is its own stages' recipes, named by the stage."""
    for r in ranks:
        coord = next(i for i, g in enumerate(groups) if r["rank"] in g)
        t = r["topology"]
        assert (t["stage_dims"], t["peer_dims"], t["stage_label"]) == (
            ["pp"],
            ["dp"],
            f"pp{coord}",
        ), t
        assert (
            t["peer_groups"] == groups and r["peers"] == groups[coord] and r["pp_rank"] == coord
        ), t
        assert r["schedule"] == schedule and r["optimizer"] == ["DistributedOptimizer"], r[
            "schedule"
        ]
        assert r["catalog"] == catalogs[coord], (r["rank"], r["catalog"])
        assert r["replicas_equal"] and r["grad_syncs"] == STEPS and r["errors"] == [], r
        own = {name for names in r["due"].values() for name in names}
        assert own == set(catalogs[coord]), (
            r["rank"],
            own,
        )  # the rotation reached every recipe of its stages
    every = set().union(*catalogs.values())
    for r in ranks:  # every rank judges every stage's recipes, each over its own pair
        judged = {name for cycle in r["verdicts"].values() for name in cycle}
        assert judged == every and sorted(r["verdicts"], key=int) == [
            str(s) for s in range(1, STEPS + 1)
        ], judged


def _check_bitwise(base: list[dict[str, Any]], run: list[dict[str, Any]]) -> None:
    for r, (b, g) in enumerate(zip(base, run, strict=True)):
        assert b["replicas_equal"] and b["grad_syncs"] == STEPS, b
        assert (g["state_digest"], g["losses"]) == (b["state_digest"], b["losses"]), (
            f"rank {r}: gemscout changed it"
        )


def _check_fault(
    ranks: list[dict[str, Any]],
    fault_rank: int,
    step: int,
    recipe: str,
    verdict: str,
    scope: tuple[str, list[int]],
) -> None:
    """One SDC report for the fault, at its stage only; candidates rejected job-wide; certification resumes; the
    same verdicts, trust and reports on every rank; the fault fired on its rank only."""
    for r in ranks:
        sdc = [rep for rep in r["reports"] if rep["kind"] == "sdc"]
        assert [(rep["step"], rep["recipe"], rep["scope"], list(rep["ranks"])) for rep in sdc] == [
            (step, recipe, *scope)
        ], r["reports"]
        if verdict == "inconclusive":
            assert "detection without a culprit" in sdc[0]["reason"], sdc[0]["reason"]
        assert all(rep["step"] >= step for rep in r["reports"]), r[
            "reports"
        ]  # healthy steps: no report
        bad = {s: {n: v for n, v in c.items() if v != "agree"} for s, c in r["verdicts"].items()}
        assert {s: c for s, c in bad.items() if c} == {str(step): {recipe: verdict}}, (
            bad
        )  # other stage clean
        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert decision["mode"] == "restore" and decision["step"] < step, decision
        trust = {int(k): v for k, v in r["trust"].items()}
        rejected = [s for s, st in trust.items() if st == "rejected"]
        assert rejected and all(decision["step"] < s < step for s in rejected), trust
        assert trust.get(step) != "recovery_verified"
        assert any(st == "recovery_verified" for s, st in trust.items() if s > step), trust
        assert [f["rank"] for f in r["fired"]] == [fault_rank] * (r["rank"] == fault_rank), r[
            "fired"
        ]
    for other in ranks[1:]:
        assert (other["trust"], other["verdicts"]) == (ranks[0]["trust"], ranks[0]["verdicts"]), (
            "ranks disagree"
        )
        assert [(x["kind"], x["step"], x["ranks"]) for x in other["reports"]] == [
            (x["kind"], x["step"], x["ranks"]) for x in ranks[0]["reports"]
        ], "ranks saw other reports"


STAGES_1F1B = {
    0: ["pp0.embedding", "pp0.hidden.0", "pp0.hidden.1"],
    1: ["pp1.hidden.0", "pp1.hidden.1", "pp1.output"],
}


@heavy(
    "megatron_scout_cell-megatron-pp2-*-w4-*",
    "topologies",
    "three 4-rank Megatron launches, ~55 s on 2 cores",
)
@pytest.mark.timeout(400)
def test_pp2_dp2_healthy_is_bitwise_and_a_replay_fault_is_detected_in_its_stage_pair(
    tmp_path: Path,
) -> None:
    args = LAYOUT + ["--layers", "4"]
    base = _run(tmp_path, "base", 4, args, scout=False)
    healthy = _run(tmp_path, "healthy", 4, args)
    _check_bitwise(base, healthy)
    _check_layout(healthy, [[0, 1], [2, 3]], ONE_F_ONE_B, STAGES_1F1B)
    assert base[0]["state_digest"] != base[2]["state_digest"]  # the stages hold different layers
    for r in healthy:
        assert r["reports"] == [] and all(
            v == "agree" for c in r["verdicts"].values() for v in c.values()
        ), r
        assert (
            "recovery_verified" in r["trust"].values() and "rejected" not in r["trust"].values()
        ), r["trust"]

    fault = _run(
        tmp_path,
        "fault",
        4,
        args + ["--fault-rank", "1", "--fault-step", "5", "--fault-recipe", "pp0.hidden.1"],
    )  # stage 0's second block is due at odd steps
    _check_bitwise(base, fault)  # the fault is in the replay only: training is untouched
    _check_layout(fault, [[0, 1], [2, 3]], ONE_F_ONE_B, STAGES_1F1B)
    _check_fault(fault, 1, 5, "pp0.hidden.1", "inconclusive", ("peer_group", [0, 1]))


@heavy(
    "megatron_scout_cell-megatron-pp2-*-w6-*", "topologies", "6 Megatron ranks, ~31 s on 2 cores"
)
@pytest.mark.timeout(400)
def test_pp2_dp3_replay_fault_is_attributed_to_its_rank(tmp_path: Path) -> None:
    ranks = _run(
        tmp_path,
        "dp3",
        6,
        LAYOUT
        + [
            "--layers",
            "4",
            "--fault-rank",
            "4",
            "--fault-step",
            "5",
            "--fault-recipe",
            "pp1.output",
        ],
    )
    _check_layout(ranks, [[0, 1, 2], [3, 4, 5]], ONE_F_ONE_B, STAGES_1F1B)
    _check_fault(ranks, 4, 5, "pp1.output", "attributed", ("rank", [4]))


@heavy(
    "megatron_scout_cell-megatron-vpp-*",
    "topologies",
    "two 4-rank Megatron launches, ~35 s on 2 cores",
)
@pytest.mark.timeout(400)
def test_virtual_stages_interleaved_schedule_is_bitwise_and_detects_in_the_stage_pair(
    tmp_path: Path,
) -> None:
    # Through the campaign driver (topology megatron-pp2-vpp2): the baseline, then GEMINI + SCOUT with the fault.
    # Four layers, one per virtual stage; pp coordinate 1 alternates its blocks: pp3.hidden.0 is due at odd steps.
    cell = {
        "id": "t",
        "world_size": 4,
        "topology": "megatron-pp2-vpp2",
        "seed": 0,
        "timeout_s": 240,
        "params": {"steps": STEPS},
        "fault": {"kind": "replay", "rank": 3, "step": 5, "recipe": "pp3.hidden.0"},
    }
    result = run_cell(cell, tmp_path)
    obs = result["observed"]
    assert (
        result["status"] == "passed"
        and obs["bitwise_equal"]
        and obs["losses_equal"]
        and obs["ranks_agree"]
    ), result
    assert obs["stage_labels"] == ["pp0", "pp0", "pp1", "pp1"] and obs["schedule"] == INTERLEAVED, (
        obs
    )
    assert (obs["sdc_reports"], obs["scope"], obs["detected_step"], obs["recipe"]) == (
        1,
        "peer_group",
        5,
        "pp3.hidden.0",
    ), obs
    assert obs["unclean"] == ["5:pp3.hidden.0:inconclusive"] and obs["localized_ranks"] == [], obs
    assert obs["decision_before_fault"] and obs["fault_step_rejected"] and obs["certified_after"], (
        obs
    )
    base, fault = (_read(tmp_path / name, 4) for name in ("baseline", "run"))
    _check_bitwise(base, fault)
    _check_layout(
        fault,
        [[0, 1], [2, 3]],
        INTERLEAVED,
        {
            0: ["pp0.embedding", "pp0.hidden.0", "pp2.hidden.0"],
            1: ["pp1.hidden.0", "pp3.hidden.0", "pp3.output"],
        },
    )
    _check_fault(fault, 3, 5, "pp3.hidden.0", "inconclusive", ("peer_group", [2, 3]))

"""SCOUT on sharded and parallel topologies, through enable_resiliency with GEMINI on real gloo ranks: FSDP2 on 4 and 2
ranks, HSDP on a 2x2 mesh, FSDP2 x TP on a 2x2 mesh, and pure TP on 2 ranks. One launch per topology
(qualification/programs/scout_rank.py --topology), each rank writing what it saw. From every rank:

* peers come from the mesh: the whole shard group under FSDP, the replicate pairs under HSDP, the dp pairs sharing a
  TP coordinate under FSDP2 x TP; pure TP has no data-parallel peer, so SCOUT says it cannot compare and never
  reports anything;
* healthy trajectory: the parameters and optimizer state (each rank's shards) equal, bit for bit, the same training
  run without gemscout — replay, gathers and all;
* a replay-only fault on one rank at step 7 is attributed to exactly that rank with 4 peers, and detected without a
  culprit (a peer-group report naming the faulty rank's group, whose reason says so) with 2 peers;
* the uncertified candidates are rejected job-wide, the decision names a verified step older than the fault, and
  clean rotations certify a step after it;
* the parameter gathers are timed on every rank (communication evidence); under FSDP2 x TP a delayed TP collective in
  one rank's replays is a communication straggler naming its TP group, with no compute straggler and no SDC, and the
  other TP group's replay compute does not absorb the delay;
* what the gathered evidence covers: under HSDP a replica whose own shard diverged is detected by its parameter
  digest (two replicas: a peer-group report without a culprit); under pure FSDP the same corruption is gathered alike
  by every peer and goes unseen — the documented boundary of a shard without an independent replica.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _heavy import heavy

from qualification.launch import launch

FAULT_RANK_4, FAULT_STEP, RECIPE = 2, 7, "hidden.1"
DIVERGE_STEP = 13  # hidden.1 is due at steps 1, 4, 7, 10, 13 (one block per due step)
DELAY_STEP = 13

CASES = {
    # topology, world: (peer groups, fault rank, extra arguments, steps)
    "fsdp2-4": (
        "fsdp2",
        4,
        [[0, 1, 2, 3]],
        FAULT_RANK_4,
        ["--diverge-rank", "3", "--diverge-step", str(DIVERGE_STEP)],
        13,
    ),
    "fsdp2-2": ("fsdp2", 2, [[0, 1]], 1, [], 12),
    "hsdp-2x2": (
        "hsdp",
        4,
        [[0, 2], [1, 3]],
        FAULT_RANK_4,
        ["--diverge-rank", "3", "--diverge-step", str(DIVERGE_STEP)],
        13,
    ),
    "fsdp2-tp-2x2": (
        "fsdp2-tp",
        4,
        [[0, 2], [1, 3]],
        FAULT_RANK_4,
        [
            "--collective-delay-rank",
            "3",
            "--collective-delay-step",
            str(DELAY_STEP),
            "--collective-delay-s",
            "0.3",
        ],
        15,
    ),
}


def run(tmp_path: Path, topology: str, world: int, steps: int, *extra: str) -> list[dict[str, Any]]:
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
        timeout_s=150,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def kinds(rank: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [rep for rep in rank["reports"] if rep["kind"] == kind]


HEAVY_CASES = {
    "fsdp2-tp-2x2": heavy(
        "scout_cell-scout-fsdp2-tp-w4-*", "topologies", "the 2x2 FSDP2 x TP mesh, ~28 s on 2 cores"
    )
}


@pytest.mark.timeout(170)
@pytest.mark.parametrize("case", [pytest.param(c, marks=HEAVY_CASES.get(c, ())) for c in CASES])
def test_scout_on_a_mesh(tmp_path: Path, case: str) -> None:
    topology, world, groups, fault_rank, extra, steps = CASES[case]
    ranks = run(
        tmp_path,
        topology,
        world,
        steps,
        "--replay-fault-rank",
        str(fault_rank),
        "--replay-fault-step",
        str(FAULT_STEP),
        "--replay-fault-recipe",
        RECIPE,
        *extra,
    )
    culprit_group = next(g for g in groups if fault_rank in g)
    for r in ranks:
        assert r["topology"]["peer_groups"] == groups, r["topology"]
        assert r["disabled_reason"] is None
        assert r["state_digest"] == r["baseline_digest"], (
            f"rank {r['rank']}: SCOUT changed training"
        )
        assert [f["rank"] for f in r["fired"] if f["kind"] == "bitflip"] == (
            [r["rank"]] * (r["rank"] == fault_rank)
        )

        sdc = kinds(r, "sdc")
        if case == "hsdp-2x2":  # the diverged replica at DIVERGE_STEP is a second fault (below)
            # Rank 3's shard is gathered by its shard partner (rank 2) too, so both replica pairs see divergent
            # parameters: detection without a culprit, over both groups.
            diverged = [rep for rep in sdc if rep["step"] == DIVERGE_STEP]
            assert diverged and all(
                (rep["scope"], rep["ranks"]) == ("peer_group", [0, 1, 2, 3]) for rep in diverged
            )
            sdc = [rep for rep in sdc if rep["step"] != DIVERGE_STEP]
        assert [(rep["step"], rep["recipe"]) for rep in sdc] == [(FAULT_STEP, RECIPE)], sdc
        if len(culprit_group) >= 3:
            assert (sdc[0]["scope"], sdc[0]["ranks"]) == ("rank", [fault_rank])
        else:
            assert (sdc[0]["scope"], sdc[0]["ranks"]) == ("peer_group", culprit_group)
            assert "detection without a culprit" in sdc[0]["reason"]

        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert (
            decision["mode"] == "restore"
            and decision["step"] is not None
            and decision["step"] < FAULT_STEP
        )
        trust = {int(k): v for k, v in r["trust"].items()}
        rejected = [s for s, st in trust.items() if st == "rejected"]
        if (
            case == "hsdp-2x2"
        ):  # the divergence at DIVERGE_STEP rejects the candidates just before it as well
            assert trust.get(DIVERGE_STEP - 1) == "rejected" and DIVERGE_STEP not in trust, trust
            rejected = [s for s in rejected if s < FAULT_STEP]
        assert rejected and all(decision["step"] < s < FAULT_STEP for s in rejected), trust
        assert trust.get(FAULT_STEP) != "recovery_verified"
        assert any(st == "recovery_verified" for s, st in trust.items() if s > FAULT_STEP), trust

        assert not [rep for rep in kinds(r, "straggler") if rep["evidence"]["signal"] == "compute"]
        for c in r["cycles"].values():
            hidden = next(n for n in c["verdicts"] if n.startswith("hidden."))
            assert sorted(c["gather_s"][hidden]) == [str(k) for k in range(world)], (
                c
            )  # every rank timed its gather
    first = ranks[0]
    for other in ranks[1:]:
        assert other["trust"] == first["trust"], "ranks disagree on trust"
        assert [(x["kind"], x["step"], x["ranks"]) for x in other["reports"]] == [
            (x["kind"], x["step"], x["ranks"]) for x in first["reports"]
        ], "ranks saw other reports"

    cycles = {int(s): c for s, c in first["cycles"].items()}
    if case == "hsdp-2x2":  # a diverged replica: its own shard changed, the other replica's did not
        verdict = cycles[DIVERGE_STEP]["verdicts"][RECIPE]
        assert verdict["verdict"] == "inconclusive" and verdict["pre_ok"], (
            verdict
        )  # two replicas: no majority
        assert "parameters diverged without a strict majority" in verdict["reason"], verdict
    if (
        case == "fsdp2-4"
    ):  # no replica of the shard: every peer gathers the same corrupted values (the boundary)
        assert cycles[DIVERGE_STEP]["verdicts"][RECIPE]["verdict"] == "agree"
    if case == "fsdp2-tp-2x2":
        for step in range(1, steps + 1):
            hidden = next(n for n in cycles[step]["verdicts"] if n.startswith("hidden."))
            assert sorted(cycles[step]["collective_s"][hidden]) == ["0", "1", "2", "3"]
        comm = [
            rep for rep in kinds(first, "straggler") if rep["evidence"]["signal"] == "communication"
        ]
        assert comm and all(rep["step"] > DELAY_STEP and rep["ranks"] == [2, 3] for rep in comm), (
            comm
        )
        assert [rep["step"] for rep in comm] == list(range(DELAY_STEP + 1, steps + 1))
        for step in range(DELAY_STEP, steps + 1):
            assert all(v["verdict"] == "agree" for v in cycles[step]["verdicts"].values()), cycles[
                step
            ]
            # The other TP group's replays wait on nobody: before FSDP's hooks were detached from the replay, rank 1
            # waited inside its "compute" for its late dp partner (rank 3) in FSDP's unshard, ~1 s per replay.
            hidden = next(n for n in cycles[step]["verdicts"] if n.startswith("hidden."))
            replay = cycles[step]["replay_s"][hidden]
            assert max(replay["0"], replay["1"]) < 0.6, (step, replay)


@pytest.mark.timeout(120)
def test_pure_tp_has_no_peers_and_says_so(tmp_path: Path) -> None:
    ranks = run(
        tmp_path,
        "tp",
        2,
        6,
        "--replay-fault-rank",
        "1",
        "--replay-fault-step",
        "4",
        "--replay-fault-recipe",
        RECIPE,
    )
    for r in ranks:
        assert r["state_digest"] == r["baseline_digest"]
        assert r["topology"]["peer_groups"] == [[0], [1]]
        assert "no data-parallel dim" in r["disabled_reason"]
        assert r["reports"] == [] and r["fired"] == []  # nothing replayed, nothing claimed
        for c in r["cycles"].values():
            for v in c["verdicts"].values():
                assert (
                    v["verdict"] == "inconclusive"
                    and not v["pre_ok"]
                    and "cannot compare" in v["reason"]
                )
        # Nothing trained is ever vouched for: every capture of a step stays a candidate.
        assert {st for s, st in r["trust"].items() if int(s) >= 1} == {"candidate"}, r["trust"]

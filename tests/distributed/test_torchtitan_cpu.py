"""TorchTitan's real ``Trainer.train()`` under ``enable_resiliency`` on CPU: 2 gloo ranks, FSDP2, llama3 debug model.

What runs is torchtitan 0.3.0 itself — ``Trainer(config)`` (its model, FSDP2, dataloader, tokenizer, LR schedule,
grad clipping, selective activation checkpointing) and ``trainer.train()`` unchanged — in the separate virtualenv
``.venv-tt`` (``make test-torchtitan`` creates it; torchtitan is never installed into the main one). Its CPU shims
(qualification/frameworks/torchtitan_cpu.py) are test-only, and one changes the model: plain causal SDPA instead of
FlexAttention (no CPU backward). This is a smoke of gemscout's TorchTitan integration, not of TorchTitan's numerics.
The tokenizer and the c4_test data are synthetic, built here (they are not in the wheel).

- healthy: with gemscout capturing every step, every rank ends bitwise equal to the run without gemscout
  (parameter shards, AdamW state, lr schedulers, ``trainer.step``, ``ntokens_seen``, dataloader state, losses);
- SIGKILL of rank 1 right after step 3 of 6, then its node folder is deleted (node loss): the relaunch restores
  step 3 — rank 0 from its own disk, rank 1 from rank 0's replica — and ends bitwise equal to the uninterrupted run;
- SCOUT on the FSDP mesh (2 peers): healthy steps agree and report nothing; a one-bit replay fault on rank 1 is
  detected (an SDC report naming the pair); training stays bitwise equal;
- SCOUT on HSDP (dp_replicate=2 x fsdp=2, 4 ranks): peers are the replicate pairs {0, 2} and {1, 3}, whose shards
  stay bitwise equal; a replay fault on rank 3 is reported for the pair {1, 3} only;
- pipeline parallelism (TorchTitan's own split, pp=2, 4 steps): with 1F1B (one stage per rank) GEMINI's run is
  bitwise equal to the run without gemscout, and SIGKILL of rank 1 after step 2 + node loss recovers bitwise from
  rank 0's replica; with Interleaved1F1B (two stages per rank, so ``model_parts`` holds two modules) the same for a
  SIGKILL of rank 0. torch 2.13's schedules get torchtitan's pre-split microbatches through a CPU shim (6 in
  torchtitan_cpu.py), which does not change the numerics. The healthy 1F1B run attaches SCOUT too: with no
  data-parallel dim no rank has a peer, so SCOUT says why and vouches for nothing;
- SCOUT on pipeline stages (4 ranks, 5 steps; one launch per scenario, the reference run through ``titan_cell``):
  1F1B on pp=2 x dp_shard=2 (``pp-fsdp``) and Interleaved1F1B on pp=2 x dp_replicate=2 (``pp-ddp``, two stages per
  rank). Peers are the two data-parallel ranks of one stage ({0, 1}, {2, 3}); each stage replays its own recipes
  (``pp0.embedding`` + its blocks on the first stage, only blocks on the last: the debug model's loss applies the head
  in chunks), and every rank judges every stage's. Healthy (every block and optimizer slice each step): no SDC, every
  verdict AGREE, every capture certified, training bitwise the run without gemscout. A one-bit replay fault on one rank
  (a rotation that covers the catalog in two steps): detected in that stage's pair with no culprit named, the
  uncertified candidate rejected on every rank, the recovery decision naming the certified step before it,
  certification resumed after it, training bitwise untouched.

Skipped, with the reason, when ``.venv-tt`` (or ``GEMSCOUT_TT_PYTHON``) has no torchtitan 0.3.0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from qualification.frameworks import titan_env
from qualification.launch import launch

REPO = Path(__file__).resolve().parents[2]
PYTHON = titan_env.python()  # $GEMSCOUT_TT_PYTHON, else .venv-tt/bin/python
STEPS, WORLD, LAUNCH_TIMEOUT_S = 6, 2, 420
UNAVAILABLE = titan_env.unavailable(PYTHON)
pytestmark = pytest.mark.skipif(
    UNAVAILABLE is not None, reason=f"{UNAVAILABLE} (see docs/torchrun.md)"
)


def titan(
    out: Path, assets: Path, *extra: str, attempt: int = 0, world: int = WORLD, steps: int = STEPS
) -> Any:
    """One launch of ``titan_rank`` on ``world`` ranks with the .venv-tt interpreter."""
    argv = [
        "-m",
        "qualification.programs.titan_rank",
        "--out",
        str(out),
        "--assets",
        str(assets),
        "--steps",
        str(steps),
        *extra,
    ]
    return launch(
        argv,
        world_size=world,
        timeout_s=LAUNCH_TIMEOUT_S,
        log_dir=out / "logs",
        attempt=attempt,
        python=PYTHON,
        env={"PYTHONPATH": str(REPO)},
    )


def ranks(out: Path, world: int = WORLD) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("titan-assets")
    subprocess.run(
        [PYTHON, "-m", "qualification.frameworks.torchtitan_cpu", str(folder)],
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return folder


@pytest.fixture(scope="module")
def baseline(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted run without gemscout."""
    out = tmp_path_factory.mktemp("titan-baseline")
    res = titan(out, assets)
    assert res.ok, (res, out / "logs")
    base = ranks(out)
    assert all(
        r["state"]["step"] == STEPS
        and sorted(r["losses"], key=int) == [str(s) for s in range(1, STEPS + 1)]
        for r in base
    ), base
    assert base[0]["state"]["params"] != base[1]["state"]["params"], (
        "FSDP: each rank should hold its own shards"
    )
    return base


def assert_bitwise(
    run: list[dict[str, Any]], base: list[dict[str, Any]], first_step: int = 1
) -> None:
    for r, (mine, theirs) in enumerate(zip(run, base, strict=True)):
        diff = [k for k in theirs["state"] if mine["state"][k] != theirs["state"][k]]
        assert not diff, f"rank {r}: {diff} differ from the run without gemscout"
        expected = {k: v for k, v in theirs["losses"].items() if int(k) >= first_step}
        assert mine["losses"] == expected, f"rank {r}: losses differ"


@pytest.mark.timeout(900)
def test_healthy_trainer_with_gemscout_is_bitwise_equal(
    baseline: list[dict[str, Any]], assets: Path, tmp_path: Path
) -> None:
    res = titan(tmp_path, assets, "--ckpt", str(tmp_path / "ckpt"), "--interval", "1")
    assert res.ok, (res, tmp_path / "logs")
    run = ranks(tmp_path)
    assert all(r["resume_step"] == 0 and r["errors"] == [] for r in run), run
    assert_bitwise(run, baseline)


@pytest.mark.timeout(900)
def test_sigkill_and_node_loss_recover_bitwise_from_the_peer(
    baseline: list[dict[str, Any]], assets: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    killed = titan(tmp_path, assets, "--ckpt", str(ckpt), "--kill-rank", "1", "--kill-step", "3")
    assert killed.first_failed == 1 and killed.returncodes[1] == -9, killed
    assert (ckpt / "node-1").is_dir()
    shutil.rmtree(
        ckpt / "node-1"
    )  # node loss: rank 1's own checkpoints are gone, only rank 0's replica is left
    res = titan(tmp_path, assets, "--ckpt", str(ckpt), attempt=1)
    assert res.ok, (res, tmp_path / "logs")
    run = ranks(tmp_path)
    for r in run:
        assert r["resume_step"] == 3 and r["errors"] == [], r
        assert r["decision"]["step"] == 3 and r["decision"]["sources"] == {
            "0": "memory",
            "1": "peer:0",
        }, r["decision"]
        assert r["resume_state"]["step"] == 3
    assert_bitwise(
        run, baseline, first_step=4
    )  # params, optimizer, schedulers, step, tokens, dataloader


@pytest.mark.timeout(900)
def test_scout_on_the_fsdp_mesh_is_silent_when_healthy_and_detects_a_replay_fault(
    baseline: list[dict[str, Any]], assets: Path, tmp_path: Path
) -> None:
    """Steps 1-3 healthy, then rank 1 computes one wrong bit in its replay of the embedding at step 4."""
    res = titan(
        tmp_path,
        assets,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--scout",
        "--replay-fault-rank",
        "1",
        "--replay-fault-step",
        "4",
        "--replay-fault-recipe",
        "embedding",
    )
    assert res.ok, (res, tmp_path / "logs")
    run = ranks(tmp_path)
    for r in run:
        assert r["scout_disabled"] is None and sorted(r["scout_cycles"], key=int) == [
            str(s) for s in range(1, 7)
        ]
        for step, cycle in r["scout_cycles"].items():
            assert cycle["peers"] == [0, 1], cycle
            # The debug model's recipes: embedding, one block per step (rotating), one optimizer slice; the output
            # recipe is off under ChunkedLossWrapper (the head runs on chunks inside the loss).
            assert {k.split(".")[0] for k in cycle["verdicts"]} == {
                "embedding",
                "hidden",
                "optimizer",
            }, cycle
            faulty = {"embedding"} if step == "4" else set()
            assert {k for k, v in cycle["verdicts"].items() if v != "agree"} == faulty, (
                step,
                cycle,
            )
        assert [(x["kind"], x["ranks"], x["step"], x["recipe"]) for x in r["reports"]] == [
            ("sdc", [0, 1], 4, "embedding")
        ], r["reports"]  # two peers: detected, no culprit to name
    assert_bitwise(run, baseline)  # SCOUT replays on private copies: training is untouched


@pytest.mark.timeout(900)
def test_scout_on_hsdp_pairs_replicate_peers_and_reports_the_faulty_pair(
    assets: Path, tmp_path: Path
) -> None:
    res = titan(
        tmp_path,
        assets,
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--scout",
        "--dp-replicate",
        "2",
        "--replay-fault-rank",
        "3",
        "--replay-fault-step",
        "3",
        world=4,
        steps=3,
    )
    assert res.ok, (res, tmp_path / "logs")
    run = ranks(tmp_path, 4)
    for r, mine in enumerate(run):
        pair = [
            r % 2,
            r % 2 + 2,
        ]  # torchtitan's mesh (dp_replicate, fsdp): rank = 2 * replica + shard
        assert all(c["peers"] == pair for c in mine["scout_cycles"].values()), mine["scout_cycles"]
        assert {
            k
            for c in mine["scout_cycles"].values()
            for k, v in c["verdicts"].items()
            if v != "agree"
        } == {"embedding"}, mine["scout_cycles"]
        # Timing reports (a compute straggler on this loaded machine) may come too; the SDC is exactly one.
        assert [
            (x["ranks"], x["step"], x["recipe"]) for x in mine["reports"] if x["kind"] == "sdc"
        ] == [([1, 3], 3, "embedding")], mine["reports"]
    for a, b in (
        (0, 2),
        (1, 3),
    ):  # replicas of one shard: bitwise equal parameters and optimizer state
        assert [run[a]["state"][k] for k in ("params", "optimizer")] == [
            run[b]["state"][k] for k in ("params", "optimizer")
        ]
    assert run[0]["state"]["params"] != run[1]["state"]["params"]


PP_STEPS = 4


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("schedule", "killed", "parts"), [("1F1B", 1, 1), ("Interleaved1F1B", 0, 2)]
)
def test_pipeline_parallel_trainer_is_bitwise_and_recovers_a_sigkill_with_node_loss(
    assets: Path, tmp_path: Path, schedule: str, killed: int, parts: int
) -> None:
    """TorchTitan's own pp=2 split and schedule, 2 ranks: healthy with GEMINI (1F1B only) and a SIGKILL of ``killed``
    after step 2 with its node folder deleted, each bitwise equal to the run without gemscout."""
    pp = ("--pp", "2", "--pp-schedule", schedule)
    base_out = tmp_path / "baseline"
    assert titan(base_out, assets, *pp, steps=PP_STEPS).ok, base_out / "logs"
    base = ranks(base_out)
    assert [r["model_parts"] for r in base] == [parts, parts]
    assert base[0]["state"]["params"] != base[1]["state"]["params"], (
        "each rank should hold its own stages"
    )
    assert all(v == -1.0 for v in base[0]["losses"].values()), "only the last stage logs a loss"
    if schedule == "1F1B":
        healthy = tmp_path / "healthy"
        assert titan(
            healthy, assets, *pp, "--ckpt", str(healthy / "ckpt"), "--scout", steps=PP_STEPS
        ).ok, healthy / "logs"
        assert_bitwise(ranks(healthy), base)
        for r in ranks(
            healthy
        ):  # pp alone: SCOUT has no peers, says why, reports and certifies nothing
            assert "no data-parallel dim in mesh (pp=2)" in (r["scout_disabled"] or ""), r[
                "scout_disabled"
            ]
            assert r["reports"] == [] and set(r["trust"].values()) == {"candidate"}, r
            assert {v for c in r["scout_cycles"].values() for v in c["verdicts"].values()} == {
                "inconclusive"
            }
    out, ckpt = tmp_path / "kill", tmp_path / "kill" / "ckpt"
    res = titan(
        out,
        assets,
        *pp,
        "--ckpt",
        str(ckpt),
        "--kill-rank",
        str(killed),
        "--kill-step",
        "2",
        steps=PP_STEPS,
    )
    assert res.first_failed == killed and res.returncodes[killed] == -9, res
    shutil.rmtree(ckpt / f"node-{killed}")
    assert titan(out, assets, *pp, "--ckpt", str(ckpt), attempt=1, steps=PP_STEPS).ok, out / "logs"
    run = ranks(out)
    for r in run:
        assert r["resume_step"] == 2 and r["errors"] == [] and r["model_parts"] == parts, r
        assert r["decision"]["sources"][str(killed)] == f"peer:{1 - killed}", r["decision"]
    assert_bitwise(run, base, first_step=3)


def pipeline_cell(
    topology: str, schedule: str, fault: dict[str, Any], per_cycle: int
) -> dict[str, Any]:
    return {
        "id": f"titan-{topology}",
        "world_size": 4,
        "workload": "llama3-debug",
        "topology": topology,
        "timeout_s": 900,
        "fault": fault,
        "params": {
            "steps": PP_STEPS + 1,
            "schedule": schedule,
            "scout": True,
            "scout_per_cycle": per_cycle,
        },
    }


def check_stages(run: list[dict[str, Any]], stages_per_rank: int) -> None:
    """SCOUT's view of TorchTitan's pp x dp mesh on every rank: the stage pair as peers, this rank's own stages."""
    n = 2 * stages_per_rank
    for r, mine in enumerate(run):
        coord = r // 2  # torchtitan unflattens (pp, dp...) from the world mesh: rank = 2 * pp + dp
        held = [f"pp{coord + 2 * k}" for k in range(stages_per_rank)]
        topo = mine["scout_topology"]
        assert mine["scout_disabled"] is None and topo["stage_order"] == "loop", mine[
            "scout_disabled"
        ]
        assert topo["peers"] == [2 * coord, 2 * coord + 1] and topo["peer_groups"] == [
            [0, 1],
            [2, 3],
        ], topo
        assert topo["stage_dims"] == ["pp"] and topo["stage_label"] == f"pp{coord}", topo
        assert {name.split(".")[0] for name in topo["catalog"]} == set(held), topo["catalog"]
        kinds = {name.split(".", 1)[1].split(".")[0] for name in topo["catalog"]}
        assert ("pp0.embedding" in topo["catalog"]) == (coord == 0) and kinds <= {
            "embedding",
            "hidden",
            "optimizer",
        }
        for cycle in mine[
            "scout_cycles"
        ].values():  # every rank judges every stage's recipes, each in its own pair
            assert {name.split(".")[0] for name in cycle["verdicts"]} == {
                f"pp{i}" for i in range(n)
            }, cycle
            assert cycle["peers"] == topo["peers"]


@pytest.mark.timeout(1200)
def test_scout_on_1f1b_stages_of_pp_x_fsdp(assets: Path, tmp_path: Path) -> None:
    """pp=2 x dp_shard=2, 1F1B: a healthy run through titan_cell, then a replay fault on rank 1's first stage."""
    from qualification.programs.titan_cell import run_cell

    res = run_cell(
        pipeline_cell("pp-fsdp", "1F1B", {"kind": "none"}, per_cycle=0), tmp_path / "cell"
    )
    obs = res["observed"]
    assert res["status"] == "passed", res
    assert (
        obs["bitwise_equal"]
        and obs["losses_equal"]
        and obs["errors"] == []
        and obs["model_parts"] == [1] * 4
    )
    assert (
        obs["sdc_reports"] == 0
        and obs["unexpected_verdicts"] == 0
        and obs["scout_disabled"] is None
    ), obs
    assert obs["peer_groups"] == [[0, 1], [2, 3]] and obs["stages"] == ["pp0", "pp1"], obs
    assert obs["certified_steps"] and obs["rejected_steps"] == [], (
        obs
    )  # the kept captures (keep_generations=2)
    healthy = ranks(tmp_path / "cell" / "run", 4)
    check_stages(healthy, 1)
    check_certified_every_step(healthy)
    for a, b in ((0, 1), (2, 3)):  # FSDP: the peers of one stage hold different shards of it
        assert healthy[a]["state"]["params"] != healthy[b]["state"]["params"]

    base = ranks(tmp_path / "cell" / "reference", 4)
    out = tmp_path / "fault"
    res2 = titan(
        out,
        assets,
        "--pp",
        "2",
        "--pp-schedule",
        "1F1B",
        "--ckpt",
        str(out / "ckpt"),
        "--scout",
        "--scout-per-cycle",
        "10",
        "--replay-fault-rank",
        "1",
        "--replay-fault-step",
        "3",
        "--replay-fault-recipe",
        "pp0.embedding",
        world=4,
        steps=PP_STEPS + 1,
    )
    assert res2.ok, (res2, out / "logs")
    run = ranks(out, 4)
    check_stages(run, 1)
    check_pipeline_fault(run, 3, "pp0.embedding", [0, 1])
    assert_bitwise(run, base)


def check_certified_every_step(run: list[dict[str, Any]]) -> None:
    """Every block and slice replayed at every step: each clean cycle certifies its own step's capture, and the
    captures GEMINI still keeps (keep_generations=2 prunes the older ones) are all verified."""
    for mine in run:
        assert {int(s): c["certified"] for s, c in mine["scout_cycles"].items()} == {
            s: s for s in range(1, PP_STEPS + 2)
        }, mine["scout_cycles"].keys()
        assert mine["trust"] and set(mine["trust"].values()) == {"recovery_verified"}, mine["trust"]


def check_pipeline_fault(
    run: list[dict[str, Any]], step: int, recipe: str, pair: list[int]
) -> None:
    """The fault: one SDC report on every rank for that stage's pair and no culprit, the candidate before it rejected
    on every rank, the decision naming the certified step before it, certification resumed after it."""
    for mine in run:
        sdc = [x for x in mine["reports"] if x["kind"] == "sdc"]
        assert [(x["step"], x["recipe"], x["ranks"], x["scope"]) for x in sdc] == [
            (step, recipe, pair, "peer_group")
        ]
        assert "detection without a culprit" in sdc[0]["reason"], sdc[0]
        bad = {
            (int(s), n)
            for s, c in mine["scout_cycles"].items()
            for n, v in c["verdicts"].items()
            if v != "agree"
        }
        assert bad == {(step, recipe)}, bad
        decision = next(d for d in mine["decisions"] if d["failure_kind"] == "sdc")
        assert decision["mode"] == "restore" and decision["step"] == 1, decision
        # A rotation that covers every stage's catalog in two steps: step 2 certifies step 1, step 3 is the fault,
        # step 5 certifies step 4. Step 2's capture was a candidate when the fault came: rejected.
        certified = {int(s): c["certified"] for s, c in mine["scout_cycles"].items()}
        assert certified == {1: None, 2: 1, 3: None, 4: None, 5: 4}, certified
        trust = {int(s): v for s, v in mine["trust"].items()}
        assert (
            trust.get(2) == "rejected" and step not in trust and trust.get(4) == "recovery_verified"
        ), trust
        assert mine["trust"] == run[0]["trust"], "ranks disagree on trust"


@pytest.mark.timeout(1200)
def test_scout_on_interleaved_stages_of_pp_x_ddp(assets: Path, tmp_path: Path) -> None:
    """pp=2 x dp_replicate=2, Interleaved1F1B (stages 0 and 2 on pp rank 0, 1 and 3 on pp rank 1): a replay fault on
    rank 3's last stage through titan_cell, then a healthy run."""
    from qualification.programs.titan_cell import run_cell

    fault = {"kind": "replay", "rank": 3, "step": 3, "recipe": "pp3.hidden.0"}
    res = run_cell(
        pipeline_cell("pp-ddp", "Interleaved1F1B", fault, per_cycle=10), tmp_path / "cell"
    )
    obs = res["observed"]
    assert res["status"] == "passed", res
    assert obs["bitwise_equal"] and obs["losses_equal"] and obs["model_parts"] == [2] * 4, obs
    assert (obs["sdc_reports"], obs["scope"], obs["group_ranks"], obs["localized_ranks"]) == (
        1,
        "peer_group",
        [2, 3],
        [],
    )
    assert (obs["detected_step"], obs["recipe"], obs["unexpected_verdicts"]) == (
        3,
        "pp3.hidden.0",
        0,
    ), obs
    assert obs["peer_groups"] == [[0, 1], [2, 3]] and obs["stages"] == [
        "pp0",
        "pp1",
        "pp2",
        "pp3",
    ], obs
    assert (
        obs["decision_before_fault"]
        and obs["decision_mode"] == "restore"
        and obs["rejected_steps"] == [2]
    )
    assert obs["fault_step_rejected"] and obs["certified_after"] and obs["ranks_agree"], obs
    run = ranks(tmp_path / "cell" / "run", 4)
    check_stages(run, 2)
    check_pipeline_fault(run, 3, "pp3.hidden.0", [2, 3])

    base = ranks(tmp_path / "cell" / "reference", 4)
    out = tmp_path / "healthy"
    res2 = titan(
        out,
        assets,
        "--pp",
        "2",
        "--dp-replicate",
        "2",
        "--pp-schedule",
        "Interleaved1F1B",
        "--ckpt",
        str(out / "ckpt"),
        "--scout",
        "--scout-per-cycle",
        "0",
        world=4,
        steps=PP_STEPS + 1,
    )
    assert res2.ok, (res2, out / "logs")
    healthy = ranks(out, 4)
    check_stages(healthy, 2)
    for mine in healthy:
        assert [x for x in mine["reports"] if x["kind"] == "sdc"] == [], mine["reports"]
        assert {v for c in mine["scout_cycles"].values() for v in c["verdicts"].values()} == {
            "agree"
        }
    check_certified_every_step(healthy)
    assert_bitwise(healthy, base)
    for a, b in (
        (0, 1),
        (2, 3),
    ):  # replicas of one pair of stages: bitwise equal parameters and optimizer state
        assert [healthy[a]["state"][k] for k in ("params", "optimizer")] == [
            healthy[b]["state"][k] for k in ("params", "optimizer")
        ]

"""DeepSpeed ZeRO-1/2 under gemscout, real gloo ranks on DeepSpeed's CPU accelerator (``[deepspeed]`` extra).

- GEMINI: a healthy run with gemscout equals a DeepSpeed run without it, bit for bit on every rank (module, fp32
  master partition, AdamW state of the partition, lr); a SIGKILL plus the loss of that rank's node is recovered from
  the peer's replica, the engine's counters and lr scheduler come back, and every rank ends bitwise equal to the
  uninterrupted run.
- bf16 module weights (fp32 master partition) with gradient accumulation recover bitwise too.
- The durable tier stores the partition state per parameter: a 2-rank job's promotion resumes on 3 or 4 ranks with
  every local folder gone, holding exactly the full state the 2-rank job had (as DeepSpeed itself gathers it), and
  then trains bitwise like a reference job loaded from that full state with DeepSpeed's own setters; the 3-rank
  job's promotion resumes on 2 ranks again.
- SCOUT: the forward recipes replay on the engine's module; with 3 peers a persistent corruption of one block on one
  rank is attributed to that rank, uncertified candidates are rejected, the decision names the newest verified step
  before the fault, and clean rotations certify again once the fault is gone.

Skipped, with the reason, where deepspeed is not installed. The rank program skips DeepSpeed's shm_comm JIT build.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from _heavy import heavy
from ds_checks import check_sdc_attributed_and_gated

from qualification.launch import launch
from qualification.programs.lifecycle import run_cell

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (pip install -e '.[deepspeed]')",
)

STEPS, MICRO_BATCH = 6, 4


def cell(topology: str, world: int, fault: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "t",
        "world_size": world,
        "workload": "three-block",
        "topology": topology,
        "seed": 0,
        "timeout_s": 150,
        "fault": fault,
        "params": {"steps": STEPS},
    }


def ranks(folder: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "topology",
    [
        "deepspeed-zero1",
        pytest.param(
            "deepspeed-zero2",
            marks=heavy(
                "lifecycle-*-deepspeed-zero2-w2-*",
                "topologies",
                "ZeRO-2 beside ZeRO-1, ~28 s on 2 cores",
            ),
        ),
    ],
)
def test_zero_lifecycle_is_bitwise(tmp_path: Path, topology: str) -> None:
    world = 2
    healthy = run_cell(cell(topology, world, {"kind": "none"}), tmp_path / "healthy")
    assert healthy["status"] == "passed", healthy
    baseline = ranks(tmp_path / "healthy" / "baseline", world)
    assert len({r["state_digest"] for r in baseline}) == world, (
        "each rank should hold a different partition"
    )
    for r in ranks(tmp_path / "healthy" / "run", world):
        assert r["errors"] == [] and r["replicas_equal"]
        assert r["global_steps"] == STEPS and r["global_samples"] == STEPS * MICRO_BATCH * world

    fault = {"kind": "sigkill", "rank": 1, "step": 4, "phase": "replicate", "node_loss": True}
    killed = run_cell(cell(topology, world, fault), tmp_path / "killed")
    obs = killed["observed"]
    assert obs["rank_exit_codes"][1] == -9
    assert obs["recovered_step"] == 3 and obs["decision"]["sources"]["1"].startswith("peer:"), obs[
        "decision"
    ]
    assert killed["status"] == "passed" and obs["bitwise_equal"] and obs["losses_equal"], killed
    for r, base in zip(ranks(tmp_path / "killed" / "run", world), baseline, strict=True):
        assert r["resume_step"] == 3
        # Counters restored at attach (3 steps) plus the 3 run since: a fresh engine would end at 3.
        assert (r["global_steps"], r["global_samples"], r["lr"]) == (
            STEPS,
            base["global_samples"],
            base["lr"],
        )


@pytest.mark.timeout(300)
def test_zero2_three_ranks_recover_from_a_kill_inside_capture(tmp_path: Path) -> None:
    fault = {"kind": "sigkill", "rank": 2, "step": 4, "phase": "capture"}
    killed = run_cell(cell("deepspeed-zero2", 3, fault), tmp_path)
    obs = killed["observed"]
    assert obs["rank_exit_codes"][2] == -9
    assert obs["recovered_step"] == 3, obs["decision"]  # step 4 never left the dying rank
    assert killed["status"] == "passed" and obs["bitwise_equal"] and obs["losses_equal"], killed


@pytest.mark.timeout(300)
def test_zero2_bf16_with_accumulation_recovers_bitwise(tmp_path: Path) -> None:
    world = 2
    argv = [
        "-m",
        "qualification.programs.ds_rank",
        "--topology",
        "deepspeed-zero2",
        "--bf16",
        "--accumulation",
        "2",
        "--steps",
        str(STEPS),
    ]
    ckpt = ["--ckpt", str(tmp_path / "ckpt")]
    kill = ["--kill-rank", "1", "--kill-step", "4", "--kill-phase", "after-step"]
    runs = [("base", [], True), ("run", ckpt + kill, False), ("run", ckpt, True)]
    for attempt, (out, extra, ok) in enumerate(runs):
        res = launch(
            argv + ["--out", str(tmp_path / out)] + extra,
            world_size=world,
            timeout_s=200,
            log_dir=tmp_path / "logs" / out,
            attempt=attempt,
        )
        assert res.ok == ok, res
    for r, base in zip(
        ranks(tmp_path / "run", world), ranks(tmp_path / "base", world), strict=True
    ):
        assert r["resume_step"] == 4 and r["decision"]["mode"] == "restore"
        assert (r["state_digest"], r["losses"], r["global_steps"]) == (
            base["state_digest"],
            base["losses"],
            STEPS,
        )
        assert r["global_samples"] == base["global_samples"] == STEPS * MICRO_BATCH * 2 * world


@pytest.mark.timeout(300)
def test_scout_attributes_a_faulty_rank_on_zero2(tmp_path: Path) -> None:
    world, fault_rank, fault_step, heal_step, block = 3, 2, 4, 7, 1
    res = launch(
        [
            "-m",
            "qualification.programs.ds_rank",
            "--out",
            str(tmp_path),
            "--topology",
            "deepspeed-zero2",
            "--steps",
            "12",
            "--ckpt",
            str(tmp_path / "ckpt"),
            "--keep-generations",
            "12",
            "--scout",
            "--fault-rank",
            str(fault_rank),
            "--fault-step",
            str(fault_step),
            "--heal-step",
            str(heal_step),
            "--fault-block",
            str(block),
        ],
        world_size=world,
        timeout_s=240,
        log_dir=tmp_path / "logs",
    )
    assert res.ok, res
    check_sdc_attributed_and_gated(
        ranks(tmp_path, world),
        fault_rank=fault_rank,
        fault_step=fault_step,
        heal_step=heal_step,
        block=block,
    )


@heavy(
    "lifecycle-durable-fallback-deepspeed-zero2-*",
    "topologies",
    "three DeepSpeed launches, ~30 s on 2 cores",
)
@pytest.mark.timeout(600)
def test_zero2_durable_tier_resumes_bitwise_after_all_local_storage_is_lost(tmp_path: Path) -> None:
    """Every rank's partition is promoted collectively into one DCP directory (per parameter, SHA-256 sidecar);
    with every node's local folder deleted, a relaunch on the same world size resumes from the durable tier bitwise
    (padding included), and a job with other param groups is refused with the reason."""
    from gemscout.gemini.durable import SIDECAR

    world, durable = 2, tmp_path / "durable"

    def go(name: str, ckpt: str | None, steps: int, *extra: str, n: int = world) -> Any:
        tiers = (
            ["--ckpt", str(tmp_path / ckpt), "--durable", str(durable)] if ckpt else []
        )  # none: no gemscout
        argv = [
            "-m",
            "qualification.programs.ds_rank",
            "--out",
            str(tmp_path / name),
            "--topology",
            "deepspeed-zero2",
            "--steps",
            str(steps),
            *tiers,
            *extra,
        ]
        return launch(argv, world_size=n, timeout_s=240, log_dir=tmp_path / "logs" / name)

    res = go("a", "local-a", 6, "--durable-every", "2", "--certify")
    assert res.ok, res
    a = ranks(tmp_path / "a", world)
    assert all(r["errors"] == [] for r in a), [r["errors"] for r in a]
    assert sorted(p.name for p in durable.iterdir()) == [
        "step-000000002",
        "step-000000004",
        "step-000000006",
    ]
    sidecar = json.loads((durable / "step-000000006" / SIDECAR).read_text())
    assert sidecar["world_size"] == world and len(sidecar["ranks"]) == world
    assert all(r["trust"]["6"] == "durable" for r in a), a[0]["trust"]
    shutil.rmtree(tmp_path / "local-a")  # every node's local folder is gone

    res = go("b", "local-b", 8)
    assert res.ok, res
    b = ranks(tmp_path / "b", world)
    res = go("base", None, 8)  # the uninterrupted run of 8 steps, without gemscout
    assert res.ok, res
    base = ranks(tmp_path / "base", world)
    for rb, rbase in zip(b, base, strict=True):
        assert rb["decision"]["mode"] == "durable" and rb["decision"]["step"] == 6, rb["decision"]
        assert rb["state_digest"] == rbase["state_digest"], (
            f"rank {rb['rank']}: resumed trajectory is not bitwise"
        )
        assert rb["losses"] == rbase["losses"] and rb["global_steps"] == 8

    res = go(
        "c", "local-c", 8, "--param-groups", "2"
    )  # the promotion's one param group cannot fill two
    assert not res.ok
    logs = " ".join(p.read_text(errors="replace") for p in (tmp_path / "logs" / "c").glob("*.log"))
    assert (
        "RunMismatchError: durable step 6 refused on rank 0: durable promotion step-000000006 has param groups of ["
        in logs
    ), logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("topology", "grown", "extra"),
    [
        pytest.param(
            "deepspeed-zero1",
            3,
            [],
            marks=heavy(
                "ds_resize_cell-resize-deepspeed-zero1-w3-*",
                "topologies",
                "2 + 3 + 2 DeepSpeed ranks, ~33 s on 2 cores",
            ),
        ),
        pytest.param(
            "deepspeed-zero2",
            4,
            ["--bf16", "--param-groups", "2"],
            marks=heavy(
                "ds_resize_cell-resize-bf16-deepspeed-zero2-*",
                "topologies",
                "2 + 4 + 2 DeepSpeed ranks, ~70 s on 2 cores",
            ),
        ),
    ],
)
def test_durable_tier_resumes_on_another_world_size(
    tmp_path: Path, topology: str, grown: int, extra: list[str]
) -> None:
    """A 2-rank job promotes step 4 (per parameter) and every local folder is lost. A job on ``grown`` ranks resumes
    from the durable tier: its full fp32 masters and AdamW moments, as DeepSpeed's ``safe_get_full_*`` gathers them,
    equal the 2-rank job's at step 4 bit for bit, and so does its module. The reference is a job on ``grown`` ranks
    without gemscout loaded from the 2-rank job's full state with DeepSpeed's own ``safe_set_full_*`` setters: after
    two more steps every rank's module, partition, moments and lr equal it bitwise, losses included. The grown job
    promotes step 6, and a 2-rank job resumes from that, equal to its full state again (shrinking)."""
    durable, dump = tmp_path / "durable", tmp_path / "full-step4.pt"

    def go(
        name: str, world: int, steps: int, *more: str, gemscout: bool = True
    ) -> list[dict[str, Any]]:
        tiers = (
            ["--ckpt", str(tmp_path / f"local-{name}"), "--durable", str(durable)]
            if gemscout
            else []
        )
        argv = [
            "-m",
            "qualification.programs.ds_rank",
            "--out",
            str(tmp_path / name),
            "--topology",
            topology,
            "--steps",
            str(steps),
            "--full-state",
            *extra,
            *tiers,
            *more,
        ]
        res = launch(argv, world_size=world, timeout_s=300, log_dir=tmp_path / "logs" / name)
        logs = " ".join(
            p.read_text(errors="replace")[-2000:] for p in (tmp_path / "logs" / name).glob("*.log")
        )
        assert res.ok, (name, res, logs)
        return ranks(tmp_path / name, world)

    a = go("a", 2, 4, "--durable-every", "2", "--certify", "--dump-full", str(dump))
    assert (
        len({r["state_digest"] for r in a}) == 2
        and len({json.dumps(r["final_full"]) for r in a}) == 1
    )
    shutil.rmtree(tmp_path / "local-a")  # every node's local folder is gone

    grown_run = go("b", grown, 6, "--durable-every", "2", "--certify")
    reference = go("ref", grown, 6, "--load-full", str(dump), gemscout=False)
    for b, ref in zip(grown_run, reference, strict=True):
        assert b["decision"]["mode"] == "durable" and b["decision"]["step"] == 4, b["decision"]
        assert b["resume_full"] == a[0]["final_full"], (
            f"rank {b['rank']}: resharded state differs from step 4's"
        )
        assert b["resume_module"] == a[0]["module_digest"]
        assert (
            ref["resume_full"] == a[0]["final_full"]
            and ref["resume_module"] == a[0]["module_digest"]
        )
        assert b["state_digest"] == ref["state_digest"], (
            f"rank {b['rank']}: steps 5-6 differ from the reference"
        )
        assert b["final_full"] == ref["final_full"]
        after = {s: v for s, v in b["losses"].items() if int(s) > 4}
        assert (
            after == ref["losses"]
            and len(after) == 2
            and all(math.isfinite(v) for v in after.values())
        )
        assert (
            (b["global_steps"], b["global_samples"], b["lr"])
            == (ref["global_steps"], ref["global_samples"], ref["lr"])
            == (6, ref["global_samples"], ref["lr"])
        )
        assert b["errors"] == [] and b["trust"]["6"] == "durable", (b["errors"], b["trust"])
    assert len({r["state_digest"] for r in grown_run}) == grown, (
        "each rank should hold a different partition"
    )

    shutil.rmtree(tmp_path / "local-b")
    shrunk = go("c", 2, 7)
    for c in shrunk:
        assert c["decision"]["mode"] == "durable" and c["decision"]["step"] == 6, c["decision"]
        assert (
            c["resume_full"] == grown_run[0]["final_full"]
            and c["resume_module"] == grown_run[0]["module_digest"]
        )
        assert c["global_steps"] == 7 and math.isfinite(c["losses"]["7"])

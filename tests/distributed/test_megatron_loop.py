"""Megatron Core's own training loop under gemscout on CPU: real gloo ranks (``[megatron]`` extra).

What runs for real (``qualification.programs.megatron_loop_rank``): Megatron's ``DistributedDataParallel`` (grad
buffers, bucketed reduce-scatter / all-reduce, ``overlap_grad_reduce`` backward hooks), the optimizer
``get_megatron_optimizer`` builds (``DistributedOptimizer`` shards of fp32 main parameters, or ``FP32Optimizer``;
Adam, grad clipping), the ``get_forward_backward_func()`` schedule with ``finalize_model_grads`` (1F1B with two
pipeline stages), a small ``GPTModel`` with dropout on; gemscout attaches to the MegatronOptimizer through
``MegatronOptimizerView``. What is stood in, and why: on this path Megatron creates tensors on ``device="cuda"``,
on ``torch.cuda.current_device()`` and dispatches on ``param.type() == "torch.cuda.FloatTensor"``; the test-only
``qualification.frameworks.megatron_cpu`` redirects exactly those to the CPU (see its docstring;
``torch.cuda.is_available()`` stays False).

- DDP + DistributedOptimizer + overlapped grad reduce, DP=2: a run with GEMINI + SCOUT every step is bitwise equal to
  the run without gemscout (model, each rank's optimizer shard, RNG tracker); DDP's gradient sync ran every step
  (``finalize_model_grads`` wired as Megatron-LM does: without it each rank steps on its own gradients).
- Same layout, rank 1 SIGKILLed after step 4 and its node folder deleted: the relaunch resumes at step 4 from the
  peer's replica and ends bitwise equal to the uninterrupted run.
- FP32Optimizer, DP=3: a fault in rank 2's replay of a block is attributed to rank 2 alone, the candidates are rejected.
- PP=2 (1F1B) x DistributedOptimizer through the lifecycle driver (campaign topology ``megatron-pp2``): SIGKILL +
  node loss after step 3 recovers bitwise, stage by stage (GEMINI; SCOUT under PP: test_megatron_pp_scout.py).

Skipped, with the reason, where megatron-core is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from _heavy import heavy

from qualification.launch import launch
from qualification.programs.lifecycle import run_cell

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core is not installed (pip install -e '.[megatron]')",
)

STEPS = 6
DDP = ["--distopt", "--overlap"]


def _run(
    tmp: Path, name: str, world: int, args: list[str], *, ok: bool = True, attempt: int = 0
) -> list[Any]:
    res = launch(
        [
            "-m",
            "qualification.programs.megatron_loop_rank",
            "--out",
            str(tmp / name),
            "--steps",
            str(STEPS),
        ]
        + args,
        world_size=world,
        timeout_s=240,
        log_dir=tmp / "logs" / name,
        attempt=attempt,
    )
    assert res.ok == ok, (res, sorted((tmp / "logs" / name).glob("*.log")))
    return _read(tmp / name, world) if ok else res.returncodes


def _read(folder: Path, world: int) -> list[Any]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


@heavy(
    "lifecycle-*-megatron-distopt-w2-*", "topologies", "three Megatron launches, ~33 s on 2 cores"
)
@pytest.mark.timeout(600)
def test_ddp_distopt_healthy_run_is_bitwise_and_sigkill_plus_node_loss_recovers_bitwise(
    tmp_path: Path,
) -> None:
    base = _run(tmp_path, "base", 2, DDP)
    healthy = _run(
        tmp_path, "healthy", 2, DDP + ["--ckpt", str(tmp_path / "ck-healthy"), "--scout"]
    )
    for r, (b, g) in enumerate(zip(base, healthy, strict=True)):
        assert (
            b["optimizer"] == ["DistributedOptimizer"]
            and b["replicas_equal"]
            and b["grad_syncs"] == STEPS
        ), b
        assert g["peers"] == [0, 1] and g["errors"] == [] and g["reports"] == [], g
        assert sorted(g["verdicts"]) == [str(s) for s in range(1, STEPS + 1)], (
            "a SCOUT cycle is missing"
        )
        assert all(v == "agree" for cycle in g["verdicts"].values() for v in cycle.values()), g[
            "verdicts"
        ]
        assert "recovery_verified" in g["trust"].values(), g["trust"]  # SCOUT ran and certified
        assert (g["state_digest"], g["losses"]) == (b["state_digest"], b["losses"]), (
            f"rank {r}: trajectory changed"
        )
    assert (
        base[0]["state_digest"] != base[1]["state_digest"]
    )  # each rank's optimizer shard is its own

    ckpt = tmp_path / "ck-kill"
    codes = _run(
        tmp_path,
        "killed",
        2,
        DDP + ["--ckpt", str(ckpt), "--kill-rank", "1", "--kill-step", "4"],
        ok=False,
    )
    assert codes[1] == -9, codes
    shutil.rmtree(
        ckpt / "node-1"
    )  # the node is gone with the process: only the peer's replica remains
    run = _run(tmp_path, "killed", 2, DDP + ["--ckpt", str(ckpt)], attempt=1)
    for r, (b, g) in enumerate(zip(base, run, strict=True)):
        assert g["resume_step"] == 4 and g["decision"]["mode"] == "restore", g["decision"]
        assert g["grad_syncs"] == STEPS - 4, g["grad_syncs"]
        assert g["decision"]["sources"] == {"0": "memory", "1": "peer:0"}, g[
            "decision"
        ]  # rank 0: its memory tier
        assert (g["state_digest"], g["losses"]) == (b["state_digest"], b["losses"]), (
            f"rank {r}: not recovered"
        )


@pytest.mark.timeout(600)
def test_fp32_optimizer_dp3_replay_fault_is_attributed_to_its_rank(tmp_path: Path) -> None:
    fault_rank, fault_step = 2, 3
    results = _run(
        tmp_path,
        "dp3",
        3,
        [
            "--ckpt",
            str(tmp_path / "ckpt"),
            "--scout",
            "--keep-generations",
            "8",
            "--fault-rank",
            str(fault_rank),
            "--fault-step",
            str(fault_step),
        ],
    )
    for r in results:
        assert (
            r["optimizer"] == ["FP32Optimizer"] and r["peers"] == [0, 1, 2] and r["replicas_equal"]
        ), r
        assert r["grad_syncs"] == STEPS, r["grad_syncs"]
        sdc = [
            (rep["step"], rep["recipe"], list(rep["ranks"]))
            for rep in r["reports"]
            if rep["kind"] == "sdc"
        ]
        assert sdc == [(fault_step, "hidden.1", [fault_rank])], sdc
        assert r["verdicts"][str(fault_step)]["hidden.1"] == "attributed", r["verdicts"]
        decision = next(d for d in r["decisions"] if d["failure_kind"] == "sdc")
        assert decision["mode"] == "restore" and decision["step"] < fault_step, decision
        # The candidate captured after the last certification cannot be trusted: rejected job-wide.
        assert "rejected" in r["trust"].values() and r["trust"] == results[0]["trust"], r["trust"]
    assert results[fault_rank]["fired"] and all(
        not r["fired"] for r in results if r["rank"] != fault_rank
    )


@heavy(
    "lifecycle-kill-megatron-pp2-w2-*",
    "topologies",
    "three Megatron pipeline launches, ~31 s on 2 cores",
)
@pytest.mark.timeout(600)
def test_pipeline_1f1b_distopt_sigkill_plus_node_loss_recovers_bitwise_through_the_lifecycle_driver(
    tmp_path: Path,
) -> None:
    # The campaign path (topology megatron-pp2): baseline, killed run, node folder deleted, relaunch, compared stage
    # by stage with the baseline. Rank 1 is the last stage: it holds the loss, the output layer and its optimizer shard.
    cell = {
        "id": "t",
        "world_size": 2,
        "workload": "gpt-megatron",
        "topology": "megatron-pp2",
        "seed": 0,
        "timeout_s": 240,
        "params": {"steps": STEPS},
        "fault": {
            "kind": "sigkill",
            "rank": 1,
            "step": 3,
            "phase": "after-step",
            "node_loss": True,
        },
    }
    result = run_cell(cell, tmp_path)
    obs = result["observed"]
    assert obs["rank_exit_codes"][1] == -9
    assert obs["recovered_step"] == 3 and obs["decision"]["sources"] == {
        "0": "memory",
        "1": "peer:0",
    }, obs
    assert result["status"] == "passed" and obs["bitwise_equal"] and obs["losses_equal"], result
    assert obs["final_step"] == STEPS and obs["replicas_equal"] and obs["errors"] == []
    base, run = (_read(tmp_path / name, 2) for name in ("baseline", "run"))
    assert [r["pp_rank"] for r in run] == [0, 1] and base[0]["state_digest"] != base[1][
        "state_digest"
    ]
    assert all(r["resume_step"] == 3 and r["optimizer"] == ["DistributedOptimizer"] for r in run)
    assert [b["grad_syncs"] for b in base] == [STEPS, STEPS] and [r["grad_syncs"] for r in run] == [
        3,
        3,
    ]

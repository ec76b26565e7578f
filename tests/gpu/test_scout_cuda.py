"""GPU tier: SCOUT replay on CUDA tensors. Skipped without a CUDA device.

Three DDP ranks share GPU 0 over gloo (one GPU in the tier; NCCL refuses two ranks on one device), model, batches
and replays on CUDA, the three-block model with dropout (so the replay must restore the captured CUDA RNG state),
``enable_resiliency(..., scout=ScoutConfig(hidden_per_cycle=None))`` at interval 1:

* clean steps: every recipe AGREEs on every rank, zero reports — replay on CUDA is bitwise equal across ranks;
* then, one step each, a low-mantissa bit flip in rank 2's replay of ``embedding``, ``hidden.1``, ``output`` and
  ``optimizer.0`` (the harness's replay injector): each is ATTRIBUTED to rank 2 alone, at that step;
* training afterwards certifies again.

The rank program takes ``--device``; ``python tests/gpu/test_scout_cuda.py cpu OUT`` under the launcher runs the
same checks on CPU (how the program itself was checked on a machine without a GPU).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORLD, CLEAN = 3, 3
FAULTS = ("embedding", "hidden.1", "output", "optimizer.0")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)"),
]


def rank_main(device_name: str, out: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gemscout
    from gemscout.scout import ScoutConfig, StragglerConfig
    from qualification.faults import Injector, fail_at
    from qualification.workloads import build_model, lm_loss, synthetic_batch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    device = torch.device(device_name)
    torch.manual_seed(17)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(17)
    model = DDP(build_model("three-block", seed=0).to(device), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reports: list[dict[str, Any]] = []
    session = gemscout.enable_resiliency(
        model,
        opt,
        scout=ScoutConfig(
            interval=1,
            hidden_per_cycle=None,
            optimizer_slices_per_cycle=None,
            stragglers=StragglerConfig(absolute_margin_s=0.5),
        ),  # ranks share one device
        on_fault_report=lambda r: reports.append(
            {"kind": r.kind.value, "ranks": list(r.ranks), "step": r.step, "recipe": r.recipe}
        ),
    )
    assert session.scout is not None
    injector = Injector(session.scout)
    cycles: list[dict[str, Any]] = []
    plan = {CLEAN + 1 + i: recipe for i, recipe in enumerate(FAULTS)}
    last = CLEAN + len(FAULTS) + 3
    for step in range(1, last + 1):
        injector.set(
            *([fail_at("bitflip", rank=2, step=step, recipe=plan[step])] if step in plan else [])
        )
        x, y = (t.to(device) for t in synthetic_batch(seed=0, step=step, rank=rank))
        loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result = session.scout.last_result
        assert result is not None and result.step == step
        cycles.append(
            {
                "step": step,
                "certified": result.certified_step,
                "verdicts": {
                    n: [r.verdict.value, list(r.ranks)] for n, r in result.results.items()
                },
            }
        )
    session.close()
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "cycles": cycles,
                "reports": reports,
                "plan": {str(k): v for k, v in plan.items()},
                "device": str(next(model.parameters()).device),
            }
        )
    )
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # leave without gloo teardown (it can deadlock; every rank has written its result)


def check(out: Path) -> None:
    """The assertions, shared by the GPU test and a CPU run of the same program."""
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    plan = {int(k): v for k, v in ranks[0]["plan"].items()}
    for r in ranks:
        for cycle in r["cycles"]:
            step = cycle["step"]
            for name, (verdict, culprits) in cycle["verdicts"].items():
                if plan.get(step) == name:
                    assert (verdict, culprits) == ("attributed", [2]), (
                        r["rank"],
                        step,
                        name,
                        verdict,
                    )
                else:
                    assert verdict == "agree", (r["rank"], step, name, verdict, culprits)
        sdc = [(p["step"], p["recipe"], p["ranks"]) for p in r["reports"] if p["kind"] == "sdc"]
        assert sdc == [(s, n, [2]) for s, n in sorted(plan.items())], sdc
        assert [p for p in r["reports"] if p["kind"] != "sdc"] == [], r["reports"]
        assert r["cycles"][-1]["certified"] is not None and r["cycles"][-1]["certified"] > max(
            plan
        ), r["cycles"][-1]
        assert [c["certified"] for c in r["cycles"][:CLEAN]] == list(range(1, CLEAN + 1))
    assert ranks[0]["cycles"] == ranks[1]["cycles"] == ranks[2]["cycles"]


@pytest.mark.timeout(240)
def test_cuda_replay_is_bitwise_across_ranks_and_names_the_faulty_rank(tmp_path: Path) -> None:
    from qualification.launch import launch

    env = {
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    res = launch(
        [__file__, "cuda", str(tmp_path)],
        world_size=WORLD,
        timeout_s=220,
        log_dir=tmp_path / "logs",
        env=env,
    )
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert res.ok, f"{res}\n{logs}"
    check(tmp_path)
    assert json.loads((tmp_path / "rank0.json").read_text())["device"].startswith("cuda")


if __name__ == "__main__":
    rank_main(sys.argv[1], Path(sys.argv[2]))

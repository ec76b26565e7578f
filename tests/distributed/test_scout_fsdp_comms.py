"""A rank late to FSDP2's own collectives, named from the job's all-gathers and reduce-scatters.

One launch of 4 ranks, HSDP on a (replicate 2, shard 2) mesh, ``enable_resiliency(..., scout=ScoutConfig(
job_collectives=True))``: SCOUT wraps every ``fully_shard`` module's all-gather and reduce-scatter. First clean steps,
then rank 3 enters the first all-gather of each step 0.4 s late (a sleep at the timer's fault seam, before the
collective). Expected: no report while clean; then a communication-straggler report naming rank 3 and its host
(``GEMSCOUT_HOSTNAME`` gives each rank its own) once confirmed, and no compute-straggler or SDC report; and the
training with the wrapped comms is bitwise equal to the same steps of plain HSDP (no gemscout), run afterwards in the
same processes from the same seed.

Nothing is mocked: real processes, real gloo, FSDP2's own custom-comm seam. Run as a script under the launcher,
this file is the rank program.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLD, CLEAN, LATE, LATE_S, CONFIRMATIONS = 4, 3, 3, 0.4, 2


def _hsdp(seed: int) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qualification.workloads import build_model

    torch.manual_seed(seed + 17)  # the dropout stream: both runs start from the same one
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build_model("three-block", seed=seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(
    model: Any, opt: Any, steps: range, rank: int, late: dict[str, bool] | None = None
) -> None:
    from qualification.workloads import lm_loss, synthetic_batch

    for step in steps:
        if late is not None:
            late["on"] = step > CLEAN
            late["armed"] = True
        inputs, targets = synthetic_batch(seed=0, step=step, rank=rank)
        lm_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad()


def rank_main(out: Path) -> None:
    os.environ["GEMSCOUT_HOSTNAME"] = f"host-{os.environ['RANK']}"
    import torch
    import torch.distributed as dist

    import gemscout
    from gemscout.scout import ScoutConfig, StragglerConfig
    from gemscout.scout.digests import digest_many
    from gemscout.scout.fsdp_comms import FsdpCollectiveTimer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    reports: list[dict[str, Any]] = []
    model, opt = _hsdp(seed=0)
    session = gemscout.enable_resiliency(
        model,
        opt,
        scout=ScoutConfig(
            interval=1,
            hidden_per_cycle=None,
            job_collectives=True,
            stragglers=StragglerConfig(absolute_margin_s=0.15, confirmations=CONFIRMATIONS),
        ),
        on_fault_report=lambda r: reports.append(
            {
                "kind": r.kind.value,
                "ranks": list(r.ranks),
                "step": r.step,
                "host": r.host,
                "signal": r.evidence.get("signal"),
                "source": r.evidence.get("source"),
            }
        ),
    )
    assert session.scout is not None
    timer = session.scout.time_job_collectives(model)  # the one enable_resiliency installed
    assert isinstance(timer, FsdpCollectiveTimer), type(timer)
    late = {"on": False, "armed": False}

    def arrive_late(kind: str) -> None:
        if late["on"] and late["armed"] and rank == 3 and kind == "all_gather":
            late["armed"] = False  # once per step: the first all-gather of its forward
            time.sleep(LATE_S)

    timer.register_before_collective(arrive_late)
    _train(model, opt, range(1, CLEAN + LATE + 1), rank, late)
    session.close()
    timed = digest_many({k: v.to_local() for k, v in model.state_dict().items()})
    plain, plain_opt = _hsdp(seed=0)
    _train(plain, plain_opt, range(1, CLEAN + LATE + 1), rank)
    untimed = digest_many({k: v.to_local() for k, v in plain.state_dict().items()})
    (out / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "reports": reports, "timed": timed, "untimed": untimed})
    )
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # leave without gloo teardown (it can deadlock; every rank has written its result)


@pytest.mark.timeout(240)
def test_rank_late_to_fsdp_collectives_is_named(tmp_path: Path) -> None:
    from qualification.launch import launch

    res = launch(
        [__file__, str(tmp_path)],
        world_size=WORLD,
        timeout_s=220,
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert res.ok, f"{res}\n{logs}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in ranks:
        assert r["timed"] == r["untimed"], (
            f"rank {r['rank']}: timing FSDP's comms changed the training"
        )
        reports = r["reports"]
        assert reports, f"rank {r['rank']}: no report of the late rank"
        assert all(p["kind"] == "straggler" and p["signal"] == "communication" for p in reports), (
            reports
        )
        assert all(p["ranks"] == [3] and p["host"] == "host-3" for p in reports), reports
        assert all(p["step"] > CLEAN for p in reports), (
            f"a report during the clean steps: {reports}"
        )
        assert min(p["step"] for p in reports) == CLEAN + CONFIRMATIONS, reports
        assert "FSDP2" in reports[0]["source"], reports


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))

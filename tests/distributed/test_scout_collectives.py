"""SCOUT on 3 real gloo ranks of DDP: training under CPU autocast and a bf16 model, and the job's own collectives.

One launch, each rank running every phase in a loop (the three-block model, the whole catalog replayed every step):

* ``autocast``: an fp32 model trained under ``torch.autocast("cpu", dtype=torch.bfloat16)``. The source captures the
  autocast context with the RNG state and every peer replays inside it: clean cycles agree everywhere with zero
  reports, and a replay fault on rank 1 in each recipe in turn is ATTRIBUTED to rank 1 alone (3 peers);
* ``bf16``: the same with the model's parameters in bfloat16 (no autocast): clean, then attributed to rank 1;
* ``late``: ``Scout.time_job_collectives`` times DDP's own gradient all-reduce; rank 2 enters it 0.4 s late at three
  consecutive steps (a sleep at the comm hook's fault seam, before the collective). Expected: a communication
  straggler report naming rank 2 and its host (``GEMSCOUT_HOSTNAME`` gives each rank its own), confirmed after
  ``confirmations`` rounds, and no compute-straggler or SDC report; the clean rounds before it report nothing; and
  the timed training is bitwise equal to the same steps of DDP without SCOUT or the hook.

Nothing is mocked: real processes, real gloo, real DDP comm hook. Run as a script (``python
test_scout_collectives.py RANK WORLD PORT OUT``) this file is the rank program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLD, CLEAN, LATE_S, LATE_ROUNDS, CONFIRMATIONS = (
    3,
    4,
    0.4,
    5,
    4,
)  # CONFIRMATIONS: compute's default, for both


def rank_main(rank: int, world: int, port: int, out: Path) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GEMSCOUT_HOSTNAME"] = f"host-{rank}"
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gemscout.scout import CycleResult, Scout, ScoutConfig, StragglerConfig
    from gemscout.scout.digests import digest_many
    from qualification.faults import Injector, fail_at
    from qualification.workloads import build_model, lm_loss, synthetic_batch

    parent = os.getppid()

    def exit_with_parent() -> (
        None
    ):  # a rank must never outlive the test, even if the test itself is killed
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    config = ScoutConfig(
        hidden_per_cycle=None,
        optimizer_slices_per_cycle=None,
        stragglers=StragglerConfig(absolute_margin_s=0.1, confirmations=CONFIRMATIONS),
    )
    assert config.stragglers.compute_confirmations == CONFIRMATIONS

    def summary(result: CycleResult | None, **cell: Any) -> dict[str, Any]:
        assert result is not None
        return {
            **cell,
            "step": result.step,
            "verdicts": {
                n: {"verdict": r.verdict.value, "ranks": list(r.ranks), "reason": r.reason}
                for n, r in result.results.items()
            },
            "reports": [
                {
                    "kind": p.kind.value,
                    "scope": p.scope.value,
                    "ranks": list(p.ranks),
                    "host": p.host,
                    "signal": p.evidence.get("signal"),
                    "reason": p.reason,
                }
                for p in result.reports
            ],
        }

    cells: list[dict[str, Any]] = []
    step = 0
    for phase in ("autocast", "bf16"):
        torch.manual_seed(7)
        module = build_model("three-block", seed=0)
        if phase == "bf16":
            module = module.to(torch.bfloat16)
        model = DDP(module)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scout = Scout(config).attach(model, opt, first_step=step + 1)
        scout.register_step_hook()
        injector = Injector(scout)
        names = list(scout.catalog.names)
        plan: list[str | None] = [None] * CLEAN + names
        for recipe in plan:
            step += 1
            injector.set(
                *(
                    [fail_at("bitflip", rank=1, step=step, recipe=recipe)]
                    if recipe and rank == 1
                    else []
                )
            )
            inputs, targets = synthetic_batch(seed=0, step=step, rank=rank)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=phase == "autocast"):
                loss = lm_loss(model(inputs), targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            cells.append(
                summary(
                    scout.last_result,
                    phase=phase,
                    recipe=recipe,
                    dtype=str(next(model.parameters()).dtype),
                )
            )
        injector.remove()
        scout.close()

    # The job's own collectives: rank 2 arrives late to DDP's all-reduce at LATE_ROUNDS consecutive steps.
    torch.manual_seed(7)
    model = DDP(build_model("three-block", seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scout = Scout(config).attach(model, opt, first_step=step + 1)
    scout.register_step_hook()
    timer = scout.time_job_collectives(model)
    late = {"on": False}

    def arrive_late(bucket: int) -> None:
        if late["on"] and rank == world - 1 and bucket == 0:
            time.sleep(LATE_S)

    timer.register_before_collective(arrive_late)
    first_late_phase_step = step + 1
    for i in range(CLEAN + LATE_ROUNDS):
        step += 1
        late["on"] = i >= CLEAN
        inputs, targets = synthetic_batch(seed=0, step=step, rank=rank)
        lm_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad()
        cells.append(summary(scout.last_result, phase="late", late=late["on"]))
    scout.close()
    timed_digest = digest_many(dict(model.state_dict()))
    # The same steps without SCOUT and without the timing hook: timing must not change a bit of training (DDP
    # scales by the reciprocal of the world size; with 3 ranks x / 3 and x * (1/3) differ).
    torch.manual_seed(7)
    plain = DDP(build_model("three-block", seed=0))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for s in range(first_late_phase_step, step + 1):
        inputs, targets = synthetic_batch(seed=0, step=s, rank=rank)
        lm_loss(plain(inputs), targets).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    untimed_digest = digest_many(dict(plain.state_dict()))
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "cells": cells,
                "timed_digest": timed_digest,
                "untimed_digest": untimed_digest,
            }
        )
    )
    dist.destroy_process_group()


def _launch(world: int, tmp_path: Path, timeout_s: float) -> list[dict[str, Any]]:
    import torch.distributed as dist

    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for r in range(world):
            with logs[r].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            str(r),
                            str(world),
                            str(master.port),
                            str(tmp_path),
                        ],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=10)
    tails = "\n".join(
        f"--- rank {r} ---\n{log.read_text()[-3000:]}" for r, log in enumerate(logs) if log.exists()
    )
    assert [p.returncode for p in procs] == [0] * world, (
        f"rank exit codes {[p.returncode for p in procs]}\n{tails}"
    )
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(200)
def test_autocast_bf16_replay_and_late_collectives(tmp_path: Path) -> None:
    ranks = _launch(WORLD, tmp_path, timeout_s=180)
    first = ranks[0]["cells"]
    for other in ranks[
        1:
    ]:  # every rank reached the same verdicts and reports (the reasons hold times: not them)
        assert [
            (c["verdicts"], [(p["kind"], p["ranks"]) for p in c["reports"]]) for c in other["cells"]
        ] == [(c["verdicts"], [(p["kind"], p["ranks"]) for p in c["reports"]]) for c in first]

    for phase, dtype in (("autocast", "torch.float32"), ("bf16", "torch.bfloat16")):
        cells = [c for c in first if c["phase"] == phase]
        assert cells and all(c["dtype"] == dtype for c in cells)
        clean = [c for c in cells if c["recipe"] is None]
        assert len(clean) == CLEAN
        for c in clean:
            assert all(v["verdict"] == "agree" for v in c["verdicts"].values()), c
            assert c["reports"] == [], c
        faulty = [c for c in cells if c["recipe"] is not None]
        assert len(faulty) == len(clean[0]["verdicts"])  # every recipe of the catalog, once
        for c in faulty:
            assert c["verdicts"][c["recipe"]]["verdict"] == "attributed", c
            assert c["verdicts"][c["recipe"]]["ranks"] == [1], c
            assert all(
                v["verdict"] == "agree" for n, v in c["verdicts"].items() if n != c["recipe"]
            ), c
            assert [(p["kind"], p["scope"], p["ranks"]) for p in c["reports"]] == [
                ("sdc", "rank", [1])
            ], c

    for r in ranks:  # the timing hook left training bitwise equal to DDP without it
        assert r["timed_digest"] == r["untimed_digest"], (
            f"rank {r['rank']}: the timing hook changed training"
        )
    late = [c for c in first if c["phase"] == "late"]
    assert all(c["reports"] == [] for c in late if not c["late"]), late
    delayed = [c for c in late if c["late"]]
    assert [c["reports"] == [] for c in delayed] == [True] * (CONFIRMATIONS - 1) + [False] * (
        LATE_ROUNDS - CONFIRMATIONS + 1
    ), delayed
    for c in delayed[CONFIRMATIONS - 1 :]:
        assert all(v["verdict"] == "agree" for v in c["verdicts"].values()), c
        (report,) = c["reports"]  # one report: communication, no compute straggler, no SDC
        assert (report["kind"], report["signal"], report["ranks"]) == (
            "straggler",
            "communication",
            [WORLD - 1],
        )
        assert (report["scope"], report["host"]) == ("node", f"host-{WORLD - 1}"), report


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))

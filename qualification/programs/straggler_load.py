"""Cell program: SCOUT's compute-straggler false-positive rate on a loaded machine, then a real straggler.

Four gloo ranks train the three-block model under SCOUT at its defaults (a cycle every step, the default rotation
and ``StragglerConfig()``) while one competing busy-loop process per core loads the machine. Healthy phase:
``params.cycles`` cycles, each of whose straggler reports is counted. Then rank ``params.delayed`` sleeps inside its
timed replays for ``params.delay_cycles`` cycles (``sustained``: at most that many, until the straggler is named):

* ``params.mode = "sustained"``: the sleep is exactly ``params.fraction`` (0.2) of each recipe's healthy median
  replay time, far inside one round's noise on a loaded host: only the sustained check can name it, within its
  window (``sustained_window`` cycles, or as many as cover ``sustained_span_s`` seconds, whichever is more);
* ``"floor"``: the same fraction but at least 4 ms, twice the default 2 ms absolute margin, which the per-round
  detector needs: named at its ``compute_confirmations``-th round.

Observed: ``healthy_cycles``, ``healthy_straggler_reports``, ``named_ranks`` (every rank any delayed-phase straggler
report named), ``named_at_delayed_cycle`` (the first, 1-based; 0 when never), ``named_criterion`` (``sustained`` or
``round``), ``window_cycles`` (the sustained window in delayed cycles, from their recorded times) and
``confirmation_cycle`` (when the mode's detector should have named it at the latest), ``ranks_agree`` (every rank delivered the same reports), ``delays_s``. Every report of the run goes to
``reports.json`` in the cell directory; with ``params.keep_times`` each rank's per-cycle times go to ``ranks.json``
(megabytes: not for a bundle kept in docs/).

``python -m qualification.programs.straggler_load --cell cell.json --out celldir`` (the cell contract);
``... rank RANK WORLD PORT OUTDIR CYCLES MODE DELAYED FRACTION DELAY_CYCLES`` runs one rank.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from qualification.programs._contract import cell_main, failed, measured

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4
FLOOR_S = 0.004  # twice the default 2 ms absolute margin: what the per-round detector needs


def rank_main(
    rank: int,
    world: int,
    port: int,
    out: Path,
    cycles: int,
    mode: str,
    delayed: int,
    fraction: float,
    delay_cycles: int,
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gemscout.scout import Scout, ScoutConfig
    from qualification.faults import Injector, ReplayDelay
    from qualification.workloads import build_model, lm_loss, synthetic_batch

    parent = os.getppid()

    def exit_with_parent() -> None:  # a rank must never outlive its launcher
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    model = DDP(build_model("three-block", seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scout = Scout(ScoutConfig(interval=1)).attach(model, opt)  # the default StragglerConfig
    scout.register_step_hook()
    injector = Injector(scout)
    cells: list[dict[str, Any]] = []
    # Diagnostics only: this rank's own run-queue wait and CPU time inside each timed replay.
    marks: dict[str, tuple[int, float]] = {}
    waits: dict[str, list[float]] = {}

    def sched() -> int:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])

    def on_inputs(ctx: Any, inputs: Any) -> None:
        marks[ctx.recipe] = (sched(), time.thread_time())

    def on_outputs(ctx: Any, outputs: Any) -> None:
        queued, cpu = marks.pop(ctx.recipe)
        waits[ctx.recipe] = [(sched() - queued) / 1e9, time.thread_time() - cpu]

    scout.register_replay_input_hook(on_inputs)
    scout.register_replay_output_hook(on_outputs)

    def train(step: int, phase: str) -> None:
        inputs, targets = synthetic_batch(seed=0, step=step, rank=rank, batch=8, seq=64)
        lm_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad()
        result = scout.last_result
        own = dict(waits)
        waits.clear()
        cells.append(
            {
                "phase": phase,
                "step": step,
                "t": time.monotonic(),
                "runq_cpu_s": own,
                "reports": [
                    {
                        "kind": p.kind.value,
                        "ranks": list(p.ranks),
                        "recipe": p.recipe,
                        "signal": p.evidence.get("signal"),
                        "criterion": p.evidence.get("criterion", "round"),
                        "reason": p.reason,
                    }
                    for p in result.reports
                ],
                "replay_s": {
                    n: {str(k): v for k, v in t.items()} for n, t in result.replay_s.items()
                },
            }
        )

    step = 0
    for _ in range(cycles):
        step += 1
        train(step, "healthy")
    # Every rank agrees on the delay: the healthy median replay time of each recipe, from the gathered times.
    per_recipe: dict[str, list[float]] = {}
    for cell in cells:
        for name, times in cell["replay_s"].items():
            per_recipe.setdefault(name, []).extend(times.values())
    medians = {name: statistics.median(values) for name, values in per_recipe.items()}
    floor = FLOOR_S if mode == "floor" else 0.0
    delays = {name: max(fraction * m, floor) for name, m in medians.items()}
    injector.set(
        *[ReplayDelay(s, rank=delayed, recipe=name) for name, s in delays.items()]
        if rank == delayed
        else []
    )
    for _ in range(delay_cycles):
        step += 1
        train(step, "delay")
        if mode == "sustained":
            # Every rank judges the same gathered times on the job's shared clock, so all name the straggler at the
            # same cycle; the stop is still agreed collectively, so that ranks which did not (a detector bug) end
            # with the others and show as ranks_agree false instead of dying in the next all-reduce.
            named = any(p["kind"] == "straggler" for p in cells[-1]["reports"])
            stop = torch.tensor([int(named)])
            dist.all_reduce(
                stop, op=dist.ReduceOp.MAX
            )  # gloo, bounded by the group's 120 s timeout
            if stop.item():
                break
    injector.set()
    stragglers = scout.config.stragglers
    scout.close()
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "cells": cells,
                "medians": medians,
                "delays": delays,
                "delayed": delayed,
                "confirmations": stragglers.compute_confirmations,
                "sustained_window": stragglers.sustained_window,
                "sustained_span_s": stragglers.sustained_span_s,
            }
        )
    )
    dist.destroy_process_group()


def launch(
    out: Path,
    cycles: int,
    mode: str,
    *,
    delayed: int = 2,
    fraction: float = 0.2,
    delay_cycles: int | None = None,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """Run the four ranks under the competing load; return each rank's record. Raises RuntimeError (with the
    ranks' log tails) when a rank fails or the run passes ``timeout_s``."""
    import torch.distributed as dist

    delay_cycles = (
        delay_cycles if delay_cycles is not None else (300 if mode == "sustained" else 24)
    )
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    logs = [out / f"rank{r}.log" for r in range(WORLD)]
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    procs: list[subprocess.Popen[bytes]] = []
    timed_out = False
    try:
        for r in range(WORLD):
            argv = [str(r), str(WORLD), str(master.port), str(out), str(cycles), mode]
            argv += [str(delayed), str(fraction), str(delay_cycles)]
            with logs[r].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "qualification.programs.straggler_load", "rank"]
                        + argv,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.5)
    finally:
        for p in procs + hogs:
            if p.poll() is None:
                p.kill()
        for p in procs + hogs:
            p.wait(timeout=10)
    codes = [p.returncode for p in procs]
    if timed_out or codes != [0] * WORLD:
        tails = "\n".join(
            f"--- rank {r} ---\n{log.read_text(errors='replace')[-3000:]}"
            for r, log in enumerate(logs)
            if log.exists()
        )
        why = f"timed out after {timeout_s:.0f} s" if timed_out else f"rank exit codes {codes}"
        raise RuntimeError(f"{why}\n{tails}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def analyse(ranks: list[dict[str, Any]], cycles: int, mode: str) -> dict[str, Any]:
    """The observations of one run (see the module docstring)."""
    cells = ranks[0]["cells"]  # every rank delivers the same reports: they come from gathered times
    agree = all(
        len(r["cells"]) == len(cells)
        and all(r["cells"][i]["reports"] == c["reports"] for i, c in enumerate(cells))
        for r in ranks
    )
    healthy = [c for c in cells if c["phase"] == "healthy"]
    delayed = [c for c in cells if c["phase"] == "delay"]
    false = [p for c in healthy for p in c["reports"] if p["kind"] == "straggler"]
    named = [
        (i, p)
        for i, c in enumerate(delayed, start=1)
        for p in c["reports"]
        if p["kind"] == "straggler"
    ]
    confirmations = ranks[0]["confirmations"]
    confirmation_cycle = 0
    if named:
        first = named[0][1]["recipe"]
        rounds = [i for i, c in enumerate(delayed, start=1) if first in c["replay_s"]]
        confirmation_cycle = rounds[confirmations - 1] if len(rounds) >= confirmations else 0
    delayed_rank = ranks[0]["delayed"]  # every rank computes the same delays; only this one sleeps
    return {
        "healthy_cycles": len(healthy),
        "healthy_straggler_reports": len(false),
        "first_false_reports": false[:3],
        "named_ranks": sorted({rank for _, p in named for rank in p["ranks"]}),
        "named_signals": sorted({str(p["signal"]) for _, p in named}),
        "named_at_delayed_cycle": named[0][0] if named else 0,
        "named_criterion": named[0][1]["criterion"] if named else "",
        "named_reason": named[0][1]["reason"] if named else "",
        "window_cycles": _window_cycles(ranks[0], delayed),
        "confirmation_cycle": confirmation_cycle,
        "delayed_rank": delayed_rank,
        "delays_s": ranks[0]["delays"],
        "replay_median_s": ranks[0]["medians"],
        "ranks_agree": agree,
        "mode": mode,
        "cycles_requested": cycles,
    }


def _window_cycles(rank: dict[str, Any], delayed: list[dict[str, Any]]) -> int:
    """How many delayed cycles the sustained window spans from the delay's start: ``sustained_window`` cycles, or
    as many as the first ``sustained_span_s`` seconds of them held, whichever is more."""
    if not delayed:
        return rank["sustained_window"]
    start = delayed[0]["t"]
    in_span = sum(1 for c in delayed if c["t"] - start <= rank["sustained_span_s"])
    return max(rank["sustained_window"], in_span)


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    started = time.monotonic()
    p = cell.get("params", {})
    cycles, mode = int(p.get("cycles", 1000)), str(p.get("mode", "sustained"))
    timeline = [{"t": 0.0, "event": "start", "detail": f"{cycles} healthy cycles, mode {mode}"}]
    try:
        ranks = launch(
            celldir,
            cycles,
            mode,
            delayed=int(p.get("delayed", 2)),
            fraction=float(p.get("fraction", 0.2)),
            delay_cycles=int(p["delay_cycles"]) if "delay_cycles" in p else None,
            timeout_s=float(cell.get("timeout_s", 900)) - 30,
        )
    except RuntimeError as exc:
        return failed(cell, str(exc).splitlines()[0], timeline)
    # Every report of the run, by cycle (the bundle's record; the per-cycle times are megabytes: kept only with
    # params.keep_times, for offline analysis).
    reports = [
        {"phase": c["phase"], "step": c["step"], "reports": c["reports"]}
        for c in ranks[0]["cells"]
        if c["reports"]
    ]
    (celldir / "reports.json").write_text(json.dumps(reports, indent=1))
    if p.get("keep_times"):
        (celldir / "ranks.json").write_text(json.dumps(ranks))
    for r in range(WORLD):
        (celldir / f"rank{r}.json").unlink(missing_ok=True)
    timeline.append(
        {"t": round(time.monotonic() - started, 3), "event": "finish", "detail": "ranks exited 0"}
    )
    return measured(cell, analyse(ranks, cycles, mode), timeline, started)


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        a = sys.argv[2:]
        rank_main(
            int(a[0]),
            int(a[1]),
            int(a[2]),
            Path(a[3]),
            int(a[4]),
            a[5],
            int(a[6]),
            float(a[7]),
            int(a[8]),
        )
    else:
        raise SystemExit(cell_main("straggler_load", run_cell))

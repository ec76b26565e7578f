"""Hang and stall cells: a DDP job under ``enable_resiliency(watch=...)`` with a slow DataLoader, slow checkpoint
writes, and a rank that stops before an all-reduce. The driver reads the reports rank 0's watchdog delivers while the
job hangs, then kills the job (as a launcher would after the report).

``fault``: ``data_rank`` / ``data_delay_s``, ``io_rank`` / ``io_delay_s``, ``hang_rank`` / ``hang_step``, ``threshold_s``.
Observed: ``data_stall_ranks``, ``checkpoint_stall_ranks``, ``hang_ranks`` (of the first report of each kind),
``data_stall_confirmations``, ``decision_kind`` (the conservative RecoveryDecision's failure kind),
``hang_detect_s`` (seconds from the hang's injection to its report).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gemscout.watch import generate_secret
from qualification.launch import free_port
from qualification.programs._contract import cell_main, measured
from qualification.programs.specs import spec_argv
from qualification.programs.specs.watch import WatchSpec


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rank_argv(cell: dict[str, Any], out: Path) -> list[str]:
    """Every rank's arguments: watch_rank and the spec file it reads (``out/spec-run.json``)."""
    f = cell.get("fault", {})
    spec = WatchSpec(
        out=out,
        steps=int(cell.get("params", {}).get("steps", 12)),
        threshold_s=float(f.get("threshold_s", 2.0)),
        data_delay_rank=int(f.get("data_rank", -1)),
        data_delay_s=float(f.get("data_delay_s", 0.15)),
        io_delay_rank=int(f.get("io_rank", -1)),
        io_delay_s=float(f.get("io_delay_s", 0.5)),
        hang_rank=int(f.get("hang_rank", -1)),
        hang_step=int(f.get("hang_step", -1)),
    )
    return ["-m", "qualification.programs.watch_rank", *spec_argv(spec, out / "spec-run.json")]


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    t0, wall0 = time.monotonic(), time.time()
    world, f = int(cell["world_size"]), cell.get("fault", {})
    out = celldir / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    port, secret = free_port(), generate_secret()
    argv = _rank_argv(cell, out)
    procs = []
    for r in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "GEMSCOUT_OOB_SECRET": secret,
        }
        log = open(celldir / f"rank{r}.log", "wb")
        procs.append(
            subprocess.Popen([sys.executable, *argv], env=env, stdout=log, stderr=subprocess.STDOUT)
        )
        log.close()
    deadline = t0 + float(cell.get("timeout_s", 120)) - 10
    want_hang = int(f.get("hang_rank", -1)) >= 0
    evs: list[dict[str, Any]] = []
    try:
        while time.monotonic() < deadline:
            evs = _events(out / "rank0.reports.jsonl")
            done = (
                any(e.get("kind") == "hang" for e in evs)
                if want_hang
                else any(e["type"] == "finished" for e in evs)
            )
            if done or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    reports = [e for e in evs if e["type"] == "report"]
    first = {}
    for rep in reports:
        first.setdefault(rep["kind"], rep)
    obs: dict[str, Any] = {
        f"{k}_ranks": list(first[k]["ranks"]) if k in first else []
        for k in ("data_stall", "checkpoint_stall", "hang")
    }
    obs["data_stall_confirmations"] = (
        first["data_stall"]["confirmations"] if "data_stall" in first else 0
    )
    decisions = [e for e in evs if e["type"] == "decision"]
    obs["decision_kind"] = decisions[0]["failure_kind"] if decisions else None
    injected = [
        e
        for e in _events(out / f"rank{f.get('hang_rank', -1)}.reports.jsonl")
        if e["type"] == "injected"
    ]
    if injected and "hang" in first:
        obs["hang_detect_s"] = round(first["hang"]["timestamp"] - injected[0]["t"], 3)
    timeline = [{"t": 0.0, "event": "start", "detail": f"{world} ranks"}]
    if injected:
        timeline.append(
            {
                "t": round(injected[0]["t"] - wall0, 3),
                "event": "fault",
                "detail": f"rank {f['hang_rank']} stops before the backward of step {injected[0]['step']}",
            }
        )
    for rep in reports:
        timeline.append(
            {"t": round(rep["timestamp"] - wall0, 3), "event": "detection", "detail": rep["reason"]}
        )
    for d in decisions:
        timeline.append({"t": round(d["t"] - wall0, 3), "event": "decision", "detail": d["reason"]})
    timeline.sort(key=lambda e: e["t"])
    return measured(cell, obs, timeline, t0)


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.hang_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

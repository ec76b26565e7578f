"""Benchmark cell: runs the GEMINI benchmark (our path beside memcpy, raw gloo and DCP in one run) and puts its JSON
in the cell directory, so the evidence bundle seals the figures with the commit that produced them.

``params``: ``bench`` (``gemini``, default: 2 CPU ranks; ``gemini_cuda``: the capture on one GPU vs the raw pinned
copy, ``device`` "cuda" or "cpu" for a dry run), ``sizes_mib`` (default "64"; "256,1024" for ``gemini_cuda``),
``quick`` (bool: a ~4 MiB smoke run of ``gemini``), ``steps``; ``goodput``: ``steps``, ``fail_every``, ``state_mib``. Observed: every ratio the
benchmark computes, ``skipped_arms`` (goodput: the arms it could not run here), and ``targets_met`` / ``targets_total`` (how many of its targets this run met), and ``targets``
(each met or missed). The cell is MEASURED, never PASSED, when the program ran and produced every ratio: each target
is reported met or missed, and a claim the cell backs holds only when all were met — figures from a shared 2-core
machine are evidence to read, not a gate, and a missed one must never read as a pass.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qualification.programs._contract import cell_main, failed

BENCHES = ("gemini", "gemini_cuda", "goodput")


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    p = cell.get("params", {})
    bench = str(p.get("bench", "gemini"))
    if bench not in BENCHES:
        return failed(cell, f"params.bench: {bench!r} is not one of {list(BENCHES)}", [])
    out = celldir / f"{bench.replace('_', '-')}-bench.json"
    argv = [sys.executable, "-m", f"qualification.bench.{bench}", "--out", str(out)]
    if bench == "gemini":
        argv += ["--scratch", str(celldir / "scratch")]
        argv += ["--quick"] if p.get("quick") else ["--sizes-mib", str(p.get("sizes_mib", "64"))]
        if "steps" in p:
            argv += ["--steps", str(p["steps"])]
    elif bench == "goodput":
        argv += ["--scratch", str(celldir / "scratch")]
        for key in ("steps", "fail_every", "state_mib"):
            if key in p:
                argv += [f"--{key.replace('_', '-')}", str(p[key])]
    else:
        argv += [
            "--sizes-mib",
            str(p.get("sizes_mib", "256,1024")),
            "--device",
            str(p.get("device", "cuda")),
        ]
    (celldir / "scratch").mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=float(cell.get("timeout_s", 600)) - 5
        )
    finally:
        shutil.rmtree(
            celldir / "scratch", ignore_errors=True
        )  # benchmark checkpoints are not evidence
    (celldir / "bench.log").write_text(proc.stdout + proc.stderr)
    timeline = [
        {"t": 0.0, "event": "start", "detail": " ".join(argv[1:])},
        {
            "t": round(time.monotonic() - t0, 3),
            "event": "finish",
            "detail": f"exit {proc.returncode}",
        },
    ]
    if proc.returncode != 0 or not out.exists():
        return failed(cell, f"benchmark exited {proc.returncode}; see bench.log", timeline)
    doc = json.loads(out.read_text())
    observed: dict[str, Any] = {"targets_met": 0, "targets_total": 0}
    if (
        "skipped" in doc
    ):  # arms the benchmark could not run here (e.g. torchft not installed), by name
        observed["skipped_arms"] = sorted(doc["skipped"])
    targets: list[dict[str, Any]] = []
    for size in doc["sizes"]:
        tag = f"{size['state_mib']}MiB"
        for name, value in size["ratios"].items():
            observed[f"{name}.{tag}"] = value
        for name, met in size.get("met", {}).items():
            observed["targets_total"] += 1
            observed["targets_met"] += bool(met)
            value = size["ratios"].get(name)
            targets.append(
                {
                    "name": f"{name} at {tag}",
                    "met": bool(met),
                    "detail": f"ratio {value:.4g}"
                    if isinstance(value, float)
                    else f"ratio {value}"
                    if value is not None
                    else "",
                }
            )
    result: dict[str, Any] = {
        "cell_id": cell["id"],
        "status": "passed",
        "observed": observed,
        "metrics": {
            "benchmark": bench,
            "sizes": [s["state_mib"] for s in doc["sizes"]],
            # goodput: each arm's row and what could not run, for the report's table and charts
            **{k: doc[k] for k in ("arms", "skipped") if k in doc},
        },
        "timeline": timeline,
        "message": "",
    }
    if targets:  # a measurement: the engine's verdict is MEASURED, each target met or missed
        result["targets"] = targets
    return result


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.bench_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""The cell contract's entry point, shared by every cell program.

``python -m qualification.programs.NAME --cell cell.json --out celldir``: read the cell, run it, write
``celldir/result.json`` (status, observed, metrics, timeline, message) and print the observations to the cell log.
The engine judges the cell from ``result.json``; the exit code is 0 whenever a result was written. Binary training
state the run left in ``celldir`` (checkpoint files, DCP shards) is then deleted: a bundle seals what was observed,
and a campaign's checkpoints would make it gigabytes (``params.keep_checkpoints`` keeps them for debugging).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RunCell = Callable[[dict[str, Any], Path], dict[str, Any]]

STATE_SUFFIXES = (".gsc", ".pt", ".pth", ".distcp", ".bin", ".safetensors", ".npy")
"""Files of binary training state: GEMINI checkpoints and replicas, torch saves, DCP shards (what
scripts/regenerate_evidence.sh refuses in a bundle). A DCP folder's ``.metadata`` goes with its shards."""


def measured(
    cell: dict[str, Any], observed: dict[str, Any], timeline: list[dict[str, Any]], started: float
) -> dict[str, Any]:
    """A cell result that ran to the end: its observations (the engine judges them against ``expect``), the
    timeline and the duration since ``started`` (``time.monotonic()``)."""
    return {
        "cell_id": cell["id"],
        "status": "passed",
        "observed": observed,
        "metrics": {"duration_s": round(time.monotonic() - started, 3)},
        "timeline": timeline,
        "message": "",
    }


def failed(
    cell: dict[str, Any],
    message: str,
    timeline: list[dict[str, Any]],
    *,
    observed: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A cell result for a run that could not produce its observations: status ``error`` and why, in one line.

    ``observed`` and ``metrics`` (empty dicts unless given) record what was known when it stopped, e.g. the ranks'
    exit codes; a status other than ``passed`` is never judged against ``expect``, whatever they hold."""
    return {
        "cell_id": cell["id"],
        "status": "error",
        "observed": {} if observed is None else observed,
        "metrics": {} if metrics is None else metrics,
        "timeline": timeline,
        "message": message,
    }


def against_reference(
    ranks: list[dict[str, Any]], reference: list[dict[str, Any]]
) -> dict[str, Any]:
    """How the ranks' ``rank<r>.json`` compare with the uninterrupted run's, rank by rank (under sharding each rank
    holds its own shard): ``bitwise_equal`` (every state digest), ``losses_equal`` (every rank's whole loss
    trajectory), ``replicas_equal`` (every rank saw its data-parallel replicas agree) and ``final_step``."""
    return {
        "bitwise_equal": all(
            r["state_digest"] == reference[i]["state_digest"] for i, r in enumerate(ranks)
        ),
        "losses_equal": all(r["losses"] == reference[i]["losses"] for i, r in enumerate(ranks)),
        "replicas_equal": all(r["replicas_equal"] for r in ranks),
        "final_step": max((int(s) for s in ranks[0]["losses"]), default=0),
    }


def trust_gating(
    trust: dict[int, str], decisions: list[dict[str, Any]], fault_step: int, end: int | None = None
) -> dict[str, bool]:
    """How the trust states answered an SDC first seen at ``fault_step`` and present until ``end`` (default: that step
    only): ``decision_before_fault`` (the first SDC decision names an older step, or none), ``fault_step_rejected``
    (no capture in ``[fault_step, end)`` was certified, while certification did happen elsewhere in the run),
    ``certified_after`` (one at or after ``end`` was).

    Every flag is false when nothing was ever certified: a run whose certification never worked would otherwise
    "reject" the faulty step for free."""
    end = fault_step + 1 if end is None else end
    sdc = [d for d in decisions if d["failure_kind"] == "sdc"]
    certified = {s for s, st in trust.items() if st == "recovery_verified"}
    return {
        "decision_before_fault": bool(certified)
        and bool(sdc)
        and (sdc[0]["step"] is None or sdc[0]["step"] < fault_step),
        "fault_step_rejected": bool(certified)
        and not any(fault_step <= s < end for s in certified),
        "certified_after": any(s >= end for s in certified),
    }


def cell_main(prog: str, run_cell: RunCell, argv: list[str] | None = None) -> int:
    """Parse the contract's arguments, run ``run_cell(cell, celldir)`` and write its result."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--cell", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    cell = json.loads(args.cell.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    result = run_cell(cell, args.out)
    (args.out / "result.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    if not cell.get("params", {}).get("keep_checkpoints", False):
        drop_state(args.out)
    print(f"{cell['id']}: {result['status']} {result['message']}".rstrip())
    print(json.dumps(result["observed"], indent=1, sort_keys=True))
    return 0


def drop_state(celldir: Path) -> int:
    """Delete the binary training state under ``celldir`` (see :data:`STATE_SUFFIXES`) and the folders that held only
    it; JSON records (trust ledgers, fault and kill records, sidecars) stay. Returns the number of files deleted."""
    dropped = 0
    for root, dirs, files in os.walk(celldir, topdown=False):
        for name in files:
            if name.endswith(STATE_SUFFIXES) or name == ".metadata":
                os.unlink(os.path.join(root, name))
                dropped += 1
        for name in dirs:
            with contextlib.suppress(OSError):  # not empty: something worth keeping is in it
                os.rmdir(os.path.join(root, name))
    return dropped

"""SCOUT on DeepSpeed ZeRO: the optimizer recipe (ZeRO-1/2: the partition owner's update replayed by every rank) and
the forward recipes (ZeRO-3: replayed on the gathered blocks).

Launches :mod:`qualification.programs.ds_rank` twice on ``world_size`` ranks: once without gemscout (the baseline),
once with GEMINI and SCOUT (``params.recipes``, default ``hidden,optimizer``; every slice of the owner at every step,
``params.slice_numel`` elements at most, default 20000), and reads what every rank saw.

``fault.kind``: ``none``; ``replay`` (``rank``, ``steps``: a bit flip in that rank's replay of the first due slice at
each of those steps — training untouched); ``update`` (``rank``, ``step``: a bit flipped in that rank's fp32 master
partition right after its real update — training diverges from the baseline from then on); ``module`` (``rank``,
``step``, ``heal``, ``block``: a persistent corruption of that block's output on that rank from ``step`` until
``heal``, in the baseline too — the forward recipes' fault, e.g. under ZeRO-3 with ``params.recipes``
``embedding,hidden,output``).

Observed: ``bitwise_equal`` (every rank's state digest and losses equal the baseline's), ``sdc_reports``,
``localized_ranks`` (every rank named by an SDC report, sorted), ``detected_steps``, ``slices_agree`` (every other
optimizer slice AGREEd at every step on every rank), ``decision_before_fault`` (the SDC decision names a verified
step older than the first fault), ``fault_step_rejected`` (no step from the first to the last fault was certified),
``certified_after`` (a step after the last fault was certified), ``ranks_agree`` (equal reports and trust on every
rank).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from qualification.launch import launch
from qualification.programs._contract import cell_main, failed, measured
from qualification.programs.specs import spec_argv
from qualification.programs.specs.deepspeed import DeepSpeedSpec


def _launch(
    fields: dict[str, Any], world: int, celldir: Path, name: str, timeout_s: float
) -> list[dict[str, Any]] | None:
    """Run ds_rank on ``world`` ranks with the :class:`DeepSpeedSpec` ``fields``, its spec in
    ``<name>/spec-<name>.json``."""
    out = celldir / name
    spec = DeepSpeedSpec(out=out, **fields)
    res = launch(
        ["-m", "qualification.programs.ds_rank", *spec_argv(spec, out / f"spec-{name}.json")],
        world_size=world,
        timeout_s=timeout_s,
        log_dir=celldir / "logs" / name,
    )
    if not res.ok:
        return None
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    world, fault = int(cell["world_size"]), cell.get("fault", {"kind": "none"})
    params = cell.get("params", {})
    steps = int(params.get("steps", 13))
    common: dict[str, Any] = {
        "topology": str(cell["topology"]),
        "workload": str(cell["workload"]),
        "seed": int(cell.get("seed", 0)),
        "steps": steps,
    }
    scout: dict[str, Any] = {
        "ckpt": celldir / "ckpt",
        "keep_generations": steps + 2,
        "scout": True,
        "scout_recipes": str(params.get("recipes", "hidden,optimizer")),
        "optimizer_slice_numel": int(params.get("slice_numel", 20000)),
        "optimizer_slices_per_cycle": 0,
    }
    kind = fault["kind"]
    faulted: list[int] = []
    if kind == "replay":
        faulted = [int(s) for s in fault["steps"]]
        scout |= {
            "replay_fault_rank": int(fault["rank"]),
            "replay_fault_steps": ",".join(map(str, faulted)),
        }
    elif kind == "update":
        faulted = [int(fault["step"])]
        scout |= {"update_fault_rank": int(fault["rank"]), "update_fault_step": faulted[0]}
    elif kind == "module":  # training itself is faulty: the baseline runs the same fault
        faulted = [int(fault["step"])]
        common |= {
            "fault_rank": int(fault["rank"]),
            "fault_step": faulted[0],
            "heal_step": int(fault["heal"]),
            "fault_block": int(fault.get("block", 1)),
        }
    elif kind != "none":
        raise ValueError(
            f"ds_scout_cell: unknown fault kind {kind!r}; use none, replay, update or module"
        )
    timeline: list[dict[str, Any]] = [
        {"t": 0.0, "event": "start", "detail": f"{world} ranks, fault {fault}"}
    ]
    limit = float(cell.get("timeout_s", 240))
    baseline = _launch(common, world, celldir, "baseline", limit)
    ranks = _launch(common | scout, world, celldir, "run", limit) if baseline is not None else None
    if baseline is None or ranks is None:
        return failed(cell, "ranks failed (see logs/)", timeline)
    sdc = [rep for rep in ranks[0]["reports"] if rep["kind"] == "sdc"]
    flagged = {(rep["step"], rep["recipe"]) for rep in sdc}
    slices_agree = all(
        verdict == ["agree", []]
        for r in ranks
        for s, cycle in r["cycles"].items()
        for name, verdict in cycle["results"].items()
        if name.startswith("optimizer.") and (int(s), name) not in flagged
    )
    trust = {int(k): v for k, v in ranks[0]["trust"].items()}
    decisions = [d for d in ranks[0]["decisions"] if d["failure_kind"] == "sdc"]
    first, last = (min(faulted), max(faulted)) if faulted else (steps + 1, steps + 1)
    obs = {
        "bitwise_equal": all(
            (r["state_digest"], r["losses"]) == (b["state_digest"], b["losses"])
            for r, b in zip(ranks, baseline, strict=True)
        ),
        "sdc_reports": len(sdc),
        "localized_ranks": sorted(
            {rank for rep in sdc if rep["scope"] == "rank" for rank in rep["ranks"]}
        ),
        "detected_steps": [rep["step"] for rep in sdc],
        "slices_agree": slices_agree,
        "decision_before_fault": bool(decisions)
        and decisions[0]["step"] is not None
        and decisions[0]["step"] < first,
        "fault_step_rejected": not any(
            st == "recovery_verified" for s, st in trust.items() if first <= s <= last
        ),
        "certified_after": any(st == "recovery_verified" for s, st in trust.items() if s > last),
        "ranks_agree": len(
            {
                json.dumps(
                    [[(x["kind"], x["step"], x["ranks"]) for x in r["reports"]], r["trust"]],
                    sort_keys=True,
                )
                for r in ranks
            }
        )
        == 1,
    }
    for rep in sdc:
        timeline.append(
            {"t": round(time.monotonic() - t0, 3), "event": "detection", "detail": rep["reason"]}
        )
    timeline.append(
        {"t": round(time.monotonic() - t0, 3), "event": "finish", "detail": f"trust {trust}"}
    )
    return measured(cell, obs, timeline, t0)


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.ds_scout_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

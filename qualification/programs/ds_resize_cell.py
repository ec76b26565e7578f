"""DeepSpeed ZeRO-1/2 resumed from the durable tier on another world size, every local folder lost.

Launches :mod:`qualification.programs.ds_rank` three times: on ``fault.from_world`` ranks with GEMINI, certifying
every step and promoting to the durable tier every ``params.durable_every`` verified steps, until step
``params.steps`` (the promoted step; it also dumps the job's full state there); then, with that job's local folder
deleted, on ``world_size`` ranks with GEMINI, which resumes from the durable tier alone and trains
``params.more_steps`` more; and on ``world_size`` ranks without gemscout, loaded from the dumped full state with
DeepSpeed's own ``safe_set_full_*`` setters (the reference). ``params.bf16`` and ``params.param_groups`` (1 or 2)
select the precision and param grouping of all three.

``fault.kind``: ``resize`` (``from_world``: the world size of the promoting job).

Observed: ``resumed_step`` (the durable step every resumed rank restored, or null when they disagree),
``full_state_equal`` (on every resumed rank, the full fp32 masters and AdamW moments as DeepSpeed gathers them, and
the module, equal the promoting job's at the promoted step, bitwise), ``reference_equal`` (after the further steps,
every rank's module, partition, moments and lr equal the reference's, bitwise, and the gathered full state too),
``losses_equal`` (the further steps' losses equal the reference's), ``losses_finite``.
"""

from __future__ import annotations

import json
import math
import shutil
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
    """Run ds_rank on ``world`` ranks with the :class:`DeepSpeedSpec` ``fields`` and ``full_state``, its spec in
    ``<name>/spec-<name>.json``."""
    out = celldir / name
    spec = DeepSpeedSpec(out=out, full_state=True, **fields)
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
    if fault["kind"] != "resize":
        raise ValueError(
            f"ds_resize_cell: unknown fault kind {fault['kind']!r}; use resize (with from_world)"
        )
    params = cell.get("params", {})
    steps, more = int(params.get("steps", 4)), int(params.get("more_steps", 2))
    every, old_world = int(params.get("durable_every", 2)), int(fault["from_world"])
    common: dict[str, Any] = {
        "topology": str(cell["topology"]),
        "workload": str(cell["workload"]),
        "seed": int(cell.get("seed", 0)),
        "param_groups": int(params.get("param_groups", 1)),
        "bf16": bool(params.get("bf16")),
    }
    durable, dump = celldir / "durable", celldir / f"full-step{steps}.pt"

    def tiers(name: str) -> dict[str, Any]:
        return {"ckpt": celldir / f"local-{name}", "durable": durable}

    timeline: list[dict[str, Any]] = [
        {"t": 0.0, "event": "start", "detail": f"{old_world} -> {world} ranks"}
    ]
    limit = float(cell.get("timeout_s", 300))
    first = _launch(
        common
        | tiers("first")
        | {"steps": steps, "durable_every": every, "certify": True, "dump_full": dump},
        old_world,
        celldir,
        "first",
        limit,
    )
    resumed = reference = None
    if first is not None:
        shutil.rmtree(
            celldir / "local-first", ignore_errors=True
        )  # every node's local folder is gone
        timeline.append(
            {
                "t": round(time.monotonic() - t0, 3),
                "event": "fault",
                "detail": f"local storage deleted; relaunch on {world} ranks",
            }
        )
        resumed = _launch(
            common | tiers("resumed") | {"steps": steps + more},
            world,
            celldir,
            "resumed",
            limit,
        )
        reference = _launch(
            common | {"steps": steps + more, "load_full": dump},
            world,
            celldir,
            "reference",
            limit,
        )
    if first is None or resumed is None or reference is None:
        return failed(cell, "ranks failed (see logs/)", timeline)
    promoted = first[0]
    after = [{s: v for s, v in r["losses"].items() if int(s) > steps} for r in resumed]
    steps_seen = {
        r["decision"]["step"] if r["decision"] and r["decision"]["mode"] == "durable" else None
        for r in resumed
    }
    obs = {
        "resumed_step": steps_seen.pop() if len(steps_seen) == 1 else None,
        "full_state_equal": all(
            (r["resume_full"], r["resume_module"])
            == (promoted["final_full"], promoted["module_digest"])
            for r in resumed
        ),
        "reference_equal": all(
            (r["state_digest"], r["final_full"], r["lr"])
            == (f["state_digest"], f["final_full"], f["lr"])
            for r, f in zip(resumed, reference, strict=True)
        ),
        "losses_equal": all(a == f["losses"] for a, f in zip(after, reference, strict=True)),
        "losses_finite": all(
            len(a) == more and all(math.isfinite(v) for v in a.values()) for a in after
        ),
    }
    timeline.append(
        {"t": round(time.monotonic() - t0, 3), "event": "finish", "detail": json.dumps(obs)}
    )
    return measured(cell, obs, timeline, t0)


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.ds_resize_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

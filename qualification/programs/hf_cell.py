"""SCOUT on a Hugging Face transformers model (one family per cell) under plain DDP: healthy, persistent-fault and
replay-only-fault runs in one launch of :mod:`qualification.programs.hf_rank`.

Cell: ``workload`` is the family (``llama``, ``gpt2``, ``qwen2``); ``fault`` = ``{kind = "decoder-layer", rank, step,
block}`` (the persistent fault adds 1e-3 to that rank's decoder layer ``block`` from ``step`` on; the replay-only
fault corrupts that rank's replay of ``hidden.0`` at its first due step >= ``step``); ``params.steps``,
``params.interval`` (``ScoutConfig.interval``).

Observed: ``healthy_not_agree`` (verdicts other than AGREE in the healthy run, every rank), ``healthy_certified_every_cycle``
(each cycle certified its own step), ``healthy_reports``, ``unreplayable_recipes`` (the healthy run's
``scout.unreplayable_recipes``), ``persistent_localized_ranks`` / ``persistent_recipe`` (the first SDC report),
``persistent_within_rotation`` (it came at most one rotation after the fault began), ``replay_localized_ranks`` /
``replay_detected_on_time`` (the replay fault's report, at the step it fired), ``candidates_rejected`` (in both
fault runs the steps between the decision's recovery-verified step and the detection are rejected, and the detected
step never captured), ``decision_restores_verified``, ``ranks_agree`` (trust states equal on every rank).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from qualification.launch import launch
from qualification.programs._contract import cell_main, failed, measured
from qualification.programs.specs import spec_argv
from qualification.programs.specs.hf import HfSpec


def _rejected(case: dict[str, Any], detected: int | None) -> tuple[bool, bool]:
    """(uncertified candidates before ``detected`` rejected and ``detected`` not captured, decision names a
    recovery-verified step older than ``detected``)."""
    if detected is None:
        return False, False
    trust = {int(s): st for s, st in case["trust"].items()}
    sdc = [d for d in case["decisions"] if d["failure_kind"] == "sdc"]
    if not sdc or sdc[0]["mode"] != "restore" or sdc[0]["step"] is None:
        return False, False
    verified = sdc[0]["step"]
    between = [s for s in trust if verified < s < detected]
    rejected = (
        bool(between) and all(trust[s] == "rejected" for s in between) and detected not in trust
    )
    return rejected, verified < detected and trust.get(verified) == "recovery_verified"


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    world, fault, params = int(cell["world_size"]), cell["fault"], cell.get("params", {})
    if fault.get("kind") != "decoder-layer":
        raise ValueError(f"hf_cell: fault.kind must be 'decoder-layer', got {fault.get('kind')!r}")
    steps, interval = int(params.get("steps", 6)), int(params.get("interval", 2))
    rank, step, block = int(fault["rank"]), int(fault["step"]), int(fault.get("block", 1))
    out = celldir / "ranks"
    how = str(cell.get("topology", "ddp"))
    if how not in ("ddp", "fsdp2"):
        raise ValueError(f"hf_cell: topology must be 'ddp' or 'fsdp2', got {how!r}")
    key = str(cell["workload"]) if how == "ddp" else f"{cell['workload']}+{how}"
    timeline: list[dict[str, Any]] = [
        {"t": 0.0, "event": "start", "detail": f"{cell['workload']} under {how}, {world} ranks"}
    ]
    spec = HfSpec(
        out=out,
        family=(str(cell["workload"]),) if how == "ddp" else (),
        fsdp2=(str(cell["workload"]),) if how == "fsdp2" else (),
        steps=steps,
        interval=interval,
        fault_rank=rank,
        fault_step=step,
        fault_block=block,
    )
    res = launch(
        ["-m", "qualification.programs.hf_rank", *spec_argv(spec, out / "spec-run.json")],
        world_size=world,
        timeout_s=float(cell.get("timeout_s", 240)),
        log_dir=celldir / "logs",
    )
    if not res.ok:
        return failed(
            cell,
            f"ranks failed: {res.returncodes}",
            timeline,
            observed={"rank_exit_codes": res.returncodes},
        )
    ranks = [json.loads((out / f"rank{r}.json").read_text())[key] for r in range(world)]
    healthy = [r["healthy"] for r in ranks]
    persistent, replay = ranks[0]["persistent"], ranks[0]["replay"]
    blocks = sum(1 for n in persistent["catalog"] if n.startswith("hidden."))
    p_sdc = [rep for rep in persistent["reports"] if rep["kind"] == "sdc"]
    r_sdc = [rep for rep in replay["reports"] if rep["kind"] == "sdc"]
    p_step = p_sdc[0]["step"] if p_sdc else None
    r_step = r_sdc[0]["step"] if r_sdc else None
    p_rejected, p_verified = _rejected(persistent, p_step)
    r_rejected, r_verified = _rejected(replay, r_step)
    obs: dict[str, Any] = {
        "healthy_not_agree": sum(
            v["verdict"] != "agree"
            for h in healthy
            for c in h["cycles"].values()
            for v in c["verdicts"].values()
        ),
        "healthy_certified_every_cycle": all(
            c["certified"] == int(s) for h in healthy for s, c in h["cycles"].items()
        )
        and all(len(h["cycles"]) == steps // interval for h in healthy),
        "healthy_reports": sum(len(h["reports"]) for h in healthy),
        "unreplayable_recipes": max(h["metrics"]["scout.unreplayable_recipes"] for h in healthy),
        "persistent_localized_ranks": list(p_sdc[0]["ranks"]) if p_sdc else [],
        "persistent_recipe": p_sdc[0]["recipe"] if p_sdc else None,
        "persistent_within_rotation": p_step is not None
        and step <= p_step <= step + interval * blocks,
        "replay_localized_ranks": list(r_sdc[0]["ranks"]) if r_sdc else [],
        "replay_detected_on_time": r_step is not None and r_step == replay["replay_fault_step"],
        "candidates_rejected": p_rejected and r_rejected,
        "decision_restores_verified": p_verified and r_verified,
        "ranks_agree": all(
            len({json.dumps(r[c]["trust"], sort_keys=True) for r in ranks}) == 1
            for c in ("healthy", "persistent", "replay")
        ),
        "tied_head": bool(ranks[0]["healthy"]["tied"]),
    }
    for name, found in (("persistent", p_sdc), ("replay", r_sdc)):
        if found:
            timeline.append(
                {
                    "t": round(time.monotonic() - t0, 3),
                    "event": "detection",
                    "detail": f"{name}: {found[0]['reason']}",
                }
            )
    timeline.append(
        {"t": round(time.monotonic() - t0, 3), "event": "finish", "detail": "three runs"}
    )
    return measured(cell, obs, timeline, t0)


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.hf_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

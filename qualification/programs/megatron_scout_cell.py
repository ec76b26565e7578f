"""SCOUT cells on Megatron Core under pipeline or expert parallelism (CPU, test-only CUDA redirection).

Launches the topology's rank program twice on ``world_size`` ranks: without gemscout (the baseline), then with
GEMINI + SCOUT at every step and the cell's fault, and compares what every rank saw.

``topology``: ``megatron-pp2`` (two stages, 1F1B, four layers: two blocks per stage) or ``megatron-pp2-vpp2`` (two
stages x two virtual stages, Megatron's interleaved 1F1B, one layer per virtual stage); data parallelism is
``world_size / 2``; both with Megatron's DDP (overlapped grad reduce) and the DistributedOptimizer
(:mod:`qualification.programs.megatron_loop_rank`). ``megatron-ep2``: a MoE GPTModel, 4 experts per layer over
``expert_model_parallel_size=2``, tp=1, expert-data-parallel size ``world_size / 2``, with the AllToAll check on the
dispatch (:mod:`qualification.programs.megatron_rank`; ``schedule`` is then ``hand-written``).
``fault.kind``: ``none`` or ``replay`` (``rank``, ``step``, ``recipe``: one corrupted replay, e.g. ``pp0.hidden.1``).
``params.steps``: steps (default 8).

Observed: ``bitwise_equal`` / ``losses_equal`` (every rank's model, optimizer shard and RNG tracker, and losses,
equal the baseline's), ``peer_groups``, ``stage_labels`` (per rank), ``schedule`` (Megatron's schedule function),
``sdc_reports``, ``scope`` / ``localized_ranks`` / ``detected_step`` / ``recipe`` (of the first SDC report),
``unclean`` (every verdict other than ``agree``, as ``step:recipe:verdict``: the other stage's pair clean),
``decision_before_fault``, ``fault_step_rejected``, ``certified_after``, ``certified`` (some capture verified),
``ranks_agree`` (same reports, verdicts and trust on every rank).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from qualification.launch import launch
from qualification.programs._contract import cell_main, failed, measured, trust_gating
from qualification.programs.specs import spec_argv
from qualification.programs.specs.megatron import MegatronLoopSpec, MegatronSpec

_LOOP, _GPT = "qualification.programs.megatron_loop_rank", "qualification.programs.megatron_rank"
# topology -> (rank program, its spec class, the layout's spec fields)
LAYOUTS: dict[str, tuple[str, type[MegatronLoopSpec] | type[MegatronSpec], dict[str, Any]]] = {
    "megatron-pp2": (
        _LOOP,
        MegatronLoopSpec,
        {"pp": 2, "layers": 4, "distopt": True, "overlap": True},
    ),
    "megatron-pp2-vpp2": (
        _LOOP,
        MegatronLoopSpec,
        {"pp": 2, "vpp": 2, "distopt": True, "overlap": True},
    ),
    "megatron-ep2": (_GPT, MegatronSpec, {"topology": "megatron-ep2"}),
}


def _launch(
    cell: dict[str, Any], celldir: Path, name: str, extra: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[int]]:
    """Every rank's result, or ``([], exit codes)`` when a rank failed."""
    steps = int(cell.get("params", {}).get("steps", 8))
    topology = str(cell["topology"])
    if topology not in LAYOUTS:
        raise ValueError(
            f"megatron_scout_cell: unknown topology {topology!r}; use one of {sorted(LAYOUTS)}"
        )
    world = int(cell["world_size"])
    program, spec_class, layout = LAYOUTS[topology]
    out = celldir / name
    spec = spec_class(out=out, steps=steps, seed=int(cell.get("seed", 0)), **layout, **extra)
    res = launch(
        ["-m", program, *spec_argv(spec, out / f"spec-{name}.json")],
        world_size=world,
        timeout_s=float(cell.get("timeout_s", 240)),
        log_dir=celldir / "logs" / name,
    )
    if not res.ok:
        return [], list(res.returncodes)
    return [json.loads((celldir / name / f"rank{r}.json").read_text()) for r in range(world)], []


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    fault = cell.get("fault", {"kind": "none"})
    timeline: list[dict[str, Any]] = [
        {"t": 0.0, "event": "start", "detail": f"{cell['world_size']} ranks, {fault}"}
    ]
    extra: dict[str, Any] = {"ckpt": celldir / "ckpt", "scout": True, "keep_generations": 16}
    if fault["kind"] == "replay":
        extra |= {
            "fault_rank": int(fault["rank"]),
            "fault_step": int(fault["step"]),
            "fault_recipe": str(fault["recipe"]),
        }
    elif fault["kind"] != "none":
        raise ValueError(
            f"megatron_scout_cell: unknown fault kind {fault['kind']!r}; use 'none' or 'replay'"
        )
    base, codes = _launch(cell, celldir, "baseline", {})
    timeline.append(
        {"t": round(time.monotonic() - t0, 3), "event": "baseline", "detail": "without gemscout"}
    )
    runs, codes = _launch(cell, celldir, "run", extra) if base else ([], codes)
    if not runs:
        return failed(cell, f"ranks failed: {codes}", timeline, observed={"rank_exit_codes": codes})
    r0 = runs[0]
    sdc = [rep for rep in r0["reports"] if rep["kind"] == "sdc"]
    trust = {int(k): v for k, v in r0["trust"].items()}
    obs: dict[str, Any] = {
        "bitwise_equal": all(
            r["state_digest"] == b["state_digest"] for r, b in zip(runs, base, strict=True)
        ),
        "losses_equal": all(r["losses"] == b["losses"] for r, b in zip(runs, base, strict=True)),
        "peer_groups": (r0["topology"] or {}).get("peer_groups"),
        "stage_labels": [(r["topology"] or {}).get("stage_label") for r in runs],
        "schedule": r0["schedule"],
        "sdc_reports": len(sdc),
        "scope": sdc[0]["scope"] if sdc else None,
        "detected_step": sdc[0]["step"] if sdc else None,
        "recipe": sdc[0]["recipe"] if sdc else None,
        "localized_ranks": list(sdc[0]["ranks"])
        if sdc and sdc[0]["scope"] in ("rank", "node")
        else [],
        "unclean": [
            f"{s}:{n}:{v}"
            for s, c in sorted(r0["verdicts"].items(), key=lambda kv: int(kv[0]))
            for n, v in c.items()
            if v != "agree"
        ],
        "certified": "recovery_verified" in trust.values(),
        "ranks_agree": len(
            {
                json.dumps(
                    [
                        [(x["kind"], x["step"], x["ranks"]) for x in r["reports"]],
                        r["verdicts"],
                        r["trust"],
                    ],
                    sort_keys=True,
                )
                for r in runs
            }
        )
        == 1,
    }
    if fault["kind"] == "replay":
        obs.update(trust_gating(trust, r0["decisions"], int(fault["step"])))
    timeline.append(
        {"t": round(time.monotonic() - t0, 3), "event": "finish", "detail": f"trust {trust}"}
    )
    return measured(cell, obs, timeline, t0)


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.megatron_scout_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

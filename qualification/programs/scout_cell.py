"""SCOUT cells on DDP: persistent SDC, replay-only (transient) SDC, compute straggler, communication straggler.

Launches :mod:`qualification.programs.scout_rank` on ``world_size`` ranks and reads what every rank saw.

``fault.kind``: ``persistent`` (``rank``, ``step``, ``heal_step``, ``block``: a forward hook corrupts that block's
output from ``step`` until ``heal_step``), ``replay`` (``rank``, ``step``, ``recipe``: one corrupted replay),
``replay-delay`` (``rank``, ``seconds``: every replay of that rank sleeps), ``comm-delay`` (``rank``, ``seconds``,
``interval``: that rank sleeps before every probe collective), ``collective-delay`` (``rank``, ``seconds``, ``step``:
from that step on, every collective of that rank's replays is delayed — a slow TP collective), ``job-delay``
(``rank``, ``seconds``, ``step``: SCOUT times the job's own collectives, ``ScoutConfig.job_collectives``, and from that
step on the rank enters the first of each step late — DDP's first gradient bucket, FSDP2's first all-gather).

``topology`` other than ``ddp`` (fsdp2, hsdp, tp, fsdp2-tp, pp, pp-dp, pp-dp3; ``params.schedule`` picks the
pipeline schedule) runs the ranks on that mesh and trains the same steps
again without gemscout, adding ``bitwise_equal`` (every rank's shards equal that run's), ``peer_groups``,
``disabled`` (SCOUT found no data-parallel peers), ``comm_straggler_ranks`` and ``compute_straggler_reports``.

Observed: ``localized_ranks`` (the ranks of the first report of the fault's kind), ``detected_step``,
``expected_step`` (for SDC: the first step >= the fault step at which the faulty recipe was due), ``recipe``,
``decision_before_fault`` (the SDC decision names a verified step older than the fault), ``fault_step_rejected``
(the contaminated steps were never certified), ``certified_after`` (a step after the fault ended was certified
again), ``sdc_reports`` / ``straggler_reports`` (counts), ``host`` (of the first straggler report), ``ranks_agree``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from qualification.launch import launch
from qualification.programs._contract import cell_main, failed, measured, trust_gating
from qualification.programs.specs import spec_argv
from qualification.programs.specs.scout import ScoutSpec


def _spec(cell: dict[str, Any], out: Path) -> ScoutSpec:
    """What every rank of the cell's one launch is told."""
    f = cell["fault"]
    p = cell.get("params", {})
    steps = int(p.get("steps", 16))
    fields: dict[str, Any] = {"fault_rank": -1}
    kind = f["kind"]
    if kind == "persistent":
        fields = {
            "fault_rank": int(f["rank"]),
            "fault_step": int(f["step"]),
            "heal_step": int(f.get("heal_step", steps + 1)),
            "fault_block": int(f.get("block", 1)),
            "fault": str(f.get("corruption", "bitflip")),
        }
    elif kind == "replay":
        fields |= {
            "replay_fault_rank": int(f["rank"]),
            "replay_fault_step": int(f["step"]),
            "replay_fault_recipe": str(f.get("recipe", "embedding")),
        }
    elif kind == "replay-delay":
        fields |= {
            "replay_delay_rank": int(f["rank"]),
            "replay_delay_s": float(f.get("seconds", 0.6)),
        }
    elif kind == "comm-delay":
        fields |= {
            "comm_delay_rank": int(f["rank"]),
            "comm_delay_s": float(f.get("seconds", 0.4)),
            "comm_probe_interval": int(f.get("interval", 2)),
        }
    elif kind == "collective-delay":
        fields |= {
            "collective_delay_rank": int(f["rank"]),
            "collective_delay_s": float(f.get("seconds", 0.3)),
            "collective_delay_step": int(f.get("step", 1)),
        }
    elif kind == "job-delay":
        fields |= {
            "job_delay_rank": int(f["rank"]),
            "job_delay_s": float(f.get("seconds", 0.4)),
            "job_delay_step": int(f.get("step", 1)),
        }
    elif kind != "none":
        raise ValueError(f"scout_cell: unknown fault kind {kind!r}")
    topology = str(cell.get("topology", "ddp"))
    if topology != "ddp":
        fields |= {"topology": topology, "baseline": True}
    if "schedule" in p:  # pipeline topologies (_pipeline.PIPELINE_TOPOLOGIES)
        fields["schedule"] = str(p["schedule"])
    if "optimizer_slice_numel" in p:  # a longer certification rotation
        fields["optimizer_slice_numel"] = int(p["optimizer_slice_numel"])
    return ScoutSpec(out=out, steps=steps, **fields)


def _argv(cell: dict[str, Any], out: Path) -> list[str]:
    """The launch's arguments: scout_rank and the spec file it reads (``out/spec-run.json``)."""
    spec = _spec(cell, out)
    return ["-m", "qualification.programs.scout_rank", *spec_argv(spec, out / "spec-run.json")]


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    t0, wall0 = time.monotonic(), time.time()
    world, fault = int(cell["world_size"]), cell.get("fault", {"kind": "none"})
    timeline: list[dict[str, Any]] = [
        {"t": 0.0, "event": "start", "detail": f"{world} ranks, fault {fault}"}
    ]
    res = launch(
        _argv(cell, celldir / "ranks"),
        world_size=world,
        timeout_s=float(cell.get("timeout_s", 200)),
        log_dir=celldir / "logs",
    )
    if not res.ok:
        return failed(
            cell,
            f"ranks failed: {res.returncodes}",
            timeline,
            observed={"rank_exit_codes": res.returncodes},
        )
    ranks = [json.loads((celldir / "ranks" / f"rank{r}.json").read_text()) for r in range(world)]
    r0 = ranks[0]
    kind = fault["kind"]
    report_kind = (
        "straggler"
        if kind in ("replay-delay", "comm-delay", "collective-delay", "job-delay")
        else "sdc"
    )
    found = [rep for rep in r0["reports"] if rep["kind"] == report_kind]
    obs: dict[str, Any] = {
        "sdc_reports": sum(rep["kind"] == "sdc" for rep in r0["reports"]),
        "straggler_reports": sum(rep["kind"] == "straggler" for rep in r0["reports"]),
        "ranks_agree": len({json.dumps(r["reports"], sort_keys=True, default=str) for r in ranks})
        == 1
        or len(
            {json.dumps([(x["kind"], x["step"], x["ranks"]) for x in r["reports"]]) for r in ranks}
        )
        == 1,
        # Only a report scoped to ranks names culprits; a peer-group report (two peers) detects without one.
        "localized_ranks": list(found[0]["ranks"])
        if found and found[0]["scope"] in ("rank", "node")
        else [],
        "scope": found[0]["scope"] if found else None,
        "detected_step": found[0]["step"] if found else None,
    }
    if (
        "topology" in r0
    ):  # a mesh run (scout_rank --topology): what the mesh gave SCOUT, and what it left alone
        signals = [rep for rep in r0["reports"] if rep["kind"] == "straggler"]
        comm = [rep for rep in signals if rep["evidence"].get("signal") == "communication"]
        obs.update(
            bitwise_equal=all(r["state_digest"] == r.get("baseline_digest") for r in ranks),
            peer_groups=(r0["topology"] or {}).get("peer_groups"),
            disabled=r0["disabled_reason"] is not None,
            comm_straggler_ranks=list(comm[0]["ranks"]) if comm else [],
            compute_straggler_reports=sum(
                rep["evidence"].get("signal") == "compute" for rep in signals
            ),
        )
    trust = {int(k): v for k, v in r0["trust"].items()}
    if found:
        timeline.append(
            {
                "t": round(found[0]["timestamp"] - wall0, 3),
                "event": "detection",
                "detail": found[0]["reason"],
            }
        )
    if report_kind == "straggler":
        obs["host"] = found[0].get("host") if found else None
    elif kind != "none":
        fstep = int(fault["step"])
        recipe = (
            f"hidden.{fault.get('block', 1)}"
            if kind == "persistent"
            else str(fault.get("recipe", "embedding"))
        )
        due: dict[int, set[str]] = {}  # every rank's: pipeline stages have recipes of their own
        for r in ranks:
            for k, names in r["due"].items():
                due.setdefault(int(k), set()).update(names)
        obs["recipe"] = found[0]["recipe"] if found else None
        obs["expected_step"] = min(
            (s for s, names in due.items() if s >= fstep and recipe in names), default=None
        )
        obs.update(
            trust_gating(trust, r0["decisions"], fstep, int(fault.get("heal_step", fstep + 1)))
        )
        sdc_decisions = [d for d in r0["decisions"] if d["failure_kind"] == "sdc"]
        if sdc_decisions:
            d = sdc_decisions[0]
            timeline.append(
                {
                    "t": round(found[0]["timestamp"] - wall0 + 0.001, 3) if found else 0.0,
                    "event": "decision",
                    "detail": f"{d['mode']} step {d['step']}: {d['reason']}",
                }
            )
    timeline.append(
        {"t": round(time.monotonic() - t0, 3), "event": "finish", "detail": f"trust {trust}"}
    )
    return measured(cell, obs, timeline, t0)


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.scout_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

"""Expert- and context-parallel cells: GEMINI + SCOUT (+ the AllToAll check on MoE) on a (dp, ep|cp=2) mesh.

Launches :mod:`qualification.programs.moe_rank` on ``world_size`` ranks (4: dp=2, 6: dp=3, where a replay fault is
attributed to exactly its rank). ``workload``: ``moe`` (mesh ("dp", "ep")) or ``cp``
(mesh ("dp", "cp")); ``topology`` is a label only. ``params.steps`` (default 8); ``params.etp`` (MoE, default 1): 2
puts expert tensor parallelism on a ("dp", "ep", "etp") mesh of ``world_size`` = dp x 2 x 2 ranks (8: dp=2, 12: dp=3).

``fault.kind``: ``none`` (healthy), ``replay`` (``rank``, ``step``, ``recipe``: one corrupted SCOUT replay),
``alltoall`` (``rank``, ``step``: that rank corrupts its replayed ``balanced`` AllToAll send after digesting it; MoE
only), ``sigkill`` (``rank``, ``step``: SIGKILL after that step, then a relaunch recovers).

Observed: ``unexpected_verdicts`` (SCOUT verdicts other than AGREE, over every rank and step, except the injected
recipe at the injected step), ``bitwise_equal`` / ``losses_equal`` (every rank's final state and losses equal the same steps trained
without gemscout), ``peer_groups``, ``model_dims``, ``sdc_reports`` (SCOUT recipe reports on rank 0),
``scope`` / ``group_ranks`` / ``detected_step`` (the first of them), ``decision_before_fault``,
``fault_step_rejected``, ``certified_after``, ``a2a_checks`` / ``a2a_clean`` (AllToAll checks run / clean, over every
rank and step), ``a2a_pairs`` (the [sender, receiver] pairs named, job-wide), ``a2a_step``, ``a2a_step_gated`` (that step not captured, and an ``alltoall`` RecoveryDecision naming an older step), ``resume_step``,
``killed_exit_code``, ``ranks_agree`` (trust ledgers equal on every rank); ``sigkill`` also ``kill`` (the killed rank's own
record of its SIGKILL, :mod:`qualification.programs._kills`; none is an error), ``fault_to_detection_s``,
``fault_to_recovery_s`` and ``fault_to_first_step_s``. Timeline: ``fault`` at that record's time, ``detection`` when
the launcher saw the exit, ``relaunch``, ``recovery`` (state restored on every rank) and ``first-step`` (every rank
trained the first step after it; :mod:`qualification.programs._recovery_times`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from qualification.launch import launch
from qualification.programs import _kills
from qualification.programs._contract import cell_main, failed
from qualification.programs._recovery_times import recovery_events
from qualification.programs.specs import spec_argv
from qualification.programs.specs.scout import MoeSpec


def _spec(cell: dict[str, Any], out: Path, **fields: Any) -> MoeSpec:
    """What every rank of one launch is told; ``fields`` are that launch's own :class:`MoeSpec` fields."""
    p = cell.get("params", {})
    return MoeSpec(
        out=out,
        workload=str(cell["workload"]),
        steps=int(p.get("steps", 8)),
        etp=int(p.get("etp", 1)),  # expert TP: a (world/4) x 2 x 2 mesh
        **fields,
    )


def _launch(
    cell: dict[str, Any], out: Path, label: str, **fields: Any
) -> tuple[Any, list[dict[str, Any]]]:
    """Launch moe_rank with the spec ``out/spec-<label>.json``; the ranks' records when every rank exited 0."""
    world = int(cell.get("world_size", 4))  # a (world/2) x 2 mesh: 4 ranks for dp=2, 6 for dp=3
    spec = _spec(cell, out, **fields)
    res = launch(
        ["-m", "qualification.programs.moe_rank", *spec_argv(spec, out / f"spec-{label}.json")],
        world_size=world,
        timeout_s=float(cell.get("timeout_s", 200)),
        log_dir=out / "logs",
    )
    ranks = (
        [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)] if res.ok else []
    )
    return res, ranks


def _observe(ranks: list[dict[str, Any]], fault: dict[str, Any]) -> dict[str, Any]:
    r0 = ranks[0]
    sdc = [rep for rep in r0["reports"] if rep["kind"] == "sdc" and rep["recipe"] != "alltoall"]
    a2a = [res for r in ranks for results in r["a2a"].values() for res in results]
    pairs = sorted(
        {tuple(rep["ranks"]) for r in ranks for rep in r["reports"] if rep["recipe"] == "alltoall"}
    )
    a2a_steps = sorted(
        {rep["step"] for r in ranks for rep in r["reports"] if rep["recipe"] == "alltoall"}
    )
    fstep, frecipe = (
        (int(fault["step"]), str(fault.get("recipe", "hidden.1")))
        if fault["kind"] == "replay"
        else (0, "")
    )
    unexpected = [
        f"{step}:{name}"
        for r in ranks
        for step, cycle in r["cycles"].items()
        for name, v in cycle["verdicts"].items()
        if v["verdict"] != "agree" and (int(step), name) != (fstep, frecipe)
    ]
    obs: dict[str, Any] = {
        "unexpected_verdicts": len(unexpected),
        "bitwise_equal": all(r["state_digest"] == r["baseline_digest"] for r in ranks),
        "losses_equal": all(r["losses"] == r["baseline_losses"] for r in ranks),
        "peer_groups": r0["topology"]["peer_groups"],
        "model_dims": r0["topology"]["model_dims"],
        "sdc_reports": len(sdc),
        "scope": sdc[0]["scope"] if sdc else None,
        "group_ranks": sdc[0]["ranks"] if sdc else [],
        "detected_step": sdc[0]["step"] if sdc else None,
        "a2a_checks": len(a2a),
        "a2a_clean": sum(res["verdict"] == "clean" for res in a2a),
        "a2a_pairs": [list(p) for p in pairs],
        "a2a_step": a2a_steps[0] if a2a_steps else None,
        "resume_step": r0["resume_step"],
        "ranks_agree": len({json.dumps(r["trust"], sort_keys=True) for r in ranks}) == 1,
    }
    trust = {int(k): v for k, v in r0["trust"].items()}
    if (
        fault["kind"] == "alltoall"
    ):  # the job-wide flag gated that step's capture on every rank, like SDC
        astep = int(fault["step"])
        gate = [d for d in r0["decisions"] if d["failure_kind"] == "alltoall"]
        obs["a2a_step_gated"] = (
            trust.get(astep) is None
            and bool(gate)
            and gate[0]["step"] is not None
            and gate[0]["step"] < astep
        )
        obs["certified_after"] = any(
            st == "recovery_verified" for s, st in trust.items() if s > int(fault["step"])
        )
    if fault["kind"] == "replay":
        fstep = int(fault["step"])
        decisions = [d for d in r0["decisions"] if d["failure_kind"] == "sdc"]
        obs["decision_before_fault"] = (
            bool(decisions) and decisions[0]["step"] is not None and decisions[0]["step"] < fstep
        )
        obs["fault_step_rejected"] = trust.get(fstep) != "recovery_verified"
        obs["certified_after"] = any(
            st == "recovery_verified" for s, st in trust.items() if s > fstep
        )
    return obs


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    t0, wall0 = time.monotonic(), time.time()
    fault = cell.get("fault", {"kind": "none"})
    kind = fault["kind"]
    timeline: list[dict[str, Any]] = [
        {"t": 0.0, "event": "start", "detail": f"{cell['workload']}, fault {fault}"}
    ]
    ckpt = celldir / "ckpt"
    extra: dict[str, Any] = {"ckpt": ckpt, "baseline": True}
    killed_code = None
    kill_record: dict[str, Any] = {}
    res_killed_detected: float | None = None
    if kind == "replay":
        extra |= {
            "replay_fault_rank": int(fault["rank"]),
            "replay_fault_step": int(fault["step"]),
            "replay_fault_recipe": str(fault.get("recipe", "hidden.1")),
        }
    elif kind == "alltoall":
        extra |= {
            "a2a_corrupt_rank": int(fault["rank"]),
            "a2a_corrupt_step": int(fault["step"]),
        }
    elif kind == "sigkill":
        res, _ = _launch(
            cell,
            celldir / "killed",
            "faulted",
            ckpt=ckpt,
            kill_rank=int(fault["rank"]),
            kill_step=int(fault["step"]),
        )
        killed_code = res.returncodes[int(fault["rank"])]
        res_killed_detected = res.detected_wall
        kills = [k for k in _kills.read(celldir / "killed") if k.get("rank") == int(fault["rank"])]
        timeline += _kills.timeline_events(kills, wall0)
        if res.detected_wall is not None:
            timeline.append(
                {
                    "t": round(res.detected_wall - wall0, 3),
                    "event": "detection",
                    "detail": f"launcher saw rank {res.first_failed} exit with {killed_code}",
                }
            )
        if (
            not kills
        ):  # some other death ended the run: what follows would not be this cell's recovery
            return failed(
                cell,
                f"rank {fault['rank']} left no record of its SIGKILL (exit codes {res.returncodes})",
                timeline,
                observed={"rank_exit_codes": res.returncodes},
            )
        kill_record = {k: kills[-1].get(k) for k in ("rank", "step", "phase", "wall")}
        timeline.append(
            {
                "t": round(time.monotonic() - t0, 3),
                "event": "relaunch",
                "detail": "every rank relaunched",
            }
        )
    elif kind != "none":
        raise ValueError(f"moe_cell: unknown fault kind {kind!r}")
    label = "relaunch" if kind == "sigkill" else "run"
    res, ranks = _launch(cell, celldir / "ranks", label, **extra)
    if not res.ok:
        return failed(
            cell,
            f"ranks failed: {res.returncodes}",
            timeline,
            observed={"rank_exit_codes": res.returncodes},
        )
    obs = _observe(ranks, fault)
    if killed_code is not None:
        obs["killed_exit_code"] = killed_code
        obs["kill"] = kill_record
        if res_killed_detected is not None:
            obs["fault_to_detection_s"] = round(res_killed_detected - kill_record["wall"], 3)
        events, times = recovery_events(
            ranks,
            kill_wall=kill_record["wall"],
            wall0=wall0,
            resume_step=int(ranks[0]["resume_step"]),
        )
        timeline += events
        obs.update(times)
    a2a_s = sorted(
        res_["seconds"] for r in ranks for results in r["a2a"].values() for res_ in results
    )
    metrics: dict[str, Any] = {"duration_s": round(time.monotonic() - t0, 3)}
    if a2a_s:
        metrics["a2a_check_median_s"] = round(a2a_s[len(a2a_s) // 2], 4)
    timeline.append(
        {
            "t": round(time.monotonic() - t0, 3),
            "event": "finish",
            "detail": f"trust {ranks[0]['trust']}",
        }
    )
    timeline.sort(key=lambda e: e["t"])
    return {
        "cell_id": cell["id"],
        "status": "passed",
        "observed": obs,
        "metrics": metrics,
        "timeline": timeline,
        "message": "",
    }


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.moe_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

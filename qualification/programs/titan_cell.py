"""TorchTitan cells: the real ``Trainer.train()`` (torchtitan 0.3.0, llama3 debug model) on CPU ranks under gemscout.

Launches :mod:`qualification.programs.titan_rank` with the TorchTitan interpreter
(:func:`qualification.frameworks.titan_env.python`: ``$GEMSCOUT_TT_PYTHON``, else ``.venv-tt/bin/python``; the main
virtualenv never has torchtitan) after building the synthetic tokenizer and data set
(:func:`qualification.frameworks.torchtitan_cpu.make_assets`) in the cell folder. Every cell first trains the same
steps without gemscout (the reference) and compares every rank with it, bit for bit. Campaign cells declare
``requires = ["torchtitan_cpu"]`` and are SKIPPED, with the reason, where that interpreter is missing; run without
it anyway, the driver reports status ``error`` naming what is missing.

``topology``: ``fsdp2`` (FSDP2 over every rank), ``hsdp`` (``dp_replicate`` 2 x ``fsdp`` world/2) or ``pp``
(TorchTitan's own pipeline split over 2 stages, ``params.schedule``: its ``pipeline_parallel_schedule``, ``1F1B`` by
default, ``Interleaved1F1B`` puts two stages on each rank; microbatches of one sample) or ``pp-fsdp`` (the same
on 2 x world/2 ranks, each stage FSDP2-sharded over world/2) or ``pp-ddp`` (2 stages x ``dp_replicate`` world/2:
each stage replicated, TorchTitan's HSDP with one shard).
``params``: ``steps`` (default 6), ``seq_len`` (128), ``batch`` (local batch, 2), ``schedule``, ``scout`` (attach SCOUT
to a ``none`` run too), ``scout_per_cycle`` (blocks and optimizer slices replayed per due step; 0: all, so a clean
cycle certifies its step at once; default: ScoutConfig's rotation).

``fault.kind``: ``none`` (GEMINI captures every step; with ``params.scout`` SCOUT checks every step), ``sigkill``
(``rank``, ``step``: SIGKILL right after that step was captured and replicated; ``node_loss``: delete that rank's node
folder before the relaunch, so it must recover from a peer's replica), ``replay`` (``rank``, ``step``, ``recipe``:
SCOUT attached, one bit of that rank's replay of that recipe flipped at that step; training itself untouched; under
pipeline parallelism the recipe names its stage, ``pp0.embedding``).

Observed: ``bitwise_equal`` (every rank's parameter shards, AdamW state, lr schedulers, ``trainer.step``,
``ntokens_seen`` and dataloader state equal the reference's), ``losses_equal`` (the logged losses of the steps this
run trained equal the reference's; under ``pp`` only the last stage logs a loss, the others log -1), ``final_step``,
``model_parts`` (per rank: the stages it holds), ``errors`` (checkpoint errors, every rank); for ``sigkill``:
``killed_exit_code``, ``recovered_step`` (every rank's, or null when they differ), ``source`` (the weakest source any
rank restored from), ``killed_rank_source`` (the killed rank's, e.g. ``peer:0``), ``kill``, ``fault_to_detection_s``,
``fault_to_recovery_s`` and ``fault_to_first_step_s`` (from the SIGKILL's own record; timeline events ``fault``,
``detection``, ``relaunch``, ``decision``, ``recovery`` and ``first-step``); for ``replay``: ``sdc_reports``
(rank 0's), ``scope`` / ``group_ranks`` / ``localized_ranks`` / ``detected_step`` / ``recipe`` (its first SDC
report), ``unexpected_verdicts`` (verdicts other than AGREE, every rank and step, besides the injected one),
``peer_groups``, ``stages`` (the pipeline stages whose recipes every rank judged, e.g. ``["pp0", "pp1"]``; empty
without pipelining), ``rejected_steps`` / ``certified_steps`` (rank 0's trust ledger, the captures still kept),
``decision_before_fault`` (the SDC decision names no step or one older than the fault), ``decision_mode`` (``stop``
when no step was verified yet: SCOUT's default rotation over the debug model's six blocks and optimizer slices
certifies nothing in a few steps; ``params.scout_per_cycle`` shortens it), ``fault_step_rejected``,
``certified_after``, ``ranks_agree`` (every rank saw the same SDC reports), ``scout_disabled``; for ``none`` with
``params.scout``: ``sdc_reports`` (every rank's), ``unexpected_verdicts``, ``peer_groups``, ``stages``,
``certified_steps``, ``rejected_steps``, ``scout_disabled``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from qualification.frameworks import titan_env
from qualification.launch import LaunchResult, launch
from qualification.programs import _kills
from qualification.programs._contract import cell_main, failed
from qualification.programs._recovery_times import recovery_events
from qualification.programs.specs import spec_argv
from qualification.programs.specs.titan import TitanSpec

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES: dict[str, dict[str, int]] = {  # the TitanSpec fields of each topology
    "fsdp2": {"dp_replicate": 1},
    "hsdp": {"dp_replicate": 2},
    "pp": {"pp": 2},
    "pp-fsdp": {"pp": 2},  # pp-fsdp: the ranks beyond the 2 stages shard each stage (FSDP2)
    "pp-ddp": {"pp": 2, "dp_replicate": 2},  # 4 ranks: each stage replicated, one shard
}


class _Job:
    """Launches of titan_rank for one cell: the interpreter, the assets, the common spec fields, the clock."""

    def __init__(self, cell: dict[str, Any], celldir: Path, python: str) -> None:
        params = cell.get("params", {})
        topology = str(cell["topology"])
        if topology not in TOPOLOGIES:
            raise ValueError(
                f"titan_cell: unknown topology {topology!r}; use one of {sorted(TOPOLOGIES)}"
            )
        self.world, self.celldir, self.python = int(cell["world_size"]), celldir, python
        self.steps = int(params.get("steps", 6))
        self.timeout = float(cell.get("timeout_s", 900))
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.timeline: list[dict[str, Any]] = []
        self.common: dict[str, Any] = {
            "assets": celldir / "assets",
            "steps": self.steps,
            "seq_len": int(params.get("seq_len", 128)),
            "batch": int(params.get("batch", 2)),
            **TOPOLOGIES[topology],
            "pp_schedule": str(params.get("schedule", "1F1B")),
        }

    def event(
        self, event: str, detail: str, rank: int | None = None, at_wall: float | None = None
    ) -> None:
        t = at_wall - self.wall0 if at_wall is not None else time.monotonic() - self.t0
        self.timeline.append(
            {
                "t": round(t, 3),
                "event": event,
                "detail": detail,
                **({"rank": rank} if rank is not None else {}),
            }
        )
        self.timeline.sort(key=lambda e: e["t"])

    def assets(self) -> None:
        subprocess.run(
            [
                self.python,
                "-m",
                "qualification.frameworks.torchtitan_cpu",
                str(self.celldir / "assets"),
            ],
            check=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    def launch(self, name: str, label: str, *, attempt: int = 0, **fields: Any) -> LaunchResult:
        """Launch every rank into ``celldir/name``, told the common fields and ``fields`` by the spec file
        ``celldir/name/spec-<label>.json``."""
        left = max(30.0, self.timeout - (time.monotonic() - self.t0) - 20.0)
        out = self.celldir / name
        spec = TitanSpec(out=out, **self.common, **fields)
        return launch(
            [
                "-m",
                "qualification.programs.titan_rank",
                *spec_argv(spec, out / f"spec-{label}.json"),
            ],
            world_size=self.world,
            timeout_s=left,
            log_dir=self.celldir / "logs" / name,
            attempt=attempt,
            python=self.python,
            env={"PYTHONPATH": str(REPO)},
        )

    def ranks(self, name: str) -> list[dict[str, Any]]:
        return [
            json.loads((self.celldir / name / f"rank{r}.json").read_text())
            for r in range(self.world)
        ]


def _compare(
    run: list[dict[str, Any]], base: list[dict[str, Any]], first_step: int
) -> dict[str, Any]:
    return {
        "bitwise_equal": all(
            mine["state"] == theirs["state"] for mine, theirs in zip(run, base, strict=True)
        ),
        "losses_equal": all(
            mine["losses"] == {s: v for s, v in theirs["losses"].items() if int(s) >= first_step}
            for mine, theirs in zip(run, base, strict=True)
        ),
        "final_step": min(r["state"]["step"] for r in run),
        "model_parts": [r["model_parts"] for r in run],
        "errors": sorted({str(e) for r in run for e in r["errors"]}),
    }


def _scout_seen(run: list[dict[str, Any]]) -> dict[str, Any]:
    """What every SCOUT run reports: who compared with whom, which stages were judged, what was certified."""
    trust = {int(s): st for s, st in run[0]["trust"].items()}
    names = {name for r in run for c in r["scout_cycles"].values() for name in c["verdicts"]}
    return {
        "peer_groups": [
            list(g)
            for g in sorted({tuple(c["peers"]) for r in run for c in r["scout_cycles"].values()})
        ],
        "stages": sorted({n.split(".")[0] for n in names if n.startswith("pp")}),
        "certified_steps": sorted(s for s, st in trust.items() if st == "recovery_verified"),
        "rejected_steps": sorted(s for s, st in trust.items() if st == "rejected"),
        "scout_disabled": next((r["scout_disabled"] for r in run if r["scout_disabled"]), None),
    }


def _scout_healthy(run: list[dict[str, Any]]) -> dict[str, Any]:
    seen = _scout_seen(run)
    return {
        "sdc_reports": sum(1 for r in run for rep in r["reports"] if rep["kind"] == "sdc"),
        "unexpected_verdicts": sum(
            1
            for r in run
            for c in r["scout_cycles"].values()
            for v in c["verdicts"].values()
            if v != "agree"
        ),
        **{
            k: seen[k]
            for k in (
                "peer_groups",
                "stages",
                "certified_steps",
                "rejected_steps",
                "scout_disabled",
            )
        },
    }


def _scout(run: list[dict[str, Any]], fault: dict[str, Any]) -> dict[str, Any]:
    fstep, frecipe = int(fault["step"]), str(fault.get("recipe", "embedding"))
    r0 = run[0]
    sdc = [rep for rep in r0["reports"] if rep["kind"] == "sdc"]
    first = sdc[0] if sdc else None
    unexpected = [
        (r["rank"], step, name)
        for r in run
        for step, cycle in r["scout_cycles"].items()
        for name, verdict in cycle["verdicts"].items()
        if verdict != "agree" and (int(step), name) != (fstep, frecipe)
    ]
    decisions = [d for d in r0["decisions"] if d["failure_kind"] == "sdc"]
    trust = {int(s): st for s, st in r0["trust"].items()}
    return {
        "sdc_reports": len(sdc),
        "scope": first["scope"] if first else None,
        "group_ranks": list(first["ranks"]) if first else [],
        "localized_ranks": list(first["ranks"])
        if first and first["scope"] in ("rank", "node")
        else [],
        "detected_step": first["step"] if first else None,
        "recipe": first["recipe"] if first else None,
        "unexpected_verdicts": len(unexpected),
        "decision_before_fault": bool(decisions)
        and (decisions[0]["step"] is None or decisions[0]["step"] < fstep),
        "decision_mode": decisions[0]["mode"] if decisions else None,
        "fault_step_rejected": trust.get(fstep) != "recovery_verified",
        "certified_after": any(st == "recovery_verified" for s, st in trust.items() if s > fstep),
        "ranks_agree": len(
            {
                json.dumps(
                    [
                        (x["step"], x["ranks"], x["recipe"])
                        for x in r["reports"]
                        if x["kind"] == "sdc"
                    ]
                )
                for r in run
            }
        )
        == 1,
        **_scout_seen(run),
    }


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    python = titan_env.python()
    why = titan_env.unavailable(python)
    if why:
        return failed(
            cell,
            f'cannot run TorchTitan: {why} (declare requires = ["torchtitan_cpu"] to skip)',
            [],
        )
    fault = cell.get("fault", {"kind": "none"})
    kind = fault["kind"]
    if kind not in ("none", "sigkill", "replay"):
        raise ValueError(f"titan_cell: unknown fault kind {kind!r}; use none, sigkill or replay")
    job = _Job(cell, celldir, python)
    job.event("start", f"{job.world} ranks, {cell['topology']}, fault {fault}, {python}")
    job.assets()
    ckpt = celldir / "ckpt"
    base = job.launch("reference", "reference")
    if not base.ok:
        return failed(
            cell, f"the reference run (no gemscout) failed: {base.returncodes}", job.timeline
        )
    job.event("reference", f"{job.steps} steps without gemscout in {base.duration_s:.1f} s")
    extra: dict[str, Any] = {}
    observed: dict[str, Any] = {}
    first_step, attempt = 1, 0
    params = cell.get("params", {})
    scout = kind == "replay" or (kind == "none" and bool(params.get("scout", False)))
    if scout:
        extra = {"scout": True, "scout_per_cycle": int(params.get("scout_per_cycle", -1))}
    if kind == "replay":
        extra |= {
            "replay_fault_rank": int(fault["rank"]),
            "replay_fault_step": int(fault["step"]),
            "replay_fault_recipe": str(fault.get("recipe", "embedding")),
        }
    elif kind == "sigkill":
        rank = int(fault["rank"])
        killed = job.launch(
            "run", "faulted", ckpt=ckpt, kill_rank=rank, kill_step=int(fault["step"])
        )
        observed["killed_exit_code"] = killed.returncodes[rank]
        if killed.ok or killed.first_failed != rank:
            return failed(
                cell,
                f"the SIGKILL did not end the run as planned: {killed.returncodes}",
                job.timeline,
                observed=observed,
            )
        kills = [k for k in _kills.read(celldir / "run") if k.get("rank") == rank]
        if (
            not kills
        ):  # some other death ended the run: what follows would not be this cell's recovery
            return failed(
                cell,
                f"rank {rank} left no record of its SIGKILL ({killed.returncodes})",
                job.timeline,
                observed=observed,
            )
        job.timeline = sorted(
            job.timeline + _kills.timeline_events(kills, job.wall0), key=lambda e: e["t"]
        )
        observed["kill"] = {k: kills[-1].get(k) for k in ("rank", "step", "phase", "wall")}
        if killed.detected_wall is not None:
            job.event(
                "detection",
                f"launcher saw rank {rank} exit with {killed.returncodes[rank]}",
                rank,
                killed.detected_wall,
            )
            observed["fault_to_detection_s"] = round(killed.detected_wall - kills[-1]["wall"], 3)
        if fault.get("node_loss"):
            shutil.rmtree(ckpt / f"node-{rank}")  # ranks_per_node=1: node r is rank r
            job.event("node-loss", f"node {rank} lost: its checkpoint folder deleted", rank)
        job.event("relaunch", f"{job.world} ranks relaunched")
        first_step, attempt = int(fault["step"]) + 1, 1
    res = job.launch("run", "relaunch" if attempt else "run", attempt=attempt, ckpt=ckpt, **extra)
    if not res.ok:
        return failed(
            cell, f"the gemscout run failed: {res.returncodes}", job.timeline, observed=observed
        )
    run, ref = job.ranks("run"), job.ranks("reference")
    observed.update(_compare(run, ref, first_step))
    if kind == "sigkill":
        decisions = [r["decision"] or {} for r in run]
        steps = {d.get("step") for d in decisions}
        observed.update(
            recovered_step=steps.pop() if len(steps) == 1 else None,
            source=decisions[0].get("source"),
            killed_rank_source=decisions[0].get("sources", {}).get(str(fault["rank"])),
        )
        job.event(
            "decision",
            f"{decisions[0].get('mode')} step {decisions[0].get('step')} from "
            f"{decisions[0].get('sources')}: {decisions[0].get('reason')}",
        )
        events, times = recovery_events(
            run,
            kill_wall=observed["kill"]["wall"],
            wall0=job.wall0,
            resume_step=int(run[0]["resume_step"]),
        )
        job.timeline = sorted(job.timeline + events, key=lambda e: e["t"])
        observed.update(times)
    if kind == "none" and scout:
        observed.update(_scout_healthy(run))
        job.event(
            "scout",
            f"{observed['sdc_reports']} SDC reports; peers {observed['peer_groups']}; certified steps "
            f"{observed['certified_steps']}",
        )
    if kind == "replay":
        observed.update(_scout(run, fault))
        if observed["detected_step"] is not None:
            job.event(
                "detection",
                f"SDC in {observed['recipe']} at step {observed['detected_step']} among "
                f"{observed['group_ranks']} ({observed['scope']})",
            )
    job.event(
        "finish",
        json.dumps({k: observed[k] for k in ("bitwise_equal", "losses_equal", "final_step")}),
    )
    metrics = {
        "duration_s": round(time.monotonic() - job.t0, 3),
        "reference_launch_s": round(base.duration_s, 3),
        "run_launch_s": round(res.duration_s, 3),
        "train_wall_s": {
            "reference": max(r["train_wall_s"] for r in ref),
            "gemscout": max(r["train_wall_s"] for r in run),
        },
    }
    return {
        "cell_id": cell["id"],
        "status": "passed",
        "observed": observed,
        "metrics": metrics,
        "timeline": job.timeline,
        "message": "",
    }


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.titan_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

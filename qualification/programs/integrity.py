"""GEMINI integrity cell: damage checkpoint files on disk, relaunch, and check that recovery refuses them.

The protocol, all with real processes and real files:

1. baseline: an uninterrupted run without gemscout for ``params.steps`` steps (the reference state);
2. first run: GEMINI checkpoints every step up to ``params.steps_before``, and the job ends cleanly;
3. fault: optionally lose a node (delete its folder), then damage the named files with an injector from
   :mod:`qualification.corruption`; nothing else is touched and gemscout is not involved;
4. relaunch to ``params.steps``: recovery must never load a damaged file. Either it falls back (to a peer's copy or
   an older step) and the run finishes bit for bit equal to the baseline, or, with no intact source left, every rank
   stops with ``RecoveryError`` (exit code 4) and the decision, mode ``stop``, is in rank 0's ``status.json``.

Cell fields used: ``world_size``, ``workload``, ``seed``, ``fault``, ``params``.

- ``fault.kind``: the damage, one of ``byte-flip``, ``truncate``, ``drop-digest``; ``fault.target``: ``own`` (the
  rank's own file), ``replica`` (the copy its ring peer holds), ``durable`` (the largest DCP data file of the durable
  promotion of the step) or ``durable-sidecar`` (that promotion's SHA-256 sidecar); ``fault.rank``: whose checkpoint;
  ``fault.step`` or ``fault.steps`` (a list): which generation(s); ``fault.node_loss``: delete that rank's node folder
  first, or ``"all"``: every node's (all local storage gone, only the durable tier is left).
- ``params``: ``steps`` (8), ``steps_before`` (6), ``interval`` (1), ``ranks_per_node`` (1), ``durable_every`` (0:
  no durable tier; N: every capture certified and every Nth verified step promoted to ``<cell>/durable``),
  ``reason_contains`` (text the decision's reason must contain, e.g. the file it refused).

Observed: ``recovered_step``, ``source_rank<R>`` (where rank R restored from, e.g. ``peer:2``), ``bitwise_equal``,
``losses_equal``, ``replicas_equal``, ``final_step``, ``decision_mode``, ``decision_reason``, ``reason_names_fault``, ``relaunch_exit_code`` (0, or the
exit code of the first rank that failed), ``relaunch_exit_codes``, ``traceback_free`` (no rank log has a traceback),
``inspect_predicted`` (what ``gemscout inspect --verify`` said a restart would do, read before the relaunch) and
``inspect_agrees`` (it said what the restart then did: mode, and for a restore the step and every rank's source).
The checkpoint folder is deleted at the end: binary state does not belong in an evidence bundle.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from gemscout.errors import RecoveryError
from gemscout.inventory import inventory
from qualification.corruption import (
    INJECTORS,
    durable_slot,
    lose_every_node,
    lose_node,
    own_slot,
    replica_slot,
)
from qualification.launch import LaunchResult, launch
from qualification.programs._contract import against_reference, cell_main
from qualification.programs.specs import spec_argv
from qualification.programs.specs.train import TrainSpec


class _Timeline:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.events: list[dict[str, Any]] = []

    def __call__(self, kind: str, detail: str) -> None:
        self.events.append(
            {"t": round(time.monotonic() - self.start, 3), "event": kind, "detail": detail}
        )


def _rank_argv(out: Path, cell: dict[str, Any], ckpt: Path | None, steps: int) -> list[str]:
    """train_rank and the spec it reads (``out/spec.json``: each launch here has its own ``out``)."""
    p = cell.get("params", {})
    # promotions need verified steps: every capture is certified
    durable = ckpt is not None and int(p.get("durable_every", 0)) > 0
    spec = TrainSpec(
        out=out,
        workload=cell["workload"],
        steps=steps,
        seed=int(cell.get("seed", 0)),
        interval=int(p.get("interval", 1)),
        ranks_per_node=int(p.get("ranks_per_node", 1)),
        ckpt=ckpt,
        durable=_durable_dir(ckpt) if durable and ckpt is not None else None,
        durable_every=int(p["durable_every"]) if durable else 0,
        certify=durable,
    )
    return ["-m", "qualification.programs.train_rank", *spec_argv(spec, out / "spec.json")]


def _durable_dir(ckpt: Path) -> Path:
    return ckpt.parent / "durable"


def _targets(ckpt: Path, fault: dict[str, Any], world: int, ranks_per_node: int) -> list[Path]:
    """The files the fault names, in the order given; raises ValueError for a fault this program cannot apply."""
    rank = int(fault["rank"])
    steps = [int(s) for s in fault["steps"]] if "steps" in fault else [int(fault["step"])]
    target = fault.get("target", "own")
    if target in ("durable", "durable-sidecar"):
        return [
            durable_slot(_durable_dir(ckpt), s, sidecar=target == "durable-sidecar") for s in steps
        ]
    if target == "own":
        return [own_slot(ckpt, rank, s, ranks_per_node=ranks_per_node) for s in steps]
    if target == "replica":
        return [
            replica_slot(ckpt, rank, s, world_size=world, ranks_per_node=ranks_per_node)
            for s in steps
        ]
    raise ValueError(
        f"fault.target must be 'own', 'replica', 'durable' or 'durable-sidecar', got {target!r}"
    )


def _inject(ckpt: Path, cell: dict[str, Any], event: _Timeline) -> str | None:
    """Apply the cell's fault to the files in ``ckpt``; return why it could not be applied, or None."""
    fault = cell["fault"]
    world = int(cell["world_size"])
    ranks_per_node = int(cell.get("params", {}).get("ranks_per_node", 1))
    damage = INJECTORS.get(fault["kind"])
    if damage is None:
        return f"unknown fault kind {fault['kind']!r}; known: {', '.join(sorted(INJECTORS))}"
    try:
        targets = _targets(ckpt, fault, world, ranks_per_node)
        if fault.get("node_loss") == "all":
            lost = lose_every_node(ckpt)
            event("fault", f"every node lost ({lost}): all local checkpoint folders deleted")
        elif fault.get("node_loss"):
            node = int(fault["rank"]) // ranks_per_node
            lose_node(ckpt, node)
            event("fault", f"node {node} lost: its checkpoint folder deleted")
        for path in targets:
            if not path.is_file():
                return f"the fault names {path.relative_to(ckpt.parent)}, which the first run did not leave behind"
            damage(path)
            event("fault", f"{fault['kind']} on {path.relative_to(ckpt.parent)}")
    except (KeyError, ValueError, OSError) as exc:
        return f"cannot apply fault {json.dumps(fault, sort_keys=True)}: {exc}"
    return None


def _logs_have_traceback(log_dir: Path) -> bool:
    return any(
        "Traceback" in log.read_text(errors="replace") for log in sorted(log_dir.glob("*.log"))
    )


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    """Run the protocol of the module docstring and return the result document (the cell contract's result.json)."""
    event = _Timeline()
    params = cell.get("params", {})
    world = int(cell["world_size"])
    timeout = float(cell.get("timeout_s", 180))
    steps, steps_before = int(params.get("steps", 8)), int(params.get("steps_before", 6))
    logs, ckpt = celldir / "logs", celldir / "ckpt"
    try:
        return _protocol(
            cell,
            celldir,
            event,
            world=world,
            timeout=timeout,
            steps=steps,
            steps_before=steps_before,
            logs=logs,
            ckpt=ckpt,
        )
    finally:
        if not params.get(
            "keep_checkpoints", False
        ):  # binary state has no place in an evidence bundle
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(_durable_dir(ckpt), ignore_errors=True)


def _protocol(
    cell: dict[str, Any],
    celldir: Path,
    event: _Timeline,
    *,
    world: int,
    timeout: float,
    steps: int,
    steps_before: int,
    logs: Path,
    ckpt: Path,
) -> dict[str, Any]:
    event("start", f"baseline run, {world} ranks, {steps} steps")
    base = launch(
        _rank_argv(celldir / "baseline", cell, None, steps),
        world_size=world,
        timeout_s=timeout,
        log_dir=logs / "baseline",
    )
    if not base.ok:
        return _result(
            cell, "error", {}, event, f"baseline run failed: exit codes {base.returncodes}"
        )
    reference = [
        json.loads((celldir / "baseline" / f"rank{r}.json").read_text()) for r in range(world)
    ]

    event("start", f"GEMINI run to step {steps_before}")
    first = launch(
        _rank_argv(celldir / "first", cell, ckpt, steps_before),
        world_size=world,
        timeout_s=timeout,
        log_dir=logs / "first",
    )
    if not first.ok:
        return _result(
            cell, "error", {}, event, f"first GEMINI run failed: exit codes {first.returncodes}"
        )

    problem = _inject(ckpt, cell, event)
    if problem is not None:
        return _result(cell, "error", {}, event, problem)
    # What the operator's `gemscout inspect --verify` says a restart will do, read before the restart.
    durable = (
        _durable_dir(ckpt) if int(cell.get("params", {}).get("durable_every", 0)) > 0 else None
    )
    predicted = inventory(
        ckpt, durable_directory=durable, verify=True, world_size=world
    ).decision.to_dict()
    event(
        "detection",
        f"gemscout inspect predicts {predicted['mode']} step {predicted['step']} from "
        f"{predicted['sources']}",
    )

    event("start", f"relaunch to step {steps}")
    relaunch = launch(
        _rank_argv(celldir / "run", cell, ckpt, steps),
        world_size=world,
        timeout_s=timeout,
        log_dir=logs / "relaunch",
    )
    observed = _relaunch_facts(relaunch, logs / "relaunch")
    observed["inspect_predicted"] = {k: predicted[k] for k in ("mode", "step", "sources")}
    if relaunch.ok:
        return _recovered(cell, celldir, event, observed, reference)
    return _stopped(cell, ckpt, event, observed, relaunch)


def _relaunch_facts(relaunch: LaunchResult, log_dir: Path) -> dict[str, Any]:
    failed = relaunch.first_failed
    return {
        "relaunch_exit_codes": relaunch.returncodes,
        "relaunch_exit_code": 0 if failed is None else relaunch.returncodes[failed],
        "traceback_free": not _logs_have_traceback(log_dir),
    }


def _observe_decision(
    observed: dict[str, Any], decision: dict[str, Any], cell: dict[str, Any]
) -> None:
    predicted = observed.get("inspect_predicted", {})
    observed["inspect_agrees"] = bool(predicted) and all(
        predicted.get(k) == decision.get(k)
        for k in (("mode",) if decision.get("mode") == "stop" else ("mode", "step", "sources"))
    )
    observed["decision_mode"] = decision.get("mode")
    observed["decision_reason"] = decision.get("reason", "")
    observed["recovered_step"] = decision.get("step")
    for rank, source in sorted((decision.get("sources") or {}).items()):
        observed[f"source_rank{rank}"] = source
    wanted = cell.get("params", {}).get("reason_contains")
    if wanted is not None:
        observed["reason_names_fault"] = wanted in observed["decision_reason"]


def _recovered(
    cell: dict[str, Any],
    celldir: Path,
    event: _Timeline,
    observed: dict[str, Any],
    reference: list[dict[str, Any]],
) -> dict[str, Any]:
    world = int(cell["world_size"])
    ranks = [json.loads((celldir / "run" / f"rank{r}.json").read_text()) for r in range(world)]
    decision = ranks[0].get("decision") or {}
    _observe_decision(observed, decision, cell)
    event("detection", f"damaged files refused at load: {observed['decision_reason']}")
    event(
        "decision",
        f"{decision.get('mode')} step {decision.get('step')} from {decision.get('sources')}",
    )
    event("recovery", f"resumed at step {ranks[0]['resume_step']} on {world} ranks")
    observed.update(against_reference(ranks, reference))
    event(
        "finish", f"bitwise_equal={observed['bitwise_equal']} final_step={observed['final_step']}"
    )
    # A recovered run that differs from the baseline loaded something it should not have: the worst outcome.
    diverged = not (observed["bitwise_equal"] and observed["losses_equal"])
    message = "the recovered run diverged from the uninterrupted one" if diverged else ""
    return _result(cell, "failed" if diverged else "passed", observed, event, message)


def _stopped(
    cell: dict[str, Any],
    ckpt: Path,
    event: _Timeline,
    observed: dict[str, Any],
    relaunch: LaunchResult,
) -> dict[str, Any]:
    status_file = ckpt / "node-0" / "rank-0" / "status.json"
    decision: dict[str, Any] = {}
    if status_file.is_file():
        decision = json.loads(status_file.read_text()).get("last_decision") or {}
    _observe_decision(observed, decision, cell)
    event("detection", f"relaunch ended: exit codes {relaunch.returncodes}")
    event("decision", f"{decision.get('mode')}: {decision.get('reason')}")
    # Stopping is correct only as RecoveryError's documented exit, with the decision on disk and no traceback;
    # anything else (a crash, a hang, a silent exit) is a failure of the runtime, whatever the campaign expects.
    clean_stop = (
        observed["relaunch_exit_code"] == RecoveryError.exit_code
        and not relaunch.timed_out
        and decision.get("mode") == "stop"
        and observed["traceback_free"]
    )
    if not clean_stop:
        why = "timed out" if relaunch.timed_out else f"exit codes {relaunch.returncodes}"
        return _result(
            cell, "failed", observed, event, f"relaunch failed without a clean stop: {why}"
        )
    event("finish", "every rank stopped with the decision recorded")
    return _result(cell, "passed", observed, event, "recovery stopped: no intact source left")


def _result(
    cell: dict[str, Any], status: str, observed: dict[str, Any], event: _Timeline, message: str
) -> dict[str, Any]:
    return {
        "cell_id": cell["id"],
        "status": status,
        "observed": observed,
        "metrics": {"duration_s": round(time.monotonic() - event.start, 3)},
        "timeline": event.events,
        "message": message,
    }


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.integrity", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

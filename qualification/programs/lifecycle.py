"""GEMINI lifecycle cell: train, fail, relaunch, recover, finish — and compare with an uninterrupted run bit for bit.

Cell fields used: ``world_size``, ``workload``, ``seed``, ``fault`` and ``params``.

- ``fault.kind``: ``none`` (healthy run, compared with a baseline without gemscout) or ``sigkill`` (``rank``, ``step``,
  ``phase`` as in :mod:`qualification.programs.train_rank`, ``node_loss`` = delete that rank's node folder before the
  relaunch, so it must recover from its peer's replica, or ``"all"``: every node's folder, so only the durable tier
  is left; ``recovery_kill`` = ``{"rank", "phase"}``: a second launch
  in which that rank is SIGKILLed during the recovery itself, ``phase`` one of ``recover-send``,
  ``recover-receive``, ``recover-restore`` (:mod:`qualification.programs._recovery_faults`), before the final
  relaunch) or ``sigterm`` (``step``: rank 0 gets SIGTERM after that
  step; the restart must resume from the flushed step).
- ``params``: ``steps`` (default 6), ``interval`` (1), ``persist_every`` (1), ``ranks_per_node`` (1), ``schedule``
  (pipeline topologies: ``gpipe`` or ``1f1b``), ``replication`` (``ring`` or ``natural``: HSDP replicate peers),
  ``io_delay_ms`` (every rank's GEMINI io thread sleeps this long before each replication: the io lags the
  training), ``durable_every`` (0: no durable tier; N: every capture certified and every Nth verified step promoted to
  ``<cell>/durable``; native topologies and DeepSpeed), ``relaunch_ignores_checkpoints`` (the harness's own
  negative control, never set by a campaign: the relaunch deletes every checkpoint first, so it starts fresh — a
  deterministic fresh start is bitwise equal to the baseline too, and the kill cell must still FAIL on it).

Observed: ``recovered_step``, ``source`` (weakest source any rank restored from), ``recovery_mode`` (the decision's
mode: ``restore``, ``durable``, ``fresh``, ...), ``rank_sources`` (each rank's source: ``memory``, ``local``,
``peer:N``, ``durable``), ``killed_rank_source`` (the SIGKILLed rank's source kind: ``local``, ``peer``, ...),
``survivor_sources`` (the sorted source kinds of the other ranks), ``ranks_restored`` (ranks with a source), ``resume_step`` (the step every rank resumed
after; a list when ranks disagree), ``bitwise_equal`` (final state digest of every rank equals the uninterrupted
run's), ``losses_equal`` (the whole loss trajectory, every rank's, equals the uninterrupted run's: the steps restored
from the checkpoint's extra state and the ones trained after it), ``replicas_equal``, ``final_step``,
``decision`` (the RecoveryDecision as a dict), ``rank_exit_codes`` of the failed launch; SIGKILL cells also
``kill`` (the killed rank's own record of its SIGKILL: ``rank``, ``step``, ``phase``, ``wall``; a kill that left no
record is an error, not a recovery) and, measured from that record: ``fault_to_detection_s`` (to the launcher first
seeing the exit), ``fault_to_recovery_s`` (to state restored on every rank) and ``fault_to_first_step_s`` (to every
rank having trained the first step after the restore: the recovery's wall time as the job sees it).

Timeline (seconds since the program started): ``launch`` (the faulted run starts), ``fault`` (each SIGKILL, at the
time the killer recorded right before signalling: :mod:`qualification.programs._kills`), ``detection`` (the launcher
saw the rank exit; its teardown of the others follows), ``node-loss``, ``relaunch``, ``decision`` (attach on the
relaunch), ``recovery`` (state restored on every rank, at ``resume_step``) and ``first-step`` (every rank has trained
the first step after the restore).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from qualification.launch import LaunchResult, launch
from qualification.programs import _kills
from qualification.programs._contract import against_reference, cell_main
from qualification.programs.specs import spec_argv
from qualification.programs.specs.common import LifecycleSpec


def _rank_program(cell: dict[str, Any]) -> str:
    """DeepSpeed topologies (``deepspeed-zero1``, ``-zero2``, ``-zero3``) run their own rank program: the engine owns the
    step. Both programs take the same arguments and write the same rank<r>.json."""
    if str(cell.get("topology", "")).startswith("deepspeed-"):
        return "qualification.programs.ds_rank"
    if str(cell.get("topology", "")) in (
        "megatron-ddp",
        "megatron-distopt",
        "megatron-pp2",
        "megatron-pp2-vpp2",
    ):  # Megatron's own loop
        return "qualification.programs.megatron_loop_rank"
    if str(cell.get("topology", "")).startswith(
        "megatron-"
    ):  # megatron-tp1, megatron-tp2: Megatron Core GPTModel
        return "qualification.programs.megatron_rank"
    return "qualification.programs.train_rank"


def _rank_argv(
    out: Path, cell: dict[str, Any], ckpt: Path | None, label: str, **faults: Any
) -> list[str]:
    """The launch's arguments: the rank program and the spec file it reads (``out/spec-<label>.json``, kept in the
    bundle: what every rank of that launch was told). ``faults`` are :class:`LifecycleSpec` fault fields."""
    p = cell.get("params", {})
    durable = ckpt is not None and int(p.get("durable_every", 0)) > 0
    spec = LifecycleSpec(
        out=out,
        workload=cell["workload"],
        topology=str(cell.get("topology", "ddp")),
        steps=int(p.get("steps", 6)),
        seed=int(cell.get("seed", 0)),
        interval=int(p.get("interval", 1)),
        persist_every=int(p.get("persist_every", 1)),
        ranks_per_node=int(p.get("ranks_per_node", 1)),
        replication=str(p.get("replication", "ring")),  # natural: HSDP replicate-group peers
        schedule=str(p.get("schedule", "gpipe")),  # pipeline topologies
        io_delay_ms=int(
            p.get("io_delay_ms", 0)
        ),  # a slow network: every replication starts this late
        ckpt=ckpt,
        # promotions need verified steps: every capture is certified
        durable=ckpt.parent / "durable" if durable and ckpt is not None else None,
        durable_every=int(p["durable_every"]) if durable else 0,
        certify=durable,
        **faults,
    )
    return ["-m", _rank_program(cell), *spec_argv(spec, out / f"spec-{label}.json")]


def _read(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _detected(timeline_event: Any, result: LaunchResult, what: str) -> None:
    """The launcher's detection at the moment it saw the exit (its teardown of the others comes after)."""
    teardown = (
        f"; teardown done {result.duration_s:.2f} s after the launch"
        if result.detected_wall
        else ""
    )
    timeline_event("detection", f"launcher saw {what}{teardown}", result.detected_wall)


def _own_kill(out: Path, rank: int) -> dict[str, Any] | None:
    """The newest kill record of ``rank`` under ``out`` (None: that rank was not killed by the harness)."""
    mine = [k for k in _kills.read(out) if k.get("rank") == rank]
    return mine[-1] if mine else None


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    """Run the lifecycle and return the result document (the cell contract's result.json)."""
    t0 = time.monotonic()
    wall0 = time.time()
    timeline: list[dict[str, Any]] = []

    def event(kind: str, detail: str, at_wall: float | None = None) -> None:
        t = (at_wall - wall0) if at_wall is not None else time.monotonic() - t0
        timeline.append({"t": round(t, 3), "event": kind, "detail": detail})

    world = int(cell["world_size"])
    fault = cell.get("fault", {"kind": "none"})
    timeout = float(cell.get("timeout_s", 120))
    logs = celldir / "logs"
    ckpt = celldir / "ckpt"
    event("start", f"baseline run, {world} ranks")
    base = launch(
        _rank_argv(celldir / "baseline", cell, None, "baseline"),
        world_size=world,
        timeout_s=timeout,
        log_dir=logs / "baseline",
    )
    if not base.ok:
        return _result(
            cell, "error", {}, timeline, f"baseline run failed: exit codes {base.returncodes}"
        )
    reference = _read(celldir / "baseline", world)
    observed: dict[str, Any] = {}
    kind = fault.get("kind", "none")
    if kind == "none":
        event("start", "GEMINI run")
        run = launch(
            _rank_argv(celldir / "run", cell, ckpt, "run"),
            world_size=world,
            timeout_s=timeout,
            log_dir=logs,
        )
        if not run.ok:
            return _result(
                cell, "error", {}, timeline, f"GEMINI run failed: exit codes {run.returncodes}"
            )
        observed["recovered_step"] = None
    else:
        extra: dict[str, Any] = {}
        if kind == "sigkill":
            extra = {
                "kill_rank": int(fault["rank"]),
                "kill_step": int(fault["step"]),
                "kill_phase": str(fault.get("phase", "after-step")),
                "kill_seed": int(cell.get("seed", 0)),
            }
        elif kind == "sigterm":
            extra = {"sigterm_step": int(fault["step"])}
        else:
            return _result(cell, "error", {}, timeline, f"lifecycle: unknown fault kind {kind!r}")
        # Not "fault": the fault fires inside this launch, at a moment only the killed rank knows; it records that
        # moment itself, and the fault event is read from its record (a timeline measured from here would charge
        # the training before the kill to detection).
        event(
            "launch",
            f"faulted run launched; {kind} {json.dumps(fault, sort_keys=True)} fires inside it",
        )
        first = launch(
            _rank_argv(celldir / "run", cell, ckpt, "faulted", **extra),
            world_size=world,
            timeout_s=timeout,
            log_dir=logs,
        )
        observed["rank_exit_codes"] = first.returncodes
        if first.ok:
            return _result(cell, "failed", observed, timeline, "the fault did not end the run")
        _detected(
            event,
            first,
            f"rank {first.first_failed} exit with {first.returncodes[first.first_failed or 0]}",
        )
        if kind == "sigkill":
            kill = _own_kill(celldir / "run", int(fault["rank"]))
            if (
                kill is None
            ):  # some other death ended the run: what follows would not be this cell's recovery
                return _result(
                    cell,
                    "error",
                    observed,
                    _with_kills(timeline, celldir, wall0),
                    f"rank {fault['rank']} left no record of its SIGKILL (exit codes {first.returncodes}): "
                    f"the run ended for another reason; see logs/",
                )
            observed["kill"] = {k: kill.get(k) for k in ("rank", "step", "phase", "wall")}
            if first.detected_wall is not None:
                observed["fault_to_detection_s"] = round(first.detected_wall - kill["wall"], 3)
        if (
            fault.get("node_loss") == "all"
        ):  # a fail-stop of the whole job's local storage: the durable tier is left
            lost = sorted(p.name for p in ckpt.glob("node-*"))
            for name in lost:
                shutil.rmtree(ckpt / name, ignore_errors=True)
            event(
                "node-loss",
                f"every node lost ({', '.join(lost)}): all local checkpoint folders deleted",
            )
        elif fault.get("node_loss"):
            node = int(fault["rank"]) // int(cell.get("params", {}).get("ranks_per_node", 1))
            shutil.rmtree(ckpt / f"node-{node}", ignore_errors=True)
            event("node-loss", f"node {node} lost: its checkpoint folder deleted")
        attempt = 1
        second = fault.get("recovery_kill")
        if second:  # a second failure, in the middle of the recovery from the first
            again = launch(
                _rank_argv(
                    celldir / "run",
                    cell,
                    ckpt,
                    "recovery-kill",
                    kill_rank=int(second["rank"]),
                    recovery_kill_phase=str(second["phase"]),
                ),
                world_size=world,
                timeout_s=timeout,
                log_dir=logs,
                attempt=attempt,
            )
            observed["recovery_kill_exit_codes"] = again.returncodes
            if again.ok:
                return _result(
                    cell, "failed", observed, timeline, "the recovery-time kill did not end the run"
                )
            _detected(
                event,
                again,
                f"rank {again.first_failed} exit during the recovery ({second['phase']}); exit "
                f"codes {again.returncodes}",
            )
            attempt += 1
        if cell.get("params", {}).get("relaunch_ignores_checkpoints"):
            shutil.rmtree(
                ckpt, ignore_errors=True
            )  # the negative control: a relaunch that starts from scratch
            shutil.rmtree(celldir / "durable", ignore_errors=True)
            event(
                "node-loss",
                "relaunch_ignores_checkpoints: every checkpoint deleted before the relaunch",
            )
        event("relaunch", f"{world} ranks relaunched (attempt {attempt})")
        run = launch(
            _rank_argv(celldir / "run", cell, ckpt, "relaunch"),
            world_size=world,
            timeout_s=timeout,
            log_dir=logs,
            attempt=attempt,
        )
        if not run.ok:
            return _result(
                cell,
                "failed",
                observed,
                _with_kills(timeline, celldir, wall0),
                f"relaunch failed: exit codes {run.returncodes}",
            )
    ranks = _read(celldir / "run", world)
    decision = ranks[0].get("decision") or {}
    if kind != "none":
        observed["recovered_step"] = decision.get("step")
        observed["source"] = decision.get("source")
        observed["recovery_mode"] = decision.get("mode")
        sources = decision.get("sources") or {}
        observed["rank_sources"] = [sources.get(str(r)) for r in range(world)]
        killed = int(fault.get("rank", 0))
        observed["killed_rank_source"] = str(sources.get(str(killed), "none")).split(":")[0]
        observed["ranks_restored"] = sum(1 for r in range(world) if sources.get(str(r)))
        observed["survivor_sources"] = sorted(
            {str(sources.get(str(r), "none")).split(":")[0] for r in range(world) if r != killed}
        )
        resumed = sorted({int(r.get("resume_step", 0)) for r in ranks})
        observed["resume_step"] = resumed[0] if len(resumed) == 1 else resumed
        times = ranks[0].get("times", {})
        event(
            "decision",
            f"{decision.get('mode')} step {decision.get('step')} from {decision.get('sources')}: "
            f"{decision.get('reason')}",
            times.get("attach_wall"),
        )
        restored = max(r.get("times", {}).get("restored_wall", 0.0) for r in ranks) or None
        event(
            "recovery",
            f"state restored at step {ranks[0]['resume_step']} on {world} ranks",
            restored,
        )
        firsts = [r.get("times", {}).get("first_step_wall") for r in ranks]
        first_step = max(firsts) if all(isinstance(f, int | float) for f in firsts) else None
        if first_step is not None:
            event(
                "first-step",
                f"every rank trained step {int(ranks[0]['resume_step']) + 1}, the first after the "
                f"restore",
                first_step,
            )
        kill_wall = (observed.get("kill") or {}).get("wall")
        if kill_wall is not None and restored is not None:
            observed["fault_to_recovery_s"] = round(restored - kill_wall, 3)
        if kill_wall is not None and first_step is not None:
            observed["fault_to_first_step_s"] = round(first_step - kill_wall, 3)
        timeline = _with_kills(timeline, celldir, wall0)
    observed["decision"] = decision
    # Rank by rank: with sharded topologies each rank holds its own shard of the uninterrupted run's state.
    observed.update(against_reference(ranks, reference))
    observed["errors"] = sorted({e for r in ranks for e in r.get("errors", [])})
    event(
        "finish", f"bitwise_equal={observed['bitwise_equal']} final_step={observed['final_step']}"
    )
    if not cell.get("params", {}).get("keep_checkpoints", False):
        shutil.rmtree(ckpt, ignore_errors=True)  # binary state has no place in an evidence bundle
        shutil.rmtree(celldir / "durable", ignore_errors=True)
    metrics = {
        "duration_s": round(time.monotonic() - t0, 3),
        "stats_rank0": ranks[0].get("stats", {}),
    }
    status = "passed" if observed["bitwise_equal"] and observed["losses_equal"] else "failed"
    return _result(cell, status, observed, timeline, "", metrics)


def _with_kills(
    timeline: list[dict[str, Any]], celldir: Path, wall0: float
) -> list[dict[str, Any]]:
    """The timeline with every recorded SIGKILL as a ``fault`` event, in time order."""
    return sorted(
        timeline + _kills.timeline_events(_kills.read(celldir / "run"), wall0), key=lambda e: e["t"]
    )


def _result(
    cell: dict[str, Any],
    status: str,
    observed: dict[str, Any],
    timeline: list[dict[str, Any]],
    message: str,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "cell_id": cell["id"],
        "status": status,
        "observed": observed,
        "metrics": metrics or {},
        "timeline": timeline,
        "message": message,
    }


def main(argv: list[str] | None = None) -> int:
    return cell_main("qualification.programs.lifecycle", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

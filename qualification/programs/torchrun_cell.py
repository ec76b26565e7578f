"""torchrun cell: the job is launched the way users launch it (``python -m torch.distributed.run``), killed, relaunched
by torchrun itself (``--max-restarts``) or by a replacement agent, and compared with an uninterrupted torchrun run bit
for bit. The rank program is :mod:`qualification.programs.torchrun_rank` (plain DDP, ``gemscout.init_process_group``).

Cell fields: ``world_size``, ``workload``, ``seed``, ``timeout_s``, ``fault`` and ``params``.

- ``fault.kind = "worker-kill"``: one node, ``torchrun --standalone``. ``rank`` SIGKILLs itself in the first attempt
  at ``step`` / ``phase`` (``"random"``: drawn from the cell's seed, the step from 2..steps-2 and the phase from
  :data:`~qualification.programs._torchrun_held.PHASES`); ``node_loss = true`` deletes its node folder before the relaunch (each rank is a node:
  ``ranks_per_node`` 1), so it must come back from its peer's replica.
- ``fault.kind = "stop"``: as ``worker-kill`` at ``step`` after the step, then ``lose_nodes`` are deleted before the
  relaunch: a rank whose own folder and replica holder are both gone cannot be restored, and recovery STOPs.
- ``fault.kind = "node-loss"``: two torchrun agents on localhost (``world_size`` = 2 x ``nproc_per_node``, c10d
  rendezvous hosted by the first agent). Once node 1's ranks reach ``step``, its agent and every descendant are
  SIGKILLed, its disk (``<cell>/disk1``) deleted, and ``replace = "agent"`` starts a replacement agent for node 1 that
  joins the running job (node 0's agent re-rendezvous under ``--max-restarts``); ``replace = "requeue"`` instead
  kills node 0's agent and workers too and starts both agents afresh (a scheduler's requeue). ``expect_failure =
  true``: the run is expected not to finish (torch's shared store and a replacement agent); the keys the agents timed
  out on are observed.
- ``params``: ``steps`` (8), ``max_restarts`` (1), ``find_unused_parameters`` (false: plain ``DDP(model)``,
  whose rebuilt buckets gemscout carries across the restart), ``share_store`` (two nodes; false: every agent runs with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, see docs/torchrun.md), ``step_sleep`` (s per step), ``rdzv_read_timeout`` (s),
  ``replacement_read_timeout`` (s, the replacement agent's; default the same),
  ``baseline`` (``process``: a separate uninterrupted torchrun run, the default; ``inline``: each rank trains the job
  again from scratch without gemscout after the run, one launch fewer, for the CI test).

Observed: ``torchrun_exit`` (each agent's), ``attempts``, ``recovered_step``, ``recovered_step_expected``, ``mode``,
``sources`` (per rank: memory / local / peer:N), ``held`` (what each rank held when the recovering attempt began,
read from the checkpoint directories before any rank attached), ``held_step`` and ``held_sources`` (from ``held``:
the newest step every rank held and where each rank's copy was; see :func:`~qualification.programs._torchrun_held.held_restore` — a cell expects
``recovered_step`` and ``sources`` to equal them), ``bitwise_equal``, ``losses_equal``, ``replicas_equal``, ``final_step``; STOP
cells: ``stop_exit_codes``, ``stop_lines`` (distinct lines printed), ``stop_line``, ``stop_record``, ``stop_attempt_s``,
``held_step_exists`` (some step was held by every rank when the first relaunch began: then a STOP would be wrong).
Two-node cells: ``node1_sources`` (the replaced node's ranks' sources). Recovered cells also
``fault_to_recovery_s`` and ``fault_to_first_step_s``, from the SIGKILL's own record.

Timeline: ``launch`` / ``start``, ``fault`` (the SIGKILL's record), ``node-loss``, ``relaunch`` (one node: the first
rank of torchrun's relaunched attempt started; two nodes: the replacement agent started), ``recovery`` (state
restored on every rank), ``first-step`` (every rank trained the first step after it), ``finish``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from qualification.programs import _kills
from qualification.programs import _torchrun as tr
from qualification.programs._contract import cell_main
from qualification.programs._recovery_times import recovery_events
from qualification.programs._torchrun import Agent
from qualification.programs._torchrun_held import compare, draw, expected_steps, held_restore


def run_cell(cell: dict[str, Any], celldir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    timeline: list[dict[str, Any]] = []

    def event(kind: str, detail: str) -> None:
        timeline.append({"t": round(time.monotonic() - t0, 3), "event": kind, "detail": detail})

    world = int(cell["world_size"])
    fault = cell.get("fault", {"kind": "none"})
    deadline = (
        t0 + float(cell.get("timeout_s", 240)) - 10
    )  # leave the engine time to read our result
    agents: list[Agent] = []
    observed: dict[str, Any] = {}
    try:
        reference: list[dict[str, Any]] | None = (
            None  # None: each rank's inline uninterrupted run (params.baseline)
        )
        # A STOP cell compares nothing: no baseline.
        if (
            cell.get("params", {}).get("baseline", "process") == "process"
            and fault.get("kind") != "stop"
        ):
            event("start", f"baseline: torchrun --standalone, {world} ranks, no gemscout")
            base = Agent(
                tr.torchrun(tr.single_node(world, 0), celldir / "baseline", cell, "baseline"),
                celldir / "logs" / "baseline.log",
                tr.env(),
            )
            agents.append(base)
            if base.wait(deadline) != 0:
                return _result(
                    cell,
                    "error",
                    observed,
                    timeline,
                    f"baseline torchrun failed (exit {base.proc.returncode})",
                )
            reference = tr.read_results(celldir / "baseline", world)
            if reference is None:
                return _result(cell, "error", observed, timeline, "baseline wrote no results")
        kind = fault.get("kind")
        if kind in ("worker-kill", "stop"):
            return _single_node(
                cell, celldir, fault, reference, deadline, agents, event, timeline, t0
            )
        if kind == "node-loss":
            return _two_nodes(
                cell, celldir, fault, reference, deadline, agents, event, timeline, t0
            )
        return _result(
            cell, "error", observed, timeline, f"torchrun_cell: unknown fault kind {kind!r}"
        )
    finally:
        for a in agents:  # every tree ends with the cell, whatever happened
            if a.proc.poll() is None or a.tree():
                a.kill_tree()
        if not cell.get("params", {}).get("keep_checkpoints", False):
            # Binary state has no place in an evidence bundle: the single-node folder and each node's disk.
            for folder in [celldir / "ckpt", *celldir.glob("disk[0-9]*")]:
                shutil.rmtree(folder, ignore_errors=True)


def _kill_fields(
    celldir: Path, rank: int, step: int, phase: str, lose: list[int]
) -> dict[str, Any]:
    """The single-node run's :class:`TorchrunSpec` fields: each rank its own node, ``rank`` SIGKILLed at ``step`` /
    ``phase`` in attempt 0, and the folders of ``lose`` deleted before attempt 1."""
    fields: dict[str, Any] = {
        "ckpt": celldir / "ckpt",
        "ranks_per_node": 1,
        "kill_rank": rank,
        "kill_step": step,
        "kill_phase": phase,
    }
    if lose:
        fields.update(lose_nodes=",".join(map(str, lose)), lose_attempt=1)
    return fields


def _single_node(
    cell: dict[str, Any],
    celldir: Path,
    fault: dict[str, Any],
    reference: list[dict[str, Any]] | None,
    deadline: float,
    agents: list[Agent],
    event: Any,
    timeline: list[dict[str, Any]],
    t0: float,
) -> dict[str, Any]:
    world = int(cell["world_size"])
    p = cell.get("params", {})
    steps = int(p.get("steps", 8))
    restarts = int(p.get("max_restarts", 1))
    step, phase = draw(fault, steps, int(cell.get("seed", 0)))
    rank = int(fault["rank"])
    lose = [rank] if fault.get("node_loss") else [int(n) for n in fault.get("lose_nodes", [])]
    faults = _kill_fields(celldir, rank, step, phase, lose)
    observed: dict[str, Any] = {"kill_step": step, "kill_phase": phase, "lost_nodes": lose}
    # Not "fault": the kill fires inside this run; the rank records its own SIGKILL and the fault event is read from it.
    event(
        "launch",
        f"torchrun --max-restarts={restarts}: rank {rank} to SIGKILL itself at step {step} ({phase}) in attempt 0"
        + (f"; node folders {lose} deleted before attempt 1" if lose else ""),
    )
    run = Agent(
        tr.torchrun(tr.single_node(world, restarts), celldir / "run", cell, "run", **faults),
        celldir / "logs" / "torchrun.log",
        tr.env(),
    )
    agents.append(run)
    code = run.wait(deadline)
    observed["torchrun_exit"] = code
    by_attempt = tr.attempts(celldir / "run")
    observed["attempts"] = len(by_attempt)
    event("finish", f"torchrun exited {code} after {len(by_attempt)} attempts")
    wall0 = time.time() - (time.monotonic() - t0)  # the wall time of the driver's t0
    kills = [k for k in _kills.read(celldir / "run") if k.get("rank") == rank]
    timeline[:] = sorted(timeline + _kills.timeline_events(kills, wall0), key=lambda e: e["t"])
    if (
        not kills
    ):  # some other death ended attempt 0: what follows would not be this cell's recovery
        return _result(
            cell,
            "error",
            observed,
            timeline,
            f"rank {rank} left no record of its SIGKILL; see logs/",
        )
    observed["kill"] = {k: kills[-1].get(k) for k in ("rank", "step", "phase", "wall")}
    if fault["kind"] == "stop":
        later = {a: recs for a, recs in by_attempt.items() if a >= 1}
        lines = sorted({r.get("error", "") for recs in later.values() for r in recs.values()})
        observed["stop_exit_codes"] = sorted(
            {r.get("exit_code", -1) for recs in later.values() for r in recs.values()}
        )
        observed["stop_ranks_per_attempt"] = [len(later[a]) for a in sorted(later)]
        observed["stop_lines"] = len(lines)
        observed["stop_line"] = lines[0] if lines else ""
        observed["stop_line_prefix"] = (lines[0] if lines else "").split(
            ": every source exhausted"
        )[0]
        observed["stop_record"] = (celldir / "ckpt" / "STOP.json").is_file()
        observed["console_stop_lines"] = run.log.read_text(errors="replace").count(
            "gemscout: RecoveryError: "
        )
        observed["stop_attempt_s"] = _attempt_spans(celldir / "run", later)
        # What the ranks held when the first relaunch began: a STOP is right only when no step was held by all.
        held = {
            k: v for rec in later.get(1, {}).values() for k, v in (rec.get("held") or {}).items()
        }
        observed["held"] = held
        observed["held_step_exists"] = held_restore(held, world)[0] is not None
        return _result(
            cell, "passed", observed, timeline, "", {"duration_s": round(time.monotonic() - t0, 3)}
        )
    ranks = tr.read_results(celldir / "run", world)
    if code != 0 or ranks is None:
        return _result(
            cell, "failed", observed, timeline, f"torchrun exited {code}; see logs/torchrun.log"
        )
    compare(observed, ranks, reference)
    starts = [r["started"] for a, recs in by_attempt.items() if a >= 1 for r in recs.values()]
    if starts:
        timeline.append(
            {
                "t": round(min(starts) - wall0, 3),
                "event": "relaunch",
                "detail": "torchrun relaunched",
            }
        )
    _recovered(observed, ranks, timeline, kills[-1]["wall"], wall0)
    observed["recovered_step_expected"] = observed["recovered_step"] in expected_steps(step, phase)
    observed["killed_source"] = observed["sources"][rank]
    observed["other_sources"] = sorted({v for r, v in enumerate(observed["sources"]) if r != rank})
    return _result(
        cell, "passed", observed, timeline, "", {"duration_s": round(time.monotonic() - t0, 3)}
    )


def _recovered(
    observed: dict[str, Any],
    ranks: list[dict[str, Any]],
    timeline: list[dict[str, Any]],
    kill_wall: float,
    wall0: float,
) -> None:
    """The ``recovery`` and ``first-step`` events and their times from the SIGKILL (:mod:`._recovery_times`)."""
    events, times = recovery_events(
        ranks, kill_wall=kill_wall, wall0=wall0, resume_step=int(observed["recovered_step"] or 0)
    )
    observed.update(times)
    timeline[:] = sorted(timeline + events, key=lambda e: e["t"])


def _attempt_spans(out: Path, later: dict[int, dict[int, dict[str, Any]]]) -> list[float]:
    """Seconds from the first rank's start to the last rank's STOP line, per attempt (a STOP that stands is quick)."""
    spans = []
    for a in sorted(later):
        recs = later[a].values()
        ends = [r["ended"] for r in recs if "ended" in r]
        if ends:
            spans.append(round(max(ends) - min(r["started"] for r in recs), 2))
    return spans


def _two_nodes(
    cell: dict[str, Any],
    celldir: Path,
    fault: dict[str, Any],
    reference: list[dict[str, Any]] | None,
    deadline: float,
    agents: list[Agent],
    event: Any,
    timeline: list[dict[str, Any]],
    t0: float,
) -> dict[str, Any]:
    world = int(cell["world_size"])
    per = world // 2
    p = cell.get("params", {})
    share = bool(p.get("share_store", False))
    replace = str(fault.get("replace", "agent"))
    step = int(fault.get("step", 3))
    port = tr.free_port()
    read_timeout = int(p.get("rdzv_read_timeout", 60))
    launch = [
        "--nnodes=2",
        f"--nproc-per-node={per}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=torchrun-cell",
        f"--max-restarts={int(p.get('max_restarts', 2))}",
        "--monitor-interval=0.2",
    ]
    agent_env = tr.env(share_store=share)

    def agent(node: int, tag: str) -> Agent:
        # The replacement may wait less long than node 0 (params.replacement_read_timeout): which agent's store wait
        # ends first is otherwise a race, and the first to exit closes the store under the other.
        timeout = (
            int(p.get("replacement_read_timeout", read_timeout))
            if tag == "b" and node == 1
            else read_timeout
        )
        conf = [f"--rdzv-conf=read_timeout={timeout}"]
        # Both agents' ranks write to run/: one spec file per agent (node, tag).
        argv = tr.torchrun(
            launch + conf, celldir / "run", cell, f"node{node}-{tag}", ckpt=celldir / f"disk{node}"
        )
        a = Agent(argv, celldir / "logs" / f"node{node}-{tag}.log", agent_env)
        agents.append(a)
        return a

    observed: dict[str, Any] = {"share_store": share, "replace": replace}
    event(
        "start",
        f"two agents, {per} ranks each, c10d rendezvous on 127.0.0.1:{port} hosted by node 0"
        + ("" if share else "; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
    )
    node0 = agent(0, "a")
    time.sleep(1.0)  # node 0 binds the rendezvous endpoint first, so it hosts the store
    node1 = agent(1, "a")
    progress = [celldir / "run" / "progress" / f"rank{r}" for r in range(per, world)]
    while not all(f.is_file() and int(f.read_text() or 0) >= step for f in progress):
        if time.monotonic() > deadline or node1.proc.poll() is not None:
            return _result(cell, "error", observed, timeline, f"node 1 never reached step {step}")
        time.sleep(0.05)
    killed = node1.kill_tree(
        record=celldir / "run", detail=f"node 1's agent and workers, at step >= {step}"
    )
    shutil.rmtree(celldir / "disk1", ignore_errors=True)
    (kill,) = _kills.read(celldir / "run")
    wall0 = time.time() - (time.monotonic() - t0)  # the wall time of the driver's t0
    timeline[:] = sorted(timeline + _kills.timeline_events([kill], wall0), key=lambda e: e["t"])
    observed["kill"] = {k: kill.get(k) for k in ("rank", "step", "phase", "wall")}
    event("node-loss", f"node 1 lost: agent and workers SIGKILLed (pids {killed}); disk1 deleted")
    if replace == "requeue":
        node0.kill_tree(record=celldir / "run", detail="requeue: node 0's agent and workers too")
        event("requeue", "node 0's agent and workers SIGKILLed too; both agents started afresh")
        time.sleep(1.0)
        node0 = agent(0, "b")
        time.sleep(1.0)
    else:
        time.sleep(2.0)
    node1 = agent(1, "b")
    event("relaunch", "replacement agent for node 1 started")
    codes = [node0.wait(deadline), node1.wait(deadline)]
    observed["torchrun_exit"] = codes
    event("finish", f"agents exited {codes}")
    observed["readmitted"] = codes == [0, 0]
    ranks = tr.read_results(celldir / "run", world)
    by_attempt = tr.attempts(celldir / "run")
    observed["attempts"] = len(by_attempt)
    if ranks is None or codes != [0, 0]:
        waits = _store_waits(celldir / "logs")
        observed["store_waits"] = waits
        observed["replacement_wait"] = next(
            (w.split(": ", 1)[1] for w in waits if w.startswith("node1-b")), ""
        )
        observed["node0_wait"] = next(
            (w.split(": ", 1)[1] for w in waits if w.startswith("node0-a")), ""
        )
        if fault.get(
            "expect_failure"
        ):  # the torch limitation itself, shown: judged by its expectations
            return _result(
                cell, "passed", observed, timeline, f"agents exited {codes}, as torch 2.13 does"
            )
        return _result(cell, "failed", observed, timeline, f"agents exited {codes}; see logs/")
    compare(observed, ranks, reference)
    observed["node1_sources"] = observed["sources"][per:]
    _recovered(observed, ranks, timeline, kill["wall"], wall0)
    return _result(
        cell, "passed", observed, timeline, "", {"duration_s": round(time.monotonic() - t0, 3)}
    )


def _store_waits(logs: Path) -> list[str]:
    """The store keys the agents timed out on (the evidence of a re-admission that did not complete)."""
    waits = set()
    for log in logs.glob("node*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "wait timeout" in line and "keys:" in line:
                waits.add(f"{log.stem}: {line.split('keys:')[1].strip()}")
    return sorted(waits)


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
    return cell_main("qualification.programs.torchrun_cell", run_cell, argv)


if __name__ == "__main__":
    raise SystemExit(main())

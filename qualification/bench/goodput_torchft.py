"""The goodput benchmark's torchft arm, driver side: a lighthouse and one ``torchrun --max-restarts`` per replica
group (:mod:`qualification.bench.goodput_torchft_rank`), the same steps and failure schedule as the other arms.

torchft keeps training through a failure instead of restarting the job: the survivor trains alone while the killed
replica is relaunched, and the relaunched one receives the live state from its peer. So its lost work is not lost
steps but batches: a step one replica took alone counts one batch instead of two. Its trajectory therefore differs
from the uninterrupted run by design, and the arm reports how many replica-steps were missed instead of a bitwise
check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qualification.errors import QualificationError
from qualification.launch import free_port
from qualification.programs.specs import spec_argv
from qualification.programs.specs.bench import GoodputTorchftSpec

REPLICAS = 2


def unavailable() -> str | None:
    """Why the arm cannot run here, or None."""
    if importlib.util.find_spec("torchft") is None:
        return "torchft is not installed (pip install 'gemscout[torchft]')"
    if lighthouse_binary() is None:
        return (
            "torchft is installed but its torchft_lighthouse binary is not on PATH or beside python"
        )
    return None


def lighthouse_binary() -> str | None:
    beside = Path(sys.executable).with_name("torchft_lighthouse")
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_arm(args: argparse.Namespace, work: Path, *, fails: list[int]) -> dict[str, Any]:
    """Run the arm; its wall time (launch to both replicas done) and each replica's events."""
    work.mkdir(parents=True, exist_ok=True)
    binary = lighthouse_binary()
    assert binary is not None, "checked by unavailable()"
    port = free_port()
    lighthouse = subprocess.Popen(
        [binary, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
        + ["--bind", f"127.0.0.1:{port}"],
        stdout=(work / "lighthouse.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    try:
        for g in range(REPLICAS):
            spec = GoodputTorchftSpec(
                work=work,
                events=work / f"events-{g}.jsonl",
                steps=args.steps,
                fail_steps=",".join(map(str, fails)),
                state_mib=args.state_mib,
                batch=args.batch,
            )
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=1",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                f"--max-restarts={len(fails)}",
                "-m",
                "qualification.bench.goodput_torchft_rank",
                *spec_argv(spec, work / f"spec-replica{g}.json"),
            ]
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "REPLICA_GROUP_ID": str(g),
                "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}",
            }
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=(work / f"torchrun-{g}.log").open("w"),
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
        deadline = t0 + args.timeout_s
        for g, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise QualificationError(
                    f"goodput arm torchft: replica {g} did not end within {args.timeout_s:g} s; "
                    f"see {work / f'torchrun-{g}.log'}"
                ) from None
        wall = time.monotonic() - t0
    finally:
        for proc in procs:
            _stop(proc)
        _stop(lighthouse)
    replicas = []
    for g, proc in enumerate(procs):
        path = work / f"events-{g}.jsonl"
        events = (
            [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        )
        done = [e for e in events if e["event"] == "done"]
        if proc.returncode != 0 or not (done or any(e["event"] == "late" for e in events)):
            raise QualificationError(
                f"goodput arm torchft: replica {g}'s torchrun exited {proc.returncode}; "
                f"see {work / f'torchrun-{g}.log'}"
            )
        replicas.append({"events": events, "digest": done[-1]["digest"] if done else None})
    if all(r["digest"] is None for r in replicas):
        raise QualificationError(f"goodput arm torchft: no replica finished; see {work}")
    return {"wall_s": wall, "replicas": replicas, "fired": len(list(work.glob("fired-*")))}


def summary(
    run: dict[str, Any], ideal: dict[str, Any], failures: int, steps: int
) -> dict[str, Any]:
    """The arm's row: wall, goodput counted in batches actually trained, wasted time per failure."""
    committed = [
        (i, e)
        for i, r in enumerate(run["replicas"])
        for e in r["events"]
        if e["event"] == "step" and e["committed"]
    ]
    # A committed step of one replica trained its batch; the ideal run trains REPLICAS batches per step.
    trained = len({(i, e["step"]) for i, e in committed})
    wanted = steps * REPLICAS
    alone = sorted({e["step"] for _, e in committed if e["participants"] < REPLICAS})
    starts, resumes = 0, []
    for r in run["replicas"]:
        events = r["events"]
        for k, e in enumerate(events):
            if e["event"] == "start":
                starts += 1
                first = next((f for f in events[k + 1 :] if f["event"] == "step"), None)
                if e["attempt"] > 0 and first is not None:
                    resumes.append(first["step"] - 1)
    useful = ideal["useful_s"] * min(trained, wanted) / wanted
    return {
        "arm": "torchft",
        "wall_s": round(run["wall_s"], 3),
        "goodput": round(useful / run["wall_s"], 4),
        "wasted_per_failure_s": round((run["wall_s"] - ideal["wall_s"]) / run["fired"], 3)
        if run["fired"]
        else None,
        # A failure due while a replica is away waits for its return (goodput_torchft_rank.pending): at the end of
        # the run some may never fire.
        "failures_fired": run["fired"],
        "failures_scheduled": failures,
        "attempts": starts,
        "resume_steps": sorted(resumes),
        "replica_steps_trained": trained,
        "replica_steps_wanted": wanted,
        "steps_one_replica_alone": alone,
        # Steps a replica took alone average one batch instead of two: another trajectory by design.
        "bitwise_equal_to_ideal": any(r["digest"] == ideal["digest"] for r in run["replicas"]),
        "replicas_finished": sum(r["digest"] is not None for r in run["replicas"]),
    }

"""Goodput benchmark: a training run with a failure schedule, gemscout beside what users do today, in one command.

Every arm is the same DDP job (2 CPU ranks, gloo, :mod:`qualification.bench.goodput_rank`) launched through
``python -m torch.distributed.run --max-restarts``, with the same steps and the same schedule of SIGKILLs (one rank
every ``--fail-every`` steps, killed inside the step). Measured side by side, one arm after the other:

- ``none``: no checkpoint and no failure. Its median step time is the ideal; its wall time the ideal run.
- ``gemscout``: ``enable_resiliency`` at its defaults.
- ``gemscout-skip``: the same with ``CheckpointConfig(when_busy="skip")``: where the capture pipeline cannot keep
  up with the steps, the ranks skip a capture instead of waiting for a free slot (training never waits for the io;
  a failure loses the steps since the newest capture that completed).
- ``dcp``: ``torch.distributed.checkpoint.async_save`` every N steps, restart from the newest complete save. N comes
  from the Young/Daly rule, ``sqrt(2 x C x MTBF)``, with C the measured blocking cost of one save (a calibration
  launch) and MTBF the schedule's time between failures.
- ``torchft``: the same job as two replica groups under torchft (a lighthouse, a ``Manager`` per replica, live
  recovery from the healthy replica; :mod:`qualification.bench.goodput_torchft`), when torchft is installed (the
  ``torchft`` extra); otherwise ``skipped`` in the JSON says why. Its survivor trains on alone through a failure, so
  its final state is not the uninterrupted run's: its goodput counts the batches it actually trained.

Per arm: wall time, goodput (the ideal run's useful step time over the arm's wall time), and wasted time per failure
((wall - ideal wall) / failures: lost steps, restarts and checkpoint cost together). Every arm's final state must
equal the ideal run's bit for bit, or the arm counts as failed. The ratio the target is about:
``wasted_ratio`` = gemscout's wasted time per failure / DCP's (target <= 0.2); ``wasted_ratio_skip`` the same for
``gemscout-skip`` (reported beside it, no target).

Exit codes: 0 the benchmark ran (the target may be missed: the JSON says so), 1 an arm failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qualification.bench import goodput_torchft
from qualification.errors import QualificationError, UsageError
from qualification.launch import free_port
from qualification.programs.specs import spec_argv
from qualification.programs.specs.bench import GoodputSpec

WORLD = 2
TARGET_WASTED_RATIO = 0.2


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m qualification.bench.goodput",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--out", type=Path, default=Path("bench-results/goodput.json"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--fail-every", type=int, default=15, help="a SIGKILL during every this-many-th step"
    )
    ap.add_argument("--state-mib", type=float, default=32, help="params + AdamW state per rank")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=300, help="bound on each torchrun")
    ap.add_argument("--scratch", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.steps < 4 or not 2 <= args.fail_every < args.steps or args.state_mib <= 0:
        raise UsageError("--steps >= 4, 2 <= --fail-every < --steps and --state-mib > 0")
    args.fail_steps = list(range(args.fail_every, args.steps, args.fail_every))
    return args


def torchrun(
    args: argparse.Namespace, arm: str, work: Path, *, fails: list[int], dcp_every: int = 1
) -> dict[str, Any]:
    """One arm's job; its wall time and rank 0's event log."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "events.jsonl"
    spec = GoodputSpec(
        arm=arm,
        work=work,
        events=log,
        steps=args.steps,
        fail_steps=",".join(map(str, fails)),
        dcp_every=dcp_every,
        state_mib=args.state_mib,
        batch=args.batch,
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={WORLD}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--max-restarts={len(fails)}",
        "-m",
        "qualification.bench.goodput_rank",
        *spec_argv(spec, work / f"spec-{arm}.json"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    with (work / "torchrun.log").open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every worker it started
            proc.wait()
            raise QualificationError(
                f"goodput arm {arm}: no end within {args.timeout_s:g} s; see {out.name}"
            ) from None
    wall = time.monotonic() - t0
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = [e for e in events if e["event"] == "done"]
    if proc.returncode != 0 or not done:
        raise QualificationError(
            f"goodput arm {arm}: torchrun exited {proc.returncode}; see {work / 'torchrun.log'}"
        )
    return {"wall_s": wall, "events": events, "digest": done[-1]["digest"]}


def step_times(events: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive steps of one attempt (restarts excluded)."""
    out, last = [], None
    for e in events:
        if e["event"] == "start":
            last = None
        elif e["event"] == "step":
            if last is not None:
                out.append(e["t"] - last)
            last = e["t"]
    return out


def arm_summary(
    name: str, run: dict[str, Any], ideal: dict[str, Any], failures: int
) -> dict[str, Any]:
    starts = [e for e in run["events"] if e["event"] == "start"]
    relaunch, redone = restarts(run["events"])
    times = step_times(run["events"])
    return {
        "arm": name,
        "wall_s": round(run["wall_s"], 3),
        "goodput": round(ideal["useful_s"] / run["wall_s"], 4),
        "wasted_per_failure_s": round((run["wall_s"] - ideal["wall_s"]) / failures, 3)
        if failures
        else None,
        "attempts": len(starts),
        "resume_steps": [e["resume"] for e in starts[1:]],
        # Where the waste goes: the arm's own step time (its healthy-path cost), and per failure the seconds from
        # the last step completed before it to the relaunched job's start, and the completed steps trained again.
        "step_s": round(statistics.median(times), 5) if times else None,
        "relaunch_s": relaunch,
        "redone_steps": redone,
        # Of each relaunch, the relaunched rank 0's own part: since its process began, and in the arm's setup.
        "boot_s": [e.get("boot_s") for e in starts[1:]],
        "setup_s": [e.get("setup_s") for e in starts[1:]],
        "bitwise_equal_to_ideal": run["digest"] == ideal["digest"],
    }


def restarts(events: list[dict[str, Any]]) -> tuple[list[float], list[int]]:
    """Per restart: seconds from the last step of the failed attempt to the next ``start``, and how many of the
    steps it had completed are trained again (its last step minus the step resumed from)."""
    relaunch: list[float] = []
    redone: list[int] = []
    last = None
    for e in events:
        if e["event"] == "step":
            last = e
        elif e["event"] == "start" and last is not None:
            relaunch.append(round(e["t"] - last["t"], 3))
            redone.append(last["step"] - e["resume"])
            last = None
    return relaunch, redone


def run(args: argparse.Namespace) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="gemscout-goodput-", dir=args.scratch))
    # The scratch folder stays when an arm fails: its logs say why.
    base = torchrun(args, "none", scratch / "none", fails=[])
    t_step = statistics.median(step_times(base["events"]))
    ideal = {"wall_s": base["wall_s"], "useful_s": t_step * args.steps, "digest": base["digest"]}
    calib = torchrun(args, "calibrate", scratch / "calibrate", fails=[])
    save_cost = statistics.median(e["blocking_s"] for e in calib["events"] if e["event"] == "save")
    mtbf = args.fail_every * t_step
    interval = math.sqrt(2 * save_cost * mtbf)  # Young/Daly
    dcp_every = max(1, min(args.steps, round(interval / t_step)))
    gem = torchrun(args, "gemscout", scratch / "gemscout", fails=args.fail_steps)
    dcp = torchrun(args, "dcp", scratch / "dcp", fails=args.fail_steps, dcp_every=dcp_every)
    skip = torchrun(args, "gemscout-skip", scratch / "gemscout-skip", fails=args.fail_steps)
    failures = len(args.fail_steps)
    arms = [
        arm_summary("gemscout", gem, ideal, failures),
        arm_summary("dcp", dcp, ideal, failures),
        arm_summary("gemscout-skip", skip, ideal, failures),
    ]
    skipped = {}
    why_not = goodput_torchft.unavailable()
    if why_not is None:
        ft = goodput_torchft.run_arm(args, scratch / "torchft", fails=args.fail_steps)
        arms.append(goodput_torchft.summary(ft, ideal, failures, args.steps))
    else:
        skipped["torchft"] = why_not
    shutil.rmtree(scratch, ignore_errors=True)
    wasted = {a["arm"]: a["wasted_per_failure_s"] for a in arms}
    ratio = wasted["gemscout"] / wasted["dcp"] if wasted["dcp"] and wasted["dcp"] > 0 else None
    skip_ratio = (
        wasted["gemscout-skip"] / wasted["dcp"] if wasted["dcp"] and wasted["dcp"] > 0 else None
    )
    # torchft's survivor trains on alone: its trajectory differs by design, so it is not part of this check.
    bitwise = all(a["bitwise_equal_to_ideal"] for a in arms if a["arm"] != "torchft")
    return {
        "benchmark": "goodput",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "world_size": WORLD,
        "steps": args.steps,
        "fail_steps": args.fail_steps,
        "state_mib": args.state_mib,
        "ideal": {"step_s": round(t_step, 5), "wall_s": round(base["wall_s"], 3)},
        "dcp_rule": {
            "save_blocking_s": round(save_cost, 5),
            "mtbf_s": round(mtbf, 3),
            "every_steps": dcp_every,
        },
        "arms": arms,
        "skipped": skipped,
        # The shape bench_cell reads: one "size" with its ratios and targets.
        "sizes": [
            {
                "state_mib": args.state_mib,
                "ratios": {
                    "wasted_ratio": round(ratio, 4) if ratio is not None else None,
                    "wasted_ratio_skip": round(skip_ratio, 4) if skip_ratio is not None else None,
                    "goodput_gemscout": arms[0]["goodput"],
                    "goodput_dcp": arms[1]["goodput"],
                    "goodput_gemscout_skip": arms[2]["goodput"],
                    **{
                        f"{a['arm']}_{k}": a[k]
                        for a in arms[3:]
                        for k in ("goodput", "wasted_per_failure_s")
                    },
                },
                "met": {
                    "wasted_ratio": ratio is not None and ratio <= TARGET_WASTED_RATIO and bitwise
                },
            }
        ],
        "bitwise_equal_to_ideal": bitwise,
    }


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        doc = run(args)
    except UsageError as exc:
        print(f"goodput: {exc}", file=sys.stderr)
        return 2
    except QualificationError as exc:
        print(f"goodput: {exc}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(
        f"ideal step {doc['ideal']['step_s'] * 1e3:.1f} ms; DCP async_save every {doc['dcp_rule']['every_steps']} "
        f"steps (blocking {doc['dcp_rule']['save_blocking_s'] * 1e3:.1f} ms per save, Young/Daly)"
    )
    for arm in doc["arms"]:
        print(
            f"{arm['arm']:13s} wall {arm['wall_s']:.1f} s  goodput {arm['goodput']:.3f}  wasted/failure "
            f"{arm['wasted_per_failure_s']} s  resumed at {arm['resume_steps']}  bitwise {arm['bitwise_equal_to_ideal']}"
        )
        if arm.get("relaunch_s"):
            print(
                f"{'':13s} step {arm['step_s'] * 1e3:.1f} ms; last step to relaunched start {arm['relaunch_s']} s; "
                f"steps trained again {arm['redone_steps']}"
            )
            print(
                f"{'':13s} of which the new process {arm['boot_s']} s, in the arm's setup {arm['setup_s']} s"
            )
        if arm["arm"] == "torchft":
            print(
                f"{'':13s} trained {arm['replica_steps_trained']} of {arm['replica_steps_wanted']} replica-steps; "
                f"{len(arm['steps_one_replica_alone'])} steps by one replica alone"
            )
    for arm, why in doc["skipped"].items():
        print(f"{arm:13s} skipped: {why}")
    ratio = doc["sizes"][0]["ratios"]["wasted_ratio"]
    print(
        f"wasted time per failure, gemscout / DCP: {ratio} (target <= {TARGET_WASTED_RATIO}); "
        f"gemscout-skip / DCP: {doc['sizes'][0]['ratios']['wasted_ratio_skip']}; JSON: {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

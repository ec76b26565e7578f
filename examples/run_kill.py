"""Crash a gemscout job and prove it resumed exactly: the driver behind ``make example-ddp`` / ``make example-hf``.

1. an uninterrupted run of the example (``torchrun``, its own checkpoint folder): the reference;
2. the same job with one rank SIGKILLed right after ``--kill-step``; torchrun stops the other rank and exits. The
   killed rank first writes ``<work>/crashed/kill.json`` (its wall time, fsynced, then the signal): a crashed run
   that left no record died of something else, and the driver stops there;
3. the job started again — one run per ``--restore`` mode — which resumes from the checkpoint and trains to the end.
   The first mode restarts on the crashed job's own folder, as a requeue on the same nodes does, and so finds the
   memory tier; each other mode restarts on a copy of the folder as the crash left it, which holds the disk tier
   only (every ``persist_every``-th capture and every step SCOUT compared), as a restart on other nodes would;
4. ``examples/check_resume.py`` compares every rank bit for bit with the reference (parameters, optimizer state,
   the digest of the sample ids trained on) and checks the step and source it resumed from.

Step 3 starts a new torchrun, as a scheduler's requeue would (torchrun's own ``--max-restarts`` relaunch works too,
through ``gemscout.init_process_group``: docs/torchrun.md).

    python examples/run_kill.py --script examples/ddp_tiny.py --work /tmp/gemscout-example
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def torchrun(script: Path, nproc: int, args: list[str], log: Path, timeout_s: float) -> int:
    """Run ``script`` under torchrun on this machine; its output goes to ``log``. Returns the exit code."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        try:
            return subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, start_new_session=True
            ).returncode
        except subprocess.TimeoutExpired:
            return 124


def _kill_record(out: Path) -> dict[str, Any] | None:
    """The killed rank's ``kill.json`` (examples/ddp_tiny.py ``crash``), or None when there is none."""
    try:
        record = json.loads((out / "kill.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("wall"), int | float)
    return record if ok else None


def held(folder: Path, nproc: int, out: Path) -> None:
    """Write which steps each rank has a usable copy of in ``folder`` right now — its own slot in memory or file
    on disk, or a replica a peer holds for it — read by gemscout's inventory, not by a restart: check_resume's
    expectation of where the restart must resume."""
    from gemscout.inventory import inventory

    found = inventory(folder, world_size=nproc)
    steps: dict[int, set[int]] = {r: set() for r in range(nproc)}
    for entry in found.ranks:
        for f in entry.files:
            if f.status != "unusable" and f.owner in steps:
                steps[f.owner].add(f.step)
    out.write_text(json.dumps({str(r): sorted(s) for r, s in steps.items()}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--script", type=Path, required=True, help="the example to run (examples/ddp_tiny.py, ...)"
    )
    ap.add_argument(
        "--work", type=Path, required=True, help="a fresh folder for checkpoints, outputs and logs"
    )
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-step", type=int, default=7)
    ap.add_argument(
        "--restore",
        action="append",
        choices=("candidate", "verified"),
        help="restart mode(s) to prove, each from its own copy of the crashed job's folder "
        "(repeat; default: candidate)",
    )
    ap.add_argument("--timeout-s", type=float, default=240, help="bound on each torchrun")
    ap.add_argument("extra", nargs="*", help="more arguments for the example (after --)")
    args = ap.parse_args()
    modes = args.restore or ["candidate"]
    if args.work.exists() and any(args.work.iterdir()):
        print(f"run_kill: --work {args.work} is not empty; give a fresh folder", file=sys.stderr)
        return 2
    common = ["--steps", str(args.steps), *args.extra]
    t0 = time.monotonic()

    def run(name: str, more: list[str], ckpt: Path | None = None) -> int:
        code = torchrun(
            args.script,
            args.nproc,
            [
                *common,
                "--ckpt",
                str(ckpt or args.work / f"ckpt-{name}"),
                "--out",
                str(args.work / name),
                *more,
            ],
            args.work / "logs" / f"{name}.log",
            args.timeout_s,
        )
        print(f"run_kill: {name}: torchrun exited {code} ({time.monotonic() - t0:.1f} s)")
        return code

    if run("reference", []) != 0:
        print(f"run_kill: the uninterrupted run failed; see {args.work / 'logs'}", file=sys.stderr)
        return 1
    if (
        run("crashed", ["--kill-rank", str(args.kill_rank), "--kill-step", str(args.kill_step)])
        == 0
    ):
        print("run_kill: the crashed run exited 0: the kill did not happen", file=sys.stderr)
        return 1
    kill = _kill_record(args.work / "crashed")
    if kill is None:
        print(
            "run_kill: the crashed run left no kill record (crashed/kill.json): it did not die by the demo's "
            f"SIGKILL; see {args.work / 'logs'}",
            file=sys.stderr,
        )
        return 1
    print(
        f"run_kill: rank {kill['rank']} SIGKILLed itself after step {kill['step']} "
        f"(recorded at {time.strftime('%H:%M:%S', time.gmtime(kill['wall']))} UTC)"
    )
    # The folder as the crash left it: check_resume reads its ledgers, and every mode after the first restarts from
    # a copy of it. A copy holds the disk tier only (the memory tier stays tied to the original folder), so the
    # first mode is the requeue on the same nodes and folder (memory), the others a restart elsewhere (disk).
    shutil.copytree(args.work / "ckpt-crashed", args.work / "ckpt-as-left")
    for i, mode in enumerate(modes):
        folder = args.work / "ckpt-crashed"
        if i > 0:
            folder = args.work / f"ckpt-resumed-{mode}"
            shutil.copytree(args.work / "ckpt-as-left", folder)
        held(folder, args.nproc, args.work / f"held-{mode}.json")
        if run(f"resumed-{mode}", ["--restore", mode], ckpt=folder) != 0:
            print(
                f"run_kill: the restarted run ({mode}) failed; see {args.work / 'logs'}",
                file=sys.stderr,
            )
            return 1
        print(
            f"run_kill: resumed-{mode} finished {time.time() - kill['wall']:.1f} s after the SIGKILL "
            "(this driver starts each restart itself, one after the other)"
        )
    check = [
        sys.executable,
        str(HERE / "check_resume.py"),
        "--reference",
        str(args.work / "reference"),
        "--crashed",
        str(args.work / "ckpt-as-left"),
        "--nproc",
        str(args.nproc),
    ]
    for mode in modes:
        check += ["--resumed", f"{mode}={args.work / f'resumed-{mode}'}"]
        check += ["--held", f"{mode}={args.work / f'held-{mode}.json'}"]
    return subprocess.run(check, env={**os.environ}, timeout=60).returncode


if __name__ == "__main__":
    raise SystemExit(main())

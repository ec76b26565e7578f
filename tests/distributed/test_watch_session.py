"""The session's out-of-band watch, end to end on real gloo ranks: a slow DataLoader, slow checkpoint writes and a
rank that stops before an all-reduce are each reported naming the injected rank, through enable_resiliency."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gemscout.inventory import inventory
from gemscout.watch import generate_secret
from qualification.launch import free_port


def start(out: Path, world: int, *extra: str) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    secret = generate_secret()
    procs = []
    for r in range(world):
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "GEMSCOUT_OOB_SECRET": secret,
            "PATH": "/usr/bin:/bin",
        }
        log = open(out / f"rank{r}.log", "wb")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "qualification.programs.watch_rank",
                    "--out",
                    str(out),
                    *extra,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def events(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}.reports.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(out: Path, procs: list[subprocess.Popen[bytes]], pred, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = events(out, 0)
        if pred(evs):
            return evs
        dead = [p.returncode for p in procs if p.poll() not in (None, 0)]
        assert not dead, f"a rank crashed: {dead}; see {out}"
        time.sleep(0.2)
    return events(out, 0)


@pytest.mark.timeout(120)
def test_stalls_and_hang_are_localized_through_the_session(tmp_path: Path) -> None:
    procs = start(
        tmp_path,
        3,
        "--steps",
        "12",
        "--data-delay-rank",
        "2",
        "--data-delay-s",
        "0.15",
        "--io-delay-rank",
        "0",
        "--io-delay-s",
        "0.5",
        "--delay-from",
        "3",
        "--hang-rank",
        "1",
        "--hang-step",
        "9",
        "--threshold-s",
        "2",
        "--ckpt",
        str(tmp_path / "ckpt"),
    )
    try:
        # The decision is delivered right after the hang report (same thread): wait for both, or the kill below can
        # land between the two writes.
        evs = wait_for(
            tmp_path,
            procs,
            lambda e: (
                any(x.get("kind") == "hang" for x in e)
                and any(x["type"] == "decision" and x.get("failure_kind") == "hang" for x in e)
            ),
            90,
        )
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    reports = [e for e in evs if e["type"] == "report"]
    by_kind = {}
    for r in reports:
        by_kind.setdefault(r["kind"], r)
    assert set(by_kind) >= {"data_stall", "checkpoint_stall", "hang"}, reports
    assert list(by_kind["data_stall"]["ranks"]) == [2]
    assert list(by_kind["checkpoint_stall"]["ranks"]) == [0]
    assert list(by_kind["hang"]["ranks"]) == [1]
    assert by_kind["data_stall"]["confirmations"] >= 2
    decisions = [
        e for e in evs if e["type"] == "decision" and e["failure_kind"] != "none"
    ]  # not the fresh start
    assert decisions and decisions[0]["failure_kind"] == "hang"
    # The job was SIGKILLed while hung; what it reported survives beside its checkpoints (gemscout inspect).
    kept = inventory(tmp_path / "ckpt").faults
    assert [tuple(f["ranks"]) for f in kept if f["kind"] == "hang"][:1] == [(1,)], kept
    assert {f["kind"] for f in kept} >= {"data_stall", "checkpoint_stall", "hang"}, kept

"""A small local launcher: N rank processes with torch's env:// variables, teardown when one dies.

It behaves like ``torchrun --standalone`` for our purposes (one host, fixed world size) but starts faster (no agent
process importing torch) and lets the harness SIGKILL or relaunch ranks. When any rank exits non-zero, the others
are killed, as an elastic agent would do before a restart.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class LaunchResult:
    returncodes: list[int]
    first_failed: int | None
    duration_s: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def launch(
    argv: list[str],
    *,
    world_size: int,
    timeout_s: float,
    log_dir: Path,
    env: dict[str, str] | None = None,
    local_world_size: int | None = None,
    attempt: int = 0,
    python: str | None = None,
) -> LaunchResult:
    """Run ``python argv...`` as ``world_size`` ranks; wait for all, or tear down when one fails or time runs out.
    ``python``: the interpreter (default: this one; e.g. another virtualenv's for an optional framework)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    lws = local_world_size or world_size
    t0 = time.monotonic()
    for rank in range(world_size):
        penv = dict(os.environ)
        penv.update(env or {})
        penv.update({
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank % lws), "LOCAL_WORLD_SIZE": str(lws), "OMP_NUM_THREADS": "1",
            "TORCHELASTIC_RESTART_COUNT": str(attempt), "PYTHONUNBUFFERED": "1",
        })
        log = open(log_dir / f"rank{rank}.attempt{attempt}.log", "wb")
        procs.append(subprocess.Popen([python or sys.executable, *argv], env=penv, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    first_failed: int | None = None
    timed_out = False
    while True:
        codes = [p.poll() for p in procs]
        if first_failed is None:
            first_failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if first_failed is not None:
                _kill_all(procs)
        if all(c is not None for c in codes):
            break
        if time.monotonic() - t0 > timeout_s:
            timed_out = True
            _kill_all(procs)
            for p in procs:
                p.wait(timeout=10)
            break
        time.sleep(0.05)
    return LaunchResult([p.returncode for p in procs], first_failed, time.monotonic() - t0, timed_out)


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

"""A small local launcher: N rank processes with torch's env:// variables, teardown when one dies.

It behaves like ``torchrun --standalone`` for our purposes (one host, fixed world size) but starts faster (no agent
process importing torch) and lets the harness SIGKILL or relaunch ranks. When any rank exits non-zero, the others
are killed, as an elastic agent would do before a restart.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PORT_FLOOR = 20000
_BIND_RETRIES = (
    3  # fresh ports tried when the store's port is taken between choosing it and binding it
)


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port for rank 0's TCPStore, free now and below the kernel's ephemeral range.

    A port the kernel handed out (bind to 0) is in the ephemeral range, which every outgoing connection and every
    gloo listener on the host draws from too: in the 2-3 s between choosing it and rank 0 binding it, a concurrent job
    can take it (EADDRINUSE). Below that range only explicit binds compete, and a random pick makes two concurrent
    launchers unlikely to choose the same one; ``launch`` retries on a fresh port if it happens anyway."""
    high = _ephemeral_low() - 1
    for _ in range(200):
        port = random.randint(_PORT_FLOOR, high) if high > _PORT_FLOOR else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free TCP port between {_PORT_FLOOR} and {high} on 127.0.0.1")


def _port_taken(log: Path) -> bool:
    """rank 0 could not bind the store's port (the only failure a relaunch on another port cures)."""
    try:
        return "EADDRINUSE" in log.read_text(errors="replace")
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class LaunchResult:
    returncodes: list[int]
    first_failed: int | None
    duration_s: float
    timed_out: bool
    detected_wall: float | None = None
    """``time.time()`` when the launcher first saw a rank exit non-zero (it polls every 50 ms), before its teardown:
    the launcher's detection, the event a timeline's ``detection`` names."""

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
    ``python``: the interpreter (default: this one; e.g. another virtualenv's for an optional framework).
    If rank 0 could not bind the store's port (taken by another process since it was chosen; nothing has run yet),
    the ranks are started again on a fresh port, at most ``_BIND_RETRIES`` times within ``timeout_s``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for _ in range(_BIND_RETRIES):
        res = _launch_once(
            argv,
            world_size=world_size,
            timeout_s=timeout_s - (time.monotonic() - t0),
            log_dir=log_dir,
            env=env,
            local_world_size=local_world_size,
            attempt=attempt,
            python=python,
        )
        if res.first_failed != 0 or not _port_taken(log_dir / f"rank0.attempt{attempt}.log"):
            break
    return LaunchResult(
        res.returncodes, res.first_failed, time.monotonic() - t0, res.timed_out, res.detected_wall
    )


def _launch_once(
    argv: list[str],
    *,
    world_size: int,
    timeout_s: float,
    log_dir: Path,
    env: dict[str, str] | None,
    local_world_size: int | None,
    attempt: int,
    python: str | None,
) -> LaunchResult:
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    lws = local_world_size or world_size
    t0 = time.monotonic()
    for rank in range(world_size):
        penv = dict(os.environ)
        penv.update(env or {})
        penv.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank % lws),
                "LOCAL_WORLD_SIZE": str(lws),
                "OMP_NUM_THREADS": "1",
                "TORCHELASTIC_RESTART_COUNT": str(attempt),
                "PYTHONUNBUFFERED": "1",
            }
        )
        log = open(log_dir / f"rank{rank}.attempt{attempt}.log", "wb")
        procs.append(
            subprocess.Popen(
                [python or sys.executable, *argv], env=penv, stdout=log, stderr=subprocess.STDOUT
            )
        )
        log.close()
    first_failed: int | None = None
    detected_wall: float | None = None
    timed_out = False
    while True:
        codes = [p.poll() for p in procs]
        if first_failed is None:
            first_failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
            if first_failed is not None:
                detected_wall = time.time()
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
    return LaunchResult(
        [p.returncode for p in procs], first_failed, time.monotonic() - t0, timed_out, detected_wall
    )


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

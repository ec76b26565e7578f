"""Find and end every process a cell started, even those that left its session.

A cell's driver starts in a session of its own (``start_new_session=True``), so its pid is also its process-group and
session id, and ``os.killpg`` reaches everything that stayed inside. Launchers do not always stay inside: a rank may
call ``setsid()``, or torchrun may put workers in a group of their own, and once the driver dies they are re-parented
away from us. So each cell's environment also carries a random token (:data:`TOKEN_VAR`), inherited by every
descendant that does not scrub its environment, and the sweep kills any process of ours that carries it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from datetime import timedelta

import psutil

TOKEN_VAR = "GEMSCOUT_CELL_TOKEN"


def members(leader_pid: int, token: str) -> list[psutil.Process]:
    """Live processes of the cell led by ``leader_pid`` (same session, same group, or carrying ``token``).

    The leader itself is left out: it is the engine's child and is waited for through its ``Popen``, which must be
    the one to reap it to keep its exit status. Processes we may not inspect (other users) are skipped.
    """
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.pid in (me, leader_pid) or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if os.getsid(proc.pid) == leader_pid or os.getpgid(proc.pid) == leader_pid:
                found.append(proc)
            elif proc.environ().get(TOKEN_VAR) == token:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def terminate(
    leader: subprocess.Popen[bytes], token: str, *, grace: timedelta = timedelta(seconds=5)
) -> list[int]:
    """SIGTERM the whole cell, wait up to ``grace`` for it to exit, then SIGKILL whatever is left; reap the leader.

    Works the same whether the leader is still running (a timeout) or has already exited (the sweep after a normal
    exit, which catches ranks a driver left behind). Blocks for at most ``grace`` plus a few seconds for SIGKILLed
    processes to go. Returns the pids of the leader's descendants that were alive when the sweep began.
    """
    leader_alive = leader.poll() is None
    first = members(leader.pid, token)
    if not first and not leader_alive:
        return []
    _signal_all(leader.pid, first, signal.SIGTERM)
    deadline = time.monotonic() + grace.total_seconds()
    with contextlib.suppress(subprocess.TimeoutExpired):
        leader.wait(timeout=grace.total_seconds())
    _, alive = psutil.wait_procs(first, timeout=max(0.0, deadline - time.monotonic()))
    # A second look catches processes started during the grace period (a launcher restarting a rank).
    stragglers = {p.pid: p for p in alive}
    stragglers.update({p.pid: p for p in members(leader.pid, token)})
    if stragglers or leader.poll() is None:
        _signal_all(leader.pid, list(stragglers.values()), signal.SIGKILL)
        leader.wait()
        psutil.wait_procs(list(stragglers.values()), timeout=5)
    return [p.pid for p in first]


def _signal_all(leader_pid: int, procs: list[psutil.Process], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader_pid, sig)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)

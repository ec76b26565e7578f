"""The SIGKILL's own timestamp: every kill the harness injects is recorded as a named event before it is delivered.

A timeline measured from the launch of the faulted run charges the training before the kill to detection, and one
measured from the launcher's detection hides how long the launcher took to notice. Only the killer knows when it
killed, and the killer is often the process it kills (a rank SIGKILLing itself), so the event is written, flushed and
fsynced (the file and its folder) *before* ``os.kill``: whatever the kill leaves behind, the record is on disk.

``wall`` is ``time.time()`` taken right before the record is written: the signal follows it by one write of a few
hundred bytes and two fsyncs, no more. For a kill of another process (the torchrun driver SIGKILLing an agent's
tree) the driver, which survives, writes the record the same way, right before it signals.

Records live in ``<out>/kill-events/`` (``out``: the rank program's result folder, shared by every attempt), one file
per kill, so records of a first kill and of a kill during the recovery never overwrite each other. Drivers read them
with :func:`read` and turn them into timeline ``fault`` events with :func:`timeline_events`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

FOLDER = "kill-events"


def record(
    out: Path,
    *,
    rank: int | None,
    step: int | None,
    phase: str,
    target_pids: list[int],
    by: str = "self",
    attempt: int | None = None,
    detail: str = "",
) -> dict[str, Any]:
    """Write one kill event under ``out/kill-events`` durably (flush, fsync file and folder) and return it."""
    event = {
        "event": "sigkill",
        "wall": time.time(),
        "rank": rank,
        "step": step,
        "phase": phase,
        "target_pids": list(target_pids),
        "by": by,
        "killer_pid": os.getpid(),
        "attempt": attempt,
        "detail": detail,
    }
    folder = out / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"sigkill-{time.time_ns()}-{os.getpid()}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, json.dumps(event, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the file's name is durable too, not only its bytes
    finally:
        os.close(dfd)
    return event


def sigkill_self(
    out: Path, *, rank: int, step: int | None, phase: str, attempt: int | None = None
) -> NoReturn:
    """Record the kill of this process, then SIGKILL it (never returns)."""
    record(out, rank=rank, step=step, phase=phase, target_pids=[os.getpid()], attempt=attempt)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError(
        "unreachable: SIGKILL was delivered"
    )  # for the type checker; the process is gone


def sigkill_self_later(
    out: Path,
    delay_s: float,
    *,
    rank: int,
    step: int | None,
    phase: str,
    attempt: int | None = None,
) -> threading.Timer:
    """Start a timer that records and SIGKILLs this process ``delay_s`` from now, wherever it then is; the record's
    ``wall`` is taken when the timer fires, not when it was armed."""
    timer = threading.Timer(
        delay_s,
        sigkill_self,
        (out,),
        {"rank": rank, "step": step, "phase": phase, "attempt": attempt},
    )
    timer.start()
    return timer


def read(out: Path) -> list[dict[str, Any]]:
    """Every kill event recorded under ``out``, oldest first (empty when nothing was killed)."""
    events = []
    for path in sorted((out / FOLDER).glob("sigkill-*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a record cut short cannot be one the killer finished writing before it signalled
        if isinstance(doc, dict) and isinstance(doc.get("wall"), int | float):
            events.append(doc)
    return sorted(events, key=lambda e: e["wall"])


def describe(event: dict[str, Any]) -> str:
    who = (
        f"rank {event['rank']}"
        if event.get("rank") is not None
        else f"pids {event.get('target_pids')}"
    )
    at = f" at step {event['step']}" if event.get("step") is not None else ""
    attempt = f", attempt {event['attempt']}" if event.get("attempt") is not None else ""
    by = "" if event.get("by") == "self" else f" by {event.get('by')}"
    extra = f"; {event['detail']}" if event.get("detail") else ""
    return f"SIGKILL {who}{at} ({event.get('phase')}{attempt}){by}{extra}"


def timeline_events(events: list[dict[str, Any]], wall0: float) -> list[dict[str, Any]]:
    """The kills as timeline ``fault`` events, ``t`` in seconds since ``wall0`` (the driver's own start)."""
    return [
        {
            "t": round(float(e["wall"]) - wall0, 3),
            "event": "fault",
            "detail": describe(e),
            **({"rank": e["rank"]} if isinstance(e.get("rank"), int) else {}),
        }
        for e in events
    ]

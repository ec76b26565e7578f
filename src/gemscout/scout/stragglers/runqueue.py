"""How long the calling thread waited for a CPU: the part of a timed section that is the host's other load.

A rank descheduled by other load is not a compute straggler (a host whose CPUs are taken shows up late to the job's
collectives instead), so SCOUT subtracts this wait from a replay's time before the compute detector compares it.
"""

from __future__ import annotations

__all__ = ["run_queue_seconds", "waited_since"]

_SCHEDSTAT = "/proc/thread-self/schedstat"


def run_queue_seconds() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU since it started (Linux schedstat), or
    None where the kernel does not say. Subtract two readings to get the wait inside a timed section: a sleep, a
    device wait or a collective is not run-queue time, only being descheduled in favour of other load is."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def waited_since(start: float | None) -> float:
    """Run-queue seconds since the reading ``start`` (0.0 when either reading is unavailable)."""
    now = run_queue_seconds() if start is not None else None
    return max(0.0, now - start) if now is not None and start is not None else 0.0

"""Kill a rank in the middle of GEMINI's recovery (the harness's injector; the runtime has no such switch).

Recovery runs inside ``enable_resiliency``. While :func:`armed` is active on the rank to kill, it SIGKILLs itself at:

- ``recover-send``: as it starts sending a replica it holds to the rank restoring from it;
- ``recover-receive``: once the second chunk of the replica it is restoring from has landed (mid-transfer);
- ``recover-restore``: while its chosen frame is being loaded into the live objects (``load_extra_state_fn`` runs in
  the middle of the restore: model and optimizer loaded, RNG not yet).

Transfers are seen through the runtime's declared recovery seams (:mod:`gemscout.gemini.seams`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from qualification.programs._kills import sigkill_self

PHASES = ("recover-send", "recover-receive", "recover-restore")


@contextmanager
def armed(phase: str, chunk_bytes: int, out: Path, rank: int) -> Iterator[Callable[[], None]]:
    """Arm ``phase`` for the duration; yields the callback to call from ``load_extra_state_fn`` (it kills only for
    ``recover-restore``). The kill is recorded under ``out`` first (:mod:`qualification.programs._kills`)."""
    if phase not in PHASES:
        raise SystemExit(f"--recovery-kill-phase must be one of {PHASES}, got {phase!r}")

    def _die() -> None:
        sigkill_self(out, rank=rank, step=None, phase=phase)

    from gemscout.gemini import seams

    def at(point: str, owner: int, landed: int, total: int) -> None:
        if phase == "recover-send" and point == "send":
            _die()
        # Mid-transfer: the second chunk is in, the next one still in flight (or all of a smaller frame).
        if phase == "recover-receive" and point == "received":
            if landed >= 2 * chunk_bytes or landed >= total:
                _die()

    handle = seams.register_recovery_hook(at)
    try:
        yield (_die if phase == "recover-restore" else (lambda: None))
    finally:
        handle.remove()

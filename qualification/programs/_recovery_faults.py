"""Kill a rank in the middle of GEMINI's recovery (the harness's injector; the runtime has no such switch).

Recovery runs inside ``enable_resiliency``. While :func:`armed` is active on the rank to kill, it SIGKILLs itself at:

- ``recover-send``: as it starts sending a replica it holds to the rank restoring from it;
- ``recover-receive``: once the second chunk of the replica it is restoring from has landed (mid-transfer);
- ``recover-restore``: while its chosen frame is being loaded into the live objects (``load_extra_state_fn`` runs in
  the middle of the restore: model and optimizer loaded, RNG not yet).

Transfers are seen by wrapping ``gemscout._dist.exchange``, which recovery calls for every peer transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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

    from gemscout import _dist as comm

    real = comm.exchange

    def exchange(send: Any, dst: Any, src: Any, **kwargs: Any) -> Any:
        if phase == "recover-send" and send is not None and dst is not None:
            _die()
        on_arrival = kwargs.get("on_arrival")
        if phase == "recover-receive" and src is not None and on_arrival is not None:

            def watched(prefix: bytes, data: Any) -> Any:
                check = on_arrival(prefix, data)
                inner = check.received

                def received(end: int) -> Any:
                    if end >= 2 * chunk_bytes or end >= data.numel():
                        _die()
                    return inner(end)

                check.received = received
                return check

            kwargs["on_arrival"] = watched
        return real(send, dst, src, **kwargs)

    comm.exchange = exchange  # type: ignore[assignment]
    try:
        yield (_die if phase == "recover-restore" else (lambda: None))
    finally:
        comm.exchange = real  # type: ignore[assignment]

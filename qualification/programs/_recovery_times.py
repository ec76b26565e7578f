"""The end of a recovery, as the ranks saw it: when state was restored on every rank and when every rank had trained
the first step after it, measured from the SIGKILL's own record (:mod:`qualification.programs._kills`).

A rank program stamps ``times`` in its result (``restored_wall``: ``time.time()`` when ``enable_resiliency``
returned; ``first_step_wall``: when the first step it trained after that finished, see :class:`Stamps`); a driver
turns every rank's stamps into the timeline's ``recovery`` and ``first-step`` events and the
``fault_to_recovery_s`` / ``fault_to_first_step_s`` observations with :func:`recovery_events`. An event is the
*last* rank's stamp (the job has recovered when every rank has), and missing on any rank means no event: a phase is
never measured from a stand-in.
"""

from __future__ import annotations

import time
from typing import Any


class Stamps:
    """A rank's ``times``: call :meth:`restored` once attach returns, :meth:`stepped` after every step."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def restored(self) -> None:
        self.times["restored_wall"] = time.time()

    def stepped(self) -> None:
        self.times.setdefault("first_step_wall", time.time())


def recovery_events(
    ranks: list[dict[str, Any]], *, kill_wall: float | None, wall0: float, resume_step: int
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Timeline events (``t`` in seconds since ``wall0``) and observations from every rank's ``times``."""
    events: list[dict[str, Any]] = []
    observed: dict[str, float] = {}
    for key, event, detail, name in (
        (
            "restored_wall",
            "recovery",
            f"state restored at step {resume_step} on every rank",
            "fault_to_recovery_s",
        ),
        (
            "first_step_wall",
            "first-step",
            f"every rank trained step {resume_step + 1}, the first after the restore",
            "fault_to_first_step_s",
        ),
    ):
        stamps = [(r.get("times") or {}).get(key) for r in ranks]
        if not ranks or not all(isinstance(s, int | float) for s in stamps):
            continue
        last = max(float(s) for s in stamps)  # type: ignore[arg-type]
        events.append({"t": round(last - wall0, 3), "event": event, "detail": detail})
        if kill_wall is not None:
            observed[name] = round(last - kill_wall, 3)
    return events, observed

"""``Session.metrics()``: a flat snapshot of what gemscout is doing, for a training loop's own logger.

Keys are dotted (``gemini.captures``, ``scout.cycles``, ``reports.sdc`` ...) and values plain ints, floats or None, so
the dictionary goes as is to TensorBoard, Weights & Biases or a Prometheus gauge. Reading it takes no lock and runs no
collective: counters the io thread updates may be one capture behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gemscout.reports import FaultKind

if TYPE_CHECKING:
    from gemscout.session import Session

Value = int | float | None


def snapshot(session: Session) -> dict[str, Value]:
    out: dict[str, Value] = {"step": session.step, "resume_step": session.resume_step}
    ck = session.checkpointer
    if ck is not None:
        out.update({f"gemini.{k}": v for k, v in ck.metrics().items()})
    if session.scout is not None:
        last = session.scout.last_result
        out.update(
            {
                "scout.cycles": session.cycles,
                "scout.cycle_s_total": session.cycle_s_total,
                "scout.last_cycle_s": session.last_cycle_s,
                "scout.last_cycle_step": last.step if last is not None else None,
                "scout.last_cycle_clean": int(last.clean) if last is not None else None,
                "scout.certified_step": _certified(last),
                "scout.quarantined_recipes": len(session.quarantine),
                "scout.unreplayable_recipes": len(getattr(session.scout, "unreplayable", {})),
            }
        )
    counts: dict[str, Any] = {f"reports.{k.value}": 0 for k in FaultKind}
    for report in session.reports:
        counts[f"reports.{report.kind.value}"] += 1
    out.update(counts)
    return out


def _certified(cycle: Any) -> int | None:
    step = getattr(cycle, "certified_step", None)
    return int(step) if step is not None and step >= 0 else None

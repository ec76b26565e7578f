"""What GEMINI does with an optimizer step, by SCOUT's verdict on it: the post-hook's decision, without its effects.

:func:`gate` takes the step, the SCOUT cycle that judged it (None when none was due), the recipes quarantined so far
and the AllToAll check's findings, and returns a :class:`Gate`. The session carries it out: it delivers the cycle's
reports, keeps the new quarantine, and then either rejects every uncertified candidate job-wide (SDC, an AllToAll
mismatch) or captures, retains and certifies as the gate says. Nothing here touches GEMINI, SCOUT or a callback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gemscout.scout.consensus import Verdict
from gemscout.scout.cycle import CycleResult


@dataclass(frozen=True, slots=True)
class Gate:
    """The decision for one step."""

    quarantine: frozenset[str]
    """Recipes that disagreed and have not passed clean since (the session keeps this for the next step)."""
    reject: tuple[str, str] | None = None
    """``(kind, reason)``: reject every uncertified candidate job-wide and name the newest recovery-verified step;
    nothing else happens at this step (a contaminated step is never captured)."""
    capture: bool = False
    """Capture the step (it is a capture step and nothing forbids it)."""
    durable: bool = False
    """The capture goes to disk too: SCOUT compared this step, and it may be certified after its memory slot is
    reused."""
    retain: bool = False
    """Keep the rotation's open steps (a cycle ran and nothing was rejected)."""
    certify: int | None = None
    """Certify candidates up to this step."""


def sdc_reason(cycle: CycleResult) -> str:
    """The rejection reason for a cycle that saw silent data corruption."""
    culprits = sorted(cycle.attributed_ranks)
    return f"silent data corruption at step {cycle.step}: " + (
        f"rank(s) {culprits} disagree with the peer majority"
        if culprits
        else "peers disagree and no majority names a culprit"
    )


def gate(
    step: int,
    cycle: CycleResult | None,
    quarantine: frozenset[str],
    *,
    due: bool,
    capture_on_inconclusive: bool,
    alltoall_mismatches: Sequence[str] | None = None,
    alltoall_clean_step: int | None = None,
) -> Gate:
    """Decide what happens after the update of ``step``.

    - ``cycle``: SCOUT's settled result for ``step``, or None when no cycle judged it.
    - ``quarantine``: the recipes quarantined before this step.
    - ``due``: ``step`` is a capture step (a multiple of the capture interval).
    - ``capture_on_inconclusive``: an inconclusive cycle still lets the step be captured (uncertified).
    - ``alltoall_mismatches``: the mismatch reasons when the AllToAll check found a mismatch at ``step``, else None.
    - ``alltoall_clean_step``: the newest step whose AllToAll check came back clean, when the check is on (nothing
      is certified past it), else None.

    By the verdict: SDC → the disagreeing recipes join the quarantine and the step is rejected; otherwise recipes
    that agreed leave it; inconclusive without ``capture_on_inconclusive`` → nothing; an AllToAll mismatch → rejected;
    any recipe still quarantined → nothing (the fault may still be there); else captured when due, and after a clean
    cycle certified up to the rotation's ``certified_step``."""
    if cycle is not None:
        if cycle.sdc:
            disagree = {name for name, r in cycle.results.items() if r.outputs_disagree}
            return Gate(quarantine | disagree, reject=("sdc", sdc_reason(cycle)))
        agree = {name for name, r in cycle.results.items() if r.verdict == Verdict.AGREE}
        quarantine = quarantine - agree
        if not cycle.clean and not capture_on_inconclusive:
            return Gate(quarantine)
    if alltoall_mismatches is not None:
        reason = f"AllToAll replay mismatch at step {step}: " + "; ".join(alltoall_mismatches)
        return Gate(quarantine, reject=("alltoall", reason))
    if quarantine:
        # What this step holds must not become a candidate that a later clean rotation could certify.
        return Gate(quarantine)
    certify = None
    if cycle is not None and cycle.clean and cycle.certified_step is not None:
        certify = cycle.certified_step
        if alltoall_clean_step is not None:
            certify = min(certify, alltoall_clean_step)
        if certify < 0:
            certify = None
    return Gate(
        quarantine,
        capture=due,
        durable=cycle is not None,
        retain=cycle is not None,
        certify=certify,
    )

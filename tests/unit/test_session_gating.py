"""The post-hook's decision (:func:`gemscout.gating.gate`): SCOUT's verdict on a step → reject, capture, certify."""

from __future__ import annotations

from gemscout.gating import gate
from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.scout.consensus import C3Result, Verdict
from gemscout.scout.cycle import CycleResult


def _cycle(
    step: int, *verdicts: tuple[str, Verdict, dict[int, str]], certified: int | None = None
) -> CycleResult:
    results = {
        name: C3Result(
            verdict=v,
            recipe=name,
            step=step,
            ranks=(1,) if v is Verdict.ATTRIBUTED else (),
            digests_by_rank=digests,
        )
        for name, v, digests in verdicts
    }
    sdc = any(len(set(d.values())) > 1 for _, _, d in verdicts)
    reports = (
        (FaultReport(kind=FaultKind.SDC, scope=Scope.RANK, ranks=(1,), step=step, reason="x"),)
        if sdc
        else ()
    )
    return CycleResult(
        step=step,
        source_rank=0,
        peers=(0, 1, 2),
        results=results,
        replay_s={},
        reports=reports,
        certified_step=certified,
    )


AGREE = {0: "a", 1: "a", 2: "a"}
BAD = {0: "a", 1: "b", 2: "a"}


def test_clean_cycle_captures_durably_and_certifies_up_to_the_clean_alltoall_step() -> None:
    cycle = _cycle(10, ("fwd", Verdict.AGREE, AGREE), certified=10)
    g = gate(
        10, cycle, frozenset({"fwd"}), due=True, capture_on_inconclusive=True, alltoall_clean_step=5
    )
    assert (g.quarantine, g.reject, g.capture, g.durable, g.retain, g.certify) == (
        frozenset(),
        None,
        True,
        True,
        True,
        5,
    )
    assert (
        gate(
            10, cycle, frozenset(), due=True, capture_on_inconclusive=True, alltoall_clean_step=-1
        ).certify
        is None
    )


def test_sdc_quarantines_the_disagreeing_recipe_and_rejects() -> None:
    cycle = _cycle(10, ("fwd", Verdict.ATTRIBUTED, BAD), ("bwd", Verdict.AGREE, AGREE))
    g = gate(10, cycle, frozenset(), due=True, capture_on_inconclusive=True)
    assert g.quarantine == {"fwd"} and not g.capture and g.certify is None
    assert g.reject is not None and g.reject[0] == "sdc" and "rank(s) [1]" in g.reject[1]


def test_quarantine_and_inconclusive_and_alltoall_mismatch_block_the_capture() -> None:
    assert not gate(3, None, frozenset({"fwd"}), due=True, capture_on_inconclusive=True).capture
    inconclusive = _cycle(10, ("fwd", Verdict.INCONCLUSIVE, AGREE))
    assert not gate(10, inconclusive, frozenset(), due=True, capture_on_inconclusive=False).capture
    g = gate(10, inconclusive, frozenset(), due=True, capture_on_inconclusive=True)
    assert g.capture and g.certify is None
    g = gate(
        4,
        None,
        frozenset(),
        due=True,
        capture_on_inconclusive=True,
        alltoall_mismatches=["r0 sent wrong"],
    )
    assert (
        g.reject == ("alltoall", "AllToAll replay mismatch at step 4: r0 sent wrong")
        and not g.capture
    )
    g = gate(4, None, frozenset(), due=False, capture_on_inconclusive=True)
    assert (g.capture, g.durable, g.retain, g.certify) == (False, False, False, None)

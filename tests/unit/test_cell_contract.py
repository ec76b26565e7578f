"""The cell contract's shared judgements: trust gating says nothing was rejected when nothing was ever certified."""

from __future__ import annotations

import pytest

from qualification.programs._contract import trust_gating

pytestmark = pytest.mark.timeout(30)

SDC = [{"failure_kind": "sdc", "step": 3}]


def test_gating_flags_hold_when_the_fault_step_alone_is_left_uncertified() -> None:
    trust = {3: "recovery_verified", 4: "unverified", 5: "recovery_verified"}
    assert trust_gating(trust, SDC, 4) == {
        "decision_before_fault": True,
        "fault_step_rejected": True,
        "certified_after": True,
    }


def test_every_flag_is_false_when_nothing_was_ever_certified() -> None:
    # A run whose certification never worked must not "reject" the faulty step for free.
    trust = {3: "unverified", 4: "unverified", 5: "unverified"}
    assert trust_gating(trust, SDC, 4) == {
        "decision_before_fault": False,
        "fault_step_rejected": False,
        "certified_after": False,
    }
    assert trust_gating({}, [], 4)["fault_step_rejected"] is False

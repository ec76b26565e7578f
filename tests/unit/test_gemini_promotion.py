"""Which step a durable promotion takes (gemscout.gemini.promotion.promotable_step) — pure, no process group."""

from __future__ import annotations

import pytest

from gemscout import TrustState
from gemscout.gemini.promotion import promotable_step

V, C, R, D = (
    TrustState.RECOVERY_VERIFIED,
    TrustState.CANDIDATE,
    TrustState.REJECTED,
    TrustState.DURABLE,
)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("states", "on_disk", "want"),
    [
        ({2: V, 4: V}, [4, 2], 4),  # newest certified file
        ({2: V, 4: V, 5: V}, [4, 2], 4),  # 5 was certified but never written (persist_every > 1)
        ({2: V, 4: C}, [4, 2], 2),  # 4 not certified yet
        ({2: V, 4: R}, [4, 2], 2),  # a rejected step is never promoted
        ({2: D, 4: V}, [4, 2], 4),
        ({2: V, 4: D}, [4, 2], -1),  # nothing newer than the last promotion
        ({2: V, 6: D}, [2], -1),  # older than a durable step: pointless
        ({0: V}, [0], -1),  # the attach-time step 0 is never promoted
        ({}, [], -1),
    ],
)
def test_promotable_step(states: dict[int, TrustState], on_disk: list[int], want: int) -> None:
    assert promotable_step(states, on_disk) == want

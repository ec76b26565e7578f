"""The ZeRO optimizer recipe's pure parts: the slice plan, the owner rotation and the deferred rotation bookkeeping.

No process group: ``ZeroScout.zero_due`` reads only the config, the peers and the plan, set here by hand. The
distributed behaviour (capture on the owner, replay everywhere, attribution) is in
``tests/distributed/test_deepspeed_scout.py``.
"""

from __future__ import annotations

import pytest

from gemscout.adapters.deepspeed.scout import ZeroScout, _DeferredRotation
from gemscout.adapters.deepspeed.zero_slices import ALIGN, plan_slices
from gemscout.scout.config import ScoutConfig
from gemscout.scout.consensus import C3Result, Verdict


@pytest.mark.timeout(30)
def test_slices_cover_every_partition_once_with_aligned_starts() -> None:
    plan = plan_slices((0, 1, 2), [56854, 100], bound=20000)
    assert sorted(plan) == [0, 1, 2]
    for owner, slices in plan.items():
        assert all(s.owner == owner and s.start % ALIGN == 0 for s in slices)
        for group, numel in enumerate([56854, 100]):
            mine = [s for s in slices if s.group == group]
            assert mine[0].start == 0 and mine[-1].stop == numel
            assert all(a.stop == b.start for a, b in zip(mine, mine[1:], strict=False))
            assert all(
                s.stop - s.start <= 19968 for s in mine
            )  # the bound rounded down to the alignment
        assert [s.name for s in slices] == [
            f"optimizer.rank{owner}.{j}" for j in range(len(slices))
        ]
    assert len({s.name for slices in plan.values() for s in slices}) == sum(map(len, plan.values()))
    assert (
        plan_slices((0,), [10], bound=1)[0][0].stop == 10
    )  # a bound under the alignment still makes progress


@pytest.mark.timeout(30)
def test_due_slices_walk_over_owners_then_over_their_slices() -> None:
    scout = ZeroScout(ScoutConfig(recipes=("optimizer",), optimizer_slices_per_cycle=1, interval=2))
    scout.peers = (0, 1, 2)
    scout._plan = plan_slices(scout.peers, [200], bound=64)  # 4 slices per owner
    seen = {s: [z.name for z in scout.zero_due(s)] for s in range(0, 30)}
    assert all(seen[s] == [] for s in range(1, 30, 2))  # not due on odd steps
    owners = [int(seen[s][0].split(".")[1][4:]) for s in range(2, 30, 2)]
    assert owners == [
        (s // 2) % 3 for s in range(2, 30, 2)
    ]  # every owner comes up, whatever gcd(interval, n)
    for owner in (0, 1, 2):  # each owner's 4 slices come up within 4 of its turns
        turns = [
            seen[s][0] for s in range(0, 30, 2) if seen[s][0].startswith(f"optimizer.rank{owner}.")
        ]
        assert set(turns[:4]) == {f"optimizer.rank{owner}.{j}" for j in range(4)}


def _result(name: str, verdict: Verdict, ranks: tuple[int, ...] = ()) -> C3Result:
    return C3Result(verdict=verdict, recipe=name, step=0, ranks=ranks)


@pytest.mark.timeout(30)
def test_deferred_rotation_records_a_step_once_with_both_halves() -> None:
    rotation = _DeferredRotation(("hidden.0", "optimizer.rank0.0"))
    assert (
        rotation.record(1, {"hidden.0": _result("hidden.0", Verdict.AGREE)}) is None
    )  # held, not recorded
    assert rotation.pending == ("hidden.0", "optimizer.rank0.0")
    assert (
        rotation.settle(1, {"optimizer.rank0.0": _result("optimizer.rank0.0", Verdict.AGREE)}) == 1
    )
    rotation.record(2, {"hidden.0": _result("hidden.0", Verdict.AGREE)})
    # An attributed slice forgets every clean pass, the forward half of the same step included.
    assert (
        rotation.settle(
            2, {"optimizer.rank0.0": _result("optimizer.rank0.0", Verdict.ATTRIBUTED, (1,))}
        )
        is None
    )
    assert rotation.last_sdc_step == 2 and rotation.pending == ("hidden.0", "optimizer.rank0.0")
    rotation.record(3, {"hidden.0": _result("hidden.0", Verdict.AGREE)})
    assert (
        rotation.settle(4, {}) is None and rotation.held is None
    )  # a held step that was not settled is dropped
    assert rotation.pending == ("hidden.0", "optimizer.rank0.0")

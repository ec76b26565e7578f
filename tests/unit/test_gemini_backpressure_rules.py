"""Backpressure in the slot pool and the replica buffers (no process group: the agreement's outcome is given), and
copy-and-hash on several threads giving the digests of one."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from gemscout.errors import CollectiveTimeout
from gemscout.gemini.replication import ReplicaBuffers
from gemscout.gemini.slots import Slot, SlotPool
from gemscout.gemini.snapshot import Capturer
from gemscout.state.layout import parse_prefix, verify_data

SHORT = timedelta(seconds=0.2)


def seal(pool: SlotPool, step: int, *, threads: int = 1) -> Slot:
    """A capture of ``step`` into ``pool`` whose io has finished (released), not yet acknowledged."""
    state = {"w": torch.full((1000,), float(step)), "v": torch.arange(50_000.0) + step}
    cap = Capturer(pool, async_copy=True, timeout=SHORT, digest_threads=threads)
    ptrs = {state["w"].data_ptr(), state["v"].data_ptr()}
    slot = cap.capture(state, {"owner": 0, "step": step}, ptrs).result(timeout=10)
    pool.release(slot)
    cap.shutdown()
    return slot


@pytest.mark.timeout(30)
def test_the_frontier_and_an_unacknowledged_capture_are_never_overwritten() -> None:
    pool = SlotPool(2, replicated=True)
    s1 = seal(pool, 1)
    pool.settle(s1, 1)  # every rank's replica of 1 landed: 1 is the frontier
    s2 = seal(pool, 2)
    assert not pool.has_free(), "1 is the frontier, 2 is not acknowledged: nothing may be reused"
    with pytest.raises(CollectiveTimeout, match="not acknowledged"):
        seal(pool, 3)
    assert sorted(s.step for s in pool.ready_slots()) == [1, 2]
    pool.settle(s2, 2)  # acknowledged: 1 is no longer needed
    assert pool.has_free()
    s3 = seal(pool, 3)
    assert s3 is s1 and sorted(s.step for s in pool.ready_slots()) == [2, 3]


@pytest.mark.timeout(30)
def test_a_capture_the_ranks_agreed_did_not_land_everywhere_frees_its_own_slot() -> None:
    pool = SlotPool(2, replicated=True)
    s1 = seal(pool, 1)
    pool.settle(s1, 1)
    s2 = seal(pool, 2)
    pool.settle(s2, 1)  # some rank's replica of 2 failed: the frontier stays 1
    s3 = seal(pool, 3)
    assert s3 is s2, "the frontier's slot is kept, the failed capture's is reused"
    assert sorted(s.step for s in pool.ready_slots()) == [1, 3]


@pytest.mark.timeout(30)
def test_without_replication_a_sealed_capture_needs_no_acknowledgement() -> None:
    pool = SlotPool(2)
    for step in (1, 2, 3):
        seal(pool, step)
    assert sorted(s.step for s in pool.ready_slots()) == [2, 3]


@pytest.mark.timeout(30)
def test_replica_buffers_keep_the_frontier_while_the_next_ones_land() -> None:
    b = ReplicaBuffers(keep=2)
    for step in (1, 2):
        b.add(step, b"p", b.buffer_for(8))
    b.settle(1)  # 2's agreement: some rank lacks 2, the frontier is 1
    b.add(3, b"p", b.buffer_for(8))
    assert b.steps() == [3, 1], "2 is dropped, never the frontier"
    kept = b.get(1)
    assert kept is not None
    buf = b.buffer_for(
        8
    )  # 3 not yet agreed and 1 the frontier: a new buffer, neither is overwritten
    assert buf.data_ptr() not in {kept[1].data_ptr(), b.get(3)[1].data_ptr()}  # type: ignore[index]
    b.add(4, b"p", buf)
    assert b.steps() == [4, 1]
    b.settle(4)
    b.add(5, b"p", b.buffer_for(8))
    assert b.steps() == [5, 4]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("threads", [1, 3])
def test_copy_and_hash_on_several_threads_gives_the_same_verified_slot(threads: int) -> None:
    slot = seal(SlotPool(2), 7, threads=threads)
    parsed = parse_prefix(slot.prefix)
    verify_data(parsed, slot.data)  # every digest matches the bytes
    reference = seal(SlotPool(2), 7, threads=1)
    assert parsed.digests == parse_prefix(reference.prefix).digests

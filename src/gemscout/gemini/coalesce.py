"""``CheckpointConfig(when_busy="skip")``: skip a capture, identically on every rank, while earlier captures' io
still holds every slot — instead of stalling the training thread until one is free.

The io of a capture runs collectives (replica exchange, frontier agreement) that must line up on every rank, so a
rank never skips alone: the ranks vote. The vote for the next capture is posted, as an asynchronous MIN all-reduce
on a group of its own, right after this capture was taken or skipped, and read at the next capture, by which time
it has normally completed — so the decision costs the training thread no barrier. It is sound because only the
training thread takes slots: a rank that had a free slot when it voted still has one when the next capture comes
(the io thread only frees slots). A vote is one step stale, so it is conservative: it may skip a capture that
could have waited a little, never take one that must wait.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gemscout import _dist as comm
from gemscout.gemini.slots import SlotPool


class FreeSlotVote:
    """Decides whether the next capture is taken; every rank of ``group`` gets the same answer."""

    def __init__(self, pool: SlotPool, group: dist.ProcessGroup | None, timeout: timedelta) -> None:
        self.pool, self.group, self.timeout = pool, group, timeout
        self._pending: tuple[Any, torch.Tensor] | None = None

    def should_skip(self) -> bool:
        """True when some rank had no free slot at its last vote (the first time: a blocking vote now)."""
        if self.group is None:
            return not self.pool.has_free()
        if self._pending is None:
            return not comm.all_agree(self.pool.has_free(), group=self.group, timeout=self.timeout)
        work, flag = self._pending
        self._pending = None
        comm.wait_all([work], self.timeout, "free-slot vote")
        return not bool(flag.item())

    def post(self) -> None:
        """Vote for the next capture; call right after this capture was taken or skipped, on every rank."""
        if self.group is None:
            return
        flag = torch.tensor([1 if self.pool.has_free() else 0], dtype=torch.int32)
        self._pending = (
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True),
            flag,
        )

    def settle(self) -> None:
        """Complete and drop a pending vote (every rank, at the same point: switching modes)."""
        if self._pending is not None:
            comm.wait_all([self._pending[0]], self.timeout, "free-slot vote")
            self._pending = None

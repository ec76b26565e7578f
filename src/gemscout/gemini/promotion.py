"""When GEMINI promotes a capture to the durable tier, which step, and the promotion itself (on the io thread).

``CheckpointConfig(durable_every=M)``: once M captures have been certified (RECOVERY_VERIFIED) since the last
promotion, the newest step that is both certified and persisted on every rank is promoted. A certified capture
that was not written to disk (``persist_every > 1``) still counts; the promotion then takes the newest older step
that was written, because a promotion reads each rank's own file. A step that is rejected, not yet certified, or
already durable (or older than a durable one) is never chosen. When no step qualifies yet, the count is kept and
the next certification tries again.

The promoter is handed the parts of the checkpointer it uses as a :class:`PromotionParts`, built once by
:func:`~gemscout.gemini.parts.build_parts`; it holds no reference to the checkpointer itself.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gemscout import _dist as comm
from gemscout.config import TrustState
from gemscout.gemini import store
from gemscout.gemini.durable import keys
from gemscout.gemini.durable import promote as collective

if TYPE_CHECKING:
    from datetime import timedelta
    from pathlib import Path

    from gemscout.gemini.durable import DurableTier
    from gemscout.gemini.lifecycle import TrustLedger
    from gemscout.state.training_state import StateSources

log = logging.getLogger("gemscout.gemini")


REPLICATED = ("model", "optimizer", "schedulers")
"""Under DDP, the parts of a capture that are the same on every rank (stored once in a promotion); caller state and
RNG are each rank's own."""


def promotable_step(states: dict[int, TrustState], on_disk: Iterable[int]) -> int:
    """The newest step > 0 that is RECOVERY_VERIFIED in ``states`` and has a file in ``on_disk``, and is newer than
    every DURABLE step; -1 when there is none. Step 0 (the attach-time capture) is never worth promoting."""
    newest_durable = max((s for s, st in states.items() if st == TrustState.DURABLE), default=0)
    ready = [
        s for s in on_disk if s > newest_durable and states.get(s) == TrustState.RECOVERY_VERIFIED
    ]
    return max(ready, default=-1)


@dataclass(frozen=True, slots=True)
class PromotionParts:
    """What a :class:`Promoter` uses of its rank's checkpointer, built once by :func:`~gemscout.gemini.parts.build_parts` after all of
    these exist.

    The objects are the checkpointer's own, shared, not copied: the ledger and the error list are the ones it
    keeps, and promotion updates them in place; the values never change after construction."""

    durable_every: int
    """``CheckpointConfig.durable_every``: certified captures per promotion (0: never promote)."""
    timeout: timedelta
    """``CheckpointConfig.timeout``: bounds the step agreement and every collective of a promotion."""
    durable: DurableTier | None
    """The durable (DCP) tier promotions write to, with its own process group; None without
    ``durable_directory`` (then nothing is promoted)."""
    ledger: TrustLedger
    """This rank's trust ledger: which step to promote is read from it, and a promoted step is marked DURABLE in
    it and saved."""
    own_dir: Path
    """This rank's own checkpoint files (``RankPaths.own``): the steps on disk, and the file a promotion reads."""
    group: dist.ProcessGroup
    """The replication group, on which every rank agrees on the step to promote (training thread)."""
    rank: int
    """This rank, for the promotion's collective write."""
    sources: StateSources
    """The live training state, whose DTensors a sharded promotion rebuilds its shards like."""
    sharded: bool
    """Sharded (DTensor or rank-local) state: every part is each rank's own; otherwise :data:`REPLICATED` parts
    are stored once."""
    check_identity: Callable[..., None]
    """Called as ``check_identity(identity, where=...)`` on the file read; raises for another run's file."""
    queue_io: Callable[..., None]
    """``queue_io(fn, *args)`` runs ``fn(*args)`` on the checkpointer's io thread, after everything queued
    before it."""
    errors: list[str]
    """The checkpointer's error list: a failed promotion is appended to it."""


class Promoter:
    """Counts certified captures and queues promotions on the checkpointer's io thread (see the module docstring).

    ``note_capture`` and ``on_certified`` run on the training thread; ``on_certified`` is collective (every rank
    calls it from the collective ``Checkpointer.certify``, after the io thread drained)."""

    def __init__(self, parts: PromotionParts) -> None:
        self.parts = parts
        self.every = parts.durable_every if parts.durable is not None else 0
        self._uncertified: deque[int] = deque(maxlen=max(1, self.every))
        """Captured steps (persisted or not) not yet certified, the newest M: a job that never certifies must not
        grow it, and M of them are all a promotion needs to be due (captures come in step order)."""
        self.certified_since_promotion = 0

    def note_capture(self, step: int) -> None:
        if self.every:
            self._uncertified.append(step)

    def on_certified(self, step: int) -> None:
        """Count the captures ``certify(step)`` verified; when M are due, agree on a step with every rank (a MIN
        all-reduce on the replication group) and queue its promotion."""
        if not self.every:
            return
        self.certified_since_promotion += sum(1 for s in self._uncertified if 0 < s <= step)
        self._uncertified = deque(
            (s for s in self._uncertified if s > step), maxlen=self._uncertified.maxlen
        )
        if self.certified_since_promotion < self.every:
            return
        parts = self.parts
        mine = promotable_step(parts.ledger.states, store.list_steps(parts.own_dir))
        agreed = torch.tensor([mine], dtype=torch.int64)
        comm.wait_all(
            [dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=parts.group, async_op=True)],
            parts.timeout,
            "promotion step agreement",
        )
        chosen = int(agreed.item())
        if chosen < 0:
            return  # no rank-wide certified file newer than the last promotion yet: keep counting
        self.certified_since_promotion = 0
        # Every rank promotes, collectively, queued in the same order on every rank since certify is collective:
        # sharded state has a part on each rank, and even replicated (DDP) state has each rank's own RNG streams and
        # caller state, which a resumed job needs rank for rank to continue bitwise.
        # live_shards here, on the training thread (see its docstring)
        likes = keys.live_shards(parts.sources) if parts.sharded else {}
        parts.queue_io(self.promote, chosen, likes)

    def promote(self, step: int, likes: dict[str, Any]) -> None:
        """Promote this rank's checkpoint file of ``step`` together with every rank (on the io thread; see
        :mod:`gemscout.gemini.durable.promote`). Failures are recorded in ``errors`` and logged, never raised."""
        parts = self.parts
        assert parts.durable is not None and parts.durable.group is not None
        try:
            path = store.step_file(parts.own_dir, step)
            collective.promote_own_file(
                parts.durable,
                step,
                path,
                likes,
                check=parts.check_identity,
                group=parts.durable.group,
                rank=parts.rank,
                timeout=parts.timeout,
                replicated=() if parts.sharded else REPLICATED,
            )
            parts.ledger.mark(step, TrustState.DURABLE)
            parts.ledger.save()
        except Exception as exc:
            parts.errors.append(f"durable promotion of step {step} failed: {exc}")
            log.error("gemini: durable promotion of step %d failed: %s", step, exc)

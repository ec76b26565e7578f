"""What happens to a capture after its copy, on the checkpointer's io thread: replicate → acknowledge → persist → agree
on the frontier and prune.

One capture at a time and in step order on every rank, so the replication exchange and the two MIN all-reduces of
all ranks line up. The pipeline is handed the parts of the checkpointer it uses as a :class:`PipelineParts`, built
once by :func:`~gemscout.gemini.parts.build_parts`; it holds no reference to the checkpointer itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gemscout import _dist as comm
from gemscout.config import TrustState
from gemscout.gemini import store
from gemscout.gemini.replication import ReplicaBuffers

if TYPE_CHECKING:
    from datetime import timedelta

    from gemscout.gemini.exchange import Frame, Replication
    from gemscout.gemini.lifecycle import TrustLedger
    from gemscout.gemini.replication import Placement
    from gemscout.gemini.shm import MemoryTier
    from gemscout.gemini.slots import Slot, SlotPool

log = logging.getLogger("gemscout.gemini")


@dataclass(frozen=True, slots=True)
class PipelineParts:
    """What a :class:`CapturePipeline` uses of its rank's checkpointer, built once by :func:`~gemscout.gemini.parts.build_parts` after all
    of these exist.

    The objects are the checkpointer's own, shared, not copied: the pool, the held replicas, the ledger, the spares,
    the stats and the error list are the ones it keeps, and the pipeline updates them in place; the values never
    change after construction."""

    rank: int
    """This rank: the owner of its slots, and its place in the ring (``placement``)."""
    group: dist.ProcessGroup
    """The replication group, on which the exchange and both agreements (acknowledgement, frontier) run."""
    placement: Placement
    """Who this rank sends its capture to and whose replica it holds."""
    replicating: bool
    """Captures are replicated (``CheckpointConfig.replicate`` with more than one node); otherwise a sealed slot
    settles at once and no acknowledgement runs."""
    timeout: timedelta
    """``CheckpointConfig.timeout``: bounds the exchange and each agreement."""
    fsync: bool
    """``CheckpointConfig.fsync``: disk files are fsynced on publish."""
    slots: int
    """``CheckpointConfig.slots``: how many captures the memory tier keeps per folder."""
    keep_generations: int
    """``CheckpointConfig.keep_generations``: disk generations kept below the frontier (see ``store.prune_safe``)."""
    memory: MemoryTier | None
    """This rank's memory tier, which slots in process memory are mirrored to; None without one."""
    pool: SlotPool
    """This rank's slots: each sealed slot is settled after its acknowledgement and released after its io."""
    replicas: dict[int, ReplicaBuffers]
    """The replicas this rank holds in memory, per owner (the checkpointer's dict): each exchange lands in it."""
    replication: Replication
    """The replication strategy (ring or natural) that runs the exchange."""
    ledger: TrustLedger
    """This rank's trust ledger: every capture becomes a candidate in it; pruned steps are forgotten and saved."""
    paths: store.RankPaths
    """This rank's folders on disk: its own files and the replicas it holds."""
    spares: store.Spares
    """Pruned files kept for the next write in their folder to overwrite."""
    stats: dict[str, float]
    """The checkpointer's stats: the pipeline sets the timings of the last capture and adds up ``replicate_*`` and
    ``natural_divergent_shards``."""
    errors: list[str]
    """The checkpointer's error list: a failed capture io is appended to it."""


class CapturePipeline:
    """The io of every sealed capture (see the module docstring). :meth:`run` is what the checkpointer queues on its
    io thread for each; :meth:`persist_sealed` is for ``flush``."""

    def __init__(self, parts: PipelineParts) -> None:
        self.parts = parts
        self.persisted_step = -1
        self.persisted_replica: dict[int, int] = {}
        self.frontier = -1
        """Newest step that every rank has persisted together with its replica (agreed on the io thread)."""
        self.retained: frozenset[int] = frozenset()  # see retain()
        self.peer_exchange_since: float | None = None
        """``time.monotonic()`` when the io thread entered the exchange or agreement it is in now (None: not in
        one). A survivor of a dead peer can sit there until the transfer timeout: see :meth:`stuck_on_peers`."""
        self.phase_hook: Callable[[str, int], None] | None = None
        """Fault-injection seam: called as ``phase_hook(phase, step)`` at "persist", "replicate" and
        "persist_replica" (on the io thread) before each happens, and at "persisted", "replicated" and
        "acknowledged" after those end. The harness uses it to kill at a phase."""

    def stuck_on_peers(self) -> bool:
        """True when the io thread has been in one peer exchange (replication or its acknowledgement) for more than
        twice what the last capture's took, and at least 0.1 s: a peer is gone or stalled, and a signal handler's
        flush stops waiting for it (the capture is sealed in memory and is written by ``persist_sealed``)."""
        since = self.peer_exchange_since
        if since is None:
            return False
        usual = self.parts.stats.get("replicate_s", 0.0) + self.parts.stats.get(
            "acknowledge_s", 0.0
        )
        return time.monotonic() - since > max(0.1, 2 * usual)

    @contextlib.contextmanager
    def _with_peers(self) -> Iterator[None]:
        self.peer_exchange_since = time.monotonic()
        try:
            yield
        finally:
            self.peer_exchange_since = None

    def retain(self, steps: Iterable[int]) -> None:
        """Keep the captures of ``steps`` past ``keep_generations`` until the next call (``Checkpointer.retain``)."""
        self.retained = frozenset(int(s) for s in steps)

    def held(self, owner: int) -> ReplicaBuffers:
        """The buffers of the replicas of ``owner`` this rank holds, created on first use."""
        parts = self.parts
        return parts.replicas.setdefault(
            owner, ReplicaBuffers(keep=parts.slots, memory=parts.memory, owner=owner)
        )

    def run(self, slot: Slot, persist_now: bool) -> None:
        """The io of one sealed capture, on the io thread. Failures are recorded in ``errors`` and logged, never
        raised; the slot is released either way."""
        parts = self.parts
        try:
            # Serial on purpose: writing the own file on a second thread while replicating gained nothing on the
            # 2-core CPU class, where both stages are CPU-bound (A/B, 60 MiB, serial vs concurrent: 0.55 / 0.53 s
            # and 0.46 / 0.55 s per capture), and it slowed the replication it competed with by 40-80 %.
            # Every capture is a candidate, written or not (persist_every > 1): certification must be able to vouch
            # for a step that lives only in memory and in its peers' replicas.
            # Replication and its acknowledgement first: they are what a node loss needs and what the next capture
            # may wait for (backpressure, see SlotPool); the disk write (every persist_every-th capture) comes after,
            # off that path.
            parts.ledger.add_candidate(slot.step)
            if parts.memory is not None and slot.file is None:
                self._mirror_to_memory(slot)
            received = None
            try:
                if parts.replicating:
                    received = self._replicate(slot)
            finally:
                try:
                    self._acknowledge(slot, landed=received is not None)
                finally:
                    # even when the replication failed: the node's own power-loss copy
                    if persist_now:
                        self._persist_own(slot)
            if persist_now:
                if received is not None:
                    self._persist_replica(*received)
                self._advance_frontier(slot.step)
        except Exception as exc:
            parts.errors.append(f"step {slot.step}: {exc}")
            log.error("gemini io for step %d failed: %s", slot.step, exc)
        finally:
            parts.pool.release(slot)

    def persist_sealed(self) -> int:
        """Write the newest sealed capture and each owner's newest held replica if not on disk yet. Issues no
        collective (``flush`` runs it in a signal handler). Returns the newest persisted own step."""
        newest = self.parts.pool.newest_ready()
        if newest is not None and newest.step > self.persisted_step:
            self._persist_own(newest)
        for owner, buffers in self.parts.replicas.items():
            if buffers.entries and buffers.entries[0][0] > self.persisted_replica.get(owner, -1):
                step, prefix, data = buffers.entries[0]
                self._persist_replica(owner, step, (prefix, data))
        return self.persisted_step

    def _acknowledge(self, slot: Slot, *, landed: bool) -> None:
        """Agree with every rank (MIN all-reduce, io thread, capture order) whether this capture's replicas landed
        everywhere; the newest step that did is the memory frontier every rank keeps (see SlotPool). Runs even when
        this rank's exchange failed, so the collectives stay lined up. A failed agreement leaves the slot unsettled:
        kept, since the step may be what the others agreed on."""
        parts = self.parts
        if not parts.replicating:
            parts.pool.settle(slot, slot.step)
            return
        t = torch.tensor([slot.step if landed else parts.pool.frontier], dtype=torch.int64)
        t0 = time.perf_counter()
        with self._with_peers():
            comm.wait_all(
                [dist.all_reduce(t, op=dist.ReduceOp.MIN, group=parts.group, async_op=True)],
                parts.timeout,
                "replica acknowledgement",
            )
        frontier = int(t.item())
        parts.stats["acknowledge_s"] = time.perf_counter() - t0
        for buffers in parts.replicas.values():
            buffers.settle(frontier)
        parts.pool.settle(slot, frontier)
        self._phase("acknowledged", slot.step)

    def _phase(self, phase: str, step: int) -> None:
        if self.phase_hook is not None:
            self.phase_hook(phase, step)

    def _persist_own(self, slot: Slot) -> None:
        self._phase("persist", slot.step)
        t0 = time.perf_counter()
        store.write_checkpoint(
            store.step_file(self.parts.paths.own, slot.step),
            slot.prefix,
            slot.data,
            fsync=self.parts.fsync,
            spares=self.parts.spares,
        )
        self.persisted_step = slot.step
        # No save here: an unrecorded step reads as CANDIDATE anyway, every transition saves, and the frontier
        # agreement right after this capture saves: one atomic ledger write (two fsyncs) per capture, not two.
        self.parts.ledger.add_candidate(slot.step)
        self.parts.stats["persist_s"] = time.perf_counter() - t0
        self._phase("persisted", slot.step)

    def _mirror_to_memory(self, slot: Slot) -> None:
        """A slot in process memory (pinned, for device copies) is written to the memory tier as a file (one copy),
        so a killed process still leaves it behind; the ``slots`` newest are kept."""
        assert self.parts.memory is not None
        folder = self.parts.memory.paths.own
        store.write_checkpoint(
            store.step_file(folder, slot.step), slot.prefix, slot.data, fsync=False
        )
        for old in store.list_steps(folder)[self.parts.slots :]:
            if (
                old < self.parts.pool.frontier
            ):  # the frontier's file stays (backpressure, see SlotPool)
                store.step_file(folder, old).unlink(missing_ok=True)

    def _replicate(self, slot: Slot) -> tuple[int, int, Frame]:
        parts = self.parts
        self._phase("replicate", slot.step)
        t0 = time.perf_counter()
        owner = parts.placement.source(parts.rank)
        buffers = self.held(owner)
        buffers.frontier = max(buffers.frontier, parts.pool.frontier)
        with self._with_peers():
            step, received, sent = parts.replication.exchange(
                slot.frame(),
                tensors=len(slot.views),
                target=parts.placement.target(parts.rank),
                source=owner,
                buffers=buffers,
            )
        parts.stats["replicate_sent_bytes"] += sent.bytes
        parts.stats["replicate_sent_tensors"] += sent.tensors
        parts.stats["natural_divergent_shards"] += sent.divergent_shards
        buffers.add(step, *received)
        parts.stats["replicate_s"] = time.perf_counter() - t0
        self._phase("replicated", slot.step)
        return owner, step, received

    def _persist_replica(self, owner: int, step: int, frame: Frame) -> None:
        self._phase("persist_replica", step)
        folder = self.parts.paths.replicas(owner)
        store.write_checkpoint(
            store.step_file(folder, step),
            frame[0],
            frame[1],
            fsync=self.parts.fsync,
            spares=self.parts.spares,
        )
        self.persisted_replica[owner] = step

    def _advance_frontier(self, step: int) -> None:
        """Agree on the newest step that every rank has on disk with its replica, then prune below it.

        Pruning by local progress alone is unsafe: a rank could drop the last step whose replica its peer finished
        writing, leaving no step restorable everywhere after a node loss. The MIN all-reduce runs on the io thread,
        in capture order on every rank, so it lines up like the replication exchange does.
        """
        parts = self.parts
        replicated = (
            not parts.replicating
            or self.persisted_replica.get(parts.placement.source(parts.rank), -1) == step
        )
        mine = step if self.persisted_step == step and replicated else self.frontier
        t = torch.tensor([mine], dtype=torch.int64)
        comm.wait_all(
            [dist.all_reduce(t, op=dist.ReduceOp.MIN, group=parts.group, async_op=True)],
            parts.timeout,
            "frontier agreement",
        )
        self.frontier = max(self.frontier, int(t.item()))
        keep = parts.keep_generations
        trusted = [
            s
            for s, st in list(parts.ledger.states.items())
            if st in (TrustState.RECOVERY_VERIFIED, TrustState.DURABLE) and s > 0
        ]
        protect = self.retained | ({max(trusted)} if trusted else set())
        store.prune_safe(parts.paths.own, self.frontier, keep, protect, spares=parts.spares)
        for owner in parts.paths.held_owners():
            store.prune_safe(
                parts.paths.replicas(owner), self.frontier, keep, protect, spares=parts.spares
            )
        steps = store.list_steps(parts.paths.own)
        if steps:
            parts.ledger.forget_before(steps[-1])
            parts.ledger.save()

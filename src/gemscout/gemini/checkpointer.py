"""The GEMINI engine of one rank: capture (into shared memory) → replicate → persist (every N) → certify → recover.

Threads: the training thread runs the hooks; ``gemini-copy`` copies into slots (files of the memory tier,
:mod:`gemscout.gemini.shm`, published when sealed); ``gemini-io`` (:mod:`gemscout.gemini.io_thread`) runs each
sealed capture's :mod:`~gemscout.gemini.capture_pipeline` (replicate, persist to disk, prune), one capture at a time
and in step order on every rank, so the replication collectives of all ranks line up. Collectives the training
thread issues on the replication group (recovery, certification) first drain the io thread, so the two never
interleave on that group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gemscout import _dist as comm
from gemscout.config import TrustState
from gemscout.errors import CollectiveTimeout
from gemscout.gemini import adoption, store
from gemscout.gemini.coalesce import FreeSlotVote
from gemscout.gemini.config import CheckpointConfig
from gemscout.gemini.exchange import Frame
from gemscout.gemini.parts import build_parts
from gemscout.gemini.recovery import RecoveryDecision
from gemscout.gemini.replication import Placement
from gemscout.gemini.slots import Slot
from gemscout.state import integrity, training_state
from gemscout.state.layout import Parsed

log = logging.getLogger("gemscout.gemini")


class Checkpointer:
    """GEMINI for one rank. Construct on every rank of ``group`` (collective). Its parts are built by
    :func:`gemscout.gemini.parts.build_parts` and held here as attributes; this class runs them."""

    def __init__(
        self,
        sources: training_state.StateSources,
        config: CheckpointConfig,
        *,
        group: dist.ProcessGroup,
        rank: int,
        placement: Placement,
        run_id: str,
        topology_digest: str,
        on_decision: Callable[[RecoveryDecision], None] | None = None,
    ) -> None:
        self.sources, self.config, self.group, self.rank = sources, config, group, rank
        if config.integrity_key is not None:
            integrity.use_key(
                config.integrity_key
            )  # every frame this process writes or reads is then keyed
        self.run_id, self.topology_digest = run_id, topology_digest
        self.on_decision = on_decision
        parts = build_parts(
            sources,
            config,
            group=group,
            rank=rank,
            placement=placement,
            run_id=run_id,
            topology_digest=topology_digest,
            on_decision=on_decision,
            drain=self.drain,  # called by recovery only, once this checkpointer is built
        )
        # Held one by one: callers and tests use them as attributes (see CheckpointerParts for each).
        self.placement, self.identity, self.paths = parts.placement, parts.identity, parts.paths
        self.memory, self.replicating = parts.memory, parts.replicating
        self.pool, self.spares, self.replicas = parts.pool, parts.spares, parts.replicas
        self.replication, self.capturer = parts.replication, parts.capturer
        self.ledger = parts.ledger
        self._io, self.stats, self.errors = parts.io, parts.stats, parts.errors
        self.pipeline, self.sharded, self.durable = parts.pipeline, parts.sharded, parts.durable
        self.promoter, self.recovery_parts = parts.promoter, parts.recovery
        self.captures = 0
        self.when_busy = "wait"
        self._vote: FreeSlotVote | None = None
        self.skipped_steps: list[int] = []
        """Steps whose capture was skipped (``when_busy="skip"``) because some rank's io still held every slot."""
        self.set_when_busy(config.when_busy)
        # Local only, after every collective of the construction (build_parts' and set_when_busy's groups).
        store.clean_stale_temps(self.paths.root)
        if self.memory is not None:
            adoption.adopt(
                self.memory,
                rank=rank,
                slots=config.slots,
                pool=self.pool,
                held=self.pipeline.held,
                check_identity=self.identity.check,
            )

    # ------------------------------------------------------------------ io state (the pipeline's)
    @property
    def phase_hook(self) -> Callable[[str, int], None] | None:
        """Fault-injection seam: see :attr:`CapturePipeline.phase_hook
        <gemscout.gemini.capture_pipeline.CapturePipeline.phase_hook>`. The harness sets it to kill at a phase."""
        return self.pipeline.phase_hook

    @phase_hook.setter
    def phase_hook(self, hook: Callable[[str, int], None] | None) -> None:
        self.pipeline.phase_hook = hook

    @property
    def persisted_step(self) -> int:
        """Newest own step written to disk by this rank; -1 before the first."""
        return self.pipeline.persisted_step

    @property
    def persisted_replica(self) -> dict[int, int]:
        """Per owner, the newest of its replicas this rank wrote to disk."""
        return self.pipeline.persisted_replica

    @property
    def frontier(self) -> int:
        """Newest step that every rank has persisted together with its replica (agreed on the io thread)."""
        return self.pipeline.frontier

    @property
    def retained(self) -> frozenset[int]:
        """The steps of the last :meth:`retain`."""
        return self.pipeline.retained

    # ------------------------------------------------------------------ capture
    def set_when_busy(self, mode: str) -> None:
        """Switch between ``"wait"`` and ``"skip"`` (see CheckpointConfig.when_busy). Collective: every rank calls
        it at the same point (the first ``"skip"`` creates the vote's group)."""
        if mode not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {mode!r}")
        if self._vote is not None:
            self._vote.settle()
        if mode == "skip" and self._vote is None:
            # Its own group: the vote belongs to the training thread, the io thread's collectives to another.
            group = (
                dist.new_group(backend="gloo", timeout=self.config.timeout)
                if self.placement.world_size > 1
                else None
            )
            self._vote = FreeSlotVote(self.pool, group, self.config.timeout)
        self.when_busy = mode

    def capture(self, step: int, *, initial: bool = False, durable: bool = False) -> None:
        """Capture ``step`` now. Blocks only for the synchronous part (see :class:`Capturer`); with
        ``when_busy="skip"`` it first agrees with every rank whether to capture at all.

        ``initial``: the step-0 capture at attach, outside any optimizer step; always taken and persisted.
        ``durable``: written to disk whatever ``persist_every`` says. The session asks for it on the steps a SCOUT
        cycle ran at: only those can become recovery-verified later, when their memory slots may be gone, and a
        rollback to the newest verified step must find it. Every rank passes the same value (cycles are
        collective)."""
        skipping = not initial and self.when_busy == "skip" and self._vote is not None
        if skipping:
            assert self._vote is not None
            t0 = time.perf_counter()
            if self._vote.should_skip():
                self.skipped_steps.append(step)
                self.stats["skipped_captures"] += 1
                self._vote.post()
                self.stats["capture_stall_s"] = time.perf_counter() - t0
                return
        state = training_state.collect(self.sources, step, inside_step=not initial)
        identity = {
            "run_id": self.run_id,
            "topology": self.topology_digest,
            "owner": self.rank,
            "step": step,
        }
        if not initial:
            self.captures += 1
            self.promoter.note_capture(step)
        persist_now = self.config.persist and (
            initial or durable or self.captures % self.config.persist_every == 0
        )
        # The copy thread queues the io once the slot is sealed (``then``): waking the io thread from here would
        # only park it on the copy, and cost the training thread a second thread hand-off inside its hook.
        future = self.capturer.capture(
            state,
            identity,
            self.sources.async_pointers(),
            then=lambda slot: self._queue_io(slot, persist_now),
        )
        future.add_done_callback(self._note_copy_failure)
        self.stats["capture_stall_s"] = self.capturer.last_stall_s
        self._io.track(future)
        if skipping:
            assert self._vote is not None
            self._vote.post()  # after this capture took its slot: the vote is about the next capture

    def wait_copied(self) -> None:
        """Block until no capture reads live tensors. The optimizer pre-step hook calls this."""
        try:
            self.capturer.wait_copied()
        except FutureTimeout:
            raise CollectiveTimeout("checkpoint copy did not finish within the timeout") from None

    def _queue_io(self, slot: Slot, persist_now: bool) -> None:
        """On the copy thread, in capture order: queue the sealed slot's io (so io runs in step order too)."""
        self.queue_io(self.pipeline.run, slot, persist_now)

    def queue_io(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the io thread after everything queued before it (:meth:`drain` waits for it)."""
        self._io.submit(fn, *args)

    def _note_copy_failure(self, future: Future[Slot]) -> None:
        exc = future.exception()
        if (
            exc is not None
        ):  # the copy failed: the slot was never sealed, and no io was queued for it
            self.errors.append(f"capture failed: {exc}")
            log.error("gemini capture failed: %s", exc)

    def verify_frame(
        self, frame: Frame, *, owner: int, step: int | None, verified: Parsed | None = None
    ) -> int:
        """:meth:`Identity.verify_frame <gemscout.gemini.exchange.Identity.verify_frame>` for this run."""
        return self.identity.verify_frame(frame, owner=owner, step=step, verified=verified)

    def check_identity(self, ident: dict[str, Any], *, where: str) -> None:
        self.identity.check(ident, where=where)

    def metrics(self) -> dict[str, int | float | None]:
        """This rank's GEMINI counters for ``Session.metrics()``, each part's own ``stats()`` joined. No lock, no
        collective: what the io thread updates may be one capture behind."""
        pool = self.pool.stats()
        return {
            "captures": self.captures,
            "skipped_captures": int(self.stats["skipped_captures"]),
            "capture_stall_s": float(self.stats["capture_stall_s"]),
            "persist_s": float(self.stats["persist_s"]),
            "replicate_s": float(self.stats["replicate_s"]),
            "replicated_bytes": int(self.stats["replicate_sent_bytes"]),
            "io_errors": len(self.errors),
            "newest_in_memory_step": pool["newest_in_memory_step"],
            "newest_persisted_step": self.persisted_step if self.persisted_step >= 0 else None,
            **self.ledger.stats(),
            "buffer_bytes": (pool["buffer_bytes"] or 0)
            + sum(b.nbytes for b in list(self.replicas.values())),
        }

    # ------------------------------------------------------------------ flush / drain
    def drain(self, timeout: timedelta | None = None, *, wait_for_peers: bool = True) -> None:
        """Wait for every queued persist/replicate job. Raises CollectiveTimeout past ``timeout`` and, with
        ``wait_for_peers`` False, as soon as the io is stuck in an exchange with a peer (``stuck_on_peers``)."""
        self._io.drain(
            self.config.timeout if timeout is None else timeout,
            give_up=None if wait_for_peers else self.pipeline.stuck_on_peers,
        )

    def flush(self, timeout: timedelta | None = None, *, wait_for_peers: bool = True) -> int:
        """Persist the newest recoverable state: drain, then write the newest capture and held replicas if not on
        disk yet. Issues no collective, so it is safe in a signal handler. ``wait_for_peers`` False (the signal
        handler): stop waiting once the io is stuck in an exchange with a peer, which after a peer's death can
        never finish; the capture it replicates is sealed and written from memory. Returns the newest persisted
        own step."""
        try:
            self.drain(
                self.config.flush_timeout if timeout is None else timeout,
                wait_for_peers=wait_for_peers,
            )
        except CollectiveTimeout as exc:
            log.warning("gemini flush: %s; writing what is sealed", exc)
        if not self.config.persist:
            return self.persisted_step
        return self.pipeline.persist_sealed()

    # ------------------------------------------------------------------ trust
    def retain(self, steps: Iterable[int]) -> None:
        """Keep the captures of ``steps`` (own files, held replicas) past ``keep_generations`` until the next call:
        SCOUT's session names those a later certification can still name (certifying ``s`` marks captures up to
        ``s``). The newest RECOVERY_VERIFIED / DURABLE step after step 0 is kept anyway. Same steps on every rank."""
        self.pipeline.retain(steps)

    def certify(self, step: int) -> list[int]:
        """Collectively mark every candidate <= ``step`` RECOVERY_VERIFIED (all ranks must call); queues a durable
        promotion when one is due (see :mod:`gemscout.gemini.promotion`). Returns the steps changed."""
        self.drain()
        ok = comm.all_agree(True, group=self.group, timeout=self.config.timeout)
        changed = self.ledger.certify_through(step) if ok else []
        self.ledger.save()
        if ok:
            self.promoter.on_certified(step)
        return changed

    def reject_candidates(self, reason: str) -> list[int]:
        """Collectively mark every uncertified candidate REJECTED (all ranks must call)."""
        self.drain()
        comm.all_agree(True, group=self.group, timeout=self.config.timeout)
        rejected = self.ledger.reject_uncertified()
        self.ledger.last_decision = {"rejected": rejected, "reason": reason}
        self.ledger.save()
        return rejected

    # ------------------------------------------------------------------ recovery
    def recover(
        self,
        *,
        failure_kind: str = "restart",
        fallback: Callable[[], int] | None = None,
        min_trust: TrustState | None = None,
    ) -> RecoveryDecision:
        """Collectively choose and restore a step (all ranks must call); see :func:`gemscout.gemini.restore.recover`.

        Raises RecoveryError when the decision is STOP (the caller should exit with its exit code).
        """
        from gemscout.gemini.restore import recover

        decision = recover(
            self.recovery_parts, failure_kind=failure_kind, fallback=fallback, min_trust=min_trust
        )
        # Every rank restored the same step and nothing is in flight: it is the memory frontier now (held where
        # recovery found it), and whatever newer a slot or replica holds is of the abandoned trajectory.
        frontier = decision.step if decision.step is not None else -1
        self.pool.reset_frontier(frontier)
        for buffers in self.replicas.values():
            buffers.reset_frontier(frontier)
        return decision

    def close(
        self,
        timeout: timedelta | None = None,
        *,
        release_memory: bool = True,
        wait_for_peers: bool = True,
    ) -> None:
        """Drain pending work (bounded) and stop the threads. ``release_memory``: the job is done with this rank's
        memory tier, delete it; False (a signal, exit cleanup) keeps it for a restart of this rank to adopt.
        ``wait_for_peers``: as for :meth:`flush`."""
        try:
            self.drain(
                self.config.flush_timeout if timeout is None else timeout,
                wait_for_peers=wait_for_peers,
            )
        except CollectiveTimeout as exc:
            log.warning("gemini close: %s", exc)
        self._io.shutdown()
        self.capturer.shutdown()
        self.spares.discard()
        if self.memory is not None:
            self.memory.close(release=release_memory)

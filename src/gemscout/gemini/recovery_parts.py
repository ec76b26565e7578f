"""What recovery (:mod:`gemscout.gemini.restore` and :mod:`gemscout.gemini.proposal`) uses of its rank's
checkpointer, as a :class:`RecoveryParts` built once by :func:`~gemscout.gemini.parts.build_parts`; recovery holds no reference to
the checkpointer itself. Its own module so that both recovery modules import it without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datetime import timedelta

    import torch.distributed as dist

    from gemscout.config import TrustState
    from gemscout.gemini.durable import DurableTier
    from gemscout.gemini.lifecycle import TrustLedger
    from gemscout.gemini.recovery import RecoveryDecision
    from gemscout.gemini.replication import ReplicaBuffers
    from gemscout.gemini.slots import SlotPool
    from gemscout.gemini.store import RankPaths
    from gemscout.state.training_state import StateSources


@dataclass(frozen=True, slots=True)
class RecoveryParts:
    """What :func:`gemscout.gemini.restore.recover` and :func:`gemscout.gemini.proposal.propose` use of their
    rank's checkpointer, built once by :func:`~gemscout.gemini.parts.build_parts` after all of these exist.

    The objects are the checkpointer's own, shared, not copied: the ledger, the slot pool and the held replicas are
    the ones it keeps (recovery reads them and updates the ledger in place), and the checkpointer never re-assigns
    any of them after construction; the values never change after construction."""

    rank: int
    """This rank: the owner of its own slots and files, and its place in every recovery collective."""
    group: dist.ProcessGroup
    """The replication group, on which every rank gathers proposals and outcomes and peers transfer frames."""
    timeout: timedelta
    """``CheckpointConfig.timeout``: bounds every collective and transfer of a recovery."""
    chunk_bytes: int
    """``CheckpointConfig.chunk_bytes``: the chunk size of a peer transfer."""
    min_trust: TrustState
    """``CheckpointConfig.min_trust``: the weakest trust state a recovery restores, unless the call names one."""
    max_recovery_attempts: int
    """``CheckpointConfig.max_recovery_attempts``: restores of the same step before the decision skips it."""
    run_id: str
    """This run's id, which names the decided checkpoint (``run_id:step``)."""
    topology_digest: str
    """This run's topology digest, recorded in every decision."""
    ledger: TrustLedger
    """This rank's trust ledger: its records are proposed, restore attempts and the last decision are written to
    it and saved."""
    durable: DurableTier | None
    """The durable (DCP) tier, scanned for a proposal and loaded from on a DURABLE decision; None without
    ``durable_directory``."""
    sources: StateSources
    """The live training state a chosen frame (or the durable tier) is restored into."""
    pool: SlotPool
    """This rank's slots: its ready ones are proposed as ``memory``."""
    replicas: dict[int, ReplicaBuffers]
    """The replicas this rank holds in memory, per owner (the checkpointer's dict, filled as they arrive): proposed
    as ``memory_held``."""
    paths: RankPaths
    """This rank's folders: its own files and the replicas it holds on disk are proposed from them."""
    drain: Callable[[], None]
    """``drain()`` waits for the checkpointer's io thread (``Checkpointer.drain``), so no replication collective
    interleaves with recovery's on the group."""
    verify_frame: Callable[..., int]
    """Called as ``verify_frame(frame, owner=..., step=..., verified=...)`` on a fetched frame; raises for one that
    does not verify (:meth:`Identity.verify_frame <gemscout.gemini.exchange.Identity.verify_frame>`)."""
    check_identity: Callable[..., None]
    """Called as ``check_identity(identity, where=...)`` on a proposed file's header; raises for another run's
    file."""
    on_decision: Callable[[RecoveryDecision], None] | None
    """The checkpointer's ``on_decision`` callback, called with every decision before it is acted on; None for
    none."""

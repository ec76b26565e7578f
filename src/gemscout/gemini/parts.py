"""The parts of one rank's GEMINI checkpointer, built once and wired to each other: its folders, memory tier, slot
pool, replication strategy, trust ledger, io thread, capture pipeline, durable tier, promoter and what recovery uses.

:func:`build_parts` is the whole construction; the :class:`~gemscout.gemini.checkpointer.Checkpointer` holds what it
returns and runs the parts (capture, drain, trust, recover, close). Each part that needs another is handed it here,
as one of the ``*Parts`` records (:class:`~gemscout.gemini.capture_pipeline.PipelineParts`,
:class:`~gemscout.gemini.promotion.PromotionParts`, :class:`~gemscout.gemini.recovery_parts.RecoveryParts`), never
the checkpointer itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from gemscout._tensors import is_dtensor
from gemscout.gemini import adoption, store
from gemscout.gemini.capture_pipeline import CapturePipeline, PipelineParts
from gemscout.gemini.config import CheckpointConfig, default_digest_threads
from gemscout.gemini.durable import DurableTier
from gemscout.gemini.exchange import Identity, Replication, replication_for
from gemscout.gemini.io_thread import IoThread
from gemscout.gemini.lifecycle import TrustLedger
from gemscout.gemini.natural import natural_placement
from gemscout.gemini.promotion import Promoter, PromotionParts
from gemscout.gemini.recovery import RecoveryDecision
from gemscout.gemini.recovery_parts import RecoveryParts
from gemscout.gemini.replication import Placement, ReplicaBuffers
from gemscout.gemini.shm import MemoryTier
from gemscout.gemini.slots import SlotPool
from gemscout.gemini.snapshot import Capturer
from gemscout.state import training_state


@dataclass(frozen=True, slots=True)
class CheckpointerParts:
    """Everything :func:`build_parts` built for one rank's checkpointer. The parts are shared, not copied: the
    pipeline, the promoter and recovery were each handed the same pool, replicas, ledger, stats and error list the
    checkpointer holds, so none of them may be re-assigned after construction."""

    placement: Placement
    """The placement the checkpointer runs with: the one passed, or its natural refinement
    (``replication="natural"``, replicating)."""
    identity: Identity
    """This run's identity (run id, topology digest), which every frame is checked against."""
    paths: store.RankPaths
    """This rank's folders on disk (``CheckpointConfig.directory``)."""
    memory: MemoryTier | None
    """This rank's memory tier (see :func:`gemscout.gemini.adoption.open_memory`); None without one."""
    replicating: bool
    """``CheckpointConfig.replicate`` and the placement has somewhere to replicate to."""
    pool: SlotPool
    """This rank's capture slots."""
    spares: store.Spares
    """Pruned files kept for the next write in their folder to overwrite (io CPU; see store.Spares)."""
    replication: Replication
    """The replication strategy (``CheckpointConfig.replication``)."""
    capturer: Capturer
    """Copies each capture into a slot (the ``gemini-copy`` thread)."""
    replicas: dict[int, ReplicaBuffers]
    """The replicas this rank holds in memory, per owner; filled by the pipeline as they arrive."""
    ledger: TrustLedger
    """This rank's trust ledger, loaded from its status file."""
    io: IoThread
    """The ``gemini-io`` thread, which runs each capture's pipeline and durable promotions in order."""
    stats: dict[str, float]
    """Timings of the last capture; ``replicate_*`` and ``natural_divergent_shards`` add up over the run."""
    errors: list[str]
    """Failures of the copy and io threads, appended as they happen."""
    pipeline: CapturePipeline
    """The io of each sealed capture, on the io thread (:mod:`gemscout.gemini.capture_pipeline`)."""
    sharded: bool
    """DTensor parameters (FSDP2, HSDP, TP) or rank-local state (DeepSpeed ZeRO partitions): durable promotions
    are collective, on a group of their own."""
    durable: DurableTier | None
    """The durable (DCP) tier; None without ``CheckpointConfig.durable_directory``."""
    promoter: Promoter
    """Chooses and queues durable promotions (:mod:`gemscout.gemini.promotion`)."""
    recovery: RecoveryParts
    """What recovery (:func:`gemscout.gemini.restore.recover`) uses of this checkpointer."""


def build_parts(
    sources: training_state.StateSources,
    config: CheckpointConfig,
    *,
    group: dist.ProcessGroup,
    rank: int,
    placement: Placement,
    run_id: str,
    topology_digest: str,
    on_decision: Callable[[RecoveryDecision], None] | None,
    drain: Callable[[], None],
) -> CheckpointerParts:
    """Build the parts of ``rank``'s checkpointer. Collective: every rank of ``group`` calls it, in the same order
    as its other group creations (a durable tier creates its own group here). ``drain()`` is the checkpointer's:
    recovery calls it to wait for the io thread, never during construction. Loads the ledger and opens the memory
    tier, but adopts nothing from it (the checkpointer does, once every collective of its construction is done)."""
    identity = Identity(run_id, topology_digest)
    if config.replication == "natural" and config.replicate and placement.enabled:
        placement = natural_placement(placement, sources.model)
    paths = store.RankPaths.of(config.directory, node=placement.node_of(rank), rank=rank)
    memory = adoption.open_memory(
        config, run_id=run_id, node=placement.node_of(rank), rank=rank, disk_root=paths.root
    )
    replicating = config.replicate and placement.enabled
    pool = SlotPool(
        config.slots,
        memory,
        files_expected=config.slots * (2 if replicating else 1),
        replicated=replicating,
    )
    spares = store.Spares()
    replication = replication_for(
        config.replication,
        group=group,
        chunk_bytes=config.chunk_bytes,
        timeout=config.timeout,
        identity=identity,
    )
    capturer = Capturer(
        pool,
        async_copy=config.async_copy,
        timeout=config.timeout,
        digest_threads=config.digest_threads or default_digest_threads(),
    )
    replicas: dict[int, ReplicaBuffers] = {}
    ledger = TrustLedger.load(paths.status, fsync=config.fsync)
    ledger.run_id = run_id
    io = IoThread()
    errors: list[str] = []
    stats: dict[str, float] = {
        "capture_stall_s": 0.0,
        "replicate_s": 0.0,
        "persist_s": 0.0,
        "replicate_sent_bytes": 0,
        "replicate_sent_tensors": 0,
        "natural_divergent_shards": 0,
        "skipped_captures": 0,
        "acknowledge_s": 0.0,
    }
    pipeline = CapturePipeline(
        PipelineParts(
            rank=rank,
            group=group,
            placement=placement,
            replicating=replicating,
            timeout=config.timeout,
            fsync=config.fsync,
            slots=config.slots,
            keep_generations=config.keep_generations,
            memory=memory,
            pool=pool,
            replicas=replicas,
            replication=replication,
            ledger=ledger,
            paths=paths,
            spares=spares,
            stats=stats,
            errors=errors,
        )
    )
    sharded = sources.rank_local or any(is_dtensor(p) for p in sources.model.parameters())
    durable = None
    if config.durable_directory is not None:
        # Collective (every rank builds the same parts). Its own group: a promotion's DCP collectives never
        # interleave with the replication exchange, and its timeout bounds every wait.
        durable_group = dist.new_group(backend="gloo", timeout=config.timeout)
        durable = DurableTier(
            config.durable_directory,
            run_id=run_id,
            fsync=config.fsync,
            group=durable_group,
            rank=rank,
        )
    promoter = Promoter(
        PromotionParts(
            durable_every=config.durable_every,
            timeout=config.timeout,
            durable=durable,
            ledger=ledger,
            own_dir=paths.own,
            group=group,
            rank=rank,
            sources=sources,
            sharded=sharded,
            check_identity=identity.check,
            queue_io=io.submit,
            errors=errors,
        )
    )
    recovery = RecoveryParts(
        rank=rank,
        group=group,
        timeout=config.timeout,
        chunk_bytes=config.chunk_bytes,
        min_trust=config.min_trust,
        max_recovery_attempts=config.max_recovery_attempts,
        run_id=run_id,
        topology_digest=topology_digest,
        ledger=ledger,
        durable=durable,
        sources=sources,
        pool=pool,
        replicas=replicas,
        paths=paths,
        drain=drain,
        verify_frame=identity.verify_frame,
        check_identity=identity.check,
        on_decision=on_decision,
    )
    return CheckpointerParts(
        placement=placement,
        identity=identity,
        paths=paths,
        memory=memory,
        replicating=replicating,
        pool=pool,
        spares=spares,
        replication=replication,
        capturer=capturer,
        replicas=replicas,
        ledger=ledger,
        io=io,
        stats=stats,
        errors=errors,
        pipeline=pipeline,
        sharded=sharded,
        durable=durable,
        promoter=promoter,
        recovery=recovery,
    )

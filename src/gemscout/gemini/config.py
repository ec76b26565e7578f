"""GEMINI's configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from gemscout.config import TrustState, require, strict_fields

KiB, MiB = 1024, 1024 * 1024


def default_digest_threads() -> int:
    """``CheckpointConfig.digest_threads=None``: one copy-and-hash thread per 8 cores this process may use, 1..4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // 8))


@strict_fields
@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig:
    """How GEMINI captures, replicates, persists and recovers checkpoints."""

    directory: Path
    """Root of this job's local checkpoint files (``node-<n>/rank-<r>/...``). Required."""
    slots: int = 2
    """In-memory slots per rank (>= 2): the newest checkpoint plus one that may still be in flight to a peer."""
    replicate: bool = True
    """Send every capture to a peer's memory (and the peer's disk when ``persist``)."""
    replication: str = "ring"
    """Where replicas go. ``"ring"``: the same local rank ``replication_jump`` nodes further on, the whole checkpoint
    sent. ``"natural"`` (HSDP): the next rank of the own replicate group, which already holds the identical shard and
    optimizer state; only the tensors whose digests differ (caller state) are sent (see gemini/natural.py)."""
    replication_jump: int = 1
    """Replicas go ``jump`` nodes further on the ring (same local rank); 1 .. nodes-1."""
    ranks_per_node: int | None = None
    """Ranks that share a node (fail together). Default: ``LOCAL_WORLD_SIZE``, else the world size."""
    chunk_bytes: int = 16 * MiB
    """Replication chunk size, 256 KiB .. 64 MiB."""
    persist: bool = True
    """Write own checkpoints and held replicas to ``directory``."""
    persist_every: int = 10
    """Write every N-th capture (and the step-0 capture) to ``directory``, fsynced when ``fsync``: what survives a
    power loss of the node or of the whole cluster. Every capture lives in the memory tier (``memory_directory``,
    survives a killed process) and in its ring peer's (survives the loss of the node), and backpressure keeps the
    newest step every rank holds in memory, so disk is the power-loss tier, not the crash tier: a power loss loses
    at most ``persist_every`` captures. The write runs on the io thread after the replicas are acknowledged, off the
    path a capture waits on. 1 writes every capture (the cost of two fsynced files each); a SIGTERM flush persists
    the newest capture regardless (docs/gemini.md, "What each tier survives")."""
    memory_directory: Path | None = Path("/dev/shm/gemscout")
    """A tmpfs folder where capture slots and held replicas live as mapped files that survive the training
    process (see gemini/shm.py): a rank restarted on the same node recovers from it without reading disk. Keyed by
    run id and ``directory``; each rank's folder is tied to an anchor file in its ``directory`` folder, so losing
    that folder loses the memory too. None keeps slots in process memory. The default is used only where
    ``/dev/shm`` exists."""
    stale_memory_after: timedelta = timedelta(minutes=10)
    """A start removes memory folders of other runs whose owner process is dead and that nothing touched for this
    long: the time a launcher may take to restart that job and re-claim them (a restart slower than this recovers
    from disk or its peers instead). When the tmpfs lacks room for this job, dead jobs' folders go at once."""
    when_busy: str = "wait"
    """What a capture does when every slot is still pinned by an earlier capture's io. ``"wait"``: block until one
    is free (bounded by ``timeout``) — every due step is captured, so a failure loses at most ``interval`` steps.
    ``"skip"``: the ranks agree (one small all-reduce on a group of its own) and all skip this capture (newest
    wins; counted in ``stats["skipped_captures"]``) — the training thread never waits for the io, and a failure loses
    at most the steps of one capture pipeline (its duration over the step time, plus one)."""
    keep_generations: int = 2
    """Generations kept on disk per owner (>= 1)."""
    fsync: bool = True
    """fsync files and folders on publish; only turn off for throwaway runs."""
    async_copy: bool = True
    """Copy parameters and optimizer state on a background thread that overlaps the next forward/backward."""
    digest_threads: int | None = None
    """Threads that copy and BLAKE3-hash a capture's parameters and optimizer state at once (hashing is most of a
    capture's CPU). None: :func:`default_digest_threads` — one per 8 usable cores, 1 to 4 (an 8-GPU node with 64+
    cores gets several; a small machine 1, where extra threads would only take cores from training)."""
    min_trust: TrustState = TrustState.CANDIDATE
    """Weakest trust state a restart (and ``session.recover()``) may restore: what a crash costs versus what it
    trusts. ``CANDIDATE`` (default, with or without SCOUT): the newest capture not rejected — a crash loses at most
    ``interval`` steps; a candidate SCOUT has not vouched for yet is restored too (a replica whose state diverged is
    still named by SCOUT's parameter digests after the restart, and the next clean rotation certifies the restored
    step). ``RECOVERY_VERIFIED``: only a step SCOUT has certified (the validation report's behaviour) — a crash may
    go back a whole rotation (docs/scout.md, "Trust on restart"). ``DURABLE``: only promoted steps."""
    max_recovery_attempts: int = 3
    """Restores of the same step before it is skipped; when every source is exhausted the decision is STOP."""
    run_id: str | None = None
    """Identity of the run; a checkpoint of another run is refused. Default: env GEMSCOUT_RUN_ID, torchelastic's
    run id, the id recorded in ``directory``, or a new one broadcast from rank 0."""
    durable_directory: Path | None = None
    """Where durable (``torch.distributed.checkpoint``) promotions go; shared by all ranks. None disables."""
    durable_every: int = 0
    """Promote every N-th recovery-verified capture to the durable tier (0 = never)."""
    timeout: timedelta = timedelta(seconds=300)
    """Bound on every blocking call: a free slot, a transfer, an agreement."""
    flush_timeout: timedelta = timedelta(seconds=60)
    """Bound on draining pending io at flush() and close()."""
    signal_timeout: timedelta = timedelta(seconds=2)
    """How long the SIGTERM/SIGINT handler waits for pending io before it writes what is sealed itself and stops
    the threads. The handler must end well inside the launcher's grace before SIGKILL (torchrun's is 30 s, Slurm's
    KillWait 30 s by default). It stops waiting sooner once the io is stuck in an exchange with a peer: a survivor
    of a dead peer sits in one that can never finish (gloo may not notice the peer is gone), and the memory tier
    outlives the process anyway. The write of the newest sealed capture after the wait is not cut short."""
    handle_signals: bool = True
    """Install SIGTERM/SIGINT handlers that flush and then chain to the previous handler."""
    integrity_key: bytes | str | None = field(default=None, repr=False)
    """The job's secret (bytes or hex, >= 16 bytes) for authenticated checkpoints: every frame's header digest
    becomes a keyed MAC and durable sidecars carry an HMAC, so a file or replica forged without the key is refused.
    None: env ``GEMSCOUT_INTEGRITY_KEY_FILE`` / ``GEMSCOUT_INTEGRITY_KEY``, else unauthenticated digests (see
    docs/gemini.md). Never printed by ``repr``."""

    def __post_init__(self) -> None:
        c = "CheckpointConfig"
        require(
            isinstance(self.directory, str | Path) and str(self.directory) != "",
            c,
            "directory",
            "give the folder for checkpoint files, e.g. directory='/local/ckpt'",
        )
        object.__setattr__(self, "directory", Path(self.directory))
        if self.durable_directory is not None:
            object.__setattr__(self, "durable_directory", Path(self.durable_directory))
        require(
            self.memory_directory is None
            or (isinstance(self.memory_directory, str | Path) and str(self.memory_directory) != ""),
            c,
            "memory_directory",
            "give a tmpfs folder (e.g. '/dev/shm/gemscout') or None to keep slots in process memory",
        )
        if self.memory_directory is not None:
            object.__setattr__(self, "memory_directory", Path(self.memory_directory))
        require(
            self.digest_threads is None
            or (isinstance(self.digest_threads, int) and 1 <= self.digest_threads <= 64),
            c,
            "digest_threads",
            f"must be None (automatic) or an int 1..64, got {self.digest_threads!r}",
        )
        require(
            isinstance(self.slots, int) and self.slots >= 2,
            c,
            "slots",
            f"must be an int >= 2, got {self.slots!r}",
        )
        require(
            self.replication in ("ring", "natural"),
            c,
            "replication",
            f"must be 'ring' or 'natural' (HSDP replicate-group peers), got {self.replication!r}",
        )
        require(
            isinstance(self.replication_jump, int) and self.replication_jump >= 1,
            c,
            "replication_jump",
            f"must be an int >= 1, got {self.replication_jump!r}",
        )
        require(
            self.ranks_per_node is None
            or (isinstance(self.ranks_per_node, int) and self.ranks_per_node >= 1),
            c,
            "ranks_per_node",
            f"must be None or an int >= 1, got {self.ranks_per_node!r}",
        )
        require(
            isinstance(self.chunk_bytes, int) and 256 * KiB <= self.chunk_bytes <= 64 * MiB,
            c,
            "chunk_bytes",
            f"must be between 262144 (256 KiB) and 67108864 (64 MiB), got {self.chunk_bytes!r}",
        )
        require(
            self.when_busy in ("wait", "skip"),
            c,
            "when_busy",
            f"must be 'wait' (backpressure) or 'skip' (coalesce captures while io is busy), got {self.when_busy!r}",
        )
        require(
            isinstance(self.persist_every, int) and self.persist_every >= 1,
            c,
            "persist_every",
            f"must be an int >= 1, got {self.persist_every!r}",
        )
        require(
            isinstance(self.keep_generations, int) and self.keep_generations >= 1,
            c,
            "keep_generations",
            f"must be an int >= 1, got {self.keep_generations!r}",
        )
        require(
            isinstance(self.max_recovery_attempts, int) and self.max_recovery_attempts >= 1,
            c,
            "max_recovery_attempts",
            f"must be an int >= 1, got {self.max_recovery_attempts!r}",
        )
        require(
            isinstance(self.durable_every, int) and self.durable_every >= 0,
            c,
            "durable_every",
            f"must be an int >= 0 (0 disables), got {self.durable_every!r}",
        )
        require(
            self.durable_every == 0 or self.durable_directory is not None,
            c,
            "durable_directory",
            "is required when durable_every > 0",
        )
        try:
            object.__setattr__(self, "min_trust", TrustState(self.min_trust))
        except ValueError:
            require(
                False,
                c,
                "min_trust",
                f"must be one of candidate, recovery_verified, durable; got {self.min_trust!r}",
            )
        require(self.min_trust != TrustState.REJECTED, c, "min_trust", "cannot be 'rejected'")
        for name in ("timeout", "flush_timeout", "signal_timeout", "stale_memory_after"):
            value = getattr(self, name)
            require(
                isinstance(value, timedelta) and value.total_seconds() > 0,
                c,
                name,
                f"must be a positive datetime.timedelta, got {value!r}",
            )
        require(
            self.integrity_key is None or isinstance(self.integrity_key, bytes | str),
            c,
            "integrity_key",
            "must be bytes, a hex string or None",
        )
        require(
            self.run_id is None or (isinstance(self.run_id, str) and self.run_id.strip() != ""),
            c,
            "run_id",
            "must be a non-empty string or None",
        )

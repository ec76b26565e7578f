"""Recovery for one rank's GEMINI: propose what this rank can load and verify, decide with every rank, fetch the
chosen frame (memory, disk or a peer), verify it, and restore it into the live objects.

The choice itself is the pure :func:`gemscout.gemini.recovery.decide`; this module is the collective around it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gemscout.config import TrustState
from gemscout.errors import IntegrityError, RecoveryError, RunMismatchError
from gemscout.gemini import comm, store
from gemscout.gemini.recovery import RecoveryDecision, RecoveryMode, decide
from gemscout.state import training_state
from gemscout.state.codec import decode
from gemscout.state.layout import parse_prefix

if TYPE_CHECKING:
    from gemscout.gemini.checkpointer import Checkpointer

log = logging.getLogger("gemscout.gemini")

Frame = tuple[bytes, torch.Tensor]


def propose(ck: Checkpointer) -> tuple[dict[str, Any], dict[tuple[str, int, int], Any]]:
    """What this rank can load and verify, and where each item lives (for the transfers)."""
    where: dict[tuple[str, int, int], Any] = {}
    memory = []
    for slot in ck.pool.ready_slots():
        memory.append(slot.step)
        where[("memory", ck.rank, slot.step)] = slot.frame()
    own = []
    unusable: list[str] = []
    for step in store.list_steps(ck.paths.own):
        if step in memory:
            continue  # memory is preferred for this step: reading and hashing the file would be wasted time
        path = store.step_file(ck.paths.own, step)
        try:
            parsed, _ = store.read_verified(path)
            ck.check_identity(parsed.identity, where=str(path))
        except (IntegrityError, OSError) as exc:
            log.warning("gemini: %s is unusable: %s", path, exc)
            unusable.append(f"rank {ck.rank} own step {step}: {exc}")
            continue
        own.append(step)
        where[("local", ck.rank, step)] = path
    memory_held = {str(o): b.steps() for o, b in ck.replicas.items()}
    for o, b in ck.replicas.items():
        for s, prefix, data in b.entries:
            where[("memory_held", o, s)] = (prefix, data)
    held: dict[str, list[int]] = {}
    for o in ck.paths.held_owners():
        for step in store.list_steps(ck.paths.replicas(o)):
            if step in memory_held.get(str(o), []):
                continue  # the replica in memory is preferred
            path = store.step_file(ck.paths.replicas(o), step)
            try:
                parsed, _ = store.read_verified(path)
                ck.check_identity(parsed.identity, where=str(path))
                if parsed.identity.get("owner") != o:
                    raise IntegrityError("owner mismatch")
            except (IntegrityError, OSError) as exc:
                log.warning("gemini: replica %s is unusable: %s", path, exc)
                unusable.append(f"rank {ck.rank} replica of rank {o} step {step}: {exc}")
                continue
            held.setdefault(str(o), []).append(step)
            where[("held", o, step)] = path
    proposal = {"rank": ck.rank, "memory": memory, "own": own, "held": held, "memory_held": memory_held,
                "unusable": unusable, "durable": ck.durable.newest_step() if ck.durable else None}
    proposal.update(ck.ledger.summary())
    return proposal, where

def recover(ck: Checkpointer, *, failure_kind: str = "restart", fallback: Callable[[], int] | None = None,
            min_trust: TrustState | None = None) -> RecoveryDecision:
    """Collectively choose and restore a step (all ranks must call). Returns the decision after restoring.

    Raises RecoveryError when the decision is STOP (the caller should exit with its exit code).
    """
    ck.drain()
    excluded: set[int] = set()
    for _ in range(ck.config.max_recovery_attempts + 2):
        proposal, where = propose(ck)
        for s in excluded:
            proposal["rejected"] = sorted(set(proposal["rejected"]) | {s})
        proposals = comm.gather_json(proposal, group=ck.group, timeout=ck.config.timeout)
        seen = [p.get("durable") for p in proposals]
        durable_step = min(seen) if all(d is not None for d in seen) else None  # type: ignore[type-var]
        decision = decide(proposals, run_id=ck.run_id, topology_digest=ck.topology_digest,
                          min_trust=min_trust or ck.config.min_trust, max_attempts=ck.config.max_recovery_attempts,
                          failure_kind=failure_kind, durable_step=durable_step, has_fallback=fallback is not None)
        if decision.mode == RecoveryMode.RESTORE:
            assert decision.step is not None
            frame, err = _fetch(ck, decision, where)
            if not comm.all_agree(err is None, group=ck.group, timeout=ck.config.timeout):
                log.warning("gemini: step %d failed verification somewhere (%s); trying an older one",
                            decision.step, err or "on a peer")
                excluded.add(decision.step)
                continue
            _deliver(ck, decision)
            assert frame is not None
            restore_frame(ck, frame)
            ck.ledger.attempts[decision.step] = ck.ledger.attempts.get(decision.step, 0) + 1
        else:
            _deliver(ck, decision)
            if decision.mode == RecoveryMode.STOP:
                ck.ledger.last_decision = decision.to_dict()
                ck.ledger.save()
                raise RecoveryError(f"recovery stopped: {decision.reason}")
            if decision.mode == RecoveryMode.DURABLE:
                assert ck.durable is not None and decision.step is not None
                ck.durable.load(decision.step, ck.sources)
            elif decision.mode == RecoveryMode.FALLBACK and fallback is not None:
                decision = _with_step(decision, fallback())
        ck.ledger.last_decision = decision.to_dict()
        ck.ledger.save()
        return decision
    raise RecoveryError("recovery stopped: every candidate step failed verification")

def _deliver(ck: Checkpointer, decision: RecoveryDecision) -> None:
    log.info("gemini recovery decision: %s", decision.to_dict())
    if ck.on_decision is not None:
        ck.on_decision(decision)

def _fetch(ck: Checkpointer, decision: RecoveryDecision, where: dict[tuple[str, int, int], Any]) -> tuple[Frame | None, str | None]:
    """Gather this rank's frame for the decided step: from memory, disk, or a peer. Returns (frame, error)."""
    step = decision.step
    assert step is not None
    frame: Frame | None = None
    err: str | None = None
    for owner in sorted(decision.sources):
        src = decision.sources[owner]
        holder = int(src.split(":")[1]) if src.startswith("peer:") else owner
        if src.startswith("peer:") and ck.rank == holder:
            comm.exchange(_held_frame(ck, where, owner, step), owner, None, group=ck.group,
                          chunk_bytes=ck.config.chunk_bytes, timeout=ck.config.timeout)
        if ck.rank == owner:
            try:
                if src.startswith("peer:"):
                    frame = comm.exchange(None, None, holder, group=ck.group,
                                          chunk_bytes=ck.config.chunk_bytes, timeout=ck.config.timeout)
                elif src == "memory":
                    frame = where[("memory", owner, step)]
                else:
                    frame = _split(store.read_raw(where[("local", owner, step)]))
                assert frame is not None
                ck.verify_frame(frame, owner=owner, step=step)
            except (IntegrityError, OSError, RunMismatchError) as exc:
                err = f"{src}: {exc}"
    return frame, err

def _held_frame(ck: Checkpointer, where: dict[tuple[str, int, int], Any], owner: int, step: int) -> Frame:
    if ("memory_held", owner, step) in where:
        return where[("memory_held", owner, step)]
    return _split(store.read_raw(where[("held", owner, step)]))

def restore_frame(ck: Checkpointer, frame: Frame) -> None:
    parsed = parse_prefix(frame[0])
    # Clone: a frame may be a slot or replica buffer GEMINI reuses; restored state must never alias it.
    state = decode(parsed.skeleton, [v.clone() for v in parsed.layout.views(frame[1])])
    training_state.restore(ck.sources, state)

def _split(raw: bytes) -> Frame:
    parsed = parse_prefix(raw)
    if len(raw) != parsed.data_offset + parsed.layout.data_nbytes:
        raise IntegrityError(f"checkpoint has {len(raw)} bytes, its header says {parsed.data_offset + parsed.layout.data_nbytes}")
    buf = bytearray(raw)
    data = torch.frombuffer(buf, dtype=torch.uint8, offset=parsed.data_offset, count=parsed.layout.data_nbytes) \
        if parsed.layout.data_nbytes else torch.empty(0, dtype=torch.uint8)
    return bytes(raw[: parsed.data_offset]), data


def _with_step(decision: RecoveryDecision, step: int) -> RecoveryDecision:
    return RecoveryDecision(decision.failure_kind, decision.mode, step, decision.checkpoint_id, decision.sources,
                            decision.topology_digest, decision.reason)


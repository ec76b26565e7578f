"""What one rank can restore from, for recovery's collective decision: :func:`propose` lists this rank's sources
(slots, own files, held replicas in memory and on disk, the durable tier, its trust records), each checked alone, and
never raises (see its docstring). Split from :mod:`gemscout.gemini.restore`, which runs the collective around it.

Like restore, it is handed the parts of the checkpointer it uses as a
:class:`~gemscout.gemini.recovery_parts.RecoveryParts`; it holds no reference to the checkpointer itself.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemscout.errors import GemscoutError, IntegrityError
from gemscout.gemini import store

if TYPE_CHECKING:
    from gemscout.gemini.recovery_parts import RecoveryParts

log = logging.getLogger("gemscout.gemini")


Item = tuple[str, int, int]
"""(kind, owner, step): kind is "memory" / "local" (the owner's own slot / file) or "memory_held" / "held" (a
replica this rank holds for ``owner``, in memory / on disk)."""


def propose(
    parts: RecoveryParts, failed: dict[Item, str] | None = None
) -> tuple[dict[str, Any], dict[Item, Any]]:
    """What this rank can load, and where each item lives (for the transfers). Total: never raises.

    Memory is listed first and, for a step it holds, the disk is not consulted. Files on disk are inventoried by
    their headers alone (identity, header digest and structure, size): reading and hashing whole generations here,
    before the group has even chosen a step, cost more than the restore itself. The tensor digests of whatever is
    chosen are checked when it is loaded (:func:`_fetch`), before anything is restored; an item that fails there is
    listed in ``failed`` (with why) and never proposed again, and the ranks decide again.

    Any failure reading one source (a folder that is a file, a FIFO, a malformed header, ...) makes that source
    unusable, listed with why; a failure outside any one source makes the whole proposal say ``cannot`` with the
    reason, so that this rank still joins the gather and every rank decides STOP naming it, instead of this rank
    dying while its peers wait for the collective timeout.
    """
    try:
        return _propose(parts, failed or {})
    except Exception as exc:
        log.error("gemini: rank %d cannot propose a recovery: %s", parts.rank, exc, exc_info=True)
        return {
            "rank": parts.rank,
            "memory": [],
            "own": [],
            "held": {},
            "memory_held": {},
            "unusable": [],
            "durable": None,
            "durable_refused": [],
            "rejected": [],
            "trust": {},
            "attempts": {},
            "cannot": f"rank {parts.rank} cannot propose: {type(exc).__name__}: {exc}",
        }, {}


def _propose(
    parts: RecoveryParts, failed: dict[Item, str]
) -> tuple[dict[str, Any], dict[Item, Any]]:
    where: dict[Item, Any] = {}
    unusable = [
        f"rank {parts.rank} {_describe(item)}: {why}" for item, why in sorted(failed.items())
    ]
    memory = []
    for slot in parts.pool.ready_slots():
        if ("memory", parts.rank, slot.step) not in failed:
            memory.append(slot.step)
            where[("memory", parts.rank, slot.step)] = slot.frame()
    own = []
    for step in _steps_in(parts.paths.own, f"rank {parts.rank} own folder", unusable):
        if step in memory or ("local", parts.rank, step) in failed:
            continue  # memory is preferred for this step: reading the file would be wasted time
        path = store.step_file(parts.paths.own, step)
        try:
            parsed = store.read_header(path)
            parts.check_identity(parsed.identity, where=str(path))
            if parsed.identity.get("owner") != parts.rank or parsed.identity.get("step") != step:
                raise IntegrityError(
                    f"identity {parsed.identity} is not rank {parts.rank}'s step {step}"
                )
        except (
            Exception
        ) as exc:  # any failure: this file is unusable, the others are still proposed
            log.warning("gemini: %s is unusable: %s", path, exc)
            unusable.append(f"rank {parts.rank} own step {step}: {reason_of(exc)}")
            continue
        own.append(step)
        where[("local", parts.rank, step)] = path
    memory_held: dict[str, list[int]] = {}
    for o, b in parts.replicas.items():
        for s, prefix, data in b.entries:
            if ("memory_held", o, s) not in failed:
                memory_held.setdefault(str(o), []).append(s)
                where[("memory_held", o, s)] = (prefix, data)
    held: dict[str, list[int]] = {}
    try:
        owners = parts.paths.held_owners()
    except OSError as exc:
        unusable.append(f"rank {parts.rank} replicas folder: {reason_of(exc)}")
        owners = []
    for o in owners:
        for step in _steps_in(
            parts.paths.replicas(o), f"rank {parts.rank} replicas of rank {o}", unusable
        ):
            if step in memory_held.get(str(o), []) or ("held", o, step) in failed:
                continue  # the replica in memory is preferred
            path = store.step_file(parts.paths.replicas(o), step)
            try:
                parsed = store.read_header(path)
                parts.check_identity(parsed.identity, where=str(path))
                if parsed.identity.get("owner") != o or parsed.identity.get("step") != step:
                    raise IntegrityError(
                        f"identity {parsed.identity} is not rank {o}'s step {step}"
                    )
            except Exception as exc:
                log.warning("gemini: replica %s is unusable: %s", path, exc)
                unusable.append(
                    f"rank {parts.rank} replica of rank {o} step {step}: {reason_of(exc)}"
                )
                continue
            held.setdefault(str(o), []).append(step)
            where[("held", o, step)] = path
    try:
        durable = parts.durable.scan() if parts.durable else []
    except (
        Exception
    ) as exc:  # an unreadable durable folder: refused, like a promotion that does not verify
        durable = [(-1, f"durable tier unreadable on rank {parts.rank}: {reason_of(exc)}")]
    proposal = {
        "rank": parts.rank,
        "memory": memory,
        "own": own,
        "held": held,
        "memory_held": memory_held,
        "unusable": unusable,
        "durable": next((s for s, why in durable if why is None), None),
        "durable_refused": [why for _, why in durable if why is not None],
    }
    proposal.update(parts.ledger.summary())
    return proposal, where


def _steps_in(folder: Path, what: str, unusable: list[str]) -> list[int]:
    """The steps in ``folder``; a folder that cannot be listed (a file, no permission) is noted as unusable."""
    try:
        return store.list_steps(folder)
    except OSError as exc:
        unusable.append(f"{what}: {reason_of(exc)}")
        return []


def reason_of(exc: BaseException) -> str:
    """One line: the error's message, with its type where the message alone would not say what happened."""
    text = str(exc).splitlines()[0][:500] if str(exc) else ""
    return text if isinstance(exc, GemscoutError) and text else f"{type(exc).__name__}: {text}"


def _describe(item: Item) -> str:
    kind, owner, step = item
    return {
        "memory": f"memory step {step}",
        "local": f"own step {step}",
        "memory_held": f"in-memory replica of rank {owner} step {step}",
        "held": f"replica of rank {owner} step {step}",
    }[kind]

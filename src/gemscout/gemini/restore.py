"""Recovery for one rank's GEMINI: propose what this rank can load and verify, decide with every rank, fetch the
chosen frame (memory, disk or a peer), verify it, and restore it into the live objects.

The choice itself is the pure :func:`gemscout.gemini.recovery.decide`; this module is the collective around it. It is
handed the parts of the checkpointer it uses as a :class:`~gemscout.gemini.recovery_parts.RecoveryParts`, built once
by :func:`~gemscout.gemini.parts.build_parts`; it holds no reference to the checkpointer itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gemscout import _dist as comm
from gemscout._modules import unwrap as _unwrap
from gemscout.config import TrustState
from gemscout.errors import ConfigError, RecoveryError, RunMismatchError
from gemscout.gemini import seams, store
from gemscout.gemini.arrival import VerifyOnArrival
from gemscout.gemini.proposal import Item, propose, reason_of
from gemscout.gemini.recovery import RecoveryDecision, RecoveryMode, decide
from gemscout.gemini.recovery_parts import RecoveryParts
from gemscout.state import training_state
from gemscout.state.codec import LocalShard, decode
from gemscout.state.layout import parse_prefix

log = logging.getLogger("gemscout.gemini")

Frame = tuple[bytes, torch.Tensor]


_MAX_ROUNDS = 64
"""Each failed round marks at least one item failed on some rank, so rounds are bounded by the items; this is a
backstop against a bug, not a limit a real job reaches."""


def recover(
    parts: RecoveryParts,
    *,
    failure_kind: str = "restart",
    fallback: Callable[[], int] | None = None,
    min_trust: TrustState | None = None,
) -> RecoveryDecision:
    """Collectively choose and restore a step (all ranks must call). Returns the decision after restoring.

    Total: whatever fails on any rank — proposing, fetching, verifying, decoding or loading into the live objects —
    is gathered, so every rank learns it in the same round and they decide together (the same step from another
    source, an older step, or STOP); no rank leaves a collective alone. Raises RecoveryError on every rank when the
    decision is STOP (the caller should exit with its exit code), or when the durable tier or the caller's fallback
    fails on some rank.
    """
    parts.drain()
    failed: dict[Item, str] = {}
    for _ in range(_MAX_ROUNDS):
        proposal, where = propose(parts, failed)
        proposals = comm.gather_json(proposal, group=parts.group, timeout=parts.timeout)
        seen = [p.get("durable") for p in proposals]
        durable_step = min(seen) if all(d is not None for d in seen) else None  # type: ignore[type-var]
        refused = list(
            dict.fromkeys(why for p in proposals for why in p.get("durable_refused", []))
        )
        decision = decide(
            proposals,
            run_id=parts.run_id,
            topology_digest=parts.topology_digest,
            min_trust=min_trust or parts.min_trust,
            max_attempts=parts.max_recovery_attempts,
            failure_kind=failure_kind,
            durable_step=durable_step,
            has_fallback=fallback is not None,
            durable_refused=refused,
        )
        if decision.mode == RecoveryMode.RESTORE:
            assert decision.step is not None
            fetched = _fetch(parts, decision, where)
            # Every rank learns every failure and who holds the failed item: that rank drops it and the ranks
            # decide again (the same step from another source, or an older step).
            if _drop_failed(parts, decision, fetched, fetched.error, failed, "failed verification"):
                continue
            _deliver(parts, decision)
            assert fetched.frame is not None
            why = None
            try:
                restore_frame(parts.sources, fetched.frame, owned=fetched.owned)
            except (
                Exception
            ) as exc:  # a frame that verifies but does not fit the live objects (crafted header)
                log.error(
                    "gemini: restoring step %d failed on rank %d: %s",
                    decision.step,
                    parts.rank,
                    exc,
                )
                why = f"{decision.sources[parts.rank]}: restore failed: {reason_of(exc)}"
            if _drop_failed(parts, decision, fetched, why, failed, "could not be restored"):
                continue
            parts.ledger.attempts[decision.step] = parts.ledger.attempts.get(decision.step, 0) + 1
        else:
            _deliver(parts, decision)
            if decision.mode == RecoveryMode.STOP:
                parts.ledger.last_decision = decision.to_dict()
                parts.ledger.save()
                raise RecoveryError(f"recovery stopped: {decision.reason}")
            if decision.mode == RecoveryMode.DURABLE:
                assert parts.durable is not None and decision.step is not None
                _together(
                    parts,
                    functools.partial(parts.durable.load, decision.step, parts.sources),
                    f"durable step {decision.step}",
                )
            elif decision.mode == RecoveryMode.FALLBACK and fallback is not None:
                decision = _with_step(
                    decision, _together(parts, fallback, "the caller's load_fallback")
                )
        parts.ledger.last_decision = decision.to_dict()
        parts.ledger.save()
        return decision
    raise RecoveryError("recovery stopped: every candidate step failed verification")


def _drop_failed(
    parts: RecoveryParts,
    decision: RecoveryDecision,
    fetched: _Fetched,
    why: str | None,
    failed: dict[Item, str],
    what: str,
) -> bool:
    """Gather every rank's failure (``why``, None for success); mark each failed item on the rank that holds it.
    Returns True when some rank failed (the ranks then decide again). Collective."""
    outcomes = comm.gather_json(why, group=parts.group, timeout=parts.timeout)
    if all(o is None for o in outcomes):
        return False
    for owner, reason in enumerate(outcomes):
        if reason is None:
            continue
        log.warning(
            "gemini: step %s from %s %s on rank %d (%s); deciding again",
            decision.step,
            decision.sources.get(owner),
            what,
            owner,
            reason,
        )
        item = fetched.mine.get(owner)  # set only where this rank holds what failed
        if item is not None:
            failed[item] = fetched.send_errors.get(owner, str(reason))
    return True


def _together(parts: RecoveryParts, action: Callable[[], Any], what: str) -> Any:
    """Run ``action`` on every rank and agree on its outcome: if it failed anywhere, every rank raises the same error
    naming the first failed rank's reason (a rank never dies alone while its peers go on training) — a
    RunMismatchError or ConfigError as itself (the job was started wrong, exit 2), anything else as RecoveryError.
    Returns what ``action`` returned."""
    failure, result = None, None
    try:
        result = action()
    except Exception as exc:
        log.error("gemini: %s failed on rank %d: %s", what, parts.rank, exc)
        failure = {"kind": type(exc).__name__, "why": reason_of(exc)}
    outcomes = comm.gather_json(failure, group=parts.group, timeout=parts.timeout)
    bad = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if bad:
        parts.ledger.save()
        rank, first = bad[0]
        kinds = {"RunMismatchError": RunMismatchError, "ConfigError": ConfigError}
        cls = kinds.get(first["kind"], RecoveryError)
        if cls is RecoveryError:
            raise RecoveryError(f"recovery stopped: {what} failed on rank {rank}: {first['why']}")
        raise cls(f"{what} refused on rank {rank}: {first['why']}")
    return result


def _deliver(parts: RecoveryParts, decision: RecoveryDecision) -> None:
    log.info("gemini recovery decision: %s", decision.to_dict())
    if parts.on_decision is not None:
        parts.on_decision(decision)


@dataclass
class _Fetched:
    frame: Frame | None = None
    owned: bool = False
    """The frame's buffer is this rank's alone (received or read from disk): restore may keep its views."""
    error: str | None = None
    """Why this rank's own frame failed (None: verified)."""
    mine: dict[int, Item] = field(default_factory=dict)
    """Per owner, the item of *this* rank used for it: its own slot / file, or the replica it sent."""
    send_errors: dict[int, str] = field(default_factory=dict)
    """Per owner, why this rank could not read the replica it should have sent (it sent an empty frame)."""


def _fetch(parts: RecoveryParts, decision: RecoveryDecision, where: dict[Item, Any]) -> _Fetched:
    """Gather this rank's frame for the decided step from memory, disk or a peer, and verify it.

    Peer transfers run first, in owner order on every rank (so the point-to-point pairs line up), and each owner
    verifies what it receives chunk by chunk as it arrives; local sources are read and verified afterwards, so no
    peer waits for this rank's own verification before its transfer starts.
    """
    step = decision.step
    assert step is not None
    out = _Fetched()
    peers = {
        o: int(src.split(":")[1]) for o, src in decision.sources.items() if src.startswith("peer:")
    }
    for owner in sorted(peers):
        holder = peers[owner]
        if parts.rank == holder:
            item: Item = (
                ("memory_held", owner, step)
                if ("memory_held", owner, step) in where
                else ("held", owner, step)
            )
            out.mine[owner] = item
            try:
                frame = where[item] if item[0] == "memory_held" else store.read_frame(where[item])
            except Exception as exc:
                # Still take part in the transfer (the owner is waiting for it); the empty frame fails its check.
                out.send_errors[owner] = str(exc)
                frame = (b"", torch.empty(0, dtype=torch.uint8))
            seams.fire("send", owner)
            comm.exchange(
                frame,
                owner,
                None,
                group=parts.group,
                chunk_bytes=parts.chunk_bytes,
                timeout=parts.timeout,
            )
        if parts.rank == owner:
            check = VerifyOnArrival(on_progress=functools.partial(seams.fire, "received", owner))
            got = comm.exchange(
                None,
                None,
                holder,
                group=parts.group,
                chunk_bytes=parts.chunk_bytes,
                timeout=parts.timeout,
                on_arrival=check,
            )
            try:
                assert got is not None
                parts.verify_frame(got, owner=owner, step=step, verified=check.result())
                out.frame, out.owned = got, True
            except Exception as exc:
                out.error = f"{decision.sources[owner]}: {reason_of(exc)}"
    src = decision.sources.get(parts.rank, "")
    if src in ("memory", "local"):
        item = (src, parts.rank, step)
        out.mine[parts.rank] = item
        try:
            if src == "memory":
                out.frame, out.owned = where[item], False
            else:
                out.frame, out.owned = store.read_frame(where[item]), True
            parts.verify_frame(out.frame, owner=parts.rank, step=step)
        except Exception as exc:
            out.frame, out.error = None, reason_of(exc)
    return out


def restore_frame(
    sources: training_state.StateSources, frame: Frame, *, owned: bool = False
) -> None:
    """Decode ``frame`` and load it into the live objects (``sources``). ``owned``: nothing else uses the frame's
    buffer, so the restored state may keep views of it instead of copies (an optimizer keeps the tensors it is
    given)."""
    parsed = parse_prefix(frame[0])
    views = parsed.layout.views(frame[1])
    state = decode(parsed.skeleton, views)
    if not owned:
        # A slot or held replica is reused by GEMINI: restored state must never alias it. Optimizer state goes
        # straight into the optimizer's live tensors (one copy, no new buffer); a model whose every module loads
        # by copying (torch's own load path, no hooks) gets the views too; the rest is cloned.
        # Only a torch optimizer's own state_dict format (an adapter's optimizer, e.g. DeepSpeed's, is cloned).
        model_state = state.get("model")
        if _copies_on_load(_unwrap(sources.model)):
            state = {**state, "model": {}}
        else:
            model_state = None
        saved = state.get("optimizer")
        if not (
            isinstance(sources.optimizer, torch.optim.Optimizer)
            and isinstance(saved, dict)
            and isinstance(saved.get("state"), dict)
        ):
            state = _clone_tensors(state)
        else:
            optimizer_state = saved["state"]
            copied = _copy_into_live_optimizer_state(sources.optimizer, optimizer_state)
            state = _clone_tensors({**state, "optimizer": {**saved, "state": {}}})
            state["optimizer"]["state"] = {
                idx: {
                    k: v if (idx, k) in copied else _clone_tensors(v) for k, v in per_param.items()
                }
                for idx, per_param in optimizer_state.items()
            }
        if model_state is not None:
            state["model"] = model_state
    training_state.restore(sources, state)


def _copies_on_load(model: torch.nn.Module) -> bool:
    """Whether ``model.load_state_dict`` copies every tensor it is given into the live one and keeps none: every
    module uses torch's own load path (``load_state_dict`` / ``_load_from_state_dict`` not overridden, no extra state
    of its own) and has no load hook (a hook, or ``set_extra_state``, may keep what it is given), and torch is not set to swap tensors on load
    (``torch.__future__.set_swap_module_params_on_conversion``)."""
    if torch.__future__.get_swap_module_params_on_conversion():
        return False
    base_load = torch.nn.Module.load_state_dict
    base_from = torch.nn.Module._load_from_state_dict
    base_extra = torch.nn.Module.set_extra_state
    if type(model).load_state_dict is not base_load:
        return False
    for module in model.modules():
        kind = type(module)
        if kind._load_from_state_dict is not base_from or kind.set_extra_state is not base_extra:
            return False
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            return False
    return True


def _copy_into_live_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: dict[Any, Any]
) -> set[tuple[Any, str]]:
    """Copy every saved optimizer state tensor into the live tensor of the same parameter and key when that tensor
    is a plain one of the same shape, dtype and device, and put the live tensor in its place in ``saved`` (so
    ``load_state_dict`` keeps it). Returns the (index, key) pairs done; the caller clones the others."""
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    done: set[tuple[Any, str]] = set()
    for idx, per_param in saved.items():
        i = int(idx)
        live_state = optimizer.state.get(flat[i]) if 0 <= i < len(flat) else None
        if not isinstance(live_state, dict):
            continue
        for key, value in per_param.items():
            live = live_state.get(key)
            if (
                isinstance(value, torch.Tensor)
                and type(live) is torch.Tensor
                and type(value) is torch.Tensor
                and live.shape == value.shape
                and live.dtype == value.dtype
                and live.device == value.device
                and live.is_contiguous()
            ):
                with torch.no_grad():
                    live.copy_(value)
                per_param[key] = live
                done.add((idx, key))
    return done


def _clone_tensors(obj: Any) -> Any:
    """``obj`` with every tensor (and LocalShard's local tensor) cloned; containers rebuilt, leaves kept."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, LocalShard):
        return LocalShard(obj.local.clone(), obj.shape, obj.stride)
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tensors(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    return obj


def _with_step(decision: RecoveryDecision, step: int) -> RecoveryDecision:
    return RecoveryDecision(
        decision.failure_kind,
        decision.mode,
        step,
        decision.checkpoint_id,
        decision.sources,
        decision.topology_digest,
        decision.reason,
    )

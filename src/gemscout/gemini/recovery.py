"""Rank-consistent choice of what to restore, as a pure function of what every rank reports.

Each rank proposes what it can load *and verify*: its own checkpoints (in memory or on disk), the replicas it holds
for peers, its trust records and recovery attempts. Every rank runs :func:`decide` on the same gathered proposals and
so reaches the same decision without a coordinator: the newest step every rank can restore from some source, in the
preference order memory → local disk → peer replica, skipping rejected steps, steps below the trust floor and steps
whose attempts are spent. Then the durable tier, then the caller's fallback, else STOP.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gemscout.config import TrustState


class RecoveryMode(enum.StrEnum):
    FRESH = "fresh"  # nothing was ever checkpointed: start from step 0
    RESTORE = "restore"  # restore ``step`` from the named sources
    DURABLE = "durable"  # restore from the durable tier
    FALLBACK = "fallback"  # the caller's load_fallback restores
    STOP = "stop"  # every source is exhausted: stop, do not restart


@dataclass(frozen=True, slots=True)
class RecoveryDecision:
    """What recovery will do, delivered to ``on_recovery_decision`` before anything is restored."""

    failure_kind: str
    mode: RecoveryMode
    step: int | None
    checkpoint_id: str | None
    sources: dict[int, str] = field(default_factory=dict)
    topology_digest: str = ""
    reason: str = ""

    @property
    def source(self) -> str:
        """The weakest source any rank uses (what an operator cares about first)."""
        order = ["memory", "local", "peer", "durable", "fallback"]
        used = {s.split(":")[0] for s in self.sources.values()}
        return next((o for o in reversed(order) if o in used), "none")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mode"] = self.mode.value
        d["source"] = self.source
        d["sources"] = {str(k): v for k, v in self.sources.items()}
        return d


def _trust_of(step: int, proposals: list[dict[str, Any]]) -> TrustState:
    seen = [TrustState(p["trust"][str(step)]) for p in proposals if str(step) in p.get("trust", {})]
    if any(s == TrustState.REJECTED for s in seen):
        return TrustState.REJECTED
    return max(seen, key=lambda s: s.rank, default=TrustState.CANDIDATE)


def decide(
    proposals: list[dict[str, Any]],
    *,
    run_id: str,
    topology_digest: str,
    min_trust: TrustState,
    max_attempts: int,
    failure_kind: str = "restart",
    durable_step: int | None = None,
    has_fallback: bool = False,
    durable_refused: Sequence[str] = (),
) -> RecoveryDecision:
    """Choose the step and per-rank sources. ``proposals[r]`` is rank r's report (see :func:`gemscout.gemini.proposal.propose`).

    ``durable_refused``: why each durable promotion newer than ``durable_step`` was refused. Like an unusable local
    file, a refused promotion is history: with nothing else left the job stops instead of starting fresh."""
    world = len(proposals)
    cannot = [str(p["cannot"]) for p in proposals if p.get("cannot")]
    if cannot:  # a rank could not even list its sources: nothing is known to be safe on it
        return RecoveryDecision(
            failure_kind,
            RecoveryMode.STOP,
            None,
            None,
            {},
            topology_digest,
            f"every source exhausted: {'; '.join(cannot)}",
        )
    rejected = {s for p in proposals for s in p.get("rejected", [])}
    attempts: dict[int, int] = {}
    for p in proposals:
        for s, n in p.get("attempts", {}).items():
            attempts[int(s)] = max(attempts.get(int(s), 0), int(n))
    steps = {s for p in proposals for s in p["memory"] + p["own"]}
    steps |= {s for p in proposals for held in p["held"].values() for s in held}
    steps |= {s for p in proposals for held in p["memory_held"].values() for s in held}
    skipped: list[str] = [f"refused {u}" for p in proposals for u in p.get("unusable", [])]
    for step in sorted(steps, reverse=True):
        trust = _trust_of(step, proposals)
        if step in rejected or trust == TrustState.REJECTED:
            skipped.append(f"step {step} rejected")
            continue
        if trust.rank < min_trust.rank:
            skipped.append(f"step {step} is {trust.value}, below {min_trust.value}")
            continue
        if attempts.get(step, 0) >= max_attempts:
            skipped.append(f"step {step} already restored {attempts[step]} times")
            continue
        sources = _sources_for(step, proposals, world)
        if sources is None:
            skipped.append(f"step {step} not restorable on every rank")
            continue
        why = "newest restorable step" + (f" ({'; '.join(skipped)})" if skipped else "")
        return RecoveryDecision(
            failure_kind,
            RecoveryMode.RESTORE,
            step,
            f"{run_id}:{step}",
            sources,
            topology_digest,
            why,
        )
    skipped += [f"refused {why}" for why in durable_refused]
    history = bool(
        steps or rejected or durable_refused or any(p.get("unusable") for p in proposals)
    )
    detail = "; ".join(skipped) if skipped else "no checkpoint found"
    if durable_step is not None:
        return RecoveryDecision(
            failure_kind,
            RecoveryMode.DURABLE,
            durable_step,
            f"{run_id}:durable:{durable_step}",
            {r: "durable" for r in range(world)},
            topology_digest,
            f"durable tier ({detail})",
        )
    if has_fallback and history:
        return RecoveryDecision(
            failure_kind,
            RecoveryMode.FALLBACK,
            None,
            None,
            {r: "fallback" for r in range(world)},
            topology_digest,
            f"caller fallback ({detail})",
        )
    if not history:
        return RecoveryDecision(
            "none", RecoveryMode.FRESH, 0, None, {}, topology_digest, "no checkpoint: fresh start"
        )
    return RecoveryDecision(
        failure_kind,
        RecoveryMode.STOP,
        None,
        None,
        {},
        topology_digest,
        f"every source exhausted: {detail}",
    )


def _sources_for(step: int, proposals: list[dict[str, Any]], world: int) -> dict[int, str] | None:
    sources: dict[int, str] = {}
    for rank in range(world):
        mine = proposals[rank]
        if step in mine["memory"]:
            sources[rank] = "memory"
        elif step in mine["own"]:
            sources[rank] = "local"
        else:
            holder = next(
                (h for h in range(world) if step in proposals[h]["memory_held"].get(str(rank), [])),
                None,
            )
            if holder is None:
                holder = next(
                    (h for h in range(world) if step in proposals[h]["held"].get(str(rank), [])),
                    None,
                )
            if holder is None:
                return None
            sources[rank] = f"peer:{holder}"
    return sources

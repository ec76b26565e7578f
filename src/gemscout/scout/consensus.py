"""C3: name the faulty rank by strict majority over replay digests.

Every peer replays the same recipe on the same inputs with what should be the same parameters, and digests its
output (:mod:`gemscout.scout.digests`). The rule, for ``n`` peers:

* every digest equal → ``AGREE``;
* more than ``n / 2`` peers share one digest → ``ATTRIBUTED``; the peers outside that majority are the culprits;
* otherwise → ``INCONCLUSIVE``: a fault is seen but no culprit can be named. With two peers every mismatch lands
  here, because one-against-one cannot say which side is wrong.

The rule never guesses: a plurality that is not a strict majority (2 vs 1 vs 1 among four peers, or 2 vs 2) names no
one. Preconditions (same step, inputs, RNG, parameters) are checked before this by
:func:`gemscout.scout.preconditions.judge`; :func:`c3` alone assumes they hold.
"""

from __future__ import annotations

import enum
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gemscout.reports import FaultKind, FaultReport, Scope

__all__ = ["C3Result", "Verdict", "c3", "validate_c3_inputs"]


class Verdict(enum.StrEnum):
    """Outcome of one C3 comparison."""

    AGREE = "agree"
    ATTRIBUTED = "attributed"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True, slots=True, kw_only=True)
class C3Result:
    """The verdict for one recipe at one step, with what it was based on.

    ``ranks`` is non-empty exactly when the verdict is ``ATTRIBUTED``: an inconclusive result never names a culprit.
    ``digests_by_rank`` is a read-only copy ordered by rank and takes no part in the hash.
    """

    verdict: Verdict
    """AGREE, ATTRIBUTED or INCONCLUSIVE."""
    recipe: str
    """Recipe id the digests belong to."""
    step: int
    """Training step the recipe was captured at."""
    ranks: tuple[int, ...] = ()
    """Attributed (faulty) ranks, sorted; empty unless ATTRIBUTED."""
    majority_digest: str | None = None
    """The digest more than half the peers share; None when there is no strict majority."""
    digests_by_rank: Mapping[int, str] = field(default_factory=dict, hash=False)
    """Every peer's output digest."""
    reason: str = ""
    """Why this verdict, in one sentence; for INCONCLUSIVE it names what was missing."""
    preconditions_ok: bool = True
    """False when the verdict is INCONCLUSIVE because peers disagreed on a precondition, not on the output."""
    peer_groups: tuple[tuple[int, ...], ...] = field(default=(), hash=False)
    """When the result combines several peer groups of a mesh (:func:`~gemscout.scout.cycle.combine_groups`): the
    groups whose digests it holds. Digests are comparable only inside a group (groups replay different inputs or TP
    shards). Empty for one group: every digest is comparable with every other."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        object.__setattr__(self, "ranks", tuple(sorted(self.ranks)))
        ordered = {rank: self.digests_by_rank[rank] for rank in sorted(self.digests_by_rank)}
        object.__setattr__(self, "digests_by_rank", types.MappingProxyType(ordered))
        # A result that broke these would attribute (or fail to attribute) against the rule; refuse to build it.
        if (self.verdict is Verdict.ATTRIBUTED) != bool(self.ranks):
            raise ValueError(
                f"C3Result.ranks must be non-empty exactly when the verdict is ATTRIBUTED, got {self.ranks}"
            )
        if not self.preconditions_ok and self.verdict is not Verdict.INCONCLUSIVE:
            raise ValueError("C3Result.verdict must be INCONCLUSIVE when preconditions_ok is False")

    @property
    def outputs_disagree(self) -> bool:
        """True when at least two peers (of one peer group) produced different digests."""
        if not self.peer_groups:
            return len(set(self.digests_by_rank.values())) > 1
        return any(
            len({self.digests_by_rank[r] for r in group if r in self.digests_by_rank}) > 1
            for group in self.peer_groups
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (rank keys as strings), suitable as report evidence."""
        return {
            "verdict": self.verdict.value,
            "recipe": self.recipe,
            "step": self.step,
            "ranks": list(self.ranks),
            "majority_digest": self.majority_digest,
            "digests_by_rank": {str(rank): digest for rank, digest in self.digests_by_rank.items()},
            "reason": self.reason,
            "preconditions_ok": self.preconditions_ok,
        } | ({"peer_groups": [list(g) for g in self.peer_groups]} if self.peer_groups else {})

    def fault_report(self, *, host: str | None = None) -> FaultReport | None:
        """The SDC report this result calls for, or None.

        ``ATTRIBUTED`` → scope ``rank`` naming the culprits (``host`` is recorded when given, e.g. for a single
        culprit). ``INCONCLUSIVE`` because outputs differ without a strict majority → scope ``peer_group`` over every
        peer: corruption is detected, the culprit is not known. ``AGREE``, or ``INCONCLUSIVE`` because of a
        precondition, → None: no output fault has been shown.
        """
        if self.verdict is Verdict.AGREE or not self.preconditions_ok:
            return None
        evidence = self.to_dict()
        if self.verdict is Verdict.ATTRIBUTED:
            return FaultReport(
                kind=FaultKind.SDC,
                scope=Scope.RANK,
                ranks=self.ranks,
                step=self.step,
                recipe=self.recipe,
                evidence=evidence,
                reason=self.reason,
                host=host,
            )
        if not self.outputs_disagree:
            return None
        return FaultReport(
            kind=FaultKind.SDC,
            scope=Scope.PEER_GROUP,
            ranks=tuple(self.digests_by_rank),
            step=self.step,
            recipe=self.recipe,
            evidence=evidence,
            reason=self.reason,
        )


def validate_c3_inputs(
    digests_by_rank: Mapping[int, str], *, recipe: str, step: int, allow_empty: bool = False
) -> None:
    """Raise ``ValueError`` unless the inputs are well-formed for :func:`c3`.

    Well-formed: a mapping (non-empty unless ``allow_empty``) of non-negative int ranks to non-empty digest strings,
    a non-empty recipe id and an int step >= 0.
    """
    if not isinstance(recipe, str) or not recipe:
        raise ValueError(f"recipe must be a non-empty string, got {recipe!r}")
    if type(step) is not int or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not isinstance(digests_by_rank, Mapping):
        raise ValueError(
            f"digests_by_rank must be a mapping of rank to digest, got {type(digests_by_rank).__name__}"
        )
    if not digests_by_rank and not allow_empty:
        raise ValueError("digests_by_rank must hold at least one peer's digest")
    for rank, digest in digests_by_rank.items():
        if type(rank) is not int or rank < 0:
            raise ValueError(f"ranks must be non-negative ints, got {rank!r}")
        if not isinstance(digest, str) or not digest:
            raise ValueError(f"digests must be non-empty strings, got {digest!r} for rank {rank}")


def c3(digests_by_rank: Mapping[int, str], *, recipe: str, step: int) -> C3Result:
    """Apply the strict-majority rule to one recipe's output digests, one per peer.

    Pure and non-blocking: the digests must already have been gathered. A single peer yields ``INCONCLUSIVE`` (there
    is nobody to compare with). Raises ``ValueError`` for an empty mapping, negative or non-int ranks, empty digests,
    an empty recipe or a negative step.
    """
    validate_c3_inputs(digests_by_rank, recipe=recipe, step=step)
    peers = len(digests_by_rank)
    digests = dict(digests_by_rank)
    if peers == 1:
        return C3Result(
            verdict=Verdict.INCONCLUSIVE,
            recipe=recipe,
            step=step,
            digests_by_rank=digests,
            reason="only one peer: nothing to compare its output with",
        )
    counts = Counter(digests.values())
    top_digest, top_count = counts.most_common(1)[0]
    if top_count == peers:
        return C3Result(
            verdict=Verdict.AGREE,
            recipe=recipe,
            step=step,
            majority_digest=top_digest,
            digests_by_rank=digests,
            reason=f"all {peers} peers produced the same digest",
        )
    if 2 * top_count > peers:
        culprits = tuple(sorted(rank for rank, digest in digests.items() if digest != top_digest))
        return C3Result(
            verdict=Verdict.ATTRIBUTED,
            recipe=recipe,
            step=step,
            ranks=culprits,
            majority_digest=top_digest,
            digests_by_rank=digests,
            reason=f"{top_count} of {peers} peers agree; ranks {list(culprits)} produced a different output",
        )
    if peers == 2:
        reason = "the two peers produced different outputs: detection without a culprit"
    else:
        groups = sorted(counts.values(), reverse=True)
        reason = (
            f"outputs differ and no digest is shared by more than half of {peers} peers "
            f"(group sizes {groups}): detection without a culprit"
        )
    return C3Result(
        verdict=Verdict.INCONCLUSIVE,
        recipe=recipe,
        step=step,
        digests_by_rank=digests,
        reason=reason,
    )

"""Communication stragglers: the same collective timed in several process groups; who slows them all down.

Groups past both margins over the fastest group are slow; the ranks common to every slow group, less any rank that
also sits in a group that was fast, are the suspects, mapped to their host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gemscout.reports import FaultKind, FaultReport, Scope
from gemscout.scout.stragglers._rounds import check_hosts, check_round, check_seconds, ms
from gemscout.scout.stragglers.config import StragglerConfig

__all__ = ["CommStragglerDetector", "GroupTiming"]


@dataclass(frozen=True, slots=True)
class GroupTiming:
    """How long one collective took in one process group, and who is in that group."""

    members: frozenset[int]
    """Global ranks of the group; any iterable of non-negative ints is accepted and frozen."""
    seconds: float
    """Measured time of the collective in this group (finite, >= 0)."""

    def __post_init__(self) -> None:
        try:
            members = frozenset(self.members)
        except TypeError:
            raise ValueError(
                f"GroupTiming.members must be an iterable of ranks, got {self.members!r}"
            ) from None
        if not members or any(type(rank) is not int or rank < 0 for rank in members):
            raise ValueError(
                f"GroupTiming.members must be a non-empty set of non-negative int ranks, got {members!r}"
            )
        object.__setattr__(self, "members", members)
        check_seconds("GroupTiming.seconds", self.seconds)


class CommStragglerDetector:
    """Finds the rank (and host) that slows collectives down, from per-group timings of the same collective.

    Feed, per round, the time the same collective took in each of several process groups whose memberships overlap
    (e.g. DP groups and the groups of another mesh dimension, or pairwise rings). The groups should be comparable:
    timing an intra-node group against an inter-node one would make the network look like a straggler.
    """

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config if config is not None else StragglerConfig()
        self._consecutive: dict[int, int] = {}
        self._last_step: int | None = None

    def consecutive(self, rank: int) -> int:
        """How many consecutive rounds up to now ``rank`` has been the common member of the slow groups."""
        return self._consecutive.get(rank, 0)

    def reset(self) -> None:
        """Forget every count."""
        self._consecutive.clear()
        self._last_step = None

    def observe(
        self,
        step: int,
        timings: Mapping[str, GroupTiming],
        rank_to_host: Mapping[int, str] | None = None,
    ) -> FaultReport | None:
        """Take one round of per-group timings and return a straggler report if a suspect is confirmed.

        The reference is the fastest group, not the median: when most groups contain the straggler, the median group
        is itself slow and would hide it. Suspects = ranks in every slow group and in no fast group. When the suspects
        (confirmed for ``config.confirmations`` rounds) all live on one known host the report has scope ``node`` and
        names it; otherwise scope ``rank``, with whatever hosts are known in the evidence. Rounds with fewer than two
        groups, no slow group, or slow groups without a common suspect reset every count and return None. Pure
        computation, never blocks. Raises ``ValueError`` for a non-increasing step, an empty mapping, a group name
        that is not a string or a value that is not a :class:`GroupTiming`.
        """
        check_round(step, self._last_step)
        hosts = check_hosts(rank_to_host)
        if not timings:
            raise ValueError("timings must hold at least one group")
        for name, timing in timings.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"group names must be non-empty strings, got {name!r}")
            if not isinstance(timing, GroupTiming):
                raise ValueError(
                    f"timings[{name!r}] must be a GroupTiming, got {type(timing).__name__}"
                )
        self._last_step = step
        cfg = self.config
        if len(timings) < 2:
            self._consecutive.clear()
            return None

        reference = min(timing.seconds for timing in timings.values())
        slow = sorted(
            name for name, timing in timings.items() if cfg.past_margins(timing.seconds, reference)
        )
        fast = sorted(name for name in timings if name not in slow)
        suspects: set[int] = set()
        if slow:
            suspects = set.intersection(*(set(timings[name].members) for name in slow))
            # A rank that also sat in a fast group did not slow that group down, so it cannot be the cause.
            for name in fast:
                suspects -= timings[name].members
        self._consecutive = {rank: self._consecutive.get(rank, 0) + 1 for rank in suspects}

        confirmed = sorted(
            rank for rank, count in self._consecutive.items() if count >= cfg.confirmations
        )
        if not confirmed:
            return None
        counts = {rank: self._consecutive[rank] for rank in confirmed}
        known = {rank: hosts[rank] for rank in confirmed if rank in hosts}
        node_hosts = set(known.values())
        on_one_host = len(known) == len(confirmed) and len(node_hosts) == 1
        host = node_hosts.pop() if on_one_host else None
        evidence: dict[str, Any] = {
            "signal": "communication",
            "group_seconds": {name: timings[name].seconds for name in sorted(timings)},
            "group_members": {name: sorted(timings[name].members) for name in sorted(timings)},
            "reference_s": reference,
            "relative_margin": cfg.relative_margin,
            "absolute_margin_s": cfg.absolute_margin_s,
            "slow_groups": slow,
            "fast_groups": fast,
            "consecutive_rounds": {str(rank): count for rank, count in counts.items()},
            "hosts": {str(rank): name for rank, name in known.items()},
        }
        where = f" on host {host!r}" if host is not None else ""
        reason = (
            f"rank(s) {confirmed}{where} common to every slow group {slow} (fastest group {ms(reference)}, slowest "
            f"{ms(max(timings[name].seconds for name in slow))}) for >= {min(counts.values())} consecutive rounds"
        )
        return FaultReport(
            kind=FaultKind.STRAGGLER,
            scope=Scope.NODE if host is not None else Scope.RANK,
            ranks=tuple(confirmed),
            step=step,
            evidence=evidence,
            confirmations=min(counts.values()),
            reason=reason,
            host=host,
        )

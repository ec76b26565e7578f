"""One watchdog's view of the channel's tamper events, turned into findings.

The channel's :class:`~gemscout.watch.tamper.TamperLedger` keeps one :class:`~gemscout.watch.tamper.TamperEvent` per
slot that showed tampering, for the whole run. The watchdog cares about the recent ones: an event is *active* for a
window (``heartbeat_timeout``) after the last sign of it, on the watchdog's own clock, and while it is active the
slot's rank is never judged stale. Each episode of an event (from its first sign to a whole quiet window) becomes one
``tamper`` finding naming the slot, recommendation ``observe``: an outsider can make noise, never a verdict or a
restart. Pure bookkeeping: no I/O, not thread-safe (the watchdog polls from one thread).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gemscout.watch.findings import StallFinding
from gemscout.watch.records import ProgressRecord
from gemscout.watch.tamper import TamperEvent

__all__ = ["TamperEpisodes", "TamperIdent"]

TamperIdent = tuple[int | None, str | None]
"""A tamper event's (rank, key): ``(None, None)`` for foreign keys in the store."""


class TamperEpisodes:
    """Which tamper events are active now, and which of their episodes were reported."""

    def __init__(self, window_s: float) -> None:
        """``window_s``: an event stays active this long after its last sign."""
        self._window_s = window_s
        # Per event: (count, last_seen on the channel's clock) seen at the last update, when it last changed on the
        # watchdog's clock, and whether the current episode of it was reported.
        self._seen: dict[TamperIdent, tuple[int, float]] = {}
        self._changed_at: dict[TamperIdent, float] = {}
        self._reported: set[TamperIdent] = set()

    @property
    def window_s(self) -> float:
        return self._window_s

    def update(self, events: Iterable[TamperEvent], now: float) -> dict[TamperIdent, TamperEvent]:
        """The events active at ``now`` (their last sign within the window), keyed by (rank, key)."""
        active: dict[TamperIdent, TamperEvent] = {}
        for event in events:
            ident = (event.rank, event.key)
            mark = (event.count, event.last_seen)
            if self._seen.get(ident) != mark:
                self._seen[ident] = mark
                self._changed_at[ident] = now
            if now - self._changed_at[ident] < self._window_s:
                active[ident] = event
            else:
                self._reported.discard(
                    ident
                )  # quiet for a whole window: a new sign is a new episode
        return active

    def findings(
        self, active: Mapping[TamperIdent, TamperEvent], records: Mapping[int, ProgressRecord]
    ) -> list[StallFinding]:
        """One ``tamper`` finding per active event whose episode was not reported yet, oldest first."""
        found: list[StallFinding] = []
        for ident, event in sorted(active.items(), key=lambda item: item[1].first_seen):
            if ident in self._reported:
                continue
            self._reported.add(ident)
            rank = event.rank
            rec = records.get(rank) if rank is not None else None
            whose = f"rank {rank}'s slot" if rank is not None else "the store"
            found.append(
                StallFinding(
                    kind="tamper",
                    ranks=(rank,) if rank is not None else (),
                    step=rec.step if rec is not None else None,
                    evidence={"tamper": event.to_dict(), "window_s": self._window_s},
                    confirmations=1,
                    reason=(
                        f"out-of-band store tampered with: {whose} {event.slot} ({event.kind}: {event.reason}); "
                        "its contents are ignored and cannot produce a verdict — someone without the job's secret "
                        "can reach the store"
                    ),
                    host=rec.host if rec is not None else None,
                    recommendation="observe",
                )
            )
        return found

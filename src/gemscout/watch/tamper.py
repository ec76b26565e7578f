"""What one channel's reader has seen of each slot, and the tampering that shows.

An :class:`~gemscout.watch.channel.OobChannel` does the store I/O and opens envelopes; it tells its
:class:`TamperLedger` what each read found: a value, an authentic sequence number, a rejected message, or an empty
slot. The ledger refuses a sequence number older than the last one accepted from that slot (a replay within the run),
counts each distinct rejected message once, and keeps one :class:`TamperEvent` per slot that showed tampering: a
forged, replayed or oversized message, a slot that held an authentic message and then vanished (someone deleted it),
or keys in the store that are not the job's slots. The watchdog turns tamper events into ``tamper`` findings instead
of verdicts.

Its state is one entry per slot the channel has read: bounded by the slots the channel's caller asks for (a watchdog:
world_size x its keys), never by what a writer puts in the store. Rejected values are kept as digests, not bytes.
Pure bookkeeping: no I/O, never blocks beyond its own lock.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gemscout.watch.envelope import TamperKind

__all__ = ["ChannelStats", "TamperEvent", "TamperLedger"]

# The channel's logger: rejections were always reported under it, and log filters in the field name it.
logger = logging.getLogger("gemscout.watch.channel")


@dataclass(kw_only=True, slots=True, frozen=True)
class ChannelStats:
    """Counters of one channel object since it was made."""

    published: int
    accepted: int
    forged: int
    """Distinct messages rejected for a bad MAC, a malformed envelope, or a rank/key that does not match their slot."""
    replayed: int
    """Distinct authentic messages rejected because their sequence number is older than one already accepted, or
    because they belong to another epoch (an earlier run under the same secret)."""
    deleted: int = 0
    """Times a slot that held an authentic message was found absent."""
    swept: int = 0
    """Keys :meth:`OobChannel.sweep` deleted because they were not the job's slots."""


@dataclass(kw_only=True, slots=True, frozen=True)
class TamperEvent:
    """Evidence that someone without the secret (or with an old message) wrote to, or deleted, a slot."""

    slot: str
    """The store key concerned (for ``foreign_keys``: a sample of the swept keys, comma-separated, truncated)."""
    rank: int | None
    key: str | None
    kind: TamperKind
    reason: str
    count: int
    """How many distinct bad values (or deletions) this slot has shown so far."""
    first_seen: float
    last_seen: float
    """The reader's monotonic clock at the first and newest occurrence."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "rank": self.rank,
            "key": self.key,
            "kind": self.kind,
            "reason": self.reason,
            "count": self.count,
        }


class TamperLedger:
    """The reader state of one channel: accepted sequence numbers, slot presence, rejections and tamper events.

    Thread-safe: the channel's readers may share it.
    """

    def __init__(self, slot_name: Callable[[int, str], str]) -> None:
        """``slot_name``: the store key of ``(rank, key)``, used in logs and events."""
        self._slot_name = slot_name
        self._lock = threading.Lock()
        self._last_seen: dict[tuple[int, str], int] = {}
        self._last_rejected: dict[tuple[int, str], bytes] = {}
        self._present: set[tuple[int, str]] = set()
        self._vanished: set[tuple[int, str]] = set()
        self._tamper: dict[tuple[int | None, str | None], TamperEvent] = {}
        self._accepted = self._forged = self._replayed = self._deleted = self._swept = 0

    def stats(self, *, published: int) -> ChannelStats:
        """The channel's counters: ``published`` (the channel counts its writes) and this ledger's."""
        with self._lock:
            return ChannelStats(
                published=published,
                accepted=self._accepted,
                forged=self._forged,
                replayed=self._replayed,
                deleted=self._deleted,
                swept=self._swept,
            )

    def events(self) -> list[TamperEvent]:
        """Every slot that showed tampering so far (newest state of each), in first-seen order."""
        with self._lock:
            return sorted(self._tamper.values(), key=lambda e: e.first_seen)

    def tampered_since(self, rank: int, key: str, since: float) -> TamperEvent | None:
        """The tamper event of ``rank``'s slot ``key`` if its newest occurrence is at or after ``since`` (monotonic)."""
        with self._lock:
            event = self._tamper.get((rank, key))
        return event if event is not None and event.last_seen >= since else None

    def seen(self, rank: int, key: str) -> None:
        """Note that ``rank``'s slot ``key`` holds a value (whatever it turns out to be)."""
        with self._lock:
            self._present.add((rank, key))
            self._vanished.discard((rank, key))

    def accept(self, rank: int, key: str, seq: int) -> int | None:
        """Accept the authentic message ``seq`` of ``rank``'s slot ``key``, unless it is a replay: then return the
        newer sequence number already accepted from that slot (and accept nothing)."""
        with self._lock:
            last = self._last_seen.get((rank, key))
            # Equal is the same message read again (the writer has not published since); only older is a replay.
            if last is not None and seq < last:
                return last
            self._last_seen[(rank, key)] = seq
            self._accepted += 1
        return None

    def reject(self, rank: int, key: str, raw: bytes, why: str, *, kind: TamperKind) -> None:
        """Count, log and record the rejected message ``raw`` of ``rank``'s slot ``key``; a value polled again is
        counted and logged once."""
        digest = hashlib.sha256(raw).digest()
        with self._lock:
            # Polling re-reads the same bad value many times: count and warn once per distinct rejected message.
            repeated = self._last_rejected.get((rank, key)) == digest
            self._last_rejected[(rank, key)] = digest
            if not repeated and kind == "replayed":
                self._replayed += 1
            elif not repeated:
                self._forged += 1
        with self._lock:
            # A message of another epoch in a slot that never held one of ours is a leftover of an earlier run in a
            # reused store: refused, not an attack. Written over one of ours, it is a replay.
            stale = kind == "replayed" and (rank, key) not in self._last_seen
        slot = self._slot_name(rank, key)
        if stale:
            if not repeated:
                logger.info("ignoring OOB slot %s: %s", slot, why)
            return
        if not repeated:
            logger.warning("rejected OOB message in slot %s: %s", slot, why)
        self._record(rank, key, slot, kind, why, new=not repeated)

    def cleared(self, rank: int, key: str) -> None:
        """Note that the channel itself deleted ``rank``'s slot ``key``: its absence next is no deletion by others."""
        with self._lock:
            self._present.discard((rank, key))

    def absent(self, rank: int, key: str) -> None:
        """Note that ``rank``'s slot ``key`` is empty; one that held a message before was deleted (tamper)."""
        ident = (rank, key)
        with self._lock:
            vanished = ident in self._present
            still_gone = ident in self._vanished
            self._present.discard(ident)
            if vanished:
                self._vanished.add(ident)
                self._deleted += 1
                # A later bad value in this slot is new again, whatever it was before the deletion.
                self._last_rejected.pop(ident, None)
        if vanished or still_gone:
            # Every read that finds it still gone refreshes the event: a deleter faster than the polls must not let
            # the slot look quiet (and its rank dead) while it keeps deleting.
            reason = "a slot that held an authentic message was deleted"
            self._record(rank, key, self._slot_name(rank, key), "deleted", reason, new=vanished)
        if vanished:
            logger.warning("OOB slot %s was deleted", self._slot_name(rank, key))

    def foreign_keys(self, count: int, sample: Iterable[str], *, detail: str = "") -> None:
        """Record that ``count`` keys that are not the job's slots were found and deleted: a ``foreign_keys``
        :class:`TamperEvent` for the store. ``detail`` adds to its reason."""
        shown = ", ".join(repr(name[:64]) for name in list(sample)[:5])
        with self._lock:
            self._swept += count
        reason = f"{count} key(s) not of this job deleted" + (f"; {detail}" if detail else "")
        self._record(None, None, shown, "foreign_keys", reason)
        logger.warning(
            "OOB store: deleted %d key(s) that are not this job's slots (%s)", count, shown
        )

    def forget_presence(self) -> None:
        """Forget which slots held a message (the accepted sequence numbers are kept)."""
        with self._lock:
            self._present.clear()
            self._vanished.clear()

    def _record(
        self,
        rank: int | None,
        key: str | None,
        slot: str,
        kind: TamperKind,
        reason: str,
        *,
        new: bool = True,
    ) -> None:
        now = time.monotonic()
        with self._lock:
            old = self._tamper.get((rank, key))
            self._tamper[(rank, key)] = TamperEvent(
                slot=slot,
                rank=rank,
                key=key,
                kind=kind,
                reason=reason,
                count=(old.count if old else 0) + (1 if new or old is None else 0),
                first_seen=old.first_seen if old else now,
                last_seen=now,
            )

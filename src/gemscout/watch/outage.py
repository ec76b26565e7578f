"""One watchdog's view of its out-of-band store's outages, turned into findings.

A loss is one ``tamper`` finding of kind ``store_lost`` per outage, naming the cause and whether the store is being
restarted; when the restarts of an outage all fail, one more says it stays down; when the store serves again, a
``store_restored`` finding says how long it was down. The watchdog that owns the store process learns all of it from
the process's :class:`~gemscout.watch.store_health.StoreStatus`; every other watchdog only sees reads that fail, and
calls the store lost once they have failed for ``store_unreachable``. Pure bookkeeping: no I/O, never blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from gemscout.watch.findings import StallFinding
from gemscout.watch.store_health import StoreStatus

__all__ = ["StoreOutage"]

logger = logging.getLogger("gemscout.watch.watchdog")


class StoreOutage:
    """Whether the store is down as far as this watchdog has reported, and the findings that change it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._down = False  # in an outage that was reported (and not yet restored)
        self._lost_at: float | None = None
        self._outages_seen = 0
        self._gave_up_reported = False
        self._unreachable_since: float | None = None

    @property
    def down(self) -> bool:
        """True from a ``store_lost`` finding until the ``store_restored`` one."""
        return self._down

    def on_status(self, status: StoreStatus, now: float) -> tuple[list[StallFinding], bool]:
        """The findings one status of the store process gives (a new outage, giving up, restoration) and whether
        the store was restored by it (nothing was read meanwhile: the caller resumes as after failed reads)."""
        found: list[StallFinding] = []
        # A status without the outage counter (a StoreHealth that does not count) counts a loss as one outage.
        outages = max(status.outages, 1 if status.lost is not None else 0)
        evidence = {
            "swept": status.swept,
            "pressure": status.pressure,
            "outage": outages,
            "restarts": status.restarts,
        }
        restarting = status.restarting
        if outages > self._outages_seen:
            self._outages_seen = outages
            cause = status.lost or status.last_lost or "the store process was lost"
            stays_down = status.lost is not None and not restarting
            self._gave_up_reported = stays_down
            then = (
                "it stays down: its restart limit is reached, and the watch sees nothing more of this job"
                if stays_down
                else "it is being restarted on the same port; watching resumes when it serves"
            )
            found.append(self._lost(cause, {**evidence, "restarting": not stays_down}, then))
        elif (
            self._down and status.lost is not None and not restarting and not self._gave_up_reported
        ):
            self._gave_up_reported = True
            then = "its restarts failed and the limit is reached: it stays down, the watch sees nothing more"
            found.append(self._lost(status.lost, {**evidence, "restarting": False}, then))
        restored = self._down and status.lost is None
        if restored:
            found.append(
                self.restored(now, f"its process serves again (restart {status.restarts})")
            )
        return found, restored

    def on_unreachable(self, now: float, exc: BaseException, after_s: float) -> StallFinding | None:
        """A watchdog that does not own the store sees its loss only as reads that fail: unreachable for
        ``after_s`` seconds is a ``store_lost`` finding, once per outage."""
        if self._unreachable_since is None:
            self._unreachable_since = now
        waited = now - self._unreachable_since
        if self._down or waited < after_s:
            return None
        return self._lost(
            f"unreachable from this watchdog for {waited:.1f} s ({exc})",
            {"unreachable_s": waited},
            "the watch sees nothing of this job until it answers again (rank 0 restarts a store process that died)",
        )

    def on_read(self, now: float) -> StallFinding | None:
        """A read succeeded (a watchdog without the store process): the outage, if one was reported, is over."""
        self._unreachable_since = None
        return self.restored(now, "it answers this watchdog again") if self._down else None

    def restored(self, now: float, how: str) -> StallFinding:
        self._down = False
        down = now - self._lost_at if self._lost_at is not None else 0.0
        logger.warning("OOB store restored after %.1f s: %s; watching resumes", down, how)
        return _finding(
            "store_restored",
            how,
            {"outage_s": round(down, 3)},
            f"out-of-band store restored after {down:.1f} s: {how}; watching resumes (every rank re-publishes "
            "its progress on its next heartbeat; no rank is judged on the outage)",
        )

    def _lost(self, cause: str, evidence: Mapping[str, object], then: str) -> StallFinding:
        self._down = True
        self._lost_at = self._clock()
        logger.error("OOB store lost: %s; %s", cause, then)
        return _finding(
            "store_lost",
            cause,
            evidence,
            f"out-of-band store lost: {cause}; {then} (training goes on: its process group has a store of "
            "its own)",
        )


def _finding(kind: str, why: str, evidence: Mapping[str, object], reason: str) -> StallFinding:
    event = {"slot": None, "rank": None, "key": None, "kind": kind, "reason": why, "count": 1}
    return StallFinding(
        kind="tamper",
        ranks=(),
        step=None,
        evidence={"tamper": event, **evidence},
        confirmations=1,
        reason=reason,
        recommendation="observe",
    )

"""What a watchdog reads of the process that serves its out-of-band store.

:class:`~gemscout.watch.store_server.StoreServer` supervises the store process and reports through
:class:`StoreStatus`; the watchdog and its outage bookkeeping (:mod:`gemscout.watch.outage`) read only that, through
:class:`StoreHealth`, so they depend on neither the process nor how it is restarted (tests hand them a stand-in).
Plain data: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["StoreHealth", "StoreStatus"]


@dataclass(kw_only=True, slots=True, frozen=True)
class StoreStatus:
    """What the store process has reported so far."""

    swept: int
    """Foreign keys the process deleted since it started."""
    sample: tuple[str, ...]
    """Some of the newest of them (each cut to 64 characters)."""
    swept_at: float | None
    """This process's monotonic clock when the newest sweep report arrived."""
    pressure: bool
    """The store reached 90 % of its memory cap at least once (a flood was refused or nearly so)."""
    lost: str | None
    """Why the store is gone (it exited or was killed), ``None`` while it serves (a restarted one too)."""
    outages: int = 0
    """Times the store was lost so far (a restart that failed belongs to the outage it was meant to end)."""
    restarts: int = 0
    """Times a fresh store process was started after a loss and served."""
    restarting: bool = False
    """While ``lost``: a restart is due or under way. False then: the restart limit is reached, it stays down."""
    last_lost: str | None = None
    """Why the store was last lost (kept once a restart serves)."""


class StoreHealth(Protocol):
    """What a watchdog needs of the process serving its store."""

    def status(self) -> StoreStatus: ...

"""SIGTERM / SIGINT while a session is live: persist the newest capture within a bound, close, then chain.

torchrun signals the survivors after one rank dies, and a scheduler signals before it kills: the handler writes the
newest captured state without waiting on peers (a dead peer's exchange can never finish), closes the session with
what is left of the bound, and then hands the signal to whatever handler was installed before it (the default
action, SIG_DFL, is re-raised so the process ends by that signal).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any, Protocol

log = logging.getLogger("gemscout")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals handled."""


class Flush(Protocol):
    """Persist the newest captured state within ``timeout``; returns the newest step on disk, or -1."""

    def __call__(self, timeout: timedelta | None = None, *, wait_for_peers: bool = True) -> int: ...


class Close(Protocol):
    """Close the session within ``timeout`` (``release_memory`` False: a restart may recover from memory)."""

    def __call__(
        self,
        timeout: timedelta | None = None,
        *,
        release_memory: bool = True,
        wait_for_peers: bool = True,
    ) -> None: ...


class SignalHandlers:
    """The handlers of :data:`SIGNALS` for one session: given its ``flush`` and ``close`` and the ``budget`` both
    share (``CheckpointConfig.signal_timeout``). Installed and restored on the main thread only (elsewhere Python
    cannot set handlers: both are no-ops there)."""

    def __init__(self, *, flush: Flush, close: Close, budget: timedelta) -> None:
        self._flush, self._close, self.budget = flush, close, budget
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Remember the current handler of each signal and install this one in its place."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Flush (pending io waited for up to the budget, and not at all once it is stuck in an exchange with a
        peer: after a peer's death, which is why torchrun signals a survivor, it can never finish; then the newest
        sealed capture written), close with what is left of that bound, then chain to the previous handler."""
        deadline = time.monotonic() + self.budget.total_seconds()
        try:
            step = self._flush(self.budget, wait_for_peers=False)
            log.warning("gemscout: signal %d: flushed step %d", signum, step)
        finally:
            prev: Callable[[int, FrameType | None], Any] | int | None = self._previous.get(
                signum, signal.SIG_DFL
            )
            left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
            self._close(left, release_memory=False, wait_for_peers=False)
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

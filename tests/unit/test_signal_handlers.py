"""SIGTERM handling (:class:`gemscout.signals.SignalHandlers`): flush without waiting on peers, close, chain."""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from types import FrameType

from gemscout.signals import SignalHandlers


def test_a_signal_flushes_without_peers_closes_keeping_memory_then_chains_and_restores() -> None:
    calls: list[tuple[str, object]] = []

    def flush(timeout: timedelta | None = None, *, wait_for_peers: bool = True) -> int:
        calls.append(("flush", (timeout, wait_for_peers)))
        return 7

    def close(
        timeout: timedelta | None = None,
        *,
        release_memory: bool = True,
        wait_for_peers: bool = True,
    ) -> None:
        calls.append(("close", (release_memory, wait_for_peers)))
        handlers.restore()

    def previous(signum: int, frame: FrameType | None) -> None:
        calls.append(("previous", signum))

    before = signal.signal(signal.SIGTERM, previous)
    try:
        handlers = SignalHandlers(flush=flush, close=close, budget=timedelta(seconds=3))
        handlers.install()
        assert signal.getsignal(signal.SIGTERM) is not previous
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [
            ("flush", (timedelta(seconds=3), False)),
            ("close", (False, False)),
            ("previous", signal.SIGTERM),
        ]
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, before)

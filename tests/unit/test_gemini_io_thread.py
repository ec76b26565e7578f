"""The io thread's drain: it waits for every queued job, stops at its bound, and gives up early when told the job can
never finish (a signal handler's flush with a peer gone)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from gemscout.errors import CollectiveTimeout
from gemscout.gemini.io_thread import IoThread


@pytest.mark.timeout(30)
def test_drain_waits_for_queued_jobs_and_gives_up_when_told() -> None:
    io = IoThread()
    done: list[int] = []
    io.submit(done.append, 1)
    io.drain(timedelta(seconds=5))
    assert done == [1]
    release = threading.Event()
    io.submit(release.wait, 20)  # a job stuck like an exchange with a dead peer
    with pytest.raises(CollectiveTimeout, match="within the timeout"):
        io.drain(timedelta(seconds=0.2))
    asked: list[bool] = []

    def give_up() -> bool:
        asked.append(True)
        return len(asked) >= 3

    with pytest.raises(CollectiveTimeout, match="stuck in an exchange with a peer"):
        io.drain(timedelta(seconds=20), give_up=give_up)
    assert len(asked) == 3  # polled until it said so, long before the 20 s bound
    release.set()
    io.drain(
        timedelta(seconds=5), give_up=lambda: False
    )  # a job that ends is waited for, give_up or not
    io.shutdown()

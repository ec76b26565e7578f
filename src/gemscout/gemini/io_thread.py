"""The checkpointer's io thread (``gemini-io``): one worker, so the jobs queued on it (each capture's pipeline,
durable promotions) run one at a time in the order queued, which is capture order on every rank; and the futures a
drain waits for, the copies still running included (a copy queues its capture's io before it completes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from gemscout.errors import CollectiveTimeout

if TYPE_CHECKING:
    from datetime import timedelta


class IoThread:
    """The io thread and what is pending on it. Thread-safe: the training thread tracks copies, the copy thread
    queues io, and recovery, certification and close drain."""

    def __init__(self) -> None:
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemini-io")
        self._pending: list[Future[Any]] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the io thread after everything queued before it (:meth:`drain` waits for it)."""
        with self._lock:
            self._pending.append(self._io.submit(fn, *args))

    def track(self, future: Future[Any]) -> None:
        """Make :meth:`drain` wait for ``future`` too (a capture's copy); forgets the futures that are done."""
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(future)

    def drain(self, timeout: timedelta, *, give_up: Callable[[], bool] | None = None) -> None:
        """Wait for every queued job and tracked future; their failures are the jobs' to record, not raised here.
        Raises CollectiveTimeout past ``timeout``, or as soon as ``give_up()`` is true (polled every 10 ms)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:  # a copy queues its io before it completes: loop until nothing new was queued
            with self._lock:
                pending = [f for f in self._pending if not f.done()]
            if not pending:
                return
            for f in pending:
                while True:
                    left = deadline - time.monotonic()
                    wait = left if give_up is None else min(left, 0.01)
                    try:
                        f.exception(
                            timeout=max(0.0, wait)
                        )  # failures are in the checkpointer's errors
                        break
                    except CancelledError:
                        break  # shutdown() cancelled queued io
                    except FutureTimeout:
                        if left <= wait:
                            raise CollectiveTimeout(
                                "checkpoint io did not drain within the timeout"
                            ) from None
                        if give_up is not None and give_up():
                            raise CollectiveTimeout(
                                "checkpoint io is stuck in an exchange with a peer that is gone or stalled"
                            ) from None

    def shutdown(self) -> None:
        """Stop the thread without waiting; jobs queued and not started are cancelled."""
        self._io.shutdown(wait=False, cancel_futures=True)

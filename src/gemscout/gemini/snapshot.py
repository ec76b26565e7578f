"""Capture into pre-allocated, double-buffered slots without stalling the training thread.

Parameters and optimizer state do not change between one ``optimizer.step()`` and the next, so their copy runs on a
background thread while the next forward and backward run; the next step (or :meth:`Capturer.wait_copied`) waits for
it. Everything else (buffers, caller state, RNG) may change during the next forward and is copied synchronously.
Digests and the header are computed on the background thread too.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from gemscout.errors import CollectiveTimeout
from gemscout.state.codec import encode
from gemscout.state.layout import Layout, build_header, frame_prefix, tensor_digests


@dataclass(eq=False)
class Slot:
    """One pre-allocated buffer. ``pins`` counts users (replication, persistence) that still read it."""

    index: int
    layout: Layout | None = None
    data: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    step: int = -1
    prefix: bytes = b""
    identity: dict[str, Any] = field(default_factory=dict)
    pins: int = 0
    ready: threading.Event = field(default_factory=threading.Event)

    def frame(self) -> tuple[bytes, torch.Tensor]:
        """The checkpoint as (prefix, data) — the same bytes as its file on disk."""
        return self.prefix, self.data


class SlotPool:
    """A fixed set of slots; a pinned slot is never handed out, so a replica in flight is never overwritten."""

    def __init__(self, count: int) -> None:
        self._slots = [Slot(i) for i in range(count)]
        self._cond = threading.Condition()

    def acquire(self, layout: Layout, *, timeout: timedelta) -> Slot:
        """The oldest unpinned slot, resized for ``layout`` if needed. Blocks while every slot is pinned."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while True:
                free = [s for s in self._slots if s.pins == 0]
                if free:
                    slot = min(free, key=lambda s: s.step)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(
                        f"no free checkpoint slot after {timeout.total_seconds():.0f}s: replication or persistence "
                        "is slower than the capture interval; raise interval or slots"
                    )
                self._cond.wait(left)
            slot.pins = 1
            slot.ready.clear()
            slot.step = -1
            if slot.layout != layout:
                slot.data = torch.empty(layout.data_nbytes, dtype=torch.uint8)
                slot.layout = layout
            return slot

    def pin(self, slot: Slot) -> None:
        with self._cond:
            slot.pins += 1

    def release(self, slot: Slot) -> None:
        with self._cond:
            slot.pins -= 1
            self._cond.notify_all()

    def newest_ready(self) -> Slot | None:
        with self._cond:
            ready = [s for s in self._slots if s.ready.is_set()]
            return max(ready, key=lambda s: s.step) if ready else None

    def ready_slots(self) -> list[Slot]:
        with self._cond:
            return sorted((s for s in self._slots if s.ready.is_set()), key=lambda s: -s.step)

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self._slots)


class Capturer:
    """Copies state objects into slots; returns a future that completes when the slot holds a sealed checkpoint."""

    def __init__(self, pool: SlotPool, *, async_copy: bool, timeout: timedelta) -> None:
        self.pool = pool
        self.async_copy = async_copy
        self.timeout = timeout
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemini-copy")
        self._copied: Future[None] | None = None
        self.last_stall_s = 0.0

    def capture(self, state: Any, identity: dict[str, Any], async_ptrs: set[int]) -> Future[Slot]:
        """Start capturing ``state`` (see :mod:`gemscout.state.training_state`) into a free slot.

        Blocks only for the synchronous part: waiting for a free slot, copying buffers / caller state / RNG.
        """
        t0 = time.perf_counter()
        self.wait_copied()
        skeleton, tensors = encode(state)
        layout = Layout.of(tensors)
        slot = self.pool.acquire(layout, timeout=self.timeout)
        views = layout.views(slot.data)
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        for view, src in zip(views, tensors, strict=True):
            if self.async_copy and src.data_ptr() in async_ptrs:
                deferred.append((view, src))
            else:
                view.copy_(src)
        copied: Future[None] = Future()
        self._copied = copied

        def work() -> Slot:
            try:
                for view, src in deferred:
                    view.copy_(src)
            finally:
                copied.set_result(None)
            digests = tensor_digests(layout, slot.data)
            slot.identity = dict(identity)
            slot.prefix = frame_prefix(build_header(layout, digests, skeleton, identity))
            slot.step = int(identity["step"])
            slot.ready.set()
            return slot

        future = self._copier.submit(work)
        if not self.async_copy:
            self.wait_copied()
        self.last_stall_s = time.perf_counter() - t0
        return future

    def wait_copied(self) -> None:
        """Block until the last capture no longer reads live tensors (call before anything writes them)."""
        copied = self._copied
        if copied is not None and not copied.done():
            copied.result(timeout=self.timeout.total_seconds())

    def shutdown(self) -> None:
        self._copier.shutdown(wait=True)

"""Capture into pre-allocated, double-buffered slots without stalling the training thread.

Parameters and optimizer state do not change between one ``optimizer.step()`` and the next, so their copy runs on a
background thread while the next forward and backward run; the next step (or :meth:`Capturer.wait_copied`) waits for
it. Everything else (buffers, caller state, RNG) may change during the next forward and is copied synchronously.
Digests and the header are computed on the background thread too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
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
    views: list[torch.Tensor] = field(default_factory=list)
    """Typed views of ``data`` for ``layout``, kept while the layout is unchanged (saves per-capture work)."""

    def frame(self) -> tuple[bytes, torch.Tensor]:
        """The checkpoint as (prefix, data) — the same bytes as its file on disk."""
        return self.prefix, self.data


class SlotPool:
    """A fixed set of slots; a pinned slot is never handed out, so a replica in flight is never overwritten."""

    def __init__(self, count: int) -> None:
        self._slots = [Slot(i) for i in range(count)]
        self._cond = threading.Condition()

    def acquire(self, layout: Layout, *, timeout: timedelta, pinned: bool = False) -> Slot:
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
            if slot.layout != layout or slot.data.is_pinned() != pinned:
                # Pinned host memory lets device-to-host copies run asynchronously on a side stream.
                slot.data = torch.empty(layout.data_nbytes, dtype=torch.uint8, pin_memory=pinned)
                slot.layout = layout
                slot.views = layout.views(slot.data)
            return slot

    def has_free(self) -> bool:
        """True if :meth:`acquire` would not block now (only the io thread frees slots, so it stays true until the
        caller acquires)."""
        with self._cond:
            return any(s.pins == 0 for s in self._slots)

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
        self._cuda_event: Any = None
        self._host_pending = False
        self._stream: Any = None
        self.last_stall_s = 0.0

    def capture(self, state: Any, identity: dict[str, Any], async_ptrs: set[int],
                then: Callable[[Slot], None] | None = None) -> Future[Slot]:
        """Start capturing ``state`` (see :mod:`gemscout.state.training_state`) into a free slot.

        Blocks only for the synchronous part: waiting for a free slot, copying buffers / caller state / RNG.
        ``then(slot)`` runs on the copy thread once the slot is sealed, before the returned future completes (so
        the next stage is queued from there, and the training thread wakes one thread per capture, not two).
        """
        t0 = time.perf_counter()
        self.wait_copied()
        skeleton, tensors = encode(state)
        layout = Layout.of(tensors)
        on_device = any(t.is_cuda for t in tensors)
        slot = self.pool.acquire(layout, timeout=self.timeout, pinned=on_device)
        views = slot.views
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        device_deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        for view, src in zip(views, tensors, strict=True):
            if self.async_copy and src.data_ptr() in async_ptrs:
                (device_deferred if src.is_cuda else deferred).append((view, src))
            else:
                view.copy_(src)
        event = self._launch_device_copies(device_deferred)
        self._host_pending = bool(deferred)
        copied: Future[None] = Future()
        self._copied = copied

        def work() -> Slot:
            try:
                if event is not None:
                    event.synchronize()  # the side-stream D2H copies into pinned memory are done
                for view, src in deferred:
                    view.copy_(src)
            finally:
                copied.set_result(None)
            digests = tensor_digests(layout, slot.data)
            slot.identity = dict(identity)
            slot.prefix = frame_prefix(build_header(layout, digests, skeleton, identity))
            slot.step = int(identity["step"])
            slot.ready.set()
            if then is not None:
                then(slot)
            return slot

        future = self._copier.submit(work)
        if not self.async_copy:
            self.wait_copied()
        self.last_stall_s = time.perf_counter() - t0
        return future

    def _launch_device_copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Queue non-blocking device-to-host copies on a side stream; return the event that marks their end."""
        if not pairs:
            self._cuda_event = None
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())  # copy what the finished step wrote
        with torch.cuda.stream(self._stream):
            for view, src in pairs:
                view.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._cuda_event = event
        return event

    def wait_copied(self) -> None:
        """Block until the last capture no longer reads live tensors (call before anything writes them).

        Device copies are ordered on the GPU instead: the compute stream waits for the copy's event, so the CPU does
        not stall; host copies are waited for on the CPU.
        """
        if self._cuda_event is not None:
            torch.cuda.current_stream().wait_event(self._cuda_event)
            self._cuda_event = None
        copied = self._copied
        if copied is not None and self._host_pending and not copied.done():
            copied.result(timeout=self.timeout.total_seconds())

    def shutdown(self) -> None:
        self._copier.shutdown(wait=True)

"""Capture into the pre-allocated slots (:mod:`gemscout.gemini.slots`) without stalling the training thread.

Parameters and optimizer state do not change between one ``optimizer.step()`` and the next, so their copy runs on a
background thread while the next forward and backward run; the next step (or :meth:`Capturer.wait_copied`) waits for
it. Everything else (buffers, caller state, RNG) may change during the next forward and is copied synchronously.
Digests and the header are computed on the background thread too; a deferred tensor is hashed chunk by chunk right
after each chunk is copied, while it is still in cache (one pass over the bytes from memory, not two).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
from blake3 import blake3

from gemscout.gemini.slots import Slot, SlotPool
from gemscout.state.codec import encode
from gemscout.state.digest import digest_bytes
from gemscout.state.layout import Layout, build_header

_HASH_CHUNK = 256 * 1024
"""Copy-and-hash granularity: small enough that a chunk is still in the L2 cache when it is hashed."""


class Capturer:
    """Copies state objects into slots; returns a future that completes when the slot holds a sealed checkpoint."""

    def __init__(
        self, pool: SlotPool, *, async_copy: bool, timeout: timedelta, digest_threads: int = 1
    ) -> None:
        self.pool = pool
        self.async_copy = async_copy
        self.timeout = timeout
        self.digest_threads = max(1, digest_threads)
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gemini-copy")
        self._helpers = (
            ThreadPoolExecutor(
                max_workers=self.digest_threads - 1, thread_name_prefix="gemini-digest"
            )
            if self.digest_threads > 1
            else None
        )
        self._copied: Future[None] | None = None
        self._cuda_event: Any = None
        self._host_pending = False
        self._stream: Any = None
        self.last_stall_s = 0.0

    def capture(
        self,
        state: Any,
        identity: dict[str, Any],
        async_ptrs: set[int],
        then: Callable[[Slot], None] | None = None,
    ) -> Future[Slot]:
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
        hint = (
            _header_hint(skeleton, len(tensors), identity)
            if self.pool.memory is not None and not on_device
            else 0
        )
        slot = self.pool.acquire(layout, timeout=self.timeout, pinned=on_device, header_hint=hint)
        views = slot.views
        deferred: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        device_deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (view, src) in enumerate(zip(views, tensors, strict=True)):
            if self.async_copy and src.data_ptr() in async_ptrs:
                if src.is_cuda:
                    device_deferred.append((view, src))
                else:
                    deferred.append((i, view, src))
            else:
                view.copy_(src)
        event = self._launch_device_copies(device_deferred)
        self._host_pending = bool(deferred)
        copied: Future[None] = Future()
        self._copied = copied

        def work() -> Slot:
            hashed: dict[int, str] = {}
            try:
                if event is not None:
                    event.synchronize()  # the side-stream D2H copies into pinned memory are done
                self._copy_and_hash_all(slot.data, layout, deferred, hashed)
            finally:
                copied.set_result(None)
            arr = slot.data.numpy()
            digests = [
                hashed[i] if i in hashed else digest_bytes(arr[e.offset : e.offset + e.nbytes].data)
                for i, e in enumerate(layout.entries)
            ]
            slot.identity = dict(identity)
            slot.step = int(identity["step"])
            slot.prefix = self.pool.seal(slot, build_header(layout, digests, skeleton, identity))
            self.pool.publish(slot)
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

    def _copy_and_hash_all(
        self,
        data: torch.Tensor,
        layout: Layout,
        deferred: list[tuple[int, torch.Tensor, torch.Tensor]],
        hashed: dict[int, str],
    ) -> None:
        """Copy and hash the deferred tensors; with ``digest_threads`` > 1 the tensors are split into that many
        groups of about equal bytes, copied and hashed at once (torch's copy and BLAKE3 both release the GIL)."""

        def run(group: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
            for i, view, src in group:
                hashed[i] = _copy_and_hash(data, layout, i, view, src)

        if self._helpers is None or len(deferred) < 2:
            run(deferred)
            return
        groups: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [
            [] for _ in range(self.digest_threads)
        ]
        loads = [0] * self.digest_threads
        for item in sorted(deferred, key=lambda d: -layout.entries[d[0]].nbytes):
            k = loads.index(min(loads))
            groups[k].append(item)
            loads[k] += layout.entries[item[0]].nbytes
        futures = [self._helpers.submit(run, g) for g in groups[1:] if g]
        run(groups[0])
        for f in futures:
            f.result()

    def shutdown(self) -> None:
        self._copier.shutdown(wait=True)
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)


def _header_hint(skeleton: Any, count: int, identity: dict[str, Any]) -> int:
    """About how long the header of ``count`` tensors with this skeleton is (sizes a memory-tier slot's room)."""
    import json

    return (
        len(json.dumps(skeleton, separators=(",", ":"), default=str))
        + 200 * count
        + 512
        + len(str(identity))
    )


def _copy_and_hash(
    data: torch.Tensor, layout: Layout, index: int, view: torch.Tensor, src: torch.Tensor
) -> str:
    """Copy ``src`` into its place in the slot (``view``) and return the BLAKE3 digest of the copied bytes, chunk
    by chunk so each chunk is hashed while it is still in cache. Falls back to copy-then-hash for a tensor that is
    not a plain contiguous one."""
    entry = layout.entries[index]
    dst = data[entry.offset : entry.offset + entry.nbytes]
    arr = data.numpy()
    if (
        entry.nbytes <= _HASH_CHUNK
        or not src.is_contiguous()
        or src.dtype != view.dtype
        or type(src) is not torch.Tensor
    ):
        view.copy_(src)
        return digest_bytes(arr[entry.offset : entry.offset + entry.nbytes].data)
    raw = src.detach().reshape(-1).view(torch.uint8)
    hasher = blake3(max_threads=1)
    for off in range(0, entry.nbytes, _HASH_CHUNK):
        end = min(off + _HASH_CHUNK, entry.nbytes)
        dst[off:end].copy_(raw[off:end])
        hasher.update(arr[entry.offset + off : entry.offset + end].data)
    return str(hasher.hexdigest())

"""Pre-allocated, double-buffered capture slots: the buffers a capture is copied into, and the pool that hands them out.

A slot is sealed (its header written), published under its step's name, and settled once the ranks agreed on whether
its replicas landed; the pool keeps the *frontier* (the newest step every rank can restore) in memory and blocks or
skips a capture while no slot is free (backpressure, see :class:`SlotPool`).

With a memory tier (:mod:`gemscout.gemini.shm`) a slot's buffer is the mapping of a file in shared memory, published
under its step's name once sealed: the capture copy is the persistence that survives the process.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from gemscout.errors import CollectiveTimeout
from gemscout.gemini import shm
from gemscout.state.layout import Layout, frame_prefix


@dataclass(eq=False)
class Slot:
    """One pre-allocated buffer. ``pins`` counts users (replication, persistence) that still read it; ``settled``
    is False from the capture until the ranks agreed on whether its replicas landed (see :class:`SlotPool`)."""

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
    file: shm.ShmFile | None = None
    """The shared-memory file whose mapping ``data`` is (memory tier), else None (process memory)."""
    settled: bool = True

    def frame(self) -> tuple[bytes, torch.Tensor]:
        """The checkpoint as (prefix, data) — the same bytes as its file on disk."""
        return self.prefix, self.data


class SlotPool:
    """A fixed set of slots; a pinned slot is never handed out, so a replica in flight is never overwritten.

    Backpressure (``replicated``): a sealed slot is also kept while it may be what a node loss needs — the
    *frontier* (the newest step every rank agreed its replica of has landed on its peer, so every survivor and every
    replica holder has it in memory), and any capture whose agreement has not run yet (it may become the frontier).
    So after any single failure every rank still holds, in memory, the newest step every rank can restore. With
    ``slots=2`` that means capture ``s+2`` waits (``when_busy="wait"``) or is skipped (``"skip"``) until the
    replicas of ``s+1`` are acknowledged everywhere."""

    def __init__(
        self,
        count: int,
        memory: shm.MemoryTier | None = None,
        *,
        files_expected: int = 0,
        replicated: bool = False,
    ) -> None:
        self._slots = [Slot(i) for i in range(count)]
        self._cond = threading.Condition()
        self.replicated = replicated
        self.frontier = -1
        """Newest step whose replicas every rank agreed have landed (io thread; -1: none yet)."""
        self.memory = memory
        self.files_expected = files_expected or count
        """Files of the state's size this rank keeps in the memory tier (own slots + held replicas): the room
        checked before the first slot file is made."""
        self._room_checked = False

    def adopt(self, found: list[shm.Adopted]) -> None:
        """Take the sealed slots a killed earlier process of this rank left in the memory tier (newest first) as
        ready slots: recovery proposes them as memory and verifies every digest before restoring one."""
        with self._cond:
            for slot, got in zip(self._slots, found, strict=False):
                slot.file, slot.layout, slot.data = got.file, got.parsed.layout, got.file.data
                slot.views = got.parsed.layout.views(slot.data)
                slot.prefix, slot.identity, slot.step = (
                    got.prefix,
                    dict(got.parsed.identity),
                    got.parsed.identity["step"],
                )
                slot.settled = True
                slot.ready.set()
            for got in found[len(self._slots) :]:
                got.file.unlink()

    def acquire(
        self, layout: Layout, *, timeout: timedelta, pinned: bool = False, header_hint: int = 0
    ) -> Slot:
        """The oldest unpinned slot, resized for ``layout`` if needed. Blocks while every slot is pinned.

        With a memory tier the slot's file is taken out of view (renamed to a temp name) before it is written
        again; ``header_hint`` (an estimate of the header's size) sizes the room reserved ahead of the data."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._cond:
            while True:
                free = [s for s in self._slots if self._reusable(s)]
                if free:
                    slot = min(free, key=lambda s: s.step)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(
                        f"no free checkpoint slot after {timeout.total_seconds():.0f}s: the newest capture's "
                        "replicas are not acknowledged by every rank yet (or persistence is slower than the capture "
                        "interval); raise interval or slots, or set when_busy='skip'"
                    )
                self._cond.wait(left)
            slot.pins = 1
            slot.ready.clear()
            slot.step = -1
            slot.settled = not self.replicated
            try:
                self._prepare(slot, layout, pinned, header_hint)
            except BaseException:
                slot.pins = 0
                self._cond.notify_all()
                raise
            return slot

    def _prepare(self, slot: Slot, layout: Layout, pinned: bool, header_hint: int) -> None:
        # Pinned host memory lets device-to-host copies run asynchronously on a side stream; it stays process memory
        # (the sealed slot is written to the memory tier by the io thread instead).
        memory = self.memory if not pinned else None
        if slot.file is not None and slot.layout == layout and memory is not None:
            try:
                memory.unpublish(slot.file)  # out of view before a byte of it changes
                return
            except (
                FileNotFoundError
            ):  # removed behind our back (its folder deleted): make a new one
                slot.file = None
        if (
            slot.file is None
            and slot.layout == layout
            and slot.data.is_pinned() == pinned
            and memory is None
        ):
            return
        if slot.file is not None:
            slot.file.unlink()
            slot.file = None
        if memory is not None:
            reserve = shm.reserve_for(header_hint)
            if not self._room_checked:
                need = self.files_expected * (layout.data_nbytes + reserve) - memory.held_bytes()
                memory.check_room(need)
                self._room_checked = True
            slot.file = memory.new_file(memory.paths.own, layout.data_nbytes, reserve)
            slot.data = slot.file.data
        else:
            slot.data = torch.empty(layout.data_nbytes, dtype=torch.uint8, pin_memory=pinned)
        slot.layout = layout
        slot.views = layout.views(slot.data)

    def seal(self, slot: Slot, header: bytes) -> bytes:
        """The slot's frame prefix for ``header``; with a memory tier also written into the slot's file, which is
        then published under its step's name. A header too large for the room reserved moves the slot to a file
        with more room (one extra copy, once per growth)."""
        if slot.file is None or self.memory is None:
            return frame_prefix(header)
        padded = shm.pad_header(header, slot.file.data_offset)
        if padded is None:
            assert slot.layout is not None
            bigger = self.memory.new_file(
                self.memory.paths.own, slot.layout.data_nbytes, shm.reserve_for(len(header))
            )
            bigger.data.copy_(slot.data)
            slot.file.unlink()
            slot.file, slot.data = bigger, bigger.data
            slot.views = slot.layout.views(slot.data)
            padded = shm.pad_header(header, bigger.data_offset)
            assert padded is not None
        prefix = frame_prefix(padded)
        slot.file.write_prefix(prefix)
        return prefix

    def publish(self, slot: Slot) -> None:
        """Give a sealed slot's file its step's name (memory tier; a no-op otherwise)."""
        if slot.file is not None and self.memory is not None:
            # After a recovery to an older step, a slot may still hold the abandoned trajectory's capture of this
            # step under this name: take it out of view first, or the rename would replace its file behind it.
            with self._cond:
                for other in self._slots:
                    if other is not slot and other.file is not None and other.step == slot.step:
                        other.ready.clear()
                        other.step = -1
                        self.memory.unpublish(other.file)
            self.memory.publish(slot.file, self.memory.paths.own, slot.step)

    def discard_files(self) -> None:
        for slot in self._slots:
            if slot.file is not None:
                slot.file.unlink()

    def _reusable(self, slot: Slot) -> bool:
        if slot.pins:
            return False
        if slot.step < 0 or not slot.ready.is_set():
            return True  # never sealed (or its copy failed): holds nothing
        return slot.settled and slot.step != self.frontier

    def has_free(self) -> bool:
        """True if :meth:`acquire` would not block now (only the io thread frees slots, so it stays true until the
        caller acquires)."""
        with self._cond:
            return any(self._reusable(s) for s in self._slots)

    def settle(self, slot: Slot, frontier: int) -> None:
        """The ranks agreed on ``slot``'s capture: ``frontier`` is the newest step whose replicas landed everywhere
        (``slot.step`` when this capture's did). Frees the slots the frontier no longer needs."""
        with self._cond:
            slot.settled = True
            self.frontier = max(self.frontier, frontier)
            self._cond.notify_all()

    def reset_frontier(self, step: int) -> None:
        """After a recovery to ``step`` (every rank restored it; nothing is in flight): ``step`` is the frontier and
        every newer slot is of an abandoned trajectory."""
        with self._cond:
            self.frontier = step
            for s in self._slots:
                s.settled = True
            self._cond.notify_all()

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

    def stats(self) -> dict[str, int | None]:
        """For ``Session.metrics()``: the newest sealed step in memory and the bytes the slots hold."""
        newest = self.newest_ready()
        return {
            "newest_in_memory_step": newest.step if newest is not None else None,
            "buffer_bytes": self.nbytes,
        }

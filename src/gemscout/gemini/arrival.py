"""Verify a checkpoint frame while its data arrives, so the digest check overlaps the transfer.

A frame's header lists every tensor's offset and BLAKE3 digest; tensors are laid out in offset order. As each chunk
of the data region lands, the bytes of the tensors it covers are fed to incremental BLAKE3 hashers (a tensor that
spans chunks keeps its hasher between them); a tensor's digest is compared the moment its last byte is in. BLAKE3's
streaming digest equals its one-shot digest, so this is the same check as
:func:`gemscout.state.layout.verify_data`, done early.

A mismatch is recorded, never raised mid-transfer: raising would leave the sender blocked on a send nobody receives
(until its timeout); :meth:`ArrivalCheck.result` raises after the transfer is complete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from blake3 import blake3

from gemscout.errors import IntegrityError
from gemscout.state.digest import digests_equal
from gemscout.state.layout import Parsed, parse_prefix


class ArrivalCheck:
    """Digest check of one frame, fed in arrival order (see :class:`VerifyOnArrival`)."""

    def __init__(
        self,
        prefix: bytes,
        data: torch.Tensor,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.error: str | None = None
        self._on_progress = on_progress
        self._landed = 0
        self.parsed: Parsed | None = None
        self._data = data.numpy() if data.numel() else None
        self._index = 0  # the next tensor whose digest is not settled
        self._done = 0  # bytes of that tensor already hashed
        self._hasher: Any = None
        try:
            self.parsed = parse_prefix(prefix)
        except IntegrityError as exc:
            self.error = str(exc)
            return
        if data.numel() < self.parsed.layout.data_nbytes:
            self.error = f"data region is truncated: {data.numel()} of {self.parsed.layout.data_nbytes} bytes present"

    def received(self, end: int) -> None:
        """Bytes ``[0, end)`` of the data region are in: hash what they complete. Never raises."""
        if end > self._landed:
            self._landed = end
            if self._on_progress is not None and self.parsed is not None:
                self._on_progress(end, self.parsed.layout.data_nbytes)
        if self.error is not None or self.parsed is None:
            return
        entries, digests = self.parsed.layout.entries, self.parsed.digests
        while self._index < len(entries):
            entry = entries[self._index]
            start = entry.offset + self._done
            stop = min(end, entry.offset + entry.nbytes)
            if stop < start or (stop == start and self._done < entry.nbytes):
                return  # this tensor's next bytes have not arrived
            if self._hasher is None:
                self._hasher = blake3(max_threads=1)
            if stop > start:
                assert self._data is not None
                self._hasher.update(self._data[start:stop].data)
                self._done += stop - start
            if self._done < entry.nbytes:
                return
            if not digests_equal(digests[self._index], self._hasher.hexdigest()):
                self.error = f"tensor {self._index} digest mismatch"
                return
            self._index, self._done, self._hasher = self._index + 1, 0, None

    def result(self) -> Parsed:
        """The verified header once every byte is in. Raises IntegrityError naming the first mismatch."""
        if self.parsed is not None:
            self.received(self.parsed.layout.data_nbytes)
        if self.error is not None:
            raise IntegrityError(self.error)
        assert self.parsed is not None and self._index == len(self.parsed.layout.entries)
        return self.parsed


class VerifyOnArrival:
    """``comm.exchange(..., on_arrival=check)`` verifies what arrives as it arrives; ``check.result()`` after the
    exchange returns the verified header or raises IntegrityError."""

    def __init__(self, on_progress: Callable[[int, int], None] | None = None) -> None:
        """``on_progress(landed, total)``: called each time more of the data region has landed (see
        :mod:`gemscout.gemini.seams`); it must not raise."""
        self.check: ArrivalCheck | None = None
        self._on_progress = on_progress

    def __call__(self, prefix: bytes, data: torch.Tensor) -> ArrivalCheck:
        self.check = ArrivalCheck(prefix, data, self._on_progress)
        return self.check

    def result(self) -> Parsed:
        if self.check is None:
            raise IntegrityError("no checkpoint arrived")
        return self.check.result()

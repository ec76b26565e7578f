"""The reference side of each GEMINI comparison, timed on the same state in the same process.

- ``memcpy`` / ``digest`` / ``write``: torch ``copy_`` of every state tensor into a pre-allocated, pre-touched
  buffer in GEMINI's slot layout (what a capture must at least do), BLAKE3 over it, and writing it to a file with
  fsync (what persisting must at least do).
- ``gloo_pair``: both ranks ``isend``/``irecv`` the same number of bytes to each other, chunk by chunk, on a gloo group
  (what replication must at least do).
- ``dcp_*``: ``torch.distributed.checkpoint`` save, async_save (time until it returns, and until the upload is done)
  and load + ``set_state_dict`` of the same model and optimizer, the load once from the page cache (files just
  written) and once after evicting them from it (``posix_fadvise(DONTNEED)``), as when the files are not in this
  host's memory.

:class:`References` times one run per call so the caller can interleave the references with GEMINI's operations;
:func:`dcp_times` returns medians over ``reps`` runs.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemscout.state.layout import Layout, tensor_digests


def timed(
    fn: Callable[[], Any], reps: int, *, warmup: int = 0, before: Callable[[], Any] | None = None
) -> float:
    """Median wall time of ``fn`` over ``reps`` runs; ``before`` (untimed) runs ahead of each, e.g. a barrier."""
    times = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class References:
    """The reference operations on a buffer the size of the state, allocated once (two: data and receive).

    Each method times one run and returns seconds; the caller interleaves them with GEMINI's own operations so
    that both sides see the same machine load.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        scratch: Path,
        *,
        peer: int,
        group: dist.ProcessGroup,
        chunk_bytes: int,
        fsync: bool,
        recv_nbytes: int = 0,
    ) -> None:
        self.tensors, self.peer, self.group, self.chunk_bytes, self.fsync = (
            tensors,
            peer,
            group,
            chunk_bytes,
            fsync,
        )
        self.layout = Layout.of(tensors)
        self.buf = torch.zeros(
            self.layout.data_nbytes, dtype=torch.uint8
        )  # zeros: pages touched before timing
        # Also receives GEMINI frames, whose data region adds RNG state and buffers to the tensors here.
        self.recv = torch.zeros(max(recv_nbytes, self.layout.data_nbytes), dtype=torch.uint8)
        self._views = self.layout.views(self.buf)
        scratch.mkdir(parents=True, exist_ok=True)
        self._path = scratch / f"write-reference-{os.getpid()}.bin"

    def memcpy(self) -> float:
        """torch ``copy_`` of every state tensor into the buffer, laid out like a GEMINI slot."""
        t0 = time.perf_counter()
        for dst, src in zip(self._views, self.tensors, strict=True):
            dst.copy_(src)
        return time.perf_counter() - t0

    def digest(self) -> float:
        """BLAKE3 of every tensor in the buffer, as GEMINI digests a slot."""
        t0 = time.perf_counter()
        tensor_digests(self.layout, self.buf)
        return time.perf_counter() - t0

    def write(self) -> float:
        """Write the buffer to a new file (and fsync it), as persisting must at least do."""
        self._path.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with open(self._path, "wb") as fh:
            fh.write(memoryview(self.buf.numpy()))
            fh.flush()
            if self.fsync:
                os.fsync(fh.fileno())
        return time.perf_counter() - t0

    def gloo_pair(self) -> float:
        """Raw simultaneous exchange of the buffer with the peer: per chunk one isend and one irecv, wait both."""
        n, c = (
            self.buf.numel(),
            self.chunk_bytes,
        )  # the receive buffer may be larger; only n bytes move
        dist.barrier(group=self.group)
        t0 = time.perf_counter()
        for off in range(0, n, c):
            works = [
                dist.isend(self.buf[off : off + c], self.peer, group=self.group),
                dist.irecv(self.recv[off : off + c], self.peer, group=self.group),
            ]
            for w in works:
                w.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._path.unlink(missing_ok=True)


def evict_from_page_cache(folder: Path) -> None:
    """Ask the kernel to drop ``folder``'s cached pages (they are clean after fsync), so a read goes to storage."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def dcp_times(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: Path,
    *,
    reps: int,
    group: dist.ProcessGroup,
) -> dict[str, float]:
    """DCP save, async_save and load of ``model`` + ``optimizer`` into ``folder`` (shared by every rank).

    Each timing includes ``get_state_dict`` (and ``set_state_dict`` for load): that is what a training loop calls.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    def barrier() -> None:
        dist.barrier(group=group)

    save_dir, async_dir = folder / "save", folder / "async"
    # One untimed run of each first: DCP's first call also pays one-off costs (planner, executor threads).
    save_s = timed(
        lambda: dcp.save(_dcp_state(model, optimizer), checkpoint_id=save_dir),
        reps,
        warmup=1,
        before=barrier,
    )

    blocking, total = [], []
    for i in range(1 + reps):
        barrier()
        t0 = time.perf_counter()
        pending = dcp.async_save(_dcp_state(model, optimizer), checkpoint_id=async_dir)
        returned = time.perf_counter() - t0
        upload: Future[Any] = getattr(pending, "upload_completion", pending)
        upload.result()
        if i > 0:
            blocking.append(returned)
            total.append(time.perf_counter() - t0)

    def load() -> None:
        sd = _dcp_state(model, optimizer)
        dcp.load(sd, checkpoint_id=save_dir)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    load_s = timed(load, reps, warmup=1, before=barrier)

    def evict_then_barrier() -> None:
        evict_from_page_cache(save_dir)
        barrier()

    cold_s = timed(load, reps, before=evict_then_barrier)
    return {
        "dcp_save_s": save_s,
        "dcp_async_save_blocking_s": statistics.median(blocking),
        "dcp_async_save_total_s": statistics.median(total),
        "dcp_load_s": load_s,
        "dcp_load_cold_s": cold_s,
    }

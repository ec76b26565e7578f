"""The reference side of each GEMINI comparison, timed on the same state in the same process.

- ``memcpy`` / ``digest`` / ``write``: torch ``copy_`` of every state tensor into a pre-allocated, pre-touched
  buffer in GEMINI's slot layout (what a capture must at least do), BLAKE3 over it, and writing it to a file with
  fsync (what persisting must at least do).
- ``gloo_pair``: both ranks ``isend``/``irecv`` the same number of bytes to each other, chunk by chunk, on a gloo group
  (what replication must at least do).
- ``dcp_*``: ``torch.distributed.checkpoint`` save, async_save (time until it returns, and until the upload is done)
  and load + ``set_state_dict`` of the same model and optimizer, the load once from the page cache (files just
  written) and once after evicting them from it (``posix_fadvise(DONTNEED)``), as when the
  files are not in this host's memory.

Every function returns the median over ``reps`` timed repetitions after one untimed warm-up where the warm-up would
otherwise time page faults rather than the operation.
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


def timed(fn: Callable[[], Any], reps: int, *, warmup: int = 0, before: Callable[[], Any] | None = None) -> float:
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


def copy_digest_write_s(tensors: list[torch.Tensor], scratch: Path, reps: int, *, fsync: bool) -> dict[str, float]:
    """The local parts of a capture, each by itself on the same bytes: memcpy of ``tensors`` into one pre-allocated
    buffer laid out like a GEMINI slot, BLAKE3 of every tensor in that buffer, and writing the buffer to a file
    (plus fsync). The buffer is freed on return."""
    layout = Layout.of(tensors)
    buf = torch.zeros(layout.data_nbytes, dtype=torch.uint8)  # zeros: pages touched before timing
    views = layout.views(buf)

    def copy() -> None:
        for dst, src in zip(views, tensors, strict=True):
            dst.copy_(src)

    def write() -> None:
        with open(path, "wb") as fh:
            fh.write(memoryview(buf.numpy()))
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())

    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / f"write-reference-{os.getpid()}.bin"
    try:
        out = {"memcpy_s": timed(copy, reps, warmup=1),
               "digest_s": timed(lambda: tensor_digests(layout, buf), reps),
               "write_s": timed(write, reps, before=lambda: path.unlink(missing_ok=True))}
    finally:
        path.unlink(missing_ok=True)
    return out


def gloo_pair_s(nbytes: int, peer: int, *, group: dist.ProcessGroup, chunk_bytes: int, reps: int) -> float:
    """Raw simultaneous exchange of ``nbytes`` with ``peer``: per chunk one isend and one irecv, then wait both."""
    send = torch.ones(nbytes, dtype=torch.uint8)
    recv = torch.zeros(nbytes, dtype=torch.uint8)

    def exchange() -> None:
        for off in range(0, nbytes, chunk_bytes):
            works = [dist.isend(send[off : off + chunk_bytes], peer, group=group),
                     dist.irecv(recv[off : off + chunk_bytes], peer, group=group)]
            for w in works:
                w.wait()

    return timed(exchange, reps, warmup=1, before=lambda: dist.barrier(group=group))


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


def dcp_times(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, *, reps: int,
              group: dist.ProcessGroup) -> dict[str, float]:
    """DCP save, async_save and load of ``model`` + ``optimizer`` into ``folder`` (shared by every rank).

    Each timing includes ``get_state_dict`` (and ``set_state_dict`` for load): that is what a training loop calls.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    def barrier() -> None:
        dist.barrier(group=group)

    save_dir, async_dir = folder / "save", folder / "async"
    save_s = timed(lambda: dcp.save(_dcp_state(model, optimizer), checkpoint_id=save_dir), reps, before=barrier)

    blocking, total = [], []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        pending = dcp.async_save(_dcp_state(model, optimizer), checkpoint_id=async_dir)
        blocking.append(time.perf_counter() - t0)
        upload: Future[Any] = getattr(pending, "upload_completion", pending)
        upload.result()
        total.append(time.perf_counter() - t0)

    def load() -> None:
        sd = _dcp_state(model, optimizer)
        dcp.load(sd, checkpoint_id=save_dir)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    load_s = timed(load, reps, before=barrier)

    def evict_then_barrier() -> None:
        evict_from_page_cache(save_dir)
        barrier()

    cold_s = timed(load, reps, before=evict_then_barrier)
    return {"dcp_save_s": save_s, "dcp_async_save_blocking_s": statistics.median(blocking),
            "dcp_async_save_total_s": statistics.median(total), "dcp_load_s": load_s, "dcp_load_cold_s": cold_s}

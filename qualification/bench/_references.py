"""The reference side of each GEMINI comparison, timed on the same state in the same process.

- ``memcpy``: torch ``copy_`` of every state tensor into a pre-allocated, pre-touched buffer (what a capture must
  at least do; GEMINI's own copy lands in the same layout).
- ``gloo_pair``: both ranks ``isend``/``irecv`` the same number of bytes to each other, chunk by chunk, on a gloo group
  (what replication must at least do).
- ``dcp_*``: ``torch.distributed.checkpoint`` save, async_save (time until it returns, and until the upload is done)
  and load + ``set_state_dict`` of the same model and optimizer.

Every function returns the median over ``reps`` timed repetitions after one untimed warm-up where the warm-up would
otherwise time page faults rather than the operation.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemscout.state.layout import Layout


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


def memcpy_s(tensors: list[torch.Tensor], reps: int) -> float:
    """Copy ``tensors`` into one pre-allocated buffer laid out like a GEMINI slot."""
    layout = Layout.of(tensors)
    buf = torch.zeros(layout.data_nbytes, dtype=torch.uint8)  # zeros: pages touched before timing
    views = layout.views(buf)

    def copy() -> None:
        for dst, src in zip(views, tensors, strict=True):
            dst.copy_(src)

    return timed(copy, reps, warmup=1)


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
    return {"dcp_save_s": save_s, "dcp_async_save_blocking_s": statistics.median(blocking),
            "dcp_async_save_total_s": statistics.median(total), "dcp_load_s": load_s}

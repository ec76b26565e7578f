"""The benchmark's training loop and the clock around GEMINI's optimizer hooks."""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from qualification.bench import _model


def peak_rss_bytes() -> int:
    """Peak resident set of this process so far (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Trainer:
    """DDP over the linear stack, AdamW, a fixed input per rank; :meth:`step` runs one optimizer step."""

    def __init__(self, state_mib: float, batch: int, rank: int) -> None:
        self.model = _model.build(state_mib)
        self.ddp = DDP(self.model)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-4)
        width = self.model.layers[0].in_features
        self.x = torch.randn(batch, width, generator=torch.Generator().manual_seed(100 + rank))
        self.step(
            1
        )  # AdamW creates its state on the first step: only then is the state its full size

    def fwd_bwd(self, micro: int) -> None:
        for i in range(micro):
            # Gradient accumulation: only the last micro-batch all-reduces.
            with self.ddp.no_sync() if i < micro - 1 else nullcontext():
                self.ddp(self.x).square().mean().backward()

    def step(self, micro: int) -> tuple[float, float]:
        """One training step; returns (forward+backward seconds, whole step seconds)."""
        t0 = time.perf_counter()
        self.fwd_bwd(micro)
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return t1 - t0, time.perf_counter() - t0

    def tensors(self) -> list[torch.Tensor]:
        return _model.state_tensors(self.model, self.opt)

    def state_bytes(self) -> int:
        return _model.state_nbytes(self.model, self.opt)

    def micro_batches_for(self, target_s: float, group: dist.ProcessGroup) -> tuple[int, float]:
        """Micro-batches per step so that forward/backward lasts at least ``target_s``. Every rank must agree: the
        ranks' largest target over their mean micro-batch time (a noisy rank must not inflate the loop).
        Returns (micro-batches, this rank's median seconds of one micro-batch without all-reduce)."""
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            with self.ddp.no_sync():
                self.ddp(self.x).square().mean().backward()
            times.append(time.perf_counter() - t0)
        self.opt.zero_grad(set_to_none=True)
        one = statistics.median(times)
        target = torch.tensor([target_s], dtype=torch.float64)
        total = torch.tensor([one], dtype=torch.float64)
        dist.all_reduce(target, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        mean = float(total.item()) / dist.get_world_size(group)
        return max(2, math.ceil(float(target.item()) / mean)), one


class HookClock:
    """Time the training thread spends in the optimizer hooks registered between ours.

    Register :meth:`start` as a pre-hook and a post-hook *before* GEMINI attaches and :meth:`pre_end` /
    :meth:`post_end` *after*: hooks run in registration order, so each interval brackets exactly GEMINI's hook.
    """

    def __init__(self, stall_probe: Callable[[], float] | None = None) -> None:
        self.pre: list[float] = []
        self.post: list[float] = []
        self.reported: list[float] = []
        """What ``stall_probe`` (GEMINI's own ``capture_stall_s``) said after each step: a cross-check."""
        self.stall_probe = stall_probe
        self._t = 0.0

    def start(self, *_: Any) -> None:
        self._t = time.perf_counter()

    def pre_end(self, *_: Any) -> None:
        self.pre.append(time.perf_counter() - self._t)

    def post_end(self, *_: Any) -> None:
        self.post.append(time.perf_counter() - self._t)
        if self.stall_probe is not None:
            self.reported.append(self.stall_probe())

    def attach_around(self, optimizer: torch.optim.Optimizer, attach: Any) -> Any:
        """Register the bracketing hooks around ``attach()`` (which registers GEMINI's); returns its result."""
        optimizer.register_step_pre_hook(self.start)
        optimizer.register_step_post_hook(self.start)
        result = attach()
        optimizer.register_step_pre_hook(self.pre_end)
        optimizer.register_step_post_hook(self.post_end)
        return result

    def reset(self) -> None:
        self.pre, self.post, self.reported = [], [], []


def run_loop(
    trainer: Trainer, micro: int, steps: int, clock: HookClock | None = None
) -> dict[str, Any]:
    """``steps`` training steps; per step: forward/backward and whole-step seconds, and hook seconds with a clock."""
    if clock is not None:
        clock.reset()
    fb, total = [], []
    for _ in range(steps):
        f, s = trainer.step(micro)
        fb.append(f)
        total.append(s)
    out: dict[str, Any] = {"micro_batches": micro, "fwd_bwd_s": fb, "step_s": total}
    if clock is not None:
        out["pre_hook_s"], out["post_hook_s"] = list(clock.pre), list(clock.post)
        out["reported_stall_s"] = list(clock.reported)
    return out


def state_digest(tensors: list[torch.Tensor]) -> str:
    """BLAKE3 over every byte of ``tensors``, in order: equal digests mean bitwise-equal state."""
    from blake3 import blake3

    h = blake3()
    for t in tensors:
        h.update(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()

"""GPU tier: CUDA RNG capture/restore and pinned-memory, side-stream capture. Skipped without a CUDA device.

Run on a lent GPU machine with ``pytest tests/gpu``; CI has no GPU, so these are skipped there with the reason.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)"),
]


def test_cuda_rng_round_trips_through_a_checkpoint_frame() -> None:
    from gemscout.state.training_state import capture_rng, restore_rng

    torch.cuda.init()
    torch.cuda.manual_seed_all(3)
    rng = capture_rng()
    assert rng["cuda"] is not None
    a = torch.rand(4, device="cuda")
    restore_rng(rng)
    b = torch.rand(4, device="cuda")
    assert torch.equal(a, b)


def test_side_stream_capture_is_bitwise_and_does_not_block_the_host(tmp_path: Path) -> None:
    from gemscout.gemini.slots import SlotPool
    from gemscout.gemini.snapshot import Capturer
    from gemscout.state.codec import decode
    from gemscout.state.layout import parse_prefix

    params = {"w": torch.randn(64, 1024, 1024, device="cuda")}  # 256 MiB
    cap = Capturer(SlotPool(2), async_copy=True, timeout=timedelta(seconds=60))
    ptrs = {params["w"].data_ptr()}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fut = cap.capture(params, {"step": 1}, ptrs)
    enqueue_s = time.perf_counter() - t0
    cap.wait_copied()  # orders the compute stream after the copy; no host wait
    slot = fut.result(timeout=60)
    parsed = parse_prefix(slot.prefix)
    back = decode(parsed.skeleton, parsed.layout.views(slot.data))
    assert torch.equal(back["w"], params["w"].cpu())
    assert slot.data.is_pinned()
    assert enqueue_s < 0.05, f"capture blocked the host for {enqueue_s:.3f}s"

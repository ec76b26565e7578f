"""The raw bytes of a tensor, as every rank program hashes its state: this rank's shard of a DTensor, on the CPU,
contiguous, viewed as bytes (no dtype conversion unless asked for)."""

from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor, *, as_float: bool = False) -> bytes:
    """``t``'s bytes in memory order: a DTensor's local shard, detached, moved to the CPU, contiguous.
    ``as_float``: converted to float32 first (a digest that must not depend on the parameter dtype)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    local = local.detach()
    if as_float:
        local = local.float()
    return local.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

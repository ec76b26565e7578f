"""Synthetic token batches, a pure function of (seed, step, rank) so any step can be regenerated after recovery."""

from __future__ import annotations

import torch


def synthetic_batch(
    *, seed: int, step: int, rank: int, batch: int = 4, seq: int = 32, vocab: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(inputs, targets)`` token ids of shape (batch, seq); targets are inputs shifted by one.

    The generator is private, so drawing a batch never disturbs the global RNG that GEMINI captures.
    """
    gen = torch.Generator().manual_seed(
        (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**63 - 1)
    )
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

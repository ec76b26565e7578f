"""The benchmark's model: a residual stack of square ``nn.Linear`` layers sized to a target training-state size.

AdamW keeps ``exp_avg`` and ``exp_avg_sq`` beside every parameter, so the checkpointed state (parameters plus
optimizer state) is about three times the parameter bytes. The width is fixed per size class and the depth chosen so
that ``3 x params`` lands within one layer of the target; the benchmark reports the exact bytes it captured, never the
requested ones.
"""

from __future__ import annotations

import torch
from torch import nn

MiB = 1024 * 1024
STATE_COPIES = 3  # parameters + AdamW exp_avg + exp_avg_sq


class LinearStack(nn.Module):
    """``h = h + 0.5 * tanh(layer(h))`` per layer: bounded activations, so deep stacks neither vanish into
    denormals (which are orders of magnitude slower on CPU) nor overflow."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + 0.5 * torch.tanh(layer(x))
        return x


def shape_for(state_mib: float) -> tuple[int, int]:
    """(width, depth) whose AdamW training state is closest to ``state_mib`` MiB (at least one layer)."""
    param_bytes = state_mib * MiB / STATE_COPIES
    width = 1024 if param_bytes >= 4 * 4 * 1024 * 1024 else 256
    per_layer = (width * width + width) * 4
    return width, max(1, round(param_bytes / per_layer))


def build(state_mib: float, *, seed: int = 0) -> LinearStack:
    width, depth = shape_for(state_mib)
    torch.manual_seed(seed)
    return LinearStack(width, depth)


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor GEMINI copies asynchronously: parameters and per-parameter optimizer state."""
    tensors = [p.detach() for p in model.parameters()]
    for st in optimizer.state.values():
        tensors.extend(v.detach() for v in st.values() if isinstance(v, torch.Tensor))
    return tensors


def state_nbytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(model, optimizer))

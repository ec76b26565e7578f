"""A workload model cut into pipeline stages, for ``torch.distributed.pipelining``.

:func:`build_stage` builds the whole model from its seed (so every stage holds exactly the weights the unsplit model
would) and keeps the part one stage runs: the first stage the embedding, the positions and its share of the blocks;
the last stage its blocks, the final norm and the head; a middle stage only blocks. Attributes keep the names SCOUT
looks for (``embed``, ``blocks``, ``norm``, ``head``), so each stage's recipes are found in the stage alone: stage 0
has ``embedding`` and ``hidden.*``, the last stage ``hidden.*`` and ``output``. Block indices are the stage's own
(``blocks[0]`` of stage 1 is the model's block ``n0``). The loss is not part of any stage: the schedule's ``loss_fn``
computes it on the last stage's logits. A cut into more stages than the workload has blocks (four virtual stages of
``three-block``) builds the workload with one block per stage instead, so every stage runs at least one block.
"""

from __future__ import annotations

import torch
from torch import nn

from qualification.workloads.models import Block, CausalLM, build_model

__all__ = ["StageModule", "block_split", "build_stage"]


def block_split(n_blocks: int, n_stages: int) -> list[range]:
    """The blocks each stage runs: contiguous, the first stages take one more when they do not divide evenly."""
    if not 1 <= n_stages <= n_blocks:
        raise ValueError(
            f"cannot cut {n_blocks} blocks into {n_stages} stages (need 1 <= stages <= blocks)"
        )
    base, extra = divmod(n_blocks, n_stages)
    out, start = [], 0
    for stage in range(n_stages):
        size = base + (1 if stage < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class StageModule(nn.Module):
    """One pipeline stage of a :class:`~qualification.workloads.models.CausalLM`.

    ``forward(x)``: token ids → hidden states on the first stage, hidden states → hidden states in the middle,
    hidden states → logits on the last (ids → logits when one stage holds everything)."""

    def __init__(self, model: CausalLM, blocks: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.embed: nn.Embedding | None = model.embed if first else None
        self.pos: nn.Parameter | None = model.pos if first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.norm: nn.LayerNorm | None = model.norm if last else None
        self.head: nn.Linear | None = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None and self.pos is not None:
            x = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            assert isinstance(block, Block)
            x = block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def build_stage(name: str, *, seed: int, stage: int, n_stages: int) -> StageModule:
    """Stage ``stage`` of ``n_stages`` of workload ``name``, with the unsplit model's parameters drawn from ``seed``
    (the workload widened to ``n_stages`` blocks when it has fewer)."""
    model = build_model(name, seed=seed)
    if len(model.blocks) < n_stages:
        model = build_model(name, seed=seed, n_blocks=n_stages)
    split = block_split(len(model.blocks), n_stages)
    return StageModule(model, split[stage], first=stage == 0, last=stage == n_stages - 1)

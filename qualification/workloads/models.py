"""Small causal language models that train on CPU in milliseconds to a tenth of a second per step.

All are pre-LayerNorm decoders: token embedding + learned positions, ``n_blocks`` blocks of causal self-attention and
a GELU MLP, a final LayerNorm and a linear head. ``TinyCausalLM`` has one block (the quickstart);
``ThreeBlockTransformer`` has three (the workload of the seed report's API validation, and every fault test's);
``TwelveBlockTransformer`` has twelve blocks of dim 128 and trains on 8 x 64-token batches (:data:`BATCH_SHAPES`):
the overhead suite's second workload, whose proportions — one block a twelfth of the model, a step of ~0.1 s on
one CPU thread — are closer to a real model's than the three-block one's, where replaying one block is a third of
the model's compute. Attributes are named so that SCOUT can find its recipe boundaries: ``embed``, ``blocks``,
``norm``, ``head``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """One pre-LN transformer block: causal multi-head attention and a 4x GELU MLP, both residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class CausalLM(nn.Module):
    """Decoder-only LM: ``forward(ids) -> logits`` of shape (batch, seq, vocab)."""

    def __init__(
        self,
        *,
        vocab: int = 128,
        dim: int = 64,
        heads: int = 4,
        n_blocks: int = 3,
        max_seq: int = 64,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(max_seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TinyCausalLM(CausalLM):
    """The quickstart model: one block, dim 64."""

    def __init__(self, **kw: int) -> None:
        kw.setdefault("n_blocks", 1)
        super().__init__(**kw)


class ThreeBlockTransformer(CausalLM):
    """The reference workload: three blocks, dim 64."""

    def __init__(self, **kw: int) -> None:
        kw.setdefault("n_blocks", 3)
        super().__init__(**kw)


class TwelveBlockTransformer(CausalLM):
    """Twelve blocks, dim 128 (2.4 M parameters, 27.7 MiB of parameters and AdamW state)."""

    def __init__(self, **kw: int) -> None:
        kw.setdefault("n_blocks", 12)
        kw.setdefault("dim", 128)
        super().__init__(**kw)


# (batch, seq) each workload trains on; vocab is the models' default (128).
BATCH_SHAPES = {"tiny-causal-lm": (4, 32), "three-block": (4, 32), "twelve-block": (8, 64)}


def build_model(name: str, *, seed: int, **kw: int) -> CausalLM:
    """Build a workload model with parameters drawn from ``seed`` (identical on every rank)."""
    models = {
        "tiny-causal-lm": TinyCausalLM,
        "three-block": ThreeBlockTransformer,
        "twelve-block": TwelveBlockTransformer,
    }
    if name not in models:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(models)}")
    gen_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        return models[name](**kw)
    finally:
        torch.set_rng_state(gen_state)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

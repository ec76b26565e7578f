"""A small causal LM for context parallelism on a ("dp", "cp") DeviceMesh, with our own sequence-sharded attention.

torch's ``context_parallel`` (ring attention) does not run on CPU here: torch 2.13 registers no sharding strategy for
``aten._scaled_dot_product_flash_attention_for_cpu`` (probed on a 2-rank gloo mesh). So each block's attention
all-gathers K and V over the ``cp`` dim (an autograd function; its backward all-reduces the gradient and keeps this
rank's chunk, which gloo supports) and masks causally by global position. Rank ``c`` of a CP group holds positions
``c * T/cp ... (c+1) * T/cp - 1`` of its dp row's batch.

Parameters are DTensors on the whole mesh, ``Replicate`` everywhere (see
:func:`qualification.workloads.moe.place_on_mesh`); gradients are averaged over every rank (each rank's loss is the
mean over its own tokens, and every rank holds as many). The modules compute on local tensors so SCOUT's replay copies
run through them too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qualification.workloads.moe import LocalEmbedding, LocalLayerNorm, LocalLinear, local


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence dim (dim 2 of (batch, heads, seq, head_dim)) over the CP group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.chunk = group, rank, x.shape[2]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(
            total, group=ctx.group
        )  # every rank's queries saw this rank's keys and values
        return total.narrow(2, ctx.rank * ctx.chunk, ctx.chunk).contiguous(), None, None, None


class CPBlock(nn.Module):
    """Pre-LN block: attention over the whole sequence (K/V gathered over cp) and a GELU MLP, both residual."""

    def __init__(self, dim: int, heads: int, cp_rank: int, cp_size: int, group: Any) -> None:
        super().__init__()
        self.heads, self.cp_rank, self.cp_size, self.group = heads, cp_rank, cp_size, group
        self.ln1 = LocalLayerNorm(dim)
        self.qkv = LocalLinear(dim, 3 * dim)
        self.proj = LocalLinear(dim, dim)
        self.ln2 = LocalLayerNorm(dim)
        self.fc1 = LocalLinear(dim, 2 * dim)
        self.fc2 = LocalLinear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        k = _GatherSeq.apply(k, self.group, self.cp_rank, self.cp_size)
        v = _GatherSeq.apply(v, self.group, self.cp_rank, self.cp_size)
        rows = torch.arange(t) + self.cp_rank * t
        mask = rows.unsqueeze(1) >= torch.arange(t * self.cp_size).unsqueeze(0)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CPLM(nn.Module):
    """``embed`` + learned positions (this rank's chunk of them), ``blocks``, ``norm``, ``head``."""

    def __init__(
        self,
        *,
        cp_rank: int,
        cp_size: int,
        group: Any,
        vocab: int = 128,
        dim: int = 32,
        heads: int = 4,
        n_blocks: int = 2,
        max_seq: int = 64,
    ) -> None:
        super().__init__()
        self.cp_rank = cp_rank
        self.embed = LocalEmbedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_seq, dim) * 0.02)
        self.blocks = nn.ModuleList(
            CPBlock(dim, heads, cp_rank, cp_size, group) for _ in range(n_blocks)
        )
        self.norm = LocalLayerNorm(dim)
        self.head = LocalLinear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: this rank's chunk of the sequence (batch, T/cp)."""
        t = ids.shape[1]
        x = self.embed(ids) + local(self.pos)[self.cp_rank * t : (self.cp_rank + 1) * t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def seq_chunk(tokens: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This CP rank's contiguous chunk of the sequence dim (dim 1)."""
    t = tokens.shape[1] // cp_size
    return tokens[:, cp_rank * t : (cp_rank + 1) * t].contiguous()


def build_cp(*, seed: int, cp_rank: int, cp_size: int, group: Any, **kw: Any) -> CPLM:
    """The CP LM with parameters drawn from ``seed`` (global RNG restored afterwards)."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        return CPLM(cp_rank=cp_rank, cp_size=cp_size, group=group, **kw)
    finally:
        torch.set_rng_state(state)

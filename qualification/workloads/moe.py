"""A small Mixture-of-Experts causal LM for expert parallelism on a ("dp", "ep") or ("dp", "ep", "etp") DeviceMesh.

Each block is ``x + moe(norm(x))``: a top-1 router over ``n_experts`` experts (a two-layer GELU MLP each), the experts
sharded over the ``ep`` dim (rank ``e`` of the EP group holds experts ``e * n_local ... (e + 1) * n_local - 1``).
Tokens travel to their expert's rank and back with ``dist.all_to_all_single`` and uneven split sizes (the counts are
exchanged first), through an autograd function whose backward is the reverse AllToAll.

Expert tensor parallelism (``etp_size`` > 1, an ``etp`` mesh dim): each local expert's MLP is sharded over the etp
group as Megatron shards a dense one — ``w1`` column-wise (its hidden columns), ``w2`` row-wise (the same hidden
rows) — so an etp rank computes a partial expert output that an all-reduce over etp completes (:class:`_ReduceFromTP`;
its backward passes the gradient through, and :class:`_CopyToTP` all-reduces the rows' gradient in backward). The
etp partners read the same batch and dispatch the same rows, each within its own EP group (the EP ranks with its
etp coordinate).

Parameters are DTensors on the whole mesh, so SCOUT reads the topology off the model: experts ``Shard(0)`` on ``ep``
(and on ``etp`` their hidden axis), everything else ``Replicate``; every (dp, ep) coordinate reads its own batch, so
gradients are averaged by hand (:func:`sync_grads`): expert weights over ``dp`` (the replicas of the same expert
shard), the rest over every rank. The
modules compute on local tensors (:func:`local`), so they run on the live DTensor parameters and on SCOUT's private
replay copies alike. Global initialization from ``seed``: every expert is drawn, then each rank keeps its own, so
the model is the same whatever the mesh.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local part of a DTensor parameter, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class LocalEmbedding(nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, local(self.weight))


class LocalLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, local(self.weight), None if self.bias is None else local(self.bias))


class LocalLayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(
            x, self.normalized_shape, local(self.weight), local(self.bias), self.eps
        )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the etp group (each etp rank saw the same rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (sum of the etp ranks' partial expert outputs); the gradient passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


# Which axis of an expert weight the etp dim shards: w1 [expert, dim, hidden] by column, w2 [expert, hidden, dim] by row.
TP_AXIS = {"expert_w1": 2, "expert_w2": 1}


class ExpertDispatch(nn.Module):
    """Top-1 routing, token dispatch to the expert's EP rank, the local experts (their etp shard), the combine back."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        ep_size: int,
        ep_rank: int,
        group: Any,
        etp_size: int = 1,
        etp_rank: int = 0,
        etp_group: Any = None,
    ) -> None:
        super().__init__()
        if n_experts % ep_size:
            raise ValueError(f"n_experts={n_experts} must be a multiple of the EP size {ep_size}")
        if hidden % etp_size:
            raise ValueError(f"hidden={hidden} must be a multiple of the expert TP size {etp_size}")
        self.n_experts, self.ep_size, self.n_local, self.group = (
            n_experts,
            ep_size,
            n_experts // ep_size,
            group,
        )
        self.etp_size, self.etp_group = etp_size, etp_group
        self.router = LocalLinear(dim, n_experts)
        w1 = torch.randn(n_experts, dim, hidden) / dim**0.5  # every expert drawn, this rank's kept
        w2 = torch.randn(n_experts, hidden, dim) / hidden**0.5
        mine = slice(ep_rank * self.n_local, (ep_rank + 1) * self.n_local)
        cols = slice(etp_rank * hidden // etp_size, (etp_rank + 1) * hidden // etp_size)
        self.expert_w1 = nn.Parameter(w1[mine][:, :, cols].clone())
        self.expert_w2 = nn.Parameter(w2[mine][:, cols, :].clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        gate, expert = F.softmax(self.router(x), dim=-1).max(dim=-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.n_experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(
            recv_counts, counts, group=self.group
        )  # per source: rows for each local expert
        in_splits = counts.view(self.ep_size, self.n_local).sum(1).tolist()
        out_splits = recv_counts.view(self.ep_size, self.n_local).sum(1).tolist()
        rows = _AllToAll.apply(x[order], out_splits, in_splits, self.group)
        if self.etp_size > 1:
            rows = _CopyToTP.apply(rows, self.etp_group)
        which = torch.repeat_interleave(
            torch.arange(self.n_local).repeat(self.ep_size), recv_counts
        )
        w1, w2 = local(self.expert_w1), local(self.expert_w2)
        out = torch.zeros_like(rows)
        for e in range(self.n_local):
            idx = (which == e).nonzero().squeeze(1)
            out = out.index_copy(0, idx, F.gelu(rows[idx] @ w1[e]) @ w2[e])
        if (
            self.etp_size > 1
        ):  # each etp rank holds part of every local expert's hidden units: sum the parts
            out = _ReduceFromTP.apply(out, self.etp_group)
        back = _AllToAll.apply(out, in_splits, out_splits, self.group)
        y = torch.zeros_like(x).index_copy(0, order, back)
        return (gate.unsqueeze(1) * y).reshape(shape)


class MoEBlock(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        ep_size: int,
        ep_rank: int,
        group: Any,
        **etp: Any,
    ) -> None:
        super().__init__()
        self.norm = LocalLayerNorm(dim)
        self.moe = ExpertDispatch(dim, hidden, n_experts, ep_size, ep_rank, group, **etp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoELM(nn.Module):
    """``embed`` + learned positions, ``blocks`` of MoE, ``norm``, ``head`` (the names SCOUT finds)."""

    def __init__(
        self,
        *,
        ep_size: int,
        ep_rank: int,
        group: Any,
        vocab: int = 128,
        dim: int = 32,
        hidden: int = 64,
        n_experts: int = 4,
        n_blocks: int = 2,
        max_seq: int = 64,
        etp_size: int = 1,
        etp_rank: int = 0,
        etp_group: Any = None,
    ) -> None:
        super().__init__()
        self.embed = LocalEmbedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_seq, dim) * 0.02)
        etp = {"etp_size": etp_size, "etp_rank": etp_rank, "etp_group": etp_group}
        self.blocks = nn.ModuleList(
            MoEBlock(dim, hidden, n_experts, ep_size, ep_rank, group, **etp)
            for _ in range(n_blocks)
        )
        self.norm = LocalLayerNorm(dim)
        self.head = LocalLinear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + local(self.pos)[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("expert_")


def place_on_mesh(
    model: nn.Module, mesh: Any, *, shard_dim: str | None, tp_dim: str | None = None
) -> None:
    """Turn every parameter into a DTensor on ``mesh``: ``Replicate`` everywhere, except expert weights, which are
    ``Shard(0)`` along ``shard_dim`` (they already hold this rank's experts) and, with ``tp_dim``, sharded along it
    on their hidden axis (:data:`TP_AXIS`: they already hold this rank's etp part)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    names = mesh.mesh_dim_names
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            expert = shard_dim is not None and is_expert(name)
            axes = (
                {shard_dim: 0} | ({tp_dim: TP_AXIS[name]} if tp_dim is not None else {})
                if expert
                else {}
            )
            placements = [Shard(axes[dim]) if dim in axes else Replicate() for dim in names]
            shape = None
            if expert:
                sizes = list(param.shape)
                for dim, axis in axes.items():
                    sizes[axis] *= mesh.size(names.index(dim))
                shape = torch.Size(sizes)
            dt = DTensor.from_local(
                param.detach(),
                mesh,
                placements,
                run_check=False,
                shape=shape,
                stride=None if shape is None else torch.empty(shape, device="meta").stride(),
            )
            setattr(module, name, nn.Parameter(dt, requires_grad=param.requires_grad))


def sync_grads(model: nn.Module, *, dp_group: Any, world_size: int, dp_size: int) -> None:
    """Average gradients: expert weights over ``dp_group`` (the replicas of this rank's expert shard), everything
    else over every rank (etp partners hold equal dense gradients: they read the same batch)."""
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = local(param.grad)
        if is_expert(name):
            dist.all_reduce(grad, group=dp_group)
            grad.div_(dp_size)
        else:
            dist.all_reduce(grad)
            grad.div_(world_size)


def build_moe(*, seed: int, ep_size: int, ep_rank: int, group: Any, **kw: Any) -> MoELM:
    """The MoE LM with parameters drawn from ``seed`` (global RNG restored afterwards)."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        return MoELM(ep_size=ep_size, ep_rank=ep_rank, group=group, **kw)
    finally:
        torch.set_rng_state(state)

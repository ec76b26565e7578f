"""Replay on sharded parameters: gather what peers can compare, keep FSDP out of the replay, time the collectives.

Under FSDP no rank holds a whole parameter, and between steps the module holds only this rank's shard (a DTensor).
A replay needs the whole parameter, so :class:`Materializer` gathers it along the *shard* dims of the topology —
``DTensor.redistribute`` to ``Replicate`` there — into a private tensor. Placements on model-parallel dims are kept:
a TP-sharded weight stays a DTensor on the TP sub-mesh, holding this rank's TP shard, exactly the form FSDP hands
the module in the real forward, so the replay runs the module's own TP collectives with its TP partners.

What the gathered copy is evidence of depends on who gathered what:

* HSDP: each peer gathers from its *own* replica's shards, so peers' digests of the gathered parameters compare
  independent replicas (the parameter-digest precondition);
* pure FSDP (or FSDP along ``dp`` of a ``(dp, tp)`` mesh): every peer gathers the *same* shards. The gathered copies
  agree by construction; the replay then shows which rank computes wrong numbers on those parameters, but a shard
  that is itself corrupted has no independent replica to be outvoted by.

Gathers are collectives along the shard dims on the mesh's own process groups; every rank materializes the same
tensors in the same order (parameter order of the recipe's modules, sorted keys of an optimizer slice), whatever its
local state. Their time is communication evidence, exposed per recipe and rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gemscout._dist import wait_all
from gemscout._tensors import is_dtensor
from gemscout.topology import Topology
from gemscout.topology_discovery import mesh_dims

__all__ = [
    "CollectiveTimer",
    "Materializer",
    "local_tensor",
    "param_model_dims",
    "uses_model_dims",
    "without_wrapper_hooks",
]

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local part of a DTensor (the tensor itself otherwise): what digests and fault hooks see."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined, no-any-return]


def param_model_dims(param: torch.Tensor, topology: Topology) -> set[str]:
    """The topology's model-parallel dims ``param`` is placed on: those its replay runs collectives along.

    A DTensor says so through its mesh's dim names. A plain tensor lies on the dims its framework's flags name
    (:attr:`~gemscout.topology.Topology.placement_flags`, set by the adapter: Megatron Core's TP shards and expert
    weights, :data:`~gemscout.adapters.megatron.topology.MEGATRON_PLACEMENT_FLAGS`). Anything else is replicated
    along every model dim. Pure; no framework is imported."""
    model = set(topology.model_dims)
    if is_dtensor(param):
        return model & set(mesh_dims(param.device_mesh))  # type: ignore[attr-defined]
    missing = object()
    dims = {
        flag.dim
        for flag in topology.placement_flags
        if getattr(param, flag.attribute, missing) is flag.value
    }
    return model & dims


def uses_model_dims(params: Sequence[torch.Tensor], topology: Topology) -> bool:
    """True when some parameter is placed on a model-parallel dim, so replaying it runs collectives."""
    return any(param_model_dims(p, topology) for p in params)


class Materializer:
    """Gathers DTensors along the topology's shard dims into private tensors (collective, on every rank alike)."""

    def __init__(self, topology: Topology, timeout: timedelta) -> None:
        self.shard_dims = frozenset(topology.shard_dims)
        self.data_dims = frozenset(topology.data_dims)
        self.timeout = timeout

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` whole along the data dims, its model-dim placements kept; a plain tensor is returned detached.

        Blocks on the mesh's collectives for a DTensor sharded along a data dim (every rank of that dim must call it,
        in the same order). The result is private: never the live parameter's storage when a gather ran, and it
        carries no autograd history. ``requires_grad`` follows the input.
        """
        if not is_dtensor(tensor):
            return tensor.detach()
        from torch.distributed.tensor import DTensor, Replicate

        assert isinstance(tensor, DTensor)
        mesh = tensor.device_mesh
        names = mesh_dims(mesh)
        target = [
            Replicate() if name in self.data_dims else p
            for name, p in zip(names, tensor.placements, strict=True)
        ]
        with torch.no_grad():
            whole = (
                tensor.redistribute(mesh, target) if list(tensor.placements) != target else tensor
            )
            local = whole.to_local().detach()
            kept = [
                (name, p)
                for name, p in zip(names, tensor.placements, strict=True)
                if name not in self.data_dims
            ]
            if kept:
                sub = mesh[tuple(name for name, _ in kept)] if len(kept) > 1 else mesh[kept[0][0]]
                out: torch.Tensor = DTensor.from_local(
                    local, sub, [p for _, p in kept], run_check=False
                )
            else:
                out = local
        return out.detach().requires_grad_(tensor.requires_grad)

    def gather_all(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every tensor gathered as :meth:`gather` does, in order, with far fewer collectives.

        FSDP shards dim 0 along one data dim; such DTensors travel together, one all-gather of their concatenated
        local shards per (mesh dim, dtype), instead of one per tensor (an optimizer slice holds dozens: parameters,
        gradients, two AdamW moments). Anything else (a strided shard of FSDP x TP, a TP placement) takes
        :meth:`gather`. The grouping depends only on placements, shapes and dtypes, so it is the same on every rank.
        """
        out: list[torch.Tensor | None] = [None] * len(tensors)
        batches: dict[tuple[Any, ...], list[int]] = {}
        for index, tensor in enumerate(tensors):
            key = self._batch_key(tensor)
            if key is None:
                out[index] = self.gather(tensor)
            else:
                batches.setdefault(key, []).append(index)
        for (_, _, dim, _, _), indices in batches.items():
            for index, whole in zip(
                indices, self._gather_batch([tensors[i] for i in indices], dim), strict=True
            ):
                out[index] = whole
        return [t for t in out if t is not None]

    def _batch_key(self, tensor: torch.Tensor) -> tuple[Any, ...] | None:
        if not is_dtensor(tensor):
            return None
        from torch.distributed.tensor import Shard

        mesh = tensor.device_mesh  # type: ignore[attr-defined]
        names = mesh_dims(mesh)
        sharded = [
            (n, p)
            for n, p in zip(names, tensor.placements, strict=True)  # type: ignore[attr-defined]
            if not p.is_replicate()
        ]
        if not set(names) <= self.data_dims or len(sharded) != 1:
            return None
        name, placement = sharded[0]
        if type(placement) is not Shard or placement.dim != 0 or tensor.dim() == 0:
            return None
        return (
            names,
            tuple(mesh.mesh.flatten().tolist()),
            name,
            str(tensor.dtype),
            tensor.device.type,
        )

    def _gather_batch(self, tensors: Sequence[torch.Tensor], dim: str) -> list[torch.Tensor]:
        from torch.distributed.tensor import Shard

        mesh = tensors[0].device_mesh  # type: ignore[attr-defined]
        index = mesh_dims(mesh).index(dim)
        size, me = mesh.size(index), mesh.get_local_rank(index)
        rows = [
            [Shard.local_shard_size_and_offset(t.shape[0], size, i)[0] for i in range(size)]
            for t in tensors
        ]
        per_row = [math.prod(t.shape[1:]) for t in tensors]
        lengths = [sum(r[i] * n for r, n in zip(rows, per_row, strict=True)) for i in range(size)]
        locals_ = [t.to_local().detach().reshape(-1) for t in tensors]  # type: ignore[attr-defined]
        assert [x.numel() for x in locals_] == [
            r[me] * n for r, n in zip(rows, per_row, strict=True)
        ]
        width = max(lengths)
        mine = torch.zeros(width, dtype=tensors[0].dtype, device=tensors[0].device)
        if locals_:
            torch.cat(locals_, out=mine[: lengths[me]])
        received = [torch.empty_like(mine) for _ in range(size)]
        wait_all(
            [dist.all_gather(received, mine, group=mesh.get_group(index), async_op=True)],
            self.timeout,
            "scout parameter gather",
        )
        out, offsets = [], [0] * size
        for tensor, r, n in zip(tensors, rows, per_row, strict=True):
            pieces = []
            for i in range(size):
                pieces.append(received[i][offsets[i] : offsets[i] + r[i] * n])
                offsets[i] += r[i] * n
            whole = torch.cat(pieces).reshape(tensor.shape)
            out.append(whole.requires_grad_(tensor.requires_grad))
        return out

    def gather_modules(
        self, paths: Sequence[str], modules: Sequence[nn.Module]
    ) -> tuple[list[dict[str, torch.Tensor]], float]:
        """Every parameter of ``modules`` gathered, one name→tensor dict per module, and the seconds it took."""
        start = time.perf_counter()
        named = [
            (i, name, p)
            for i, module in enumerate(modules)
            for name, p in module.named_parameters()
        ]
        gathered = self.gather_all([p for _, _, p in named])
        out: list[dict[str, torch.Tensor]] = [{} for _ in modules]
        for (i, name, _), tensor in zip(named, gathered, strict=True):
            out[i][name] = tensor
        return out, time.perf_counter() - start

    def gather_named(
        self, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], float]:
        """Every tensor of ``tensors`` gathered, in sorted key order (so every rank gathers in the same order)."""
        start = time.perf_counter()
        keys = sorted(tensors)
        out = dict(zip(keys, self.gather_all([tensors[k] for k in keys]), strict=True))
        return out, time.perf_counter() - start


def _owned_by_fsdp(hook: Any) -> bool:
    """Whether ``hook`` is FSDP's: a bound method of its module state (``FSDPState._pre_forward``), or a
    ``functools.wraps`` wrapper of one (grouped ``fully_shard([a, b])``).

    Every link is looked at: FSDP decorates those methods itself, and ``inspect.unwrap`` of a bound method follows
    its function's ``__wrapped__`` to the plain function, which has no ``__self__`` left to recognize."""
    candidate, seen = hook, 0
    while (
        candidate is not None and seen < 16
    ):  # each link of the __wrapped__ chain, bound methods included
        owner = getattr(candidate, "__self__", None)
        if owner is not None and type(owner).__module__.startswith("torch.distributed.fsdp"):
            return True
        candidate, seen = getattr(candidate, "__wrapped__", None), seen + 1
    return False


@contextmanager
def without_wrapper_hooks(
    modules: Sequence[nn.Module], owned_by: Callable[[Any], bool] | None = None
) -> Iterator[None]:
    """Detach a sharding wrapper's forward hooks from ``modules`` (and their submodules) for the replay, then put them
    back in order. ``owned_by(hook)`` says which hooks are the wrapper's (default: FSDP2's).

    Those hooks would all-gather into the live module, reshard it and register the post-backward reduce-scatter that
    writes ``.grad``: the replay's backward would then change training. Every other hook stays: a user's module hook
    (a persistent fault included) and TP's input/output hooks, which the replay needs.
    """
    owned_by = owned_by or _owned_by_fsdp
    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    try:
        for module in modules:
            for sub in module.modules():
                for registry in (sub._forward_pre_hooks, sub._forward_hooks):
                    owned = [key for key, hook in registry.items() if owned_by(hook)]
                    if owned:
                        saved.append((registry, dict(registry)))
                        for key in owned:
                            del registry[key]
        yield
    finally:
        for registry, original in saved:
            registry.clear()
            registry.update(original)


CollectiveHook = Callable[[str], None]
"""``hook(op_name)`` runs right before a collective of the replay enters (fault injection: a delayed collective)."""


class CollectiveTimer(TorchDispatchMode):
    """Times the collectives that run inside a replay (TP's all-reduces, forward and backward).

    A dispatch mode sees every functional collective DTensor issues, in the forward and in the backward (the mode
    travels with autograd's thread-local state). The time spent in them is communication, not compute: the caller
    subtracts it from the replay time before comparing compute, and compares it per model-parallel group instead.
    """

    def __init__(self, before: Sequence[CollectiveHook] = ()) -> None:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        super().__init__()
        self.seconds = 0.0
        self.count = 0
        self._before = tuple(before)
        self._async = AsyncCollectiveTensor

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "namespace", "") not in _COLLECTIVE_NAMESPACES:
            pending = [
                t
                for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, self._async) and not t.completed
            ]
            if pending:
                # The first op on a collective's result waits for the collective inside the subclass's dispatch,
                # where this mode does not see it; wait here instead, timed as the collective it is.
                start = time.perf_counter()
                for tensor in pending:
                    tensor.trigger_wait()
                self.seconds += time.perf_counter() - start
            return func(*args, **kwargs)
        start = time.perf_counter()
        try:
            name = getattr(func, "__name__", str(func))
            if not any(part in name for part in ("wait", "wrap")):  # not the bookkeeping ops
                self.count += 1
                for hook in self._before:
                    hook(str(func))
            return func(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

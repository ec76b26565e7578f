"""Module helpers shared by the state collector, SCOUT's catalog and the framework adapters."""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The module that owns the parameters under wrappers that hold the model as ``.module``, repeatedly.

    DDP, DeepSpeed's engine, Megatron's DistributedDataParallel and Float16Module all do; an attribute named
    ``module`` that is not an ``nn.Module`` ends the walk. FSDP2 and torchtitan's model parts have no wrapper: the
    model is returned as it is."""
    inner = getattr(model, "module", None)
    while isinstance(inner, nn.Module):
        model, inner = inner, getattr(inner, "module", None)
    return model

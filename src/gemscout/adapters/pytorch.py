"""Plain PyTorch: an ``nn.Module`` (DDP, FSDP2, HSDP, DeviceMesh TP) with a ``torch.optim.Optimizer``, used as is.
The last adapter of the registry, so its checks are the ones a user of no framework meets."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gemscout.adapters.classes import defined_in
from gemscout.adapters.target import Request, Target
from gemscout.errors import ConfigError


def adapt(model: Any, optimizer: Any, request: Request) -> Target:
    if isinstance(model, list | tuple):
        raise ConfigError(
            f"enable_resiliency.model: expected one torch.nn.Module, got a {type(model).__name__} of "
            f"{len(model)}; a list of model chunks is accepted only from Megatron Core (its modules)"
        )
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"enable_resiliency.model: expected a torch.nn.Module, got {type(model).__name__}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        hint = (
            "; with DeepSpeed pass the DeepSpeedEngine as model, not engine.module"
            if defined_in(optimizer, "deepspeed")
            else ""
        )
        raise ConfigError(
            f"enable_resiliency.optimizer: expected a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}{hint}"
        )
    return Target(
        framework="torch",
        model=model,
        optimizer=optimizer,
        extra_state_fn=request.extra_state_fn,
        load_extra_state_fn=request.load_extra_state_fn,
        schedulers=tuple(request.schedulers),
        scout=request.scout,
    )

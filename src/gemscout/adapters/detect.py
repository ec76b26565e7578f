"""Which framework built the objects given to ``enable_resiliency``, and what gemscout attaches to for each.

Detection reads class modules and names along each object's MRO; it never imports a framework, so it costs nothing
when the framework is absent and cannot fail on a broken install. The kinds:

- **DeepSpeed**: a ``deepspeed…DeepSpeedEngine`` → :mod:`gemscout.adapters.deepspeed` (ZeRO-1/2/3);
- **TorchTitan**: a ``torchtitan…Trainer`` → :mod:`gemscout.adapters.torchtitan` (pass the trainer as ``model``);
- **Megatron Core**: a list of model chunks, a module or an optimizer from ``megatron…`` →
  :mod:`gemscout.adapters.megatron`;
- **PyTorch**: an ``nn.Module`` (DDP, FSDP2, HSDP, DeviceMesh TP) with a ``torch.optim.Optimizer`` → used as is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from gemscout.errors import ConfigError
from gemscout.scout.config import ScoutConfig
from gemscout.topology import Topology

__all__ = ["Framework", "Target", "detect", "resolve"]


class Framework(enum.StrEnum):
    """The training frameworks ``enable_resiliency`` tells apart."""

    TORCH = "torch"
    DEEPSPEED = "deepspeed"
    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"


def _mro(obj: Any) -> list[tuple[str, str]]:
    return [(cls.__module__ or "", cls.__name__) for cls in type(obj).__mro__]


def _from(obj: Any, package: str) -> bool:
    """True when ``obj``'s class, or a base class, is defined in ``package``."""
    return any(module == package or module.startswith(package + ".") for module, _ in _mro(obj))


def _is(obj: Any, package: str, name: str) -> bool:
    return any(
        (module == package or module.startswith(package + ".")) and cls == name
        for module, cls in _mro(obj)
    )


def detect(model: Any, optimizer: Any = None) -> Framework:
    """The framework that built ``model`` (and ``optimizer``), by class module and name. Pure; imports nothing."""
    if _is(model, "deepspeed", "DeepSpeedEngine"):
        return Framework.DEEPSPEED
    if _is(model, "torchtitan", "Trainer") or _from(optimizer, "torchtitan"):
        return Framework.TORCHTITAN
    if isinstance(model, list | tuple):
        return (
            Framework.MEGATRON
            if model and all(_from(m, "megatron") for m in model)
            else Framework.TORCH
        )
    if _from(model, "megatron") or _from(optimizer, "megatron"):
        return Framework.MEGATRON
    return Framework.TORCH


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """What a session attaches to, whatever framework the caller used."""

    framework: Framework
    """The detected framework."""
    model: nn.Module
    """The module that owns the parameters (its ``state_dict`` is captured; SCOUT hooks its submodules)."""
    optimizer: torch.optim.Optimizer
    """Where the step hooks go and whose ``state_dict`` is captured: the caller's optimizer, or an adapter object
    offering the same subset of the interface (see :class:`gemscout.adapters.deepspeed.EngineOptimizer`)."""
    extra_state_fn: Callable[[], Any] | None
    """Caller state to capture (an adapter wraps the caller's with the framework's own counters)."""
    load_extra_state_fn: Callable[[Any], None] | None
    """The inverse of ``extra_state_fn``."""
    schedulers: tuple[Any, ...]
    """LR schedulers the loop steps after the optimizer step (captured, replayed once on restore)."""
    scout: ScoutConfig | None = None
    """The ScoutConfig to attach with (an adapter may fill in its framework's module paths)."""
    scout_topology: Topology | None = None
    """SCOUT's peers when the framework defines them (Megatron's parallel_state); None: SCOUT reads the model."""
    install_hooks: Callable[[], list[Any]] | None = None
    """The adapter's own step hooks, registered right before the session's (so they run first); returns handles."""
    scout_factory: Callable[[ScoutConfig], Any] | None = None
    """The Scout class to attach when the framework needs its own (DeepSpeed ZeRO's optimizer recipe); None: Scout."""


def resolve(
    model: Any,
    optimizer: Any,
    *,
    extra_state_fn: Callable[[], Any] | None = None,
    load_extra_state_fn: Callable[[Any], None] | None = None,
    schedulers: Sequence[Any] = (),
    scout: ScoutConfig | None = None,
    group: Any = None,
) -> Target:
    """Detect the framework and return what to attach to. Imports an adapter only for a detected framework.

    Raises ConfigError for an object no adapter accepts and for an argument the framework cannot take.
    """
    framework = detect(model, optimizer)
    if framework is Framework.DEEPSPEED:
        from gemscout.adapters.deepspeed import resolve_engine

        parts = resolve_engine(
            model,
            optimizer,
            extra_state_fn=extra_state_fn,
            load_extra_state_fn=load_extra_state_fn,
            schedulers=schedulers,
            scout=scout if isinstance(scout, ScoutConfig) else None,
        )
        # EngineOptimizer offers exactly the optimizer interface the session, GEMINI and SCOUT's forward recipes use.
        return Target(
            framework=framework,
            model=parts.model,
            optimizer=cast(torch.optim.Optimizer, parts.optimizer),
            extra_state_fn=parts.extra_state_fn,
            load_extra_state_fn=parts.load_extra_state_fn,
            schedulers=tuple(schedulers),
            scout=scout,
            scout_factory=parts.scout_factory,
        )
    if framework is Framework.TORCHTITAN:
        from gemscout.adapters.torchtitan import resolve_trainer

        tt = resolve_trainer(
            model,
            optimizer,
            extra_state_fn=extra_state_fn,
            load_extra_state_fn=load_extra_state_fn,
            schedulers=schedulers,
            scout=scout,
            group=group,
        )
        return Target(
            framework=framework,
            model=tt.model,
            optimizer=cast(torch.optim.Optimizer, tt.optimizer),
            extra_state_fn=tt.extra_state_fn,
            load_extra_state_fn=tt.load_extra_state_fn,
            schedulers=tt.schedulers,
            scout=tt.scout,
            scout_topology=tt.topology,
        )
    if framework is Framework.MEGATRON:
        from gemscout.adapters.megatron import resolve_megatron

        mc = resolve_megatron(
            model,
            optimizer,
            extra_state_fn=extra_state_fn,
            load_extra_state_fn=load_extra_state_fn,
            schedulers=schedulers,
            scout=scout,
            group=group,
        )
        # MegatronOptimizerView offers the optimizer interface the session, GEMINI and SCOUT use (see its docstring).
        return Target(
            framework=framework,
            model=mc.model,
            optimizer=cast(torch.optim.Optimizer, mc.optimizer),
            extra_state_fn=mc.extra_state_fn,
            load_extra_state_fn=mc.load_extra_state_fn,
            schedulers=mc.schedulers,
            scout=mc.scout,
            scout_topology=mc.topology,
            install_hooks=mc.install_hooks,
        )
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
            if _from(optimizer, "deepspeed")
            else ""
        )
        raise ConfigError(
            f"enable_resiliency.optimizer: expected a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}{hint}"
        )
    return Target(
        framework=framework,
        model=model,
        optimizer=optimizer,
        extra_state_fn=extra_state_fn,
        load_extra_state_fn=load_extra_state_fn,
        schedulers=tuple(schedulers),
        scout=scout,
    )

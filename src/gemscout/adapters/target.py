"""What every framework adapter is given and what it returns: the caller's :class:`Request` in, a :class:`Target`
out — the objects a session attaches to, whatever framework built them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gemscout.scout.config import ScoutConfig
from gemscout.topology import Topology


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """What the caller passed to ``enable_resiliency`` besides the model and optimizer, for the adapter to wrap."""

    extra_state_fn: Callable[[], Any] | None = None
    load_extra_state_fn: Callable[[Any], None] | None = None
    schedulers: Sequence[Any] = ()
    scout: ScoutConfig | None = None
    group: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """What a session attaches to, whatever framework the caller used."""

    framework: str
    """The name of the adapter that claimed the objects (its registry entry)."""
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
    rank_local: bool = False
    """Every rank's model and optimizer state is its own partition (DeepSpeed ZeRO), so the durable tier promotes
    every rank's, not one copy of replicated state."""


def with_framework_state(
    key: str,
    save: Callable[[], Any],
    load: Callable[[Any], None],
    extra_state_fn: Callable[[], Any] | None,
    load_extra_state_fn: Callable[[Any], None] | None,
) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """The caller's extra state wrapped with a framework's own: a capture holds ``{key: save(), "caller": <the
    caller's, or None>}``, and the inverse loads the framework's part (``load``) before it hands the caller's back
    to ``load_extra_state_fn``. The pair an adapter puts in its :class:`Target`."""

    def extra() -> dict[str, Any]:
        return {key: save(), "caller": extra_state_fn() if extra_state_fn else None}

    def load_extra(state: dict[str, Any]) -> None:
        load(state[key])
        if load_extra_state_fn is not None and state["caller"] is not None:
            load_extra_state_fn(state["caller"])

    return extra, load_extra

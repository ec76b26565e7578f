"""The framework adapters ``enable_resiliency`` knows, in the order it asks them, and the lookup.

An adapter is a name, a ``claims(model, optimizer)`` test that reads class names only (:mod:`.classes`; pure, imports
nothing), and the module whose ``adapt(model, optimizer, request) -> Target`` turns the framework's objects into what
a session attaches to. That module is imported only when its adapter claims the objects, so ``import gemscout``
never loads a framework. Plain PyTorch is the last entry and claims everything else. Adding a framework is one entry
here and its module in this package; nothing outside ``gemscout.adapters`` names a framework.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gemscout.adapters.classes import defined_in, is_class
from gemscout.adapters.target import Request, Target
from gemscout.scout.config import ScoutConfig

__all__ = ["ADAPTERS", "Adapter", "Request", "Target", "detect", "resolve"]


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    claims: Callable[[Any, Any], bool]
    module: str
    """Holds ``adapt(model, optimizer, request: Request) -> Target``."""


def _megatron(model: Any, optimizer: Any) -> bool:
    if isinstance(model, list | tuple):  # model chunks (virtual pipeline stages)
        return bool(model) and all(defined_in(m, "megatron") for m in model)
    return defined_in(model, "megatron") or defined_in(optimizer, "megatron")


ADAPTERS: tuple[Adapter, ...] = (
    Adapter(
        "deepspeed",
        lambda model, _: is_class(model, "deepspeed", "DeepSpeedEngine"),
        "gemscout.adapters.deepspeed.engine",
    ),
    Adapter(
        "torchtitan",
        lambda model, opt: (
            is_class(model, "torchtitan", "Trainer") or defined_in(opt, "torchtitan")
        ),
        "gemscout.adapters.torchtitan.adapter",
    ),
    Adapter("megatron", _megatron, "gemscout.adapters.megatron.adapter"),
    Adapter("torch", lambda model, opt: True, "gemscout.adapters.pytorch"),
)


def detect(model: Any, optimizer: Any = None) -> Adapter:
    """The first adapter that claims ``model`` (and ``optimizer``). Pure; imports nothing."""
    return next(a for a in ADAPTERS if a.claims(model, optimizer))


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
    """Find the adapter and return what to attach to. Imports an adapter only when it claims the objects.

    Raises ConfigError for an object no adapter accepts and for an argument the framework cannot take.
    """
    adapter = detect(model, optimizer)
    request = Request(
        extra_state_fn=extra_state_fn,
        load_extra_state_fn=load_extra_state_fn,
        schedulers=tuple(schedulers),
        scout=scout,
        group=group,
    )
    target: Target = importlib.import_module(adapter.module).adapt(model, optimizer, request)
    return target

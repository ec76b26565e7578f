"""Numerical fault injectors for SCOUT, entering only through the runtime's public seams.

Replay faults corrupt what one rank computes while *replaying* a recipe, never its training: they are registered with
``Scout.register_replay_output_hook`` / ``register_replay_input_hook`` and act when the :class:`ReplayContext`
matches their (rank, step, recipe). This is how a rank with faulty arithmetic looks to SCOUT, without having to make
the training itself diverge. Persistent faults (:func:`corrupt_module_output`) use an ordinary module forward hook, so
they hit training and replay alike.

Kinds (each changes the digest of any tensor that is not constant):

* ``bitflip`` — flip the lowest mantissa bit of the first element (the smallest change a float can show);
* ``signflip`` — negate the first element;
* ``scale`` — multiply the whole tensor by ``1 + 1e-3``;
* ``zero`` — set the largest-magnitude element to zero;
* ``permute`` — swap the largest and the smallest element (same values, another order);
* ``stale`` — replay on the inputs this rank saw the previous time it replayed the recipe (a stale buffer).

The target tensor is the recipe's forward ``output`` (the updated parameters of the first parameter for an optimizer
slice). ``stale`` acts on the inputs *after* the peers' precondition digests were taken, like a stale read during the
computation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gemscout.scout.engine import Scout
from gemscout.scout.replay import ReplayContext

__all__ = [
    "FAULT_KINDS",
    "CollectiveDelay",
    "Injector",
    "ReplayDelay",
    "ReplayFault",
    "corrupt",
    "corrupt_module_output",
    "fail_at",
]

FAULT_KINDS: tuple[str, ...] = ("bitflip", "signflip", "scale", "zero", "permute", "stale")
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def corrupt(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """A corrupted copy of ``tensor`` (floating point); the input is never modified. Raises ``ValueError`` for an
    unknown kind or ``stale`` (which replaces inputs, not values)."""
    if not tensor.is_floating_point():
        raise ValueError(f"numerical faults need a floating-point tensor, got {tensor.dtype}")
    flat = tensor.detach().clone().reshape(-1)
    if kind == "bitflip":
        bits = flat.view(_INT_VIEW[flat.element_size()])
        bits[0] ^= 1
    elif kind == "signflip":
        flat[0] = -flat[0]
    elif kind == "scale":
        flat.mul_(1 + 1e-3)
    elif kind == "zero":
        flat[int(flat.abs().argmax())] = 0
    elif kind == "permute":
        hi, lo = int(flat.argmax()), int(flat.argmin())
        flat[hi], flat[lo] = flat[lo].clone(), flat[hi].clone()
    else:
        raise ValueError(f"unknown numerical fault {kind!r}; use one of {FAULT_KINDS[:-1]}")
    return flat.view(tensor.shape)


def _target_key(outputs: Mapping[str, torch.Tensor]) -> str:
    if "output" in outputs:
        return "output"
    return next(k for k in sorted(outputs) if outputs[k].is_floating_point())


@dataclass(frozen=True, slots=True)
class ReplayFault:
    """Corrupt the replay of ``recipe`` (None: any) at ``step`` (None: every step) on ``rank``."""

    kind: str
    rank: int
    step: int | None = None
    recipe: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; use one of {FAULT_KINDS}")

    def applies(self, ctx: ReplayContext) -> bool:
        return (
            ctx.rank == self.rank
            and (self.step is None or ctx.step == self.step)
            and (self.recipe is None or ctx.recipe == self.recipe)
        )


@dataclass(frozen=True, slots=True)
class ReplayDelay:
    """Sleep ``seconds`` inside the timed replay of ``recipe`` (None: any) on ``rank``: a compute straggler."""

    seconds: float
    rank: int
    recipe: str | None = None

    def applies(self, ctx: ReplayContext) -> bool:
        return ctx.rank == self.rank and (self.recipe is None or ctx.recipe == self.recipe)


@dataclass(frozen=True, slots=True)
class CollectiveDelay:
    """Sleep ``seconds`` before each collective a replay of ``recipe`` (None: any) issues on ``rank``, from step
    ``from_step`` on: a delayed TP collective. Its TP partners wait inside the same collective; the numbers do not
    change."""

    seconds: float
    rank: int
    recipe: str | None = None
    from_step: int = 0

    def applies(self, ctx: ReplayContext) -> bool:
        return (
            ctx.rank == self.rank
            and ctx.step >= self.from_step
            and (self.recipe is None or ctx.recipe == self.recipe)
        )


def fail_at(
    kind: str, *, rank: int, step: int | None = None, recipe: str | None = None
) -> ReplayFault:
    """The replay fault ``kind`` on ``rank`` at ``step`` for ``recipe``."""
    return ReplayFault(kind, rank, step, recipe)


@dataclass
class Injector:
    """Holds the active faults for one :class:`Scout` and applies them through its public replay hooks.

    Install once per rank (it also remembers each recipe's previous inputs, for ``stale``); add faults only on the
    rank they target, or everywhere — a fault only ever acts on its own rank.
    """

    scout: Scout
    faults: list[ReplayFault | ReplayDelay | CollectiveDelay] = field(default_factory=list)
    fired: list[dict[str, Any]] = field(default_factory=list)
    _previous: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    _handles: list[RemovableHandle] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._handles = [
            self.scout.register_replay_input_hook(self._on_inputs),
            self.scout.register_replay_output_hook(self._on_outputs),
            self.scout.register_replay_collective_hook(self._on_collective),
        ]

    def set(self, *faults: ReplayFault | ReplayDelay | CollectiveDelay) -> None:
        """Replace the active faults."""
        self.faults = list(faults)

    def remove(self) -> None:
        """Unregister both hooks."""
        for handle in self._handles:
            handle.remove()

    def _on_inputs(
        self, ctx: ReplayContext, inputs: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        previous = self._previous.get(ctx.recipe)
        self._previous[ctx.recipe] = {k: t.detach().clone() for k, t in inputs.items()}
        for fault in self.faults:
            if isinstance(fault, ReplayFault) and fault.kind == "stale" and fault.applies(ctx):
                if previous is None or previous.keys() != inputs.keys():
                    raise RuntimeError(
                        f"stale-input fault on {ctx.recipe}: no earlier replay of it on this rank"
                    )
                self.fired.append(
                    {"kind": "stale", "recipe": ctx.recipe, "step": ctx.step, "rank": ctx.rank}
                )
                return previous
        return None

    def _on_collective(self, ctx: ReplayContext, op: str) -> None:
        for fault in self.faults:
            if isinstance(fault, CollectiveDelay) and fault.applies(ctx):
                time.sleep(fault.seconds)
                self.fired.append(
                    {
                        "kind": "collective_delay",
                        "recipe": ctx.recipe,
                        "step": ctx.step,
                        "rank": ctx.rank,
                        "op": op,
                    }
                )

    def _on_outputs(
        self, ctx: ReplayContext, outputs: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        changed = None
        for fault in self.faults:
            if isinstance(fault, CollectiveDelay) or not fault.applies(ctx):
                continue
            if isinstance(fault, ReplayDelay):
                time.sleep(fault.seconds)
                self.fired.append(
                    {"kind": "delay", "recipe": ctx.recipe, "step": ctx.step, "rank": ctx.rank}
                )
            elif fault.kind != "stale":
                changed = dict(changed or outputs)
                key = _target_key(changed)
                changed[key] = corrupt(changed[key], fault.kind)
                self.fired.append(
                    {
                        "kind": fault.kind,
                        "recipe": ctx.recipe,
                        "step": ctx.step,
                        "rank": ctx.rank,
                        "tensor": key,
                    }
                )
        return changed


def corrupt_module_output(module: nn.Module, kind: str, *, active: bool = True) -> RemovableHandle:
    """A persistent fault: every forward of ``module`` (training and replay) returns a corrupted output on this rank.

    Register it only on the faulty rank (or pass ``active=False`` elsewhere). Gradients still flow: the corruption is
    added as a constant, so training proceeds on the wrong numbers like it would on faulty hardware.
    """

    def hook(mod: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
        if not active or not isinstance(output, torch.Tensor):
            return None
        return output + (corrupt(output, kind) - output).detach()

    return module.register_forward_hook(hook)

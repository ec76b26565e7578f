"""A ``MegatronOptimizer`` as gemscout sees it: the inner torch optimizers GEMINI checkpoints.

A ``MegatronOptimizer`` (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``,
``ChainedOptimizer``) is not a torch optimizer: :class:`MegatronOptimizerView` gives it step hooks around
``optimizer.step()`` and a pickle-free per-rank state (see its docstring). Megatron's optimizers allocate on CUDA; on
CPU that path runs in tests only, under a test-only shim of those calls (tests/distributed/test_megatron_loop.py).
Nothing here imports megatron.
"""

from __future__ import annotations

from typing import Any

import torch

from gemscout.adapters._optim_view import InnerOptimizers
from gemscout.adapters._step_hooks import Hook, StepHooks
from gemscout.errors import RunMismatchError

__all__ = ["MegatronOptimizerView"]

FORMAT = "gemscout.megatron-optimizer.v1"


class MegatronOptimizerView(InnerOptimizers):
    """A ``MegatronOptimizer`` with the part of the ``torch.optim.Optimizer`` interface gemscout uses.

    - ``register_step_pre_hook`` / ``register_step_post_hook``: run around ``optimizer.step()`` (an instance attribute
      shadows the method for every caller, Megatron's ``train_step`` included), called as ``hook(self, args, kwargs)``;
      the post-hooks run for skipped updates too (an fp16 overflow still ends the iteration);
    - ``state_dict``: this rank's state, taken from the torch optimizer(s) inside — the main (fp32) parameters it
      updates (the whole model for ``FP32Optimizer``, this rank's shard for ``DistributedOptimizer``), its state and
      hyper-parameters, and the grad scaler — never Megatron's own ``state_dict()`` (which omits the sharded state of
      the distributed optimizer and needs collectives to build it);
    - ``param_groups`` / ``state`` / ``defaults`` of the torch optimizer(s).
    """

    def __init__(self, optimizer: Any) -> None:
        self.megatron = optimizer
        self.parts: list[Any] = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
        self.inner: list[torch.optim.Optimizer] = [p.optimizer for p in self.parts]
        self._hooks = StepHooks(self, optimizer)

    def register_step_pre_hook(self, hook: Hook) -> Any:
        """Run ``hook(self, args, kwargs)`` at the start of every ``optimizer.step()``."""
        return self._hooks.add_pre(hook)

    def register_step_post_hook(self, hook: Hook) -> Any:
        """Run ``hook(self, args, kwargs)`` when ``optimizer.step()`` has returned."""
        return self._hooks.add_post(hook)

    def _layout(self) -> dict[str, Any]:
        # Shapes of the main parameters: a DistributedOptimizer shard restored on another DP rank (or another DP
        # size) has other shapes and would load silently wrong.
        return {
            "kinds": [type(p).__name__ for p in self.parts],
            "main_shapes": [
                [list(p.shape) for g in inner.param_groups for p in g["params"]]
                for inner in self.inner
            ],
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (live tensors; GEMINI copies them). Nothing needs pickle."""
        parts = []
        for part, inner in zip(self.parts, self.inner, strict=True):
            scaler = getattr(part, "grad_scaler", None)
            parts.append(
                {
                    "main": [p for g in inner.param_groups for p in g["params"]],
                    "inner": inner.state_dict(),
                    "grad_scaler": scaler.state_dict() if scaler is not None else None,
                }
            )
        return {"format": FORMAT, **self._layout(), "parts": parts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a state taken by :meth:`state_dict` into the live optimizer, bitwise. Raises RunMismatchError when it
        was taken from another optimizer kind or partitioning."""
        if state.get("format") != FORMAT:
            raise RunMismatchError(
                f"the optimizer state is not a Megatron optimizer's ({state.get('format')!r}); it "
                "was taken from another kind of job"
            )
        here = self._layout()
        there = {k: state.get(k) for k in here}
        if there != here:
            raise RunMismatchError(
                f"the Megatron optimizer state was taken with {there}, this optimizer has {here}; "
                "resume with the same optimizer and parallel layout, each rank from its own state"
            )
        with torch.no_grad():
            for part, inner, saved in zip(self.parts, self.inner, state["parts"], strict=True):
                live = [p for g in inner.param_groups for p in g["params"]]
                for param, value in zip(live, saved["main"], strict=True):
                    param.copy_(value)
                inner.load_state_dict(saved["inner"])  # torch copies (and casts) every state tensor
                scaler = getattr(part, "grad_scaler", None)
                if scaler is not None and saved["grad_scaler"] is not None:
                    scaler.load_state_dict(saved["grad_scaler"])

"""Megatron's ``OptimizerParamScheduler`` as a scheduler gemscout can capture and replay.

The loop steps it after ``optimizer.step()`` with an increment (``opt_param_scheduler.step(increment=global_batch)``),
so the state GEMINI takes inside the step is one scheduler step behind, and restoring it means replaying that step —
with the increment the loop used, which only the loop knows. :class:`ParamSchedulerReplay` records the increment of
every call the loop makes (an instance attribute wraps ``step``) and stores it with the scheduler's ``state_dict()``;
restore loads the state and ``step()`` replays the recorded increment (the latest before the capture: exact for a
constant global batch, one ramp-up stage behind while a batch-size ramp-up is changing it).

Megatron's ``load_state_dict`` *adds* the stored ``num_steps`` to the live counter (it expects a fresh scheduler), so
the counter is zeroed first: a mid-run ``session.recover()`` would otherwise count twice.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("gemscout")
_CALCULATOR = "megatron.core.num_microbatches_calculator"


def _global_batch_size() -> int | None:
    """Megatron's current global batch size (the increment its training loop uses), when its calculator is set up."""
    module = sys.modules.get(_CALCULATOR)
    if module is None or getattr(module, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is None:
        return None
    return int(module.get_current_global_batch_size())


__all__ = ["ParamSchedulerReplay"]


class ParamSchedulerReplay:
    """``state_dict`` / ``load_state_dict`` / ``step()`` over a live ``OptimizerParamScheduler`` (see module doc)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.increment: int | None = None
        """The increment of the loop's latest ``step`` call (None before the first)."""
        self._original: Callable[..., Any] | None = None

    def install(self) -> ParamSchedulerReplay:
        """Start recording the loop's increments. Returns self, whose :meth:`remove` stops it."""
        if self._original is None:
            self._original = self.scheduler.step
            vars(self.scheduler)["step"] = self._record
        return self

    def remove(self) -> None:
        if self._original is not None and vars(self.scheduler).get("step") == self._record:
            del vars(self.scheduler)["step"]
        self._original = None

    def _record(self, increment: int) -> None:
        assert self._original is not None
        self.increment = int(increment)
        self._original(increment=increment)

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "increment": self.increment}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.num_steps = 0
        type(self.scheduler).load_state_dict(self.scheduler, state["scheduler"])
        self.increment = state["increment"]

    def step(self) -> None:
        """Replay the loop's step after the captured one. A capture of the very first step has no recorded
        increment yet: Megatron's global batch size is used (what its training loop steps by), else nothing is
        replayed and a warning says the schedule is one step behind."""
        increment = self.increment if self.increment is not None else _global_batch_size()
        if increment is None:
            log.warning(
                "gemscout: the OptimizerParamScheduler increment of the restored step is unknown (restored "
                "the first step, and Megatron's microbatch calculator is not set up); the lr schedule is one "
                "step behind"
            )
            return
        type(self.scheduler).step(self.scheduler, increment=increment)

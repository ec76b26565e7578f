"""TorchTitan's ``OptimizersContainer`` as gemscout sees it (:class:`OptimizersView`): the container's own step
hooks (they fire once per ``train_step``) and the state of the torch optimizers inside, in torch's own format, not the
container's ``state_dict()`` (which builds a flattened distributed state dict, FQN-keyed, meant for DCP). Also the
storable form of the dataloader state the adapter captures (``_to_storable`` / ``_from_storable``: the bytes a
``StatefulDataLoader`` holds are stored as uint8 tensors). Imported by :mod:`gemscout.adapters.torchtitan.adapter`;
nothing here imports torchtitan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gemscout.adapters._optim_view import InnerOptimizers

__all__ = ["OptimizersView"]


def _to_storable(value: Any) -> Any:
    """The dataloader state with ``bytes`` (StatefulDataLoader pickles its worker state) as uint8 tensors."""
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": torch.frombuffer(bytearray(value), dtype=torch.uint8).clone()}
    if isinstance(value, dict):
        return {k: _to_storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_storable(v) for v in value)
    return value


def _from_storable(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__bytes__"}:
        return bytes(value["__bytes__"].numpy().tobytes())
    if isinstance(value, dict):
        return {k: _from_storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_from_storable(v) for v in value)
    return value


class OptimizersView(InnerOptimizers):
    """An ``OptimizersContainer`` as gemscout sees it: the container's own step hooks, and the state of the torch
    optimizers inside in torch's format, their parameters numbered in order across all of them (what
    ``param_groups`` lists)."""

    def __init__(self, container: Any) -> None:
        self.container = container
        self.inner: list[torch.optim.Optimizer] = list(container.optimizers)
        classes = {type(opt) for opt in self.inner}
        # SCOUT's optimizer recipe replays one update in a private optimizer of the class that did it: the inner one.
        self.replay_class: type[torch.optim.Optimizer] | None = (
            classes.pop() if len(classes) == 1 else None
        )

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self.container.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self.container.register_step_post_hook(hook)

    def state_dict(self) -> dict[str, Any]:
        """One torch-format state dict over every inner optimizer (indices offset per optimizer)."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.inner:
            sd = opt.state_dict()
            state.update({offset + int(i): s for i, s in sd["state"].items()})
            groups += [
                {**g, "params": [offset + int(i) for i in g["params"]]} for g in sd["param_groups"]
            ]
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Split a :meth:`state_dict` back over the inner optimizers and load each (torch copies every tensor)."""
        groups, offset, g = state["param_groups"], 0, 0
        for opt in self.inner:
            count = sum(len(group["params"]) for group in opt.param_groups)
            mine = groups[g : g + len(opt.param_groups)]
            g += len(opt.param_groups)
            opt.load_state_dict(
                {
                    "state": {
                        int(i) - offset: s
                        for i, s in state["state"].items()
                        if offset <= int(i) < offset + count
                    },
                    "param_groups": [
                        {**group, "params": [int(i) - offset for i in group["params"]]}
                        for group in mine
                    ],
                }
            )
            offset += count

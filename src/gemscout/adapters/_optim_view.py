"""Several torch optimizers seen as one (a MegatronOptimizer's chained parts, a TorchTitan OptimizersContainer)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["InnerOptimizers"]


class InnerOptimizers:
    """``param_groups`` / ``state`` / ``defaults`` over the torch optimizers in ``self.inner``, in order: the subset of
    the ``torch.optim.Optimizer`` interface gemscout reads. Subclasses set ``inner``."""

    inner: list[torch.optim.Optimizer]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.inner for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for opt in self.inner for p, s in opt.state.items()}

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner[0].defaults

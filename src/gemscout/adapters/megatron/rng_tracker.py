"""Megatron's RNG tracker as gemscout captures, restores and guards it.

Megatron's RNG tracker (``get_cuda_rng_tracker()``: the model-parallel, data-parallel and expert RNG streams that
dropout inside TP regions draws from) is captured with every step and restored with it (:func:`capture_rng_tracker`,
:func:`restore_rng_tracker`); SCOUT's replays do not move it (:class:`TrackerGuard` puts it back after each
cycle). Nothing here imports megatron: the tracker is read from ``megatron.core.tensor_parallel.random`` only when
megatron has already loaded it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from gemscout.errors import ConfigError

__all__ = ["TrackerGuard", "capture_rng_tracker", "restore_rng_tracker"]

_RANDOM = "megatron.core.tensor_parallel.random"


def _tracker() -> Any:
    """The live Megatron RNG tracker, or None when megatron's random module is not loaded or no tracker exists."""
    module = sys.modules.get(_RANDOM)
    tracker = getattr(module, "_CUDA_RNG_STATE_TRACKER", None) if module is not None else None
    return tracker if tracker is not None and hasattr(tracker, "get_states") else None


def capture_rng_tracker() -> dict[str, torch.Tensor] | None:
    """Fresh copies of every stream of Megatron's RNG tracker (name → generator state), or None without one."""
    tracker = _tracker()
    if tracker is None:
        return None
    states = tracker.get_states()
    if not all(isinstance(v, torch.Tensor) for v in states.values()):
        # TransformerEngine's graph-safe tracker keeps torch.Generator objects, which cannot be stored bitwise here.
        raise ConfigError(
            "Megatron's RNG tracker holds generator objects (a CUDA-graph-safe or TransformerEngine "
            "tracker); gemscout captures the plain CudaRNGStatesTracker: initialise it with "
            "use_cudagraphable_rng=False and te_rng_tracker=False"
        )
    return {name: state.detach().clone() for name, state in states.items()}


def restore_rng_tracker(states: dict[str, torch.Tensor] | None) -> None:
    """Put back what :func:`capture_rng_tracker` took (copies: the checkpoint's buffers are never aliased)."""
    tracker = _tracker()
    if states is None or tracker is None:
        return
    tracker.set_states({name: state.clone() for name, state in states.items()})


class TrackerGuard:
    """Keeps SCOUT's replays from moving Megatron's RNG tracker: a replay of a block forks the tracker for its dropout,
    which would advance the training streams. Its step pre-hook runs before the session's (registered first), its
    post-hook before the session's capture, so the restored tracker is what GEMINI takes."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None

    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        tracker = _tracker()
        self.saved = dict(tracker.get_states()) if tracker is not None else None

    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        tracker = _tracker()
        if tracker is not None and self.saved is not None:
            tracker.set_states(
                self.saved
            )  # the tracker replaces its entries, never mutates them: no copy needed
        self.saved = None

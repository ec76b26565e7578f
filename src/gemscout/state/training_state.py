"""Collect and restore everything a step's checkpoint holds.

The captured object is ``{"step", "model", "optimizer", "extra", "schedulers", "stateful", "rng"}``. Restore order is
model, optimizer, schedulers, the caller's ``Stateful`` objects, caller state, RNG last — so nothing that draws random
numbers while loading can shift the trajectory.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from gemscout._modules import unwrap as _unwrap
from gemscout.errors import ConfigError
from gemscout.state.codec import LocalShard


@dataclass(slots=True)
class StateSources:
    """The live objects a checkpoint is taken from and restored into."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    extra_state_fn: Callable[[], Any] | None = None
    load_extra_state_fn: Callable[[Any], None] | None = None
    schedulers: Sequence[Any] = field(default_factory=tuple)
    stateful: Mapping[str, Any] = field(default_factory=dict)
    """The caller's objects with ``state_dict()`` / ``load_state_dict()`` (a ``StatefulDataLoader``, its own
    classes), by name: their state is taken with each capture and loaded back on restore."""
    rank_local: bool = False
    """Every rank's state is its own even without DTensors (DeepSpeed ZeRO's fp32 master partition and optimizer
    state): a durable promotion is then collective, each rank writing its own entries; it loads on the same world
    size only, unless a partition codec stores it per parameter (:mod:`gemscout.gemini.durable.codecs`)."""

    def async_pointers(self) -> set[int]:
        """Storage addresses of tensors that change only inside ``optimizer.step()``: safe to copy in background.

        For sharded parameters (DTensor) this is the local shard, which FSDP leaves alone during forward and backward
        (it all-gathers into separate buffers)."""
        ptrs = {_local(p).data_ptr() for p in _unwrap(self.model).parameters()}
        # The optimizer's own parameters: the model's again under DDP/FSDP; DeepSpeed ZeRO's fp32 master partitions.
        ptrs.update(
            _local(p).data_ptr() for group in self.optimizer.param_groups for p in group["params"]
        )
        for state in self.optimizer.state.values():
            ptrs.update(_local(v).data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
        return ptrs


def capture_rng() -> dict[str, Any]:
    """Every RNG stream training may draw from: torch CPU, CUDA (when initialised), Python, NumPy."""
    np_state = cast(
        tuple[Any, ...], np.random.get_state(legacy=True)
    )  # (name, words, pos, has_gauss, cached)
    version, words, gauss_next = random.getstate()
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": (version, torch.tensor(words, dtype=torch.int64), gauss_next),
        "numpy": (np_state[0], np_state[1], int(np_state[2]), int(np_state[3]), float(np_state[4])),
        "cuda": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"].clone())
    version, words, gauss_next = rng["python"]
    random.setstate((version, tuple(int(w) for w in words.tolist()), gauss_next))
    name, state, npos, gauss, cached_g = rng["numpy"]
    np.random.set_state((name, np.asarray(state, dtype=np.uint32), npos, gauss, cached_g))
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.clone() for s in rng["cuda"]])


def collect(sources: StateSources, step: int, *, inside_step: bool = True) -> dict[str, Any]:
    """Build the state object for ``step``. Tensors are referenced, not copied; RNG tensors are fresh copies.

    ``inside_step``: taken in the optimizer post-hook, before the loop steps its schedulers (every capture but the
    initial one at attach); restore then replays that scheduler step."""
    return {
        "step": step,
        "advance_schedulers": inside_step,
        "model": _unwrap(sources.model).state_dict(),
        "optimizer": sources.optimizer.state_dict(),
        "schedulers": [s.state_dict() for s in sources.schedulers],
        "extra": sources.extra_state_fn() if sources.extra_state_fn else None,
        "stateful": {name: obj.state_dict() for name, obj in sources.stateful.items()},
        "rng": capture_rng(),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t


def _as_dtensor(shard: LocalShard, like: Any) -> Any:
    """Rebuild a DTensor on ``like``'s mesh and placements from a stored local shard."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        shard.local.clone(),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=torch.Size(shard.shape),
        stride=shard.stride,
    )


def _rebuild_shards(sources: StateSources, state: dict[str, Any]) -> None:
    """Turn every LocalShard of the model and optimizer state back into a DTensor sharded like its live parameter."""
    live = _unwrap(sources.model).state_dict()
    model_sd = state["model"]
    for name, value in model_sd.items():
        if isinstance(value, LocalShard):
            model_sd[name] = _as_dtensor(value, live[name])
    flat = [p for group in sources.optimizer.param_groups for p in group["params"]]
    # An adapter's optimizer view may keep its own layout (MegatronOptimizerView: "parts", no torch "state"); its
    # tensors are plain, so there is nothing to rebuild.
    for idx, per_param in state["optimizer"].get("state", {}).items():
        for key, value in per_param.items():
            if isinstance(value, LocalShard):
                per_param[key] = _as_dtensor(value, flat[int(idx)])


def restore(sources: StateSources, state: dict[str, Any]) -> None:
    """Load ``state`` into the live objects, bitwise. The caller checks identity and step beforehand."""
    _rebuild_shards(sources, state)
    with torch.no_grad():
        _unwrap(sources.model).load_state_dict(state["model"], strict=True)
    sources.optimizer.load_state_dict(state["optimizer"])
    for sched, sd in zip(sources.schedulers, state["schedulers"], strict=True):
        sched.load_state_dict(sd)
        if state.get("advance_schedulers", True):
            # The loop steps its schedulers after optimizer.step() returns, i.e. after the capture: replay that step.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sched.step()
    saved = state.get("stateful") or {}
    missing = sorted(set(sources.stateful) - set(saved))
    if missing:
        # Loading the rest would resume with, e.g., the data position of a fresh loader: samples seen twice.
        raise ConfigError(
            f"enable_resiliency.stateful: the checkpoint of step {state['step']} holds no state for "
            f"{missing} (it has {sorted(saved)}); pass the same names as the run that wrote it"
        )
    for name, obj in sources.stateful.items():
        obj.load_state_dict(saved[name])
    if sources.load_extra_state_fn is not None and state["extra"] is not None:
        sources.load_extra_state_fn(state["extra"])
    restore_rng(state["rng"])

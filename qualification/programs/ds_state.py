"""The state of a DeepSpeed engine as :mod:`qualification.programs.ds_rank` reports it: digests and full state.

- :func:`state_digest`: SHA-256 over this rank's module state (every parameter: ZeRO-1/2 keep them all on every rank),
  its fp32 master partition and the optimizer state of that partition;
- :func:`module_digest`: SHA-256 over the module's state;
- :func:`full_state`: per parameter, the SHA-256 of the fp32 master and AdamW moments as DeepSpeed itself assembles
  them from every rank's fragment (``safe_get_full_*``), plus each group's step count and lr;
- :func:`dump_full` / :func:`load_full`: that full state as tensors (rank 0, ``torch.save``: test side only), with the
  module, step counts, hyper-parameters, lr scheduler, engine counters and torch RNG, written and loaded back into a
  fresh engine through DeepSpeed's own ``safe_set_full_*`` setters — a reference resume on any world size that shares
  no code with gemscout's durable tier.

Each dispatches a stage-3 engine to :mod:`qualification.programs.ds_zero3`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from qualification.programs import ds_zero3
from qualification.programs._tensor_bytes import tensor_bytes


def state_digest(engine: Any) -> str:
    """SHA-256 over this rank's module state, fp32 master partition and the optimizer state of that partition."""
    if engine.zero_optimization_stage() == 3:
        return ds_zero3.state_digest(engine)
    h = hashlib.sha256()
    for name, t in engine.module.state_dict().items():
        h.update(name.encode())
        h.update(tensor_bytes(t))
    inner = engine.optimizer.optimizer
    for i, group in enumerate(inner.param_groups):
        master = group["params"][0]
        h.update(f"master.{i}".encode())
        h.update(tensor_bytes(master))
        for key, value in sorted(inner.state.get(master, {}).items()):
            h.update(f"state.{i}.{key}".encode())
            h.update(tensor_bytes(value) if torch.is_tensor(value) else repr(value).encode())
        h.update(repr(group.get("lr")).encode())
    return h.hexdigest()


def _link_moments(engine: Any) -> None:
    """(Re)link DeepSpeed's per-parameter views of the AdamW moments, which ``safe_get/set_full_optimizer_state`` read.

    DeepSpeed links them once, after the first group's first step: a resumed engine has not stepped yet, and with
    two param groups the second group's moments do not exist at that point, so its views stay empty for good."""
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()


def full_state(engine: Any) -> dict[str, Any]:
    """Per parameter, the SHA-256 of its full fp32 master and AdamW moments, gathered by DeepSpeed's own helpers
    (an all-reduce of each rank's fragment: independent of gemscout's layout code), and the step count and lr of
    every group. Collective: every rank calls."""
    if engine.zero_optimization_stage() == 3:
        return ds_zero3.full_state(engine)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    inner = engine.optimizer.optimizer
    assert all(inner.state.get(g["params"][0]) for g in inner.param_groups), (
        "--full-state needs a stepped engine"
    )
    _link_moments(engine)
    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        tensors = {
            "master": safe_get_full_fp32_param(p),
            **{k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")},
        }
        out[name] = {k: hashlib.sha256(tensor_bytes(t)).hexdigest() for k, t in tensors.items()}
    out["/groups"] = [
        [float(inner.state[g["params"][0]]["step"]), repr(g["lr"])] for g in inner.param_groups
    ]
    return out


_MOMENTS = ("exp_avg", "exp_avg_sq")


def dump_full(engine: Any, path: Path) -> None:
    """Rank 0 writes the full state of the job to ``path`` (see the module doc). Collective: every rank calls."""
    if engine.zero_optimization_stage() == 3:
        return ds_zero3.dump_full(engine, path)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _link_moments(engine)
    params = {
        name: {
            "master": safe_get_full_fp32_param(p),
            **{k: safe_get_full_optimizer_state(p, k) for k in _MOMENTS},
        }
        for name, p in engine.module.named_parameters()
    }
    inner = engine.optimizer.optimizer
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "step": inner.state[g["params"][0]]["step"].clone(),
        }
        for g in inner.param_groups
    ]
    ds_zero3.save_blob(
        engine,
        path,
        params=params,
        groups=groups,
        model={k: v.clone() for k, v in engine.module.state_dict().items()},
    )


def load_full(engine: Any, path: Path) -> int:
    """Load a :func:`dump_full` into a fresh engine with DeepSpeed's own setters; returns the step it holds."""
    if engine.zero_optimization_stage() == 3:
        return ds_zero3.load_full(engine, path)
    blob = torch.load(path, weights_only=False)
    inner = engine.optimizer.optimizer
    with torch.no_grad():
        engine.module.load_state_dict(
            blob["model"]
        )  # in place: the module's weights are views of DeepSpeed's flat
        for group, saved in zip(inner.param_groups, blob["groups"], strict=True):
            master = group["params"][0]
            inner.state[master] = {
                "step": saved["step"].clone(),
                **{k: torch.zeros_like(master) for k in _MOMENTS},
            }
            group.update({k: v for k, v in saved.items() if k != "step"})
        _link_moments(engine)
    return ds_zero3.set_full_state(engine, blob)


def module_digest(engine: Any) -> str:
    if engine.zero_optimization_stage() == 3:  # collective: gathers the partitioned parameters
        return ds_zero3.module_digest(engine)
    h = hashlib.sha256()
    for t in engine.module.state_dict().values():
        h.update(tensor_bytes(t))
    return h.hexdigest()

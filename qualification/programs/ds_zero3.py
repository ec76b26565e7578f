"""The ZeRO-3 side of :mod:`qualification.programs.ds_rank`: its config and its digests of a stage-3 engine.

Under ZeRO-3 the module's parameters are empty placeholders outside gathered contexts, so the ZeRO-1/2 digests (over
``engine.module.state_dict()`` and the torch optimizer's ``param_groups``) would hash nothing. Here:

- :func:`state_digest`: SHA-256 over this rank's partition of every parameter (``ds_tensor``), its fp32 master
  partition of every sub-group (``fp32_partitioned_groups_flat``) with the optimizer state of it, and the lr —
  without the padding of the last rank's slices, which DeepSpeed leaves uninitialized and never reads;
- :func:`module_digest`: SHA-256 over the whole module, gathered with DeepSpeed's own
  ``deepspeed.zero.GatheredParameters`` (collective: every rank calls) — the same on every rank.

The config lowers ``stage3_param_persistence_threshold`` so that the test model has both kinds of parameters: the
matrices stay partitioned between steps, the vectors (norms, biases) are persistent (gathered after every step).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from qualification.programs._tensor_bytes import tensor_bytes

PERSISTENCE_THRESHOLD = 1000
"""Parameters with fewer elements stay gathered between steps (the three-block model's norms and biases)."""


def zero3_config() -> dict[str, Any]:
    """The ``zero_optimization`` section of a stage-3 run."""
    return {"stage": 3, "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD}


def _real(p: Any) -> int:
    """Elements of ``p``'s partition on this rank that are not padding."""
    pn = int(p.partition_numel())
    return max(0, min(pn, int(p.ds_numel) - int(dist.get_rank(group=p.ds_process_group)) * pn))


def state_digest(engine: Any) -> str:
    """This rank's parameter partitions, fp32 master partitions and their optimizer state (see the module doc).

    The padding at the end of the last rank's slices is left out: DeepSpeed 0.19.8 allocates it uninitialized
    (``torch.empty``), never reads it (every gather is cut to the parameter's size) and the optimizer steps it with
    zero gradients, so it holds whatever memory it was given and differs between runs."""
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        h.update(name.encode())
        h.update(tensor_bytes(p.ds_tensor.narrow(0, 0, _real(p))))
    for name, b in engine.module.named_buffers():
        h.update(name.encode())
        h.update(tensor_bytes(b))
    zero = engine.optimizer
    inner = zero.optimizer
    for i, master in enumerate(zero.fp32_partitioned_groups_flat):
        state = sorted(inner.state.get(master, {}).items())
        offset = 0
        for p in zero.fp16_groups[i]:
            real = _real(p)
            h.update(f"master.{i}.{offset}".encode())
            h.update(tensor_bytes(master.narrow(0, offset, real)))
            for key, value in state:
                if torch.is_tensor(value) and value.shape == master.shape:
                    h.update(f"state.{i}.{key}.{offset}".encode())
                    h.update(tensor_bytes(value.narrow(0, offset, real)))
            offset += int(p.partition_numel())
        for key, value in state:
            if not (torch.is_tensor(value) and value.shape == master.shape):
                h.update(f"state.{i}.{key}".encode())
                h.update(tensor_bytes(value) if torch.is_tensor(value) else repr(value).encode())
    for group in inner.param_groups:
        h.update(repr(group.get("lr")).encode())
    return h.hexdigest()


def module_digest(engine: Any) -> str:
    """The whole module's parameters and buffers, gathered by DeepSpeed. Collective: every rank calls."""
    import deepspeed

    h = hashlib.sha256()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        for t in engine.module.state_dict().values():
            h.update(tensor_bytes(t))
    return h.hexdigest()


_MOMENTS = ("exp_avg", "exp_avg_sq")


def _full(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter, its full fp32 master and AdamW moments as DeepSpeed assembles them (``safe_get_full_*``: an
    all-gather of every rank's slice, independent of gemscout's layout code). Collective."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {
        name: {
            "master": safe_get_full_fp32_param(p),
            **{k: safe_get_full_optimizer_state(p, k) for k in _MOMENTS},
        }
        for name, p in engine.module.named_parameters()
    }


def _steps(engine: Any) -> list[Any]:
    zero = engine.optimizer
    return [zero.optimizer.state[m]["step"] for m in zero.fp32_partitioned_groups_flat]


def full_state(engine: Any) -> dict[str, Any]:
    """The SHA-256 of every parameter's full master and moments, each sub-group's step count and every group's lr:
    a world-size-independent picture of the optimizer state. Collective."""
    out: dict[str, Any] = {
        name: {k: hashlib.sha256(tensor_bytes(t)).hexdigest() for k, t in per.items()}
        for name, per in _full(engine).items()
    }
    out["/groups"] = [
        [float(s) for s in _steps(engine)],
        [repr(g["lr"]) for g in engine.optimizer.optimizer.param_groups],
    ]
    return out


def dump_full(engine: Any, path: Any) -> None:
    """Rank 0 writes the job's full state (``torch.save``: test side only): full masters and moments, the gathered
    module, step counts, hyper-parameters, lr scheduler, engine counters, torch RNG. Collective."""
    import deepspeed

    params = _full(engine)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        model = {k: v.clone() for k, v in engine.module.state_dict().items()}
    inner = engine.optimizer.optimizer
    save_blob(
        engine,
        path,
        params=params,
        model=model,
        steps=[s.clone() for s in _steps(engine)],
        groups=[{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
    )


def save_blob(engine: Any, path: Any, **parts: Any) -> None:
    """Rank 0 saves ``parts`` with what every stage's full-state dump shares: the lr scheduler, the torch RNG and the
    engine counters (``torch.save``: test side only)."""
    blob = {
        **parts,
        "scheduler": engine.lr_scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "counters": {
            k: int(getattr(engine, k))
            for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")
        },
    }
    if dist.get_rank() == 0:
        torch.save(blob, path)


def load_full(engine: Any, path: Any) -> int:
    """Load a :func:`dump_full` into a fresh stage-3 engine with DeepSpeed's own tools (``GatheredParameters`` with a
    modifier rank for the module, ``safe_set_full_*`` for masters and moments); returns the step it holds."""
    import deepspeed

    blob = torch.load(path, weights_only=False)
    zero = engine.optimizer
    inner = zero.optimizer
    params = dict(engine.module.named_parameters())
    with torch.no_grad():
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
            for name, p in params.items():
                p.data.copy_(blob["model"][name])
        for master, step in zip(zero.fp32_partitioned_groups_flat, blob["steps"], strict=True):
            inner.state[master] = {
                "step": step.clone(),
                **{k: torch.zeros_like(master) for k in _MOMENTS},
            }
        for group, saved in zip(inner.param_groups, blob["groups"], strict=True):
            group.update(saved)
    return set_full_state(engine, blob)


def set_full_state(engine: Any, blob: dict[str, Any]) -> int:
    """The part of loading a full-state dump every stage shares: masters and moments through DeepSpeed's own
    ``safe_set_full_*`` setters, the lr scheduler, engine counters and torch RNG. Returns the step it holds."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            safe_set_full_fp32_param(p, blob["params"][name]["master"])
            for k in _MOMENTS:
                safe_set_full_optimizer_state(p, blob["params"][name][k], k)
    engine.lr_scheduler.load_state_dict(blob["scheduler"])
    for k, v in blob["counters"].items():
        setattr(engine, k, v)
    torch.set_rng_state(blob["rng"])
    return int(blob["counters"]["global_steps"])

"""The arguments of a block call, as SCOUT captures them and rebuilds them for replay.

Real model code calls a block with more than one tensor: a transformers decoder layer gets the hidden state plus
``position_embeddings`` (a tuple of tensors), ``position_ids``, ``attention_mask=None``, ``use_cache`` (a bool) and a
``Cache`` object. :func:`encode` turns such a call into JSON specs plus a flat dict of tensor copies, and
:func:`decode` rebuilds an equal call from them on any peer. Accepted:

* tensors (copied; whether they required grad is kept, so replay differentiates the same inputs);
* ``None``, ``bool``, ``int``, ``float`` (NaN and infinities too), ``str``, ``torch.dtype``, ``torch.device``;
* tuples, lists and dicts with ``str`` keys, nested any way, holding any of these;
* a transformers ``Cache`` (``DynamicCache`` in a training forward with ``use_cache=True``): see :func:`_cache_spec`.

Anything else raises :class:`Unreplayable` with the argument's path and type, and the recipe is reported as one SCOUT
cannot replay (never as a forward that "did not return").
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["Unreplayable", "decode", "encode"]


class Unreplayable(Exception):
    """A recipe input that SCOUT cannot reproduce on a peer; the message says which one and why."""


def encode(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    tensors: dict[str, torch.Tensor],
) -> tuple[list[Any], dict[str, Any]]:
    """Specs of ``module(*args, **kwargs)``; tensor copies go into ``tensors`` under ``arg.<i>[.<j>...]`` /
    ``kwarg.<name>[.<j>...]``. Raises :class:`Unreplayable`."""
    encoder = _Encoder(module, tensors)
    specs = [encoder.spec(f"arg.{i}", value) for i, value in enumerate(args)]
    kw = {key: encoder.spec(f"kwarg.{key}", value) for key, value in sorted(kwargs.items())}
    return specs, kw


def decode(spec: Mapping[str, Any], leaves: Mapping[str, torch.Tensor]) -> Any:
    """The value ``spec`` describes, its tensors taken from ``leaves`` (by key). A cache is a fresh, empty one.
    Raises ``ValueError`` for a malformed spec."""
    if "tensor" in spec:
        return leaves[spec["tensor"]]
    if "value" in spec:
        return spec["value"]
    if "float" in spec:
        return float(spec["float"])
    if "tuple" in spec:
        return tuple(decode(s, leaves) for s in spec["tuple"])
    if "list" in spec:
        return [decode(s, leaves) for s in spec["list"]]
    if "dict" in spec:
        return {key: decode(s, leaves) for key, s in spec["dict"]}
    if "dtype" in spec:
        return getattr(torch, spec["dtype"])
    if "device" in spec:
        return torch.device(spec["device"])
    if "cache" in spec:
        return _class_named(spec["cache"])()
    raise ValueError(f"malformed recipe input spec {sorted(spec)}")


class _Encoder:
    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        self.module, self.tensors = module, tensors

    def spec(self, key: str, value: Any) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, nn.Parameter):
                # A tensor subclass (DTensor, a quantized wrapper) would arrive on the peers as a plain tensor and be
                # replayed through other code paths: not the call that ran.
                raise Unreplayable(
                    f"recipe input {key} is a {type(value).__name__}, a tensor subclass SCOUT does "
                    "not send (it would be replayed as a plain tensor)"
                )
            self.tensors[key] = value.detach().clone()
            return {"tensor": key, "grad": bool(value.requires_grad)}
        if value is None or isinstance(value, bool | int | str):
            return {"value": value}
        if isinstance(value, float):
            # JSON has no NaN or infinity, and the wire header refuses them; spell them out.
            return {"value": value} if math.isfinite(value) else {"float": repr(value)}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        if isinstance(value, tuple | list):
            items = [self.spec(f"{key}.{i}", v) for i, v in enumerate(value)]
            return {"tuple": items} if isinstance(value, tuple) else {"list": items}
        if isinstance(value, dict):
            bad = next((k for k in value if not isinstance(k, str)), None)
            if bad is not None:
                raise Unreplayable(
                    f"recipe input {key} is a dict with a {type(bad).__name__} key; SCOUT sends str keys only"
                )
            return {
                "dict": [[k, self.spec(f"{key}.{i}", v)] for i, (k, v) in enumerate(value.items())]
            }
        if _is_transformers_cache(value):
            return _cache_spec(self.module, key, value)
        raise Unreplayable(
            f"recipe input {key} is a {type(value).__module__}.{type(value).__qualname__}, which "
            "SCOUT cannot send to its peers (tensors, numbers, str, None, dtypes, devices, "
            "tuples/lists/dicts of them and a transformers Cache are supported)"
        )


def _is_transformers_cache(value: Any) -> bool:
    # By name, so gemscout never imports transformers: a subclass of transformers.cache_utils.Cache.
    return any(
        c.__name__ == "Cache" and c.__module__ == "transformers.cache_utils"
        for c in type(value).__mro__
    )


_CONSTRUCTIBLE: dict[str, str | None] = {}


def _cache_spec(module: nn.Module, key: str, cache: Any) -> dict[str, Any]:
    """A transformers ``Cache`` passed to a block: replayed with a fresh, empty instance of the same class.

    Why that reproduces the call: in a training forward the cache is created empty for the step, and the block only
    appends its own layer's keys and values (``cache.update(k, v, layer_idx)``), getting back exactly what it
    appended. A fresh empty cache therefore gives the block the same keys and values, and the live cache — which the
    real forward filled and the model may still read — is never touched. That holds only when this block's layer is
    still empty when it is called: a cache carrying past tokens (generation, or a prefix passed in by the caller)
    would need its contents replayed too, so that call is refused here with the reason.
    """
    cls = type(cache)
    name = f"{cls.__module__}:{cls.__qualname__}"
    found = (getattr(m, "layer_idx", None) for m in module.modules())
    layer_idx: int | None = next((i for i in found if type(i) is int), None)
    if layer_idx is None:
        raise Unreplayable(
            f"recipe input {key} is a {cls.__qualname__}, and the block has no layer_idx attribute "
            "saying which of its layers it writes; SCOUT cannot tell whether that layer holds past "
            "tokens (train with use_cache=False to pass no cache)"
        )
    seen = _seq_length(cache, layer_idx)
    if seen:
        raise Unreplayable(
            f"recipe input {key} is a {cls.__qualname__} whose layer {layer_idx} already holds "
            f"{seen} past positions; SCOUT replays a block only from an empty cache (a training "
            "forward), never a cache carrying past tokens"
        )
    if name not in _CONSTRUCTIBLE:
        try:
            _class_named(name)()
            _CONSTRUCTIBLE[name] = None
        except Exception as exc:  # any failure means the peers could not build one either
            _CONSTRUCTIBLE[name] = f"{type(exc).__name__}: {exc}"
    why = _CONSTRUCTIBLE[name]
    if why is not None:
        raise Unreplayable(
            f"recipe input {key} is a {cls.__qualname__}, and a fresh empty one for the replay "
            f"cannot be built without arguments ({why}); train with use_cache=False"
        )
    return {"cache": name}


def _seq_length(cache: Any, layer_idx: int) -> int:
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list) and layer_idx >= len(layers):
        return 0  # a lazily grown cache has no entry for this layer yet
    get: Callable[..., Any] | None = getattr(cache, "get_seq_length", None)
    if get is None:
        raise Unreplayable(
            f"a {type(cache).__qualname__} without get_seq_length(); SCOUT cannot tell if it is empty"
        )
    return int(get(layer_idx))


def _class_named(name: str) -> type:
    """The class ``module:qualname`` from a module already imported (a peer runs the same model code, so the
    module is loaded there too; nothing is imported on the replay path)."""
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        raise ValueError(f"{module_name} is not imported on this rank")
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ValueError(f"{name} is not a class")
    return obj

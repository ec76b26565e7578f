"""Pickle-free encoding of nested training state.

A state object (model and optimizer state dicts, caller state, RNG states) is split into a JSON *skeleton* and a list
of tensors. The skeleton holds every non-tensor value; each tensor is replaced by ``{"__t__": index}``. Decoding is
the inverse. Nothing here ever unpickles: a checkpoint or a peer message can only produce JSON values and tensors.

Accepted leaves: ``torch.Tensor``, ``numpy.ndarray`` (stored as a tensor, restored as an array), ``int``, ``float``
(NaN and infinities included), ``bool``, ``str``, ``None``. Containers: ``dict`` (any str/int/float/bool keys,
insertion order kept), ``list``, ``tuple`` (restored as tuple). Anything else is refused with a
:class:`~gemscout.errors.ConfigError` naming its path, because storing it would need pickle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gemscout._tensors import is_dtensor as _is_dtensor
from gemscout.errors import ConfigError

_TENSOR, _ARRAY, _TUPLE, _DICT, _SHARD = "__t__", "__np__", "__tuple__", "__dict__", "__dt__"
_RESERVED = {_TENSOR, _ARRAY, _TUPLE, _DICT, _SHARD}
_PLAIN = (int, float, str, bool, type(None))


def encode(obj: Any, *, path: str = "state") -> tuple[Any, list[torch.Tensor]]:
    """Split ``obj`` into ``(skeleton, tensors)``. Tensors are referenced, not copied."""
    tensors: list[torch.Tensor] = []
    return _encode(obj, tensors, path), tensors


@dataclass(frozen=True, slots=True)
class LocalShard:
    """This rank's shard of a distributed tensor (DTensor), with the global shape and stride it belongs to.

    Decoding yields these instead of DTensors: the device mesh and placements are live objects of the job, so the
    restore step rebuilds the DTensor from the live parameter it belongs to.
    """

    local: torch.Tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _encode(obj: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if _is_dtensor(obj):
        tensors.append(obj.to_local().detach())
        return {_SHARD: [len(tensors) - 1, list(obj.shape), list(obj.stride())]}
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {_TENSOR: len(tensors) - 1}
    if isinstance(obj, np.ndarray):
        tensors.append(torch.from_numpy(np.ascontiguousarray(obj)))
        return {_ARRAY: len(tensors) - 1}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple | list):
        if all(
            type(v) in _PLAIN for v in obj
        ):  # fast path: e.g. param-group index lists, RNG words
            items: list[Any] = list(obj)
        else:
            items = [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
        return {_TUPLE: items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        plain = all(isinstance(k, str) and k not in _RESERVED for k in obj)
        if plain:
            return {k: _encode(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        items = []
        for k, v in obj.items():
            if not isinstance(k, str | int | float | bool):
                raise ConfigError(
                    f"{path} has a key of type {type(k).__name__}; use str or int keys"
                )
            items.append([k, _encode(v, tensors, f"{path}[{k!r}]")])
        return {_DICT: items}
    raise ConfigError(
        f"{path} is a {type(obj).__name__}, which cannot be stored without pickle; "
        "return tensors, numbers, strings, None, lists, tuples and dicts instead"
    )


def decode(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the object encoded by :func:`encode` from its skeleton and tensors."""
    if isinstance(skeleton, list):
        return [decode(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if len(skeleton) == 1:
            ((key, value),) = skeleton.items()
            if key == _TENSOR:
                return tensors[value]
            if key == _ARRAY:
                return tensors[value].numpy()
            if key == _TUPLE:
                return tuple(decode(v, tensors) for v in value)
            if key == _DICT:
                return {k: decode(v, tensors) for k, v in value}
            if key == _SHARD:
                return LocalShard(tensors[value[0]], tuple(value[1]), tuple(value[2]))
        return {k: decode(v, tensors) for k, v in skeleton.items()}
    return skeleton

"""How a capture's tensors are named in a durable promotion: one ``torch.distributed.checkpoint`` key per tensor.

A DTensor shard is stored as the global tensor it belongs to (key ``s/<path>``), so DCP stores each element once and
can reshard on load; a tensor that is the same on every rank (DDP's model, optimizer and schedulers) is keyed
``g/<path>`` on every rank and written once; everything else (caller state, RNG, counters) is the rank's own
(``r<rank>/<path>``). Paths are built from the capture's codec skeleton (:mod:`gemscout.state.codec`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gemscout._modules import unwrap
from gemscout._tensors import is_dtensor
from gemscout.errors import ConfigError, IntegrityError
from gemscout.state import training_state

Entry = tuple[str, list[int] | None, list[int] | None]
"""(DCP key, global shape, global stride) per tensor index; shape and stride only for DTensor shards."""


def key_component(key: Any) -> str:
    """One path component of a DCP key, unique by construction: ``/`` and ``%`` in a string key are escaped
    (``%2F``, ``%25``), a string that reads as an integer is marked ``%s`` (an ``int`` key of a non-string dict,
    e.g. an optimizer's parameter index, stays bare), and bool / float keys are marked ``%b`` / ``%f``. Caller state
    ``{"a/b": t1, "a": {"b": t2}}`` so gives ``a%2Fb`` and ``a/b``, never the same key twice. Model and optimizer
    names contain neither ``/`` nor ``%`` and are unchanged, so their keys are the same as format 2's."""
    if isinstance(key, bool):
        return f"%b{key}"
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float):
        return f"%f{key!r}"
    if not isinstance(key, str):
        raise IntegrityError(f"checkpoint skeleton has a dict key of type {type(key).__name__}")
    escaped = key.replace("%", "%25").replace("/", "%2F")
    return f"%s{escaped}" if _INTEGER.fullmatch(escaped) else escaped


_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only: str(int) never yields another digit


def tensor_entries(skeleton: Any, rank: int, replicated: tuple[str, ...] = ()) -> list[Entry]:
    """A DCP key per tensor of a codec skeleton, in tensor-index order (see the module docstring). A plain tensor
    under a top-level key in ``replicated`` is the same on every rank (DDP's model, optimizer and schedulers): its
    key ``g/<path>`` is shared by every rank, so DCP stores it once. Keys are built from :func:`key_component`;
    raises ConfigError if two tensors still share a key (a float-NaN dict key twice), IntegrityError for a
    skeleton that is not the codec's."""
    found: dict[int, Entry] = {}

    def walk(node: Any, path: str, depth: int) -> None:
        if depth > MAX_SKELETON_DEPTH:
            raise IntegrityError(
                f"checkpoint skeleton is nested deeper than {MAX_SKELETON_DEPTH} levels"
            )
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}", depth + 1)
            return
        if not isinstance(node, dict):
            return
        if len(node) == 1:
            ((key, value),) = node.items()
            if key == "__dt__":
                index, shape, stride = value
                _claim(found, index, (f"s{path}", list(shape), list(stride)))
                return
            if key in ("__t__", "__np__"):
                shared = path.split("/")[1] in replicated
                _claim(found, value, (f"g{path}" if shared else f"r{rank}{path}", None, None))
                return
            if key == "__tuple__":
                walk(value, path, depth + 1)
                return
            if key == "__dict__":
                for k, v in value:
                    walk(v, f"{path}/{key_component(k)}", depth + 1)
                return
        for k, v in node.items():
            walk(v, f"{path}/{key_component(k)}", depth + 1)

    try:
        walk(skeleton, "", 0)
    except (TypeError, ValueError, IndexError) as exc:
        raise IntegrityError(f"checkpoint skeleton is malformed: {exc}") from None
    if sorted(found) != list(range(len(found))):
        raise IntegrityError(
            "checkpoint skeleton does not reference its tensors 0..n-1 exactly once"
        )
    entries = [found[i] for i in range(len(found))]
    check_unique_keys(entries)
    return entries


MAX_SKELETON_DEPTH = 64
"""Deeper than any training state (a model's state dict is flat; optimizer state three levels); a crafted skeleton
nested thousands deep would otherwise end in RecursionError."""


def _claim(found: dict[int, Entry], index: Any, entry: Entry) -> None:
    if type(index) is not int or index < 0 or index in found:
        raise IntegrityError(
            f"checkpoint skeleton references tensor {index!r} twice or not as an index"
        )
    found[index] = entry


def check_unique_keys(entries: list[Entry]) -> None:
    """Refuse a promotion in which two tensors share a DCP key: DCP would store one and load it into both (the
    other's values silently lost). Raises ConfigError naming the key."""
    seen: set[str] = set()
    for key, _, _ in entries:
        if key in seen:
            raise ConfigError(
                f"durable promotion: two tensors of the state map to the DCP key {key!r}; rename one "
                "of the caller state's keys (e.g. a dict holding two float NaN keys)"
            )
        seen.add(key)


def live_shards(sources: training_state.StateSources) -> dict[str, Any]:
    """The live DTensors a stored shard is rebuilt like, by key prefix: ``/model/<name>`` and
    ``/optimizer/state/<index>`` (an optimizer state entry shards like its parameter).

    Call on the training thread between steps: ``state_dict()`` runs FSDP's hooks, and during a forward FSDP
    registers unsharded parameters; the io thread only reads the mesh, placements and local shape of what this
    returns."""
    likes: dict[str, Any] = {}
    for name, value in unwrap(sources.model).state_dict().items():
        if is_dtensor(value):
            likes[f"/model/{key_component(name)}"] = value
    flat = [p for g in sources.optimizer.param_groups for p in g["params"]]
    for idx, p in enumerate(flat):
        if is_dtensor(p):
            likes[f"/optimizer/state/{idx}"] = p
    return likes


def shard_like(likes: dict[str, Any], key: str) -> Any:
    path = key[1:]  # drop the "s"
    parts = path.split("/")
    like = likes.get(path) if parts[1] == "model" else likes.get("/".join(parts[:4]))
    if like is None:
        raise IntegrityError(
            f"durable checkpoint has a sharded entry {key!r} with no live DTensor to shard it like"
        )
    return like


def as_dtensor(local: torch.Tensor, like: Any, shape: list[int], stride: list[int]) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(stride),
    )

"""Reading a ZeRO-1/2 optimizer slice off the live partitioned optimizer: what the owner copies and compares.

A slice (:class:`~gemscout.adapters.deepspeed.zero_slices.ZeroSlice`) is a range of one param group's flat fp32
master partition. Before the update the owner copies the slice's master values, its reduced gradient, the
optimizer state sliced with the partition and the group's hyper-parameters (:func:`capture_slice`, the input of the
replay); after the update :func:`live_slice` is the owner's actual slice, keyed as a replay's outputs are. Every
rank digests its own hyper-parameters with :func:`hyper_digest` for the replay's precondition.
:class:`~gemscout.adapters.deepspeed.scout.ZeroScout` runs these at the right moments of ``engine.step()``.
Nothing here imports deepspeed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import blake3
import torch

from gemscout.adapters.deepspeed.zero_slices import ZeroSlice
from gemscout.scout.capture import Captured, to_json_value
from gemscout.scout.digests import digest_many

__all__ = ["blake3_digest", "capture_slice", "hyper_digest", "live_slice"]


def blake3_digest(*parts: str) -> str:
    """A ``blake3:<hex>`` digest over length-prefixed texts (the form SCOUT's record rows carry compactly)."""
    hasher = blake3.blake3(b"gemscout.deepspeed_scout.v1\0")
    for part in parts:
        data = part.encode()
        hasher.update(len(data).to_bytes(8, "little") + data)
    return f"blake3:{hasher.hexdigest()}"


def _hyper(group: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    plain, tensors = {}, {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            tensors[key] = value.detach().clone()
        else:
            plain[key] = to_json_value(value, f"hyper-parameter {key!r}")
    return plain, tensors


def hyper_digest(optimizer: torch.optim.Optimizer, group: int) -> str:
    """The digest of param group ``group``'s hyper-parameters and the optimizer class (no collective)."""
    plain, tensors = _hyper(optimizer.param_groups[group])
    described = json.dumps({"class": type(optimizer).__qualname__, "hyper": plain}, sort_keys=True)
    return blake3_digest(digest_many({f"hyper.{k}": t for k, t in tensors.items()}), described)


def capture_slice(
    optimizer: torch.optim.Optimizer,
    piece: ZeroSlice,
    group: Mapping[str, Any],
    master: torch.Tensor,
    step: int,
) -> Captured:
    """A copy of ``piece`` before the update: master values, gradient, optimizer state, hyper-parameters of
    ``group`` (the param group being stepped). Raises TypeError on a hyper-parameter or state value it cannot send
    to the peers."""
    captured = Captured(step=step)
    plain, tensors = _hyper(group)
    captured.tensors.update({f"hyper.{k}": t for k, t in tensors.items()})
    key = piece.key
    captured.tensors[f"param.{key}"] = master.detach()[piece.start : piece.stop].clone()
    if master.grad is not None:
        captured.tensors[f"grad.{key}"] = master.grad.detach()[piece.start : piece.stop].clone()
    values: dict[str, Any] = {}
    for name, value in optimizer.state.get(master, {}).items():
        if isinstance(value, torch.Tensor):
            captured.tensors[f"state.{key}#{name}"] = _state_part(value, master, piece).clone()
        else:
            values[name] = to_json_value(value, f"optimizer state {name!r}")
    captured.meta.update(
        optimizer=type(optimizer).__qualname__,
        hyper=plain,
        state_values={key: values} if values else {},
        params=[key],
        on_device=[],
    )
    return captured


def _state_part(value: torch.Tensor, master: torch.Tensor, piece: ZeroSlice) -> torch.Tensor:
    # Per-element state (exp_avg, exp_avg_sq) is sliced with the partition; a scalar (AdamW's step) is whole.
    return (
        value.detach()[piece.start : piece.stop] if value.shape == master.shape else value.detach()
    )


def live_slice(
    optimizer: torch.optim.Optimizer, master: torch.Tensor, piece: ZeroSlice
) -> dict[str, torch.Tensor]:
    """The owner's live slice after the update, keyed as a replay's outputs are."""
    out = {f"param.{piece.key}": master.detach()[piece.start : piece.stop]}
    for name, value in optimizer.state.get(master, {}).items():
        if isinstance(value, torch.Tensor):
            out[f"state.{piece.key}#{name}"] = _state_part(value, master, piece)
    return out

"""Partition codecs: how an adapter stores rank-local partitions in a durable promotion, parameter by parameter.

A rank-local partition (DeepSpeed ZeRO's flat fp32 masters and optimizer state) has no DTensor to tell DCP how it
maps onto the model, so by default a promotion of it loads only on the world size that wrote it. An adapter that
knows the partitioning registers a :class:`PartitionCodec`: the codec stores each parameter's slices under its own
key and, on load, reads back the slices the live engine's partitioning needs, so such a promotion resumes on any
world size. The sidecar records the codec's ``name``; a promotion names a codec this process has not registered
only when a job of another kind tries to load it, and that is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gemscout.state import training_state
from gemscout.state.layout import Parsed


class PartitionCodec(Protocol):
    """One way of storing rank-local partitions per parameter (see the module docstring)."""

    name: str
    """Recorded in the sidecar of each rank (``ranks[i]["codec"]``); unique among registered codecs."""

    def accepts(self, skeleton: Any) -> bool:
        """Whether a capture with this codec skeleton holds this codec's partitions."""
        ...

    def promotion_items(
        self, parsed: Parsed, data: torch.Tensor, rank: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's DCP items for a promotion of its verified capture, and its sidecar record: ``codec`` (this
        codec's name), ``identity`` (the capture's, ``parsed.identity``) and whatever :meth:`load` needs."""
        ...

    def load(
        self,
        folder: Path,
        records: list[dict[str, Any]],
        sources: training_state.StateSources,
        *,
        group: dist.ProcessGroup,
        rank: int,
    ) -> None:
        """Collectively load a verified promotion written by this codec into the live objects (any world size)."""
        ...


_REGISTERED: dict[str, PartitionCodec] = {}


def register(codec: PartitionCodec) -> None:
    """Make promotions of ``codec``'s partitions per parameter (idempotent: a name registered before is kept)."""
    _REGISTERED.setdefault(codec.name, codec)


def for_skeleton(skeleton: Any) -> PartitionCodec | None:
    """The registered codec that accepts a capture with this skeleton, or None (the default key layout)."""
    return next((c for c in _REGISTERED.values() if c.accepts(skeleton)), None)


def named(name: str) -> PartitionCodec | None:
    """The registered codec a sidecar names, or None when this process has not registered it."""
    return _REGISTERED.get(name)

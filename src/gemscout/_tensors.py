"""Tensor helpers both capabilities share (the state codec, GEMINI's sharded paths, SCOUT's materializer)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_dtensor"]


def is_dtensor(obj: Any) -> bool:
    """True when ``obj`` is a ``torch.distributed.tensor.DTensor`` (or a subclass of it).

    Never imports DTensor: importing it costs ~45 MiB of resident memory and seconds of import time that a job
    without DTensors should not pay. No DTensor can exist before ``torch.distributed.tensor`` is imported (its class
    lives there), so until then the answer is False without looking further."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return isinstance(dtensor, type) and isinstance(obj, dtensor)

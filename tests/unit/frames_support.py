"""A checkpoint frame built in memory, for the GEMINI unit tests."""

from __future__ import annotations

import torch

from gemscout.state.codec import encode
from gemscout.state.layout import Layout, build_header, frame_prefix, tensor_digests


def frame_of(obj: object, step: int = 3) -> tuple[bytes, torch.Tensor]:
    """``(prefix, data)`` of a frame holding ``obj`` with identity ``{"step": step}``, digests included."""
    skeleton, tensors = encode(obj)
    layout = Layout.of(tensors)
    data = torch.empty(layout.data_nbytes, dtype=torch.uint8)
    for view, t in zip(layout.views(data), tensors, strict=True):
        view.copy_(t)
    return frame_prefix(
        build_header(layout, tensor_digests(layout, data), skeleton, {"step": step})
    ), data

"""The wire format of captured replay inputs: how a capture travels from the source peer to the others.

A slice flattened at capture time (:func:`~gemscout.scout.capture.flatten_slice`) is expanded back into per-parameter
views (:func:`expand_flat`). :func:`pack` writes the captures of one step as a JSON header (names, dtypes, shapes,
offsets, metadata) and one flat byte payload, each tensor at a 64-byte aligned offset; :func:`unpack` parses them back
into :class:`~gemscout.scout.capture.Captured` whose tensors are views of the received payload, with a digest of the
inputs exactly as received. Nothing is pickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import blake3
import torch

from gemscout.scout.capture import Captured

__all__ = ["expand_flat", "pack", "unpack"]

WIRE_VERSION = 1
_ALIGN = 64  # payload offsets are aligned so every tensor can be viewed in place with its own dtype
_ZEROS = torch.zeros(_ALIGN, dtype=torch.uint8)
_DTYPES = {str(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)}
_DTYPE_NAMES = {value: name for name, value in _DTYPES.items()}


def expand_flat(
    tensors: Mapping[str, torch.Tensor], layout: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`~gemscout.scout.capture.flatten_slice` on ``tensors``: each ``flat.<kind>`` becomes
    views of its members, by key. Raises ``ValueError`` when a flat tensor does not hold exactly its members'
    elements."""
    out = {k: t for k, t in tensors.items() if k not in layout}
    for flat_key, members in layout.items():
        flat = tensors[flat_key]
        offset = 0
        for key, shape in members:
            numel = 1
            for size in shape:
                numel *= size
            out[key] = flat[offset : offset + numel].view(shape)
            offset += numel
        if offset != flat.numel():
            raise ValueError(f"{flat_key} holds {flat.numel()} elements, its members {offset}")
    return out


def pack(
    step: int,
    captures: Mapping[str, Captured],
    out: Callable[[int, int], torch.Tensor] | None = None,
) -> tuple[bytes, torch.Tensor]:
    """Serialize captures to ``(header JSON bytes, flat uint8 payload)``; tensors are copied into the payload.

    ``out(header_bytes, payload_bytes)``: where the payload goes — a uint8 tensor of ``payload_bytes`` elements (the
    exchange passes a slice of its reusable send buffer, so the payload is written once, in place); default: a new
    tensor. Returns the payload written.
    """
    entries: dict[str, Any] = {}
    parts: list[torch.Tensor] = []
    offset = 0
    for name, captured in captures.items():
        table = []
        tensors = captured.tensors
        for key in sorted(tensors):
            tensor = tensors[key]
            if tensor.requires_grad:
                tensor = tensor.detach()
            if not tensor.is_cpu:
                tensor = tensor.cpu()
            # reshape copies a strided view into row-major order and is free on a contiguous tensor.
            flat = tensor.reshape(-1).view(torch.uint8)
            nbytes = flat.numel()
            table.append(
                [
                    key,
                    _DTYPE_NAMES.get(tensor.dtype) or str(tensor.dtype),
                    list(tensor.shape),
                    offset,
                    nbytes,
                ]
            )
            parts.append(flat)
            padded = -(-nbytes // _ALIGN) * _ALIGN
            if padded > nbytes:  # zeroed: the alignment padding is sent (and digested) too
                parts.append(_ZEROS[: padded - nbytes])
            offset += padded
        entries[name] = {"error": captured.error, "meta": captured.meta, "tensors": table}
    header = json.dumps(
        {"version": WIRE_VERSION, "step": step, "recipes": entries}, sort_keys=True, allow_nan=False
    ).encode()
    # One copy of everything: a copy per tensor costs more than the bytes when an optimizer slice holds hundreds.
    payload = (
        out(len(header), offset) if out is not None else torch.empty(offset, dtype=torch.uint8)
    )
    if parts:
        torch.cat(parts, out=payload)
    return header, payload


def unpack(header: bytes, payload: torch.Tensor, step: int) -> dict[str, Captured]:
    """Parse :func:`pack` output into captures whose tensors are views of ``payload``.

    Raises ``ValueError`` for a header of another version or step, an unknown dtype, or an offset past the payload.
    """
    doc = json.loads(header)
    if doc.get("version") != WIRE_VERSION or doc.get("step") != step:
        raise ValueError(
            f"capture header is version {doc.get('version')} for step {doc.get('step')}, "
            f"expected version {WIRE_VERSION} for step {step}"
        )
    out: dict[str, Captured] = {}
    raw = payload.numpy().data
    total = payload.numel()
    # Offsets are multiples of 64, so every tensor is a strided view of the payload seen as its dtype (one call each).
    typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
    for name, entry in doc["recipes"].items():
        captured = Captured(step=step, meta=entry["meta"], error=entry["error"])
        # One pass over the received bytes (cheaper than digesting hundreds of small tensors one by one): the
        # layout (names, dtypes, shapes) and then the inputs' bytes, in the sender's sorted order, each run of
        # adjacent inputs (alignment padding included: it is zeroed by the sender) in one update.
        hasher = blake3.blake3(b"gemscout.scout.received.v2\0")
        inputs = [row for row in entry["tensors"] if not row[0].startswith("rng.")]
        hasher.update(json.dumps([row[:3] for row in inputs]).encode())
        run_start = run_end = -1
        for key, dtype_name, shape, offset, nbytes in entry["tensors"]:
            dtype = _DTYPES.get(dtype_name)
            if dtype is None or offset < 0 or offset % _ALIGN or offset + nbytes > total:
                raise ValueError(
                    f"capture entry {name}/{key} is malformed ({dtype_name}, offset {offset})"
                )
            size = dtype.itemsize
            seen = typed.get(dtype)
            if seen is None:
                whole = payload[: total // size * size].view(dtype)
                seen = typed[dtype] = (whole, int(whole.storage_offset()))
            view, base = seen
            # as_strided counts from the start of the storage, not of the view: add where the view begins.
            captured.tensors[key] = view.as_strided(
                shape, _contiguous_strides(shape), base + offset // size
            )
            if key.startswith("rng."):
                continue
            if run_start >= 0 and offset == -(-run_end // _ALIGN) * _ALIGN:
                run_end = offset + nbytes  # adjacent to the previous input: one run
                continue
            if run_start >= 0:
                hasher.update(raw[run_start:run_end])
            run_start, run_end = offset, offset + nbytes
        if run_start >= 0:
            hasher.update(raw[run_start:run_end])
        captured.received_digest = f"blake3:{hasher.hexdigest()}"
        out[name] = captured
    return out


_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def _contiguous_strides(shape: list[int]) -> tuple[int, ...]:
    key = tuple(shape)
    cached = _STRIDES.get(key)
    if cached is not None:
        return cached
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    if (
        len(_STRIDES) >= 4096
    ):  # a cycle sees the same few shapes; bound what odd workloads could add
        _STRIDES.clear()
    _STRIDES[key] = out = tuple(reversed(strides))
    return out

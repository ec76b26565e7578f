"""The byte layout shared by in-memory slots, peer replicas and files on disk.

::

    MAGIC (8 bytes) | header length (uint64 LE) | header JSON (UTF-8) | header digest (32 bytes) | pad to 64 | data

The data region holds every tensor's raw bytes, each starting at a 64-byte aligned offset, so a tensor is read back
with ``torch.frombuffer`` without a copy and without pickle. The header lists name-free tensor entries (dtype, shape,
offset, nbytes, digest) plus the JSON skeleton from :mod:`gemscout.state.codec` and the checkpoint's identity
(run id, topology digest, owner rank, step). The header digest covers the header bytes; each tensor digest covers its
bytes. A file is valid only if every digest matches (fail closed).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from gemscout.errors import IntegrityError
from gemscout.state.digest import DIGEST_SIZE, digest_bytes, digests_equal

MAGIC = b"GEMSCK01"
ALIGN = 64
_PREFIX = struct.Struct("<8sQ")

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn, torch.float8_e5m2,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise IntegrityError(f"dtype {dtype} is not supported by the checkpoint format")
    return name


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lives in the data region."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    """The data-region layout of a list of tensors; equal layouts can reuse the same slot buffer."""

    entries: tuple[TensorEntry, ...]
    data_nbytes: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> Layout:
        entries, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(TensorEntry(dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
            offset = align(offset + nbytes)
        return cls(tuple(entries), offset)

    def views(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of ``data`` (a uint8 tensor) for every entry, shaped like the original tensors."""
        out = []
        for e in self.entries:
            raw = data[e.offset : e.offset + e.nbytes]
            out.append(raw.view(_DTYPES[e.dtype]).view(e.shape) if e.nbytes else torch.empty(e.shape, dtype=_DTYPES[e.dtype]))
        return out


def tensor_digests(layout: Layout, data: torch.Tensor) -> list[str]:
    """Digest of every tensor's bytes in ``data``; reads the data, never the live tensors."""
    arr = data.numpy()
    return [digest_bytes(arr[e.offset : e.offset + e.nbytes].data) for e in layout.entries]


def build_header(layout: Layout, digests: list[str], skeleton: Any, identity: dict[str, Any]) -> bytes:
    """Serialize the header JSON for a data region with the given per-tensor digests."""
    doc = {
        "format": 1,
        "identity": identity,
        "skeleton": skeleton,
        "data_nbytes": layout.data_nbytes,
        "tensors": [
            {"dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes, "digest": d}
            for e, d in zip(layout.entries, digests, strict=True)
        ],
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


def frame_prefix(header: bytes) -> bytes:
    """Everything that precedes the data region: magic, header length, header, header digest, padding."""
    head = _PREFIX.pack(MAGIC, len(header)) + header + bytes.fromhex(digest_bytes(header))
    return head + b"\0" * (align(len(head)) - len(head))


@dataclass(frozen=True, slots=True)
class Parsed:
    """A verified header: identity, skeleton, layout and digests, plus where the data region starts."""

    identity: dict[str, Any]
    skeleton: Any
    layout: Layout
    digests: tuple[str, ...]
    data_offset: int


def parse_prefix(buf: memoryview | bytes) -> Parsed:
    """Parse and verify the header at the start of ``buf``. Raises IntegrityError on any mismatch."""
    if len(buf) < _PREFIX.size:
        raise IntegrityError("checkpoint is truncated before its header")
    magic, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise IntegrityError("not a gemscout checkpoint (bad magic)")
    end = _PREFIX.size + hlen
    if len(buf) < end + DIGEST_SIZE:
        raise IntegrityError("checkpoint is truncated inside its header")
    header = bytes(buf[_PREFIX.size : end])
    stored = bytes(buf[end : end + DIGEST_SIZE]).hex()
    if not digests_equal(stored, digest_bytes(header)):
        raise IntegrityError("header digest mismatch")
    try:
        doc = json.loads(header)
        entries = tuple(
            TensorEntry(t["dtype"], tuple(t["shape"]), int(t["offset"]), int(t["nbytes"])) for t in doc["tensors"]
        )
        layout = Layout(entries, int(doc["data_nbytes"]))
        digests = tuple(str(t["digest"]) for t in doc["tensors"])
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"header is malformed: {exc}") from None
    if any(e.dtype not in _DTYPES for e in entries):
        raise IntegrityError("header names an unknown dtype")
    return Parsed(doc["identity"], doc["skeleton"], layout, digests, align(end + DIGEST_SIZE))


def verify_data(parsed: Parsed, data: torch.Tensor) -> None:
    """Check every tensor digest over ``data`` (the data region). Raises IntegrityError naming the first mismatch."""
    if data.numel() < parsed.layout.data_nbytes:
        raise IntegrityError(
            f"data region is truncated: {data.numel()} of {parsed.layout.data_nbytes} bytes present"
        )
    for i, (want, got) in enumerate(zip(parsed.digests, tensor_digests(parsed.layout, data), strict=True)):
        if not digests_equal(want, got):
            raise IntegrityError(f"tensor {i} digest mismatch")

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
from gemscout.files import parse_json
from gemscout.state import integrity
from gemscout.state.digest import DIGEST_SIZE, digest_bytes, digests_equal

MAGIC = b"GEMSCK01"
MAGIC_KEYED = b"GEMSCKK1"
"""The magic of a frame whose header digest is keyed (see :mod:`gemscout.state.integrity`)."""
ALIGN = 64
_PREFIX = struct.Struct("<8sQ")

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.bool,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
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
            out.append(
                raw.view(_DTYPES[e.dtype]).view(e.shape)
                if e.nbytes
                else torch.empty(e.shape, dtype=_DTYPES[e.dtype])
            )
        return out


def tensor_digests(layout: Layout, data: torch.Tensor) -> list[str]:
    """Digest of every tensor's bytes in ``data``; reads the data, never the live tensors."""
    arr = data.numpy()
    return [digest_bytes(arr[e.offset : e.offset + e.nbytes].data) for e in layout.entries]


def build_header(
    layout: Layout, digests: list[str], skeleton: Any, identity: dict[str, Any]
) -> bytes:
    """Serialize the header JSON for a data region with the given per-tensor digests."""
    doc = {
        "format": 1,
        "identity": identity,
        "skeleton": skeleton,
        "data_nbytes": layout.data_nbytes,
        "tensors": [
            {
                "dtype": e.dtype,
                "shape": list(e.shape),
                "offset": e.offset,
                "nbytes": e.nbytes,
                "digest": d,
            }
            for e, d in zip(layout.entries, digests, strict=True)
        ],
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()


def frame_prefix(header: bytes) -> bytes:
    """Everything that precedes the data region: magic, header length, header, header digest, padding. With the
    job's integrity key (:mod:`gemscout.state.integrity`) the digest is a keyed BLAKE3 MAC and the magic
    :data:`MAGIC_KEYED`."""
    key = integrity.current_key()
    mac = digest_bytes(header) if key is None else integrity.keyed_digest(header, key)
    head = (
        _PREFIX.pack(MAGIC if key is None else MAGIC_KEYED, len(header))
        + header
        + bytes.fromhex(mac)
    )
    return head + b"\0" * (align(len(head)) - len(head))


@dataclass(frozen=True, slots=True)
class Parsed:
    """A verified header: identity, skeleton, layout and digests, plus where the data region starts."""

    identity: dict[str, Any]
    skeleton: Any
    layout: Layout
    digests: tuple[str, ...]
    data_offset: int


MAX_HEADER_BYTES = 256 << 20
"""Largest header a reader accepts (~1.5 M tensor entries); a larger length field is refused before it is read."""
MAX_DIMS = 64
MAX_SKELETON_DEPTH = 64
"""Deeper than any training state's skeleton; decoding a deeper one would end in RecursionError."""
_HEX64 = frozenset("0123456789abcdef")
_MARKERS = ("__t__", "__np__", "__tuple__", "__dict__", "__dt__")


def parse_prefix(buf: memoryview | bytes) -> Parsed:
    """Parse and verify the header at the start of ``buf``: magic, header digest, then the structure of the header
    (:func:`check_header`), so a header forged with recomputed digests but an impossible layout is refused here,
    not decoded. Raises IntegrityError on any mismatch, never another error."""
    if len(buf) < _PREFIX.size:
        raise IntegrityError("checkpoint is truncated before its header")
    magic, hlen = _PREFIX.unpack_from(buf, 0)
    if magic not in (MAGIC, MAGIC_KEYED):
        raise IntegrityError("not a gemscout checkpoint (bad magic)")
    key = integrity.current_key()
    if key is not None and magic != MAGIC_KEYED:
        raise IntegrityError(
            "checkpoint is not authenticated, but this job has an integrity key: refused (written "
            "by a job without the key, or forged)"
        )
    if key is None and magic == MAGIC_KEYED:
        raise IntegrityError(
            f"checkpoint is authenticated with an integrity key this process does not have; set "
            f"{integrity.ENV_KEY_FILE} or {integrity.ENV_KEY} (or CheckpointConfig.integrity_key)"
        )
    if hlen > MAX_HEADER_BYTES:
        raise IntegrityError(f"header length {hlen} is over the {MAX_HEADER_BYTES}-byte cap")
    end = _PREFIX.size + hlen
    if len(buf) < end + DIGEST_SIZE:
        raise IntegrityError("checkpoint is truncated inside its header")
    header = bytes(buf[_PREFIX.size : end])
    stored = bytes(buf[end : end + DIGEST_SIZE]).hex()
    if not digests_equal(
        stored, digest_bytes(header) if key is None else integrity.keyed_digest(header, key)
    ):
        raise IntegrityError(
            "header digest mismatch"
            if key is None
            else "header MAC mismatch: not written with this job's integrity key (forged or another job)"
        )
    doc = parse_json(header, "checkpoint header", max_depth=MAX_SKELETON_DEPTH + 4, allow_nan=True)
    layout, digests = check_header(doc)
    return Parsed(doc["identity"], doc["skeleton"], layout, digests, align(end + DIGEST_SIZE))


def _refuse(why: str) -> IntegrityError:
    return IntegrityError(f"header is malformed: {why}")


def _is_int(v: Any, minimum: int = 0) -> bool:
    return type(v) is int and v >= minimum


def check_header(doc: Any) -> tuple[Layout, tuple[str, ...]]:
    """Check a parsed header's structure and return its layout and digests. The layout must be exactly the one
    :meth:`Layout.of` builds for the entries' dtypes and shapes (offsets in order, 64-byte aligned, no overlap and
    no gap, ``nbytes = numel × itemsize``, ``data_nbytes`` the aligned end), every dtype known, every shape a list of
    non-negative ints, every digest 64 hex digits; the identity a flat object whose ``step`` / ``owner`` are
    non-negative ints; the skeleton the codec's (:func:`check_skeleton`). Raises IntegrityError."""
    if not isinstance(doc, dict):
        raise _refuse("not a JSON object")
    if doc.get("format") != 1:
        raise _refuse(f"format {doc.get('format')!r} is not 1")
    identity, tensors, data_nbytes = doc.get("identity"), doc.get("tensors"), doc.get("data_nbytes")
    if not isinstance(identity, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str | int | float))
        for k, v in identity.items()
    ):
        raise _refuse("identity is not an object of scalars")
    for key in ("step", "owner"):
        if key in identity and not _is_int(identity[key]):
            raise _refuse(f"identity {key} {identity[key]!r} is not a non-negative integer")
    if not isinstance(tensors, list):
        raise _refuse("tensors is not a list")
    if not _is_int(data_nbytes):
        raise _refuse(f"data_nbytes {data_nbytes!r} is not a non-negative integer")
    entries, digests, offset = [], [], 0
    for i, t in enumerate(tensors):
        if not isinstance(t, dict):
            raise _refuse(f"tensor {i} is not an object")
        dtype, shape, off, nbytes, digest = (
            t.get(k) for k in ("dtype", "shape", "offset", "nbytes", "digest")
        )
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise _refuse(f"tensor {i} has an unknown dtype {dtype!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(_is_int(d) for d in shape)
        ):
            raise _refuse(f"tensor {i} shape {shape!r} is not a list of non-negative integers")
        numel = 1
        for d in shape:
            numel *= d
        if not _is_int(nbytes) or nbytes != numel * _DTYPES[dtype].itemsize:
            raise _refuse(
                f"tensor {i} nbytes {nbytes!r} is not numel × itemsize ({numel} × {_DTYPES[dtype].itemsize})"
            )
        if not _is_int(off) or off != offset:
            raise _refuse(
                f"tensor {i} offset {off!r} is not {offset} (aligned, after the previous tensor)"
            )
        if (
            not isinstance(digest, str)
            or len(digest) != 2 * DIGEST_SIZE
            or not set(digest) <= _HEX64
        ):
            raise _refuse(f"tensor {i} digest is not {2 * DIGEST_SIZE} hex digits")
        entries.append(TensorEntry(dtype, tuple(shape), off, nbytes))
        digests.append(digest)
        offset = align(off + nbytes)
    if data_nbytes != offset:
        raise _refuse(
            f"data_nbytes {data_nbytes} is not the aligned end of the last tensor ({offset})"
        )
    check_skeleton(doc.get("skeleton"), len(entries))
    return Layout(tuple(entries), data_nbytes), tuple(digests)


def check_skeleton(skeleton: Any, n_tensors: int) -> None:
    """Check that ``skeleton`` is what :func:`gemscout.state.codec.encode` writes for ``n_tensors`` tensors: every
    marker well formed (``__t__`` / ``__np__`` an index, ``__dt__`` ``[index, shape, stride]``, ``__tuple__`` a
    list, ``__dict__`` a list of ``[scalar key, value]`` pairs), no tensor index out of range or referenced twice, nesting
    at most :data:`MAX_SKELETON_DEPTH`. Iterative. Raises IntegrityError."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(skeleton, 0)]

    def claim(index: Any) -> None:
        if not _is_int(index) or index >= n_tensors or index in seen:
            raise _refuse(
                f"skeleton references tensor {index!r} twice or outside 0..{n_tensors - 1}"
            )
        seen.add(index)

    while stack:
        node, depth = stack.pop()
        if depth > MAX_SKELETON_DEPTH:
            raise _refuse(f"skeleton is nested deeper than {MAX_SKELETON_DEPTH} levels")
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        if len(node) == 1 and next(iter(node)) in _MARKERS:
            ((key, value),) = node.items()
            if key in ("__t__", "__np__"):
                claim(value)
            elif key == "__dt__":
                if not (
                    isinstance(value, list)
                    and len(value) == 3
                    and all(isinstance(v, list) and all(_is_int(d) for d in v) for v in value[1:])
                ):
                    raise _refuse("a sharded tensor marker is not [index, shape, stride]")
                claim(value[0])
            elif key == "__tuple__":
                if not isinstance(value, list):
                    raise _refuse("a tuple marker does not hold a list")
                stack.append((value, depth + 1))
            else:
                if not isinstance(value, list) or not all(
                    isinstance(p, list) and len(p) == 2 and isinstance(p[0], str | int | float)
                    for p in value
                ):
                    raise _refuse("a dict marker does not hold [key, value] pairs")
                stack.extend((p[1], depth + 1) for p in value)
            continue
        stack.extend((v, depth + 1) for v in node.values())


def verify_data(parsed: Parsed, data: torch.Tensor) -> None:
    """Check every tensor digest over ``data`` (the data region). Raises IntegrityError naming the first mismatch."""
    if data.numel() < parsed.layout.data_nbytes:
        raise IntegrityError(
            f"data region is truncated: {data.numel()} of {parsed.layout.data_nbytes} bytes present"
        )
    for i, (want, got) in enumerate(
        zip(parsed.digests, tensor_digests(parsed.layout, data), strict=True)
    ):
        if not digests_equal(want, got):
            raise IntegrityError(f"tensor {i} digest mismatch")

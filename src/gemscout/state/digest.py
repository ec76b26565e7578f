"""Integrity digests for checkpoint buffers.

BLAKE3 (the maintained ``blake3`` package) rather than SHA-256: measured on this machine class, hashlib SHA-256
runs ~0.7 GB/s per core — slower than the copy it protects — while BLAKE3 runs several GB/s on one core. This digest
guards against corruption and torn writes on the checkpoint tier; evidence bundles use SHA-256 (see the harness).
"""

from __future__ import annotations

import hmac

from blake3 import blake3

ALGORITHM = "blake3"
DIGEST_SIZE = 32


def digest_bytes(data: bytes | memoryview) -> str:
    """Hex BLAKE3-256 of ``data``; large inputs are hashed without holding the GIL."""
    return blake3(data, max_threads=1).hexdigest()


def digests_equal(a: str, b: str) -> bool:
    """Constant-time comparison of two hex digests."""
    return hmac.compare_digest(a.encode(), b.encode())

"""The job's integrity key: authenticated checkpoints, off unless a key is given.

Without a key, digests guard against corruption (bit flips, torn writes, truncation), not against a forger: anyone
who can write the checkpoint folder or reach the replication group can recompute them. With a key, every frame's
header digest is a BLAKE3 *keyed* hash (a MAC) under the job key, and the header lists every tensor's digest, so
the MAC covers the whole frame — own files, held replicas on disk, replicas in memory and on the wire (their prefix
is the file's). Keyed frames carry their own magic (``GEMSCKK1``): a reader with a key refuses an unkeyed frame (a
forger would simply leave the MAC out) and a reader without one refuses a keyed frame naming the setting it needs.
A durable promotion's sidecar then carries an HMAC-SHA256 of its content under the same key.

The key comes from, first match: :func:`use_key` (``CheckpointConfig(integrity_key=...)`` calls it), the file named
by ``GEMSCOUT_INTEGRITY_KEY_FILE``, or ``GEMSCOUT_INTEGRITY_KEY`` (hex). Any length of at least 16 bytes; it is
stretched to BLAKE3's 32-byte key by BLAKE3's key derivation, so the raw secret is never used directly. The key is
per process, like the job's identity; every rank and ``gemscout inspect`` must use the same one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from pathlib import Path

from blake3 import blake3

from gemscout.errors import ConfigError

ENV_KEY, ENV_KEY_FILE = "GEMSCOUT_INTEGRITY_KEY", "GEMSCOUT_INTEGRITY_KEY_FILE"
_CONTEXT = "gemscout checkpoint integrity 2026-12 v1"
MIN_KEY_BYTES = 16

_lock = threading.Lock()
_explicit: bytes | None = None
_explicit_set = False


def derive(raw: bytes) -> bytes:
    """The 32-byte BLAKE3 key for secret ``raw`` (refused as ConfigError if shorter than 16 bytes)."""
    if len(raw) < MIN_KEY_BYTES:
        raise ConfigError(
            f"integrity key: must be at least {MIN_KEY_BYTES} bytes, got {len(raw)}; use e.g. `openssl rand -hex 32`"
        )
    return blake3(raw, derive_key_context=_CONTEXT).digest()


def use_key(raw: bytes | str | None) -> None:
    """Set this process's key (``bytes``, or a ``str`` of hex digits); None falls back to the environment."""
    global _explicit, _explicit_set
    if isinstance(raw, str):
        try:
            raw = bytes.fromhex(raw.strip())
        except ValueError:
            raise ConfigError(
                "CheckpointConfig.integrity_key: give bytes or a hex string"
            ) from None
    with _lock:
        _explicit, _explicit_set = (derive(raw), True) if raw is not None else (None, False)


def current_key() -> bytes | None:
    """The derived key in force, or None (unkeyed). Reads the environment each call unless :func:`use_key` set
    one, so ``gemscout inspect`` and a test's env take effect without a restart."""
    with _lock:
        if _explicit_set:
            return _explicit
    path = os.environ.get(ENV_KEY_FILE)
    if path:
        try:
            raw = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                f"{ENV_KEY_FILE}={path}: cannot read the key file ({exc.strerror})"
            ) from None
        return derive(raw)
    text = os.environ.get(ENV_KEY)
    if text:
        try:
            return derive(bytes.fromhex(text.strip()))
        except ValueError:
            raise ConfigError(
                f"{ENV_KEY} must be hex digits (e.g. `openssl rand -hex 32`)"
            ) from None
    return None


def keyed_digest(data: bytes, key: bytes) -> str:
    """Hex BLAKE3 keyed hash (a MAC) of ``data``."""
    return blake3(data, key=key).hexdigest()


def sidecar_mac(canonical: bytes, key: bytes) -> str:
    """HMAC-SHA256 of a sidecar's canonical JSON (the durable tier's files are SHA-256 already)."""
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()

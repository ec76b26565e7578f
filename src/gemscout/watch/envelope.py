"""The out-of-band message format: a sealed, MACed JSON envelope bound to one slot of one run.

An envelope is ``<HMAC-SHA256 hex>\\n<body>``. The body is JSON with the protocol version, namespace, epoch, rank,
key, sequence number and the payload sealed with a BLAKE3 keyed-mode keystream (a random nonce per message) under a
key derived from the secret, so a reader of the store learns nothing of it. The MAC covers the whole body and is
checked, in constant time, before anything in it is trusted (encrypt-then-MAC).

:class:`Envelope` only builds and opens messages; which sequence numbers a reader has seen, and what a rejection
means for the job, belong to :class:`~gemscout.watch.channel.OobChannel`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

import blake3

TamperKind = Literal[
    "forged", "replayed", "deleted", "oversized", "foreign_keys", "store_lost", "store_restored"
]

VERSION = 2
_MAC_DOMAIN = (
    b"gemscout-oob-v2\n"  # binds the MAC to this protocol version, not just to the body bytes
)
_SEAL_DOMAIN = b"gemscout-oob-v2 payload sealing key"
_NONCE_BYTES = (
    16  # random per message: a repeat would reuse a keystream; 2**-64 odds at 2**32 messages
)
# A progress record nests 4 deep; a deeper body is hostile or broken, refused before parsing.
MAX_JSON_DEPTH = 32


class Envelope:
    """Builds and opens the messages of one run (``namespace``, ``epoch``) under one secret."""

    def __init__(self, secret: bytes, *, namespace: str, epoch: str, max_bytes: int) -> None:
        self._secret = secret
        # A key of its own for sealing payloads, so the MAC key is never also a cipher key.
        self._seal_key = hmac.new(secret, _SEAL_DOMAIN, hashlib.sha256).digest()
        self._namespace = namespace
        self._epoch = epoch
        self._max_bytes = max_bytes

    def pack(self, rank: int, key: str, seq: int, payload: Mapping[str, Any]) -> str:
        """The message for ``rank``'s slot ``key``. Raises ``ValueError`` for a payload that is not finite JSON or
        whose message would be above ``max_bytes``."""
        plain = json.dumps(dict(payload), sort_keys=True, separators=(",", ":"), allow_nan=False)
        body = json.dumps(
            {
                "v": VERSION,
                "ns": self._namespace,
                "epoch": self._epoch,
                "rank": rank,
                "key": key,
                "seq": seq,
                "sealed": self._seal(plain.encode("utf-8")),
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        message = f"{self._mac(body.encode('utf-8'))}\n{body}"
        if len(message) > self._max_bytes:
            raise ValueError(
                f"OOB message for {key!r} is {len(message)} bytes, above max_message_bytes"
            )
        return message

    def open(
        self, rank: int, key: str, raw: bytes
    ) -> tuple[int, dict[str, Any]] | tuple[TamperKind, str]:
        """``(seq, payload)`` of an authentic envelope that belongs in ``rank``'s slot ``key``, or
        ``(tamper kind, reason)``. Never raises on any input."""
        if len(raw) > self._max_bytes:
            return (
                "oversized",
                f"message of {len(raw)} bytes is above max_message_bytes={self._max_bytes}",
            )
        mac_hex, sep, body = raw.partition(b"\n")
        if not sep:
            return "forged", "malformed envelope"
        if not hmac.compare_digest(self._mac(body).encode("ascii"), mac_hex):
            return "forged", "bad HMAC"
        # Authentic from here on (someone holds the secret): still parse defensively, a bug must not crash a reader.
        if json_depth(body) > MAX_JSON_DEPTH:
            return "forged", "body nests too deep"
        try:
            decoded = json.loads(body)
        except (ValueError, RecursionError):
            return "forged", "body is not JSON"
        if (
            not isinstance(decoded, dict)
            or decoded.get("v") != VERSION
            or decoded.get("ns") != self._namespace
        ):
            return "forged", "envelope of another protocol version or namespace"
        if decoded.get("epoch") != self._epoch:
            return (
                "replayed",
                f"message of epoch {str(decoded.get('epoch'))[:64]!r}, not this run's {self._epoch!r}",
            )
        if (
            decoded.get("rank") != rank
            or decoded.get("key") != key
            or type(decoded.get("seq")) is not int
        ):
            return "forged", "envelope does not match its slot"
        plain = self._unseal(decoded.get("sealed"))
        if plain is None or json_depth(plain) > MAX_JSON_DEPTH:
            return "forged", "sealed payload does not open"
        try:
            payload = json.loads(plain)
        except (ValueError, RecursionError):
            return "forged", "sealed payload is not JSON"
        if not isinstance(payload, dict):
            return "forged", "sealed payload is not an object"
        return decoded["seq"], payload

    def _seal(self, plain: bytes) -> str:
        # Confidentiality without a cipher library: the payload is XORed with a keystream that BLAKE3 in keyed mode
        # (a PRF with extendable output) derives from a random nonce. Integrity and authenticity come from the HMAC
        # over the whole body, checked before anything is unsealed.
        nonce = os.urandom(_NONCE_BYTES)
        sealed = _xor(plain, self._keystream(nonce, len(plain)))
        return base64.b64encode(nonce + sealed).decode("ascii")

    def _unseal(self, sealed: object) -> bytes | None:
        if not isinstance(sealed, str):
            return None
        try:
            raw = base64.b64decode(sealed, validate=True)
        except ValueError:
            return None
        if len(raw) <= _NONCE_BYTES:
            return None
        nonce, body = raw[:_NONCE_BYTES], raw[_NONCE_BYTES:]
        return _xor(body, self._keystream(nonce, len(body)))

    def _keystream(self, nonce: bytes, length: int) -> bytes:
        return blake3.blake3(nonce, key=self._seal_key).digest(length=length)

    def _mac(self, body: bytes) -> str:
        return hmac.new(self._secret, _MAC_DOMAIN + body, hashlib.sha256).hexdigest()


def _xor(data: bytes, stream: bytes) -> bytes:
    mixed = int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")
    return mixed.to_bytes(len(data), "little")


def json_depth(body: bytes) -> int:
    """The deepest bracket nesting of a JSON text (strings skipped), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest

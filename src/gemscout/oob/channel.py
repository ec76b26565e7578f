"""The out-of-band channel: authenticated JSON messages over a key-value store (a torch ``TCPStore``).

Every rank owns one slot per key, ``<namespace>/<rank>/<key>``, and overwrites it with its newest message. A message
is an envelope: the body (JSON with version, rank, key, sequence number and payload) and an HMAC-SHA256 of that body
under the per-job secret. Readers verify the MAC in constant time, check that rank and key in the body match the slot
(so a valid message cannot be moved to another rank's slot), and refuse a sequence number older than the last one they
accepted from that slot (a replay). A rejected message is logged, counted in :attr:`OobChannel.stats`, and never
returned, so nothing downstream can act on it.

The secret comes from the launcher (:attr:`OobConfig.secret` or ``GEMSCOUT_OOB_SECRET``; see
:mod:`gemscout.oob.secret` for why it is never sent through the store). Without one the channel refuses to start,
unless ``insecure_dev=True``, which uses a fixed public key: messages are still checked for shape and replay, but
anyone can forge them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from torch.distributed import DistStoreError

from gemscout.oob.config import OobConfig
from gemscout.oob.secret import resolve_secret

logger = logging.getLogger(__name__)

_MAC_DOMAIN = b"gemscout-oob-v1\n"  # binds the MAC to this protocol version, not just to the body bytes
_VERSION = 1


@runtime_checkable
class OobStore(Protocol):
    """The slice of ``torch.distributed.Store`` the channel uses; ``TCPStore`` and ``HashStore`` satisfy it."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


@dataclass(kw_only=True, slots=True, frozen=True)
class ChannelStats:
    """Counters of one channel object since it was made."""

    published: int
    accepted: int
    forged: int
    """Distinct messages rejected for a bad MAC, a malformed envelope, or a rank/key that does not match their slot."""
    replayed: int
    """Distinct authentic messages rejected because their sequence number is older than one already accepted."""


class OobChannel:
    """Authenticated publish/read of small JSON payloads, one slot per (rank, key).

    Thread-safe: the progress publisher and a watchdog may share one channel object.
    """

    def __init__(self, store: OobStore, *, config: OobConfig) -> None:
        self._store = store
        self._config = config
        self._secret = resolve_secret(config.secret, insecure_dev=config.insecure_dev)
        self._lock = threading.Lock()
        # Wall-clock microseconds as the starting sequence number keeps it increasing across a restart of this rank,
        # so readers that remember the previous incarnation's numbers do not take the new messages for replays.
        self._next_seq = time.time_ns() // 1000
        self._last_seen: dict[tuple[int, str], int] = {}
        self._last_rejected: dict[tuple[int, str], bytes] = {}
        self._published = self._accepted = self._forged = self._replayed = 0

    @classmethod
    def connect(
        cls,
        *,
        host: str,
        port: int,
        config: OobConfig,
        is_master: bool = False,
        timeout: timedelta = timedelta(seconds=30),
    ) -> OobChannel:
        """Open a ``TCPStore`` at ``host:port`` (serving it when ``is_master``) and wrap it.

        Blocks until the store answers or ``timeout`` passes; raises ``torch.distributed.DistStoreError`` then.
        """
        from torch.distributed import TCPStore

        store = TCPStore(host, port, is_master=is_master, wait_for_workers=False, timeout=timeout)
        return cls(store, config=config)

    @property
    def rank(self) -> int | None:
        return self._config.rank

    @property
    def store(self) -> OobStore:
        return self._store

    @property
    def stats(self) -> ChannelStats:
        with self._lock:
            return ChannelStats(
                published=self._published, accepted=self._accepted, forged=self._forged, replayed=self._replayed
            )

    def slot(self, rank: int, key: str) -> str:
        """The store key that holds ``rank``'s newest message under ``key``."""
        return f"{self._config.namespace}/{rank}/{key}"

    def publish(self, key: str, payload: Mapping[str, Any]) -> int:
        """Sign ``payload`` and overwrite this rank's slot for ``key``; return the sequence number used.

        Blocks on one store round trip (bounded by the store's own timeout). Raises ``ValueError`` for an observer
        channel, a key with ``/``, or a payload that is not finite JSON or is too large.
        """
        rank = self._config.rank
        if rank is None:
            raise ValueError("an observer channel (rank=None) cannot publish")
        if not key or "/" in key:
            raise ValueError(f"key must be non-empty without '/', got {key!r}")
        with self._lock:
            seq = max(self._next_seq, time.time_ns() // 1000)
            self._next_seq = seq + 1
        body = json.dumps(
            {"v": _VERSION, "rank": rank, "key": key, "seq": seq, "payload": dict(payload)},
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        )
        message = f"{self._mac(body.encode('utf-8'))}\n{body}"
        if len(message) > self._config.max_message_bytes:
            raise ValueError(f"OOB message for {key!r} is {len(message)} bytes, above max_message_bytes")
        self._store.set(self.slot(rank, key), message)
        with self._lock:
            self._published += 1
        return seq

    def read(self, rank: int, key: str, timeout: timedelta = timedelta(0)) -> dict[str, Any] | None:
        """``rank``'s newest authentic payload under ``key``, or ``None``.

        Waits up to ``timeout`` for the slot to exist (zero: look once, never block). ``None`` means absent, or
        rejected (forged, malformed, or replayed); rejections are logged and counted, never raised. A waiting read
        occupies the store connection; long waits belong on their own connection (``TCPStore.clone()``).
        """
        slot = self.slot(rank, key)
        if timeout <= timedelta(0):
            if not self._store.check([slot]):
                return None
        else:
            try:
                self._store.wait([slot], timeout)
            except DistStoreError:  # the wait timed out; network failures still raise
                return None
        return self._verify(rank, key, self._store.get(slot))

    def read_many(self, ranks: Iterable[int], key: str) -> dict[int, dict[str, Any]]:
        """The newest authentic payload under ``key`` of each of ``ranks`` that has one. Never blocks on absence."""
        found: dict[int, dict[str, Any]] = {}
        for rank in ranks:
            payload = self.read(rank, key)
            if payload is not None:
                found[rank] = payload
        return found

    def _mac(self, body: bytes) -> str:
        return hmac.new(self._secret, _MAC_DOMAIN + body, hashlib.sha256).hexdigest()

    def _verify(self, rank: int, key: str, raw: bytes) -> dict[str, Any] | None:
        opened = self._open(rank, key, raw)
        if isinstance(opened, str):
            self._reject(rank, key, raw, opened, replay=False)
            return None
        seq, payload = opened
        with self._lock:
            last = self._last_seen.get((rank, key))
            # Equal is the same message read again (the writer has not published since); only older is a replay.
            replayed = last is not None and seq < last
            if not replayed:
                self._last_seen[(rank, key)] = seq
                self._accepted += 1
        if replayed:
            self._reject(rank, key, raw, f"replayed sequence number {seq} < {last}", replay=True)
            return None
        return payload

    def _open(self, rank: int, key: str, raw: bytes) -> tuple[int, dict[str, Any]] | str:
        """``(seq, payload)`` of an authentic envelope that belongs in this slot, or the reason it is not one."""
        if len(raw) > self._config.max_message_bytes:
            return "message too large"
        mac_hex, sep, body = raw.partition(b"\n")
        if not sep:
            return "malformed envelope"
        if not hmac.compare_digest(self._mac(body).encode("ascii"), mac_hex):
            return "bad HMAC"
        try:
            decoded = json.loads(body)
        except ValueError:
            return "body is not JSON"
        if (
            not isinstance(decoded, dict)
            or decoded.get("v") != _VERSION
            or decoded.get("rank") != rank
            or decoded.get("key") != key
            or type(decoded.get("seq")) is not int
            or not isinstance(decoded.get("payload"), dict)
        ):
            return "envelope does not match its slot"
        return decoded["seq"], decoded["payload"]

    def _reject(self, rank: int, key: str, raw: bytes, why: str, *, replay: bool) -> None:
        with self._lock:
            # Polling re-reads the same bad value many times: count and warn once per distinct rejected message.
            repeated = self._last_rejected.get((rank, key)) == raw
            self._last_rejected[(rank, key)] = raw
            if not repeated and replay:
                self._replayed += 1
            elif not repeated:
                self._forged += 1
        if not repeated:
            logger.warning("rejected OOB message in slot %s: %s", self.slot(rank, key), why)
        return None

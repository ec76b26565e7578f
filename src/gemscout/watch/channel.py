"""The out-of-band channel: authenticated JSON messages over a key-value store (a torch ``TCPStore``).

Every rank owns one slot per key, ``<namespace>/<rank>/<key>``, and overwrites it with its newest message, an
:class:`~gemscout.watch.envelope.Envelope` (sealed payload, HMAC-SHA256 under the per-job secret). Readers verify the
MAC in constant time, check that namespace, epoch, rank and key in the body match the slot (so a valid message cannot be moved to another rank's slot, another
namespace, or replayed from an earlier run of the job under the same secret), and refuse a sequence number older than
the last one they accepted from that slot (a replay within the run). A rejected message is logged, counted in
:attr:`OobChannel.stats`, never returned, and recorded as a :class:`~gemscout.watch.tamper.TamperEvent` naming the
slot — as is a slot that held an authentic message and then vanished (someone deleted it); the channel's
:class:`~gemscout.watch.tamper.TamperLedger` keeps that bookkeeping. Nothing downstream can act on a rejected message.

A ``TCPStore`` has no authentication: anyone who reaches its port can read, write and delete keys. So the server is
bound to one address (the job's own address, loopback for a local job) instead of every interface. The ``TCPStore``
server has no size or key cap: the watch serves it from a child process with a memory cap of its own
(:mod:`gemscout.watch.store_server`), never inside training; :func:`~gemscout.watch.bound_store.serve_store` serves
one in this process (tests, experiments). :meth:`OobChannel.sweep` deletes keys that are not the job's slots
(leftovers; it cannot bound memory: one writer floods faster than a reader lists and deletes). A client connection the server dropped (it refuses a message
past its cap by closing the connection) is replaced once per operation when the channel was made by
:meth:`OobChannel.connect`.

The secret comes from the launcher (:attr:`OobConfig.secret` or ``GEMSCOUT_OOB_SECRET``; see
:mod:`gemscout.watch.secret` for why it is never sent through the store). Without one the channel refuses to start,
unless ``insecure_dev=True``, which uses a fixed public key: messages are still checked for shape and replay, but
anyone can forge them.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch.distributed import DistNetworkError, DistStoreError

from gemscout.watch.bound_store import serve_store
from gemscout.watch.config import OobConfig
from gemscout.watch.envelope import Envelope, TamperKind
from gemscout.watch.secret import resolve_secret
from gemscout.watch.tamper import ChannelStats, TamperEvent, TamperLedger
from gemscout.watch.wire import BoundedReader, Oversized

logger = logging.getLogger(__name__)

_GET_TIMEOUT = timedelta(milliseconds=500)
_RECONNECT_TIMEOUT = timedelta(
    seconds=3
)  # a store that is gone refuses at once; a busy one answers within this
_RECONNECT_BACKOFF_S = (
    2.0  # after a failed reconnect, fail fast for this long instead of waiting on each call
)

_T = TypeVar("_T")


@runtime_checkable
class OobStore(Protocol):
    """The slice of ``torch.distributed.Store`` the channel uses; ``TCPStore`` and ``HashStore`` satisfy it."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


class OobChannel:
    """Authenticated publish/read of small JSON payloads, one slot per (rank, key).

    Thread-safe: the progress publisher and a watchdog may share one channel object.
    """

    def __init__(
        self,
        store: OobStore,
        *,
        config: OobConfig,
        reconnect: Callable[[], OobStore] | None = None,
        bounded: BoundedReader | None = None,
    ) -> None:
        """``reconnect``: makes a fresh connection to the same store, used once per operation when the server
        dropped this one (``DistNetworkError``); ``None``: such an error is raised. ``bounded``: a reader of the
        same store that learns a value's length before its bytes (:mod:`gemscout.watch.wire`); with it, a slot
        holding more than ``max_message_bytes`` is refused without being read into this process
        (:meth:`connect` always makes one)."""
        self._store = store
        self._bounded = bounded
        self._config = config
        self._reconnect = reconnect
        self._reconnect_lock = threading.Lock()
        self._reconnect_failed_at: float | None = None
        self._envelope = Envelope(
            resolve_secret(config.secret, insecure_dev=config.insecure_dev),
            namespace=config.namespace,
            epoch=config.epoch,
            max_bytes=config.max_message_bytes,
        )
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()  # serializes reads that change the store's timeout
        # Wall-clock microseconds as the starting sequence number keeps it increasing across a restart of this rank,
        # so readers that remember the previous incarnation's numbers do not take the new messages for replays.
        self._next_seq = time.time_ns() // 1000
        self._published = 0
        # What the reads found in each slot: accepted sequence numbers, presence, rejections, tamper events.
        self._ledger = TamperLedger(self.slot)

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

        if is_master:
            served = serve_store(host, port, timeout=timeout)
            return cls(served, config=config, bounded=_bounded_reader(host, served.port))
        store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)

        def reconnect() -> OobStore:
            # TCPStore's client retries a refused connection until its timeout: ask the kernel first, so a store that
            # is gone fails the call at once instead of holding the publisher for seconds on every attempt.
            socket.create_connection(
                (host, port), timeout=_RECONNECT_TIMEOUT.total_seconds()
            ).close()
            fresh = TCPStore(
                host, port, is_master=False, wait_for_workers=False, timeout=_RECONNECT_TIMEOUT
            )
            fresh.set_timeout(timeout)
            return fresh

        return cls(store, config=config, reconnect=reconnect, bounded=_bounded_reader(host, port))

    @property
    def rank(self) -> int | None:
        return self._config.rank

    @property
    def store(self) -> OobStore:
        return self._store

    @property
    def stats(self) -> ChannelStats:
        with self._lock:
            published = self._published
        return self._ledger.stats(published=published)

    def tamper_events(self) -> list[TamperEvent]:
        """Every slot that showed tampering so far (newest state of each), in first-seen order."""
        return self._ledger.events()

    def tampered_since(self, rank: int, key: str, since: float) -> TamperEvent | None:
        """The tamper event of ``rank``'s slot ``key`` if its newest occurrence is at or after ``since`` (monotonic)."""
        return self._ledger.tampered_since(rank, key, since)

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
        message = self._envelope.pack(rank, key, seq, payload)
        slot = self.slot(rank, key)
        self._io(lambda store: store.set(slot, message))
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
        if timeout <= timedelta(0) and self._bounded is not None:
            return self._read_bounded(rank, key, self._bounded)
        if timeout <= timedelta(0):
            present = self._io(lambda store: store.check([slot]))
        else:
            try:
                self._io(lambda store: store.wait([slot], timeout))
                present = True
            except DistStoreError:  # the wait timed out; network failures still raise
                present = False
        raw = self._get_nowait(slot) if present else None
        if raw is None:
            self._ledger.absent(rank, key)
            return None
        return self._verify(rank, key, raw)

    def _read_bounded(self, rank: int, key: str, reader: BoundedReader) -> dict[str, Any] | None:
        """:meth:`read` (no wait) through the length-first reader: an oversized value is refused before its bytes
        are read; a store that cannot be reached raises ``DistNetworkError`` as a ``TCPStore`` call would. A
        connection the server dropped (or a store process that was restarted) is made again once per read."""
        limit = self._config.max_message_bytes
        try:
            try:
                raw = reader.get(self.slot(rank, key), limit)
            except ConnectionError as dropped:
                logger.debug(
                    "OOB bounded read failed (%s); once more on a fresh connection", dropped
                )
                raw = reader.get(self.slot(rank, key), limit)
        except Oversized as big:
            self._ledger.seen(rank, key)
            why = f"message of {big.length} bytes is above max_message_bytes={limit} (not read)"
            self._reject(rank, key, f"oversized {big.length}".encode(), why, kind="oversized")
            return None
        except TimeoutError:  # deleted between the check and the get: the server waits for it
            raw = None
        except OSError as exc:
            raise DistNetworkError(f"the OOB store could not be read: {exc}") from exc
        if raw is None:
            self._ledger.absent(rank, key)
            return None
        return self._verify(rank, key, raw)

    def _get_nowait(self, slot: str) -> bytes | None:
        """The slot's value, or None when it is gone. A TCPStore ``get`` of a missing key waits for the store's
        whole timeout, so a key deleted between ``check`` and ``get`` (a deleter in a loop) would stall every read;
        the get runs under a short timeout instead."""

        def get(store: OobStore) -> bytes:
            set_timeout = getattr(store, "set_timeout", None)
            if set_timeout is None:
                return store.get(slot)
            with self._io_lock:
                previous = store.timeout  # type: ignore[attr-defined]
                set_timeout(_GET_TIMEOUT)
                try:
                    return store.get(slot)
                finally:
                    set_timeout(previous)

        try:
            return self._io(get)
        except DistStoreError:  # deleted between check and get
            return None

    def _io(self, operation: Callable[[OobStore], _T]) -> _T:
        """Run ``operation`` on the store; if the server dropped the connection, once more on a fresh one.

        After a failed reconnect the dropped connection is not used again: calls fail at once for
        ``_RECONNECT_BACKOFF_S`` (each use of a dead connection costs a send and a torch warning), then reconnect."""
        with self._reconnect_lock:
            store, failed_at = self._store, self._reconnect_failed_at
        if failed_at is not None:
            if time.monotonic() - failed_at < _RECONNECT_BACKOFF_S:
                raise DistNetworkError(
                    "the OOB store dropped this connection and could not be reached again"
                )
            return operation(self._replace(store))
        try:
            return operation(store)
        except DistNetworkError:
            if self._reconnect is None:
                raise
            return operation(self._replace(store))

    def _replace(self, dropped: OobStore) -> OobStore:
        """A fresh connection in place of ``dropped`` (or the one another thread made meanwhile)."""
        assert self._reconnect is not None
        with self._reconnect_lock:
            if self._store is dropped:
                try:
                    self._store = self._reconnect()
                except (OSError, DistNetworkError, DistStoreError) as exc:
                    self._reconnect_failed_at = time.monotonic()
                    raise DistNetworkError(
                        f"the OOB store dropped this connection; reconnecting failed: {exc}"
                    ) from exc
                logger.info("OOB store connection was dropped; reconnected")
            self._reconnect_failed_at = None
            return self._store

    def sweep(self, expected: Iterable[tuple[int, str]]) -> list[str]:
        """Delete every key of the store that is not one of the ``expected`` ``(rank, key)`` slots; return them.

        For a store this job owns (served by :func:`~gemscout.watch.bound_store.serve_store` for the OOB channel alone): nothing else belongs in
        it, so anything else is a flood or leftovers (:meth:`read` itself deletes a slot whose value is over
        ``max_message_bytes``: no genuine writer publishes one, and the owner republishes). A sweep that found keys
        records a ``foreign_keys`` :class:`TamperEvent`. A store without ``list_keys`` is left alone.
        """
        list_keys = getattr(self._store, "list_keys", None)
        delete_key = getattr(self._store, "delete_key", None)
        if list_keys is None or delete_key is None:
            return []
        keep = {self.slot(r, k) for r, k in expected}
        removed = [name for name in list_keys() if name not in keep]
        for name in removed:
            delete_key(name)
        if removed:
            self.note_foreign_keys(len(removed), sorted(removed)[:5])
        return removed

    def note_foreign_keys(self, count: int, sample: Iterable[str], *, detail: str = "") -> None:
        """Record that ``count`` keys that are not this job's slots were found and deleted (by :meth:`sweep`, or by
        the store process itself): a ``foreign_keys`` :class:`TamperEvent` for the store. ``detail`` adds to its
        reason."""
        self._ledger.foreign_keys(count, sample, detail=detail)

    def forget_presence(self) -> None:
        """Forget which slots held a message: after the store was unreadable (a restarted store process serves an
        empty store), a slot found absent is not one someone deleted. The sequence numbers accepted are kept, so an
        old message written into the fresh store is still refused as a replay."""
        self._ledger.forget_presence()

    def read_many(self, ranks: Iterable[int], key: str) -> dict[int, dict[str, Any]]:
        """The newest authentic payload under ``key`` of each of ``ranks`` that has one. Never blocks on absence."""
        found: dict[int, dict[str, Any]] = {}
        for rank in ranks:
            payload = self.read(rank, key)
            if payload is not None:
                found[rank] = payload
        return found

    def _verify(self, rank: int, key: str, raw: bytes) -> dict[str, Any] | None:
        self._ledger.seen(rank, key)
        opened = self._envelope.open(rank, key, raw)
        if isinstance(opened[0], str):
            kind, why = opened
            self._reject(rank, key, raw, str(why), kind=kind)  # type: ignore[arg-type]
            return None
        seq, payload = opened
        last = self._ledger.accept(rank, key, seq)
        if last is not None:
            self._reject(
                rank, key, raw, f"replayed sequence number {seq} < {last}", kind="replayed"
            )
            return None
        return payload  # type: ignore[return-value]

    def _reject(self, rank: int, key: str, raw: bytes, why: str, *, kind: TamperKind) -> None:
        self._ledger.reject(rank, key, raw, why, kind=kind)
        if kind == "oversized" and hasattr(self._store, "delete_key"):
            # No genuine writer publishes one (publish refuses): free the server's memory; the owner republishes.
            slot = self.slot(rank, key)
            self._io(lambda store: store.delete_key(slot))  # type: ignore[attr-defined]
            self._ledger.cleared(rank, key)


def _bounded_reader(host: str, port: int) -> BoundedReader:
    return BoundedReader(host, port, timeout_s=_GET_TIMEOUT.total_seconds())

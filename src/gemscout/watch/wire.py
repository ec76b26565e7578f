"""A reader of one ``TCPStore`` value that learns its length before it takes its bytes.

``TCPStore.get`` hands back the whole value, so a reader that refuses values over ``max_message_bytes`` would first
receive and hold whatever an outsider put in a slot — up to the store's memory cap, per read. This speaks just enough
of the store's wire protocol (torch's ``c10d`` TCPStore; ``QueryType`` in ``TCPStoreBackend.hpp``) to ask whether a
key exists and then read the value's 8-byte length, and closes the connection instead of reading a value that is over
the limit: the bytes stay in the server (whose memory the store process caps) and never reach this process.

Protocol, as the libuv server speaks it: on connect the client sends ``VALIDATE`` (a byte 0) and the magic
``0x3C85F7CE`` (uint32, little-endian); a string is a uint64 length and its bytes; ``CHECK`` (5) sends a count and
that many keys and is answered by one byte (0 ready, 1 not); ``GET`` (3) sends a key and is answered by a uint64
length and the value. The C++ client puts ``/`` before every key, so the server holds ``/<key>``.
"""

from __future__ import annotations

import socket
import struct
import threading

__all__ = ["BoundedReader", "Oversized"]

_VALIDATE, _GET, _CHECK = 0, 3, 5
_MAGIC = 0x3C85F7CE
_READY = 0
_KEY_PREFIX = b"/"


class Oversized(Exception):
    """The value is longer than the limit; it was not read."""

    def __init__(self, length: int) -> None:
        super().__init__(f"value of {length} bytes")
        self.length = length


class BoundedReader:
    """Reads values from the store at ``host:port`` over one connection of its own (made on first use and again
    after any failure). Thread-safe. Every call is bounded by ``timeout_s`` per socket operation."""

    def __init__(self, host: str, port: int, *, timeout_s: float) -> None:
        self._address = (host, port)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def get(self, key: str, limit: int) -> bytes | None:
        """The value of ``key``, or None when the key does not exist. Raises :class:`Oversized` (without reading the
        value) when it is longer than ``limit`` bytes, ``OSError`` when the store cannot be reached or answers
        nonsense; the connection is dropped after either and made again by the next call."""
        name = _KEY_PREFIX + key.encode()
        with self._lock:
            sock = self._connected()
            try:
                sock.sendall(struct.pack("<BQ", _CHECK, 1) + _string(name))
                if _recv_exact(sock, 1)[0] != _READY:
                    return None
                sock.sendall(struct.pack("<B", _GET) + _string(name))
                (length,) = struct.unpack("<Q", _recv_exact(sock, 8))
                if length > limit:
                    raise Oversized(length)
                return _recv_exact(sock, length)
            except BaseException:
                self._drop()
                raise

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection(self._address, timeout=self._timeout_s)
            try:
                sock.sendall(struct.pack("<BI", _VALIDATE, _MAGIC))
            except BaseException:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        chunk = sock.recv_into(view[got:], n - got)
        if chunk == 0:
            raise ConnectionResetError("the OOB store closed the connection mid-answer")
        got += chunk
    return bytes(buf)

"""The out-of-band store served from a small child process, so that what an outsider sends cannot grow training.

``TCPStore``'s server holds every key anyone sends and has no size or key cap; served inside rank 0's training process,
a flood of keys from anyone who reaches the port grows that process until the kernel kills it. A sweeper cannot bound
that: one client writes faster than another can list and delete. So rank 0 binds and listens on the job's address
itself (the port is known at once; clients queue in the backlog) and hands the listening descriptor to a child
process (:mod:`gemscout.watch._store_child`) that adopts it and caps its own memory (``RLIMIT_DATA``): past the cap the
store refuses the message that would grow it (the sending connection is dropped), and the training process holds
nothing of the store at all. The child sweeps foreign keys itself, at once while it keeps finding some, and exits when
its parent dies or :meth:`StoreServer.close` stops it. Its death is reported through :meth:`StoreServer.status`, which
the watchdog turns into a ``tamper`` finding (``store_lost``); training uses its own store and goes on.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Protocol

from gemscout.errors import ConfigError, GemscoutError

logger = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_store_child.py")
_TAIL_LINES = 20


def listen_socket(host: str, port: int) -> tuple[socket.socket, str]:
    """A socket bound to ``host``'s address only and listening, and that address (``host`` is resolved once).

    TCPStore's own server ignores the host name and listens on every interface, so whoever serves one makes the
    socket here and hands it over. Raises ``OSError`` when the address cannot be bound (not this host's)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address[:2] if family == socket.AF_INET else address)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock, str(address[0])


class StoreServerError(GemscoutError):
    """The store process could not be started (it exited, or did not become ready in time)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StoreServerConfig:
    """How the out-of-band store process runs."""

    memory_cap_bytes: int = 256 << 20
    """Memory the store process may add to what it holds after importing torch: keys, values, its server thread and
    its sweeps' copies. Past it, the message that would grow the store is refused and its connection dropped. A
    reserve above it (an eighth of it, at least 8 MiB) is for sweeps of a full store only. A job's own slots take
    ``world_size`` x at most ``OobConfig.max_message_bytes`` (256 KiB); the default leaves room for 1,000 ranks'
    worst case."""
    start_timeout: timedelta = timedelta(seconds=60)
    """How long :meth:`StoreServer.start` waits for the process to serve (it imports torch: seconds on a busy host)."""
    stop_timeout: timedelta = timedelta(seconds=5)
    """How long :meth:`StoreServer.close` waits after SIGTERM before SIGKILL."""
    sweep_interval: timedelta = timedelta(milliseconds=100)
    """Pause between two sweeps that found nothing (a sweep that found keys runs again at once)."""
    python: str = field(default_factory=lambda: sys.executable)
    """The interpreter that runs the store process (it must import torch)."""

    def __post_init__(self) -> None:
        if type(self.memory_cap_bytes) is not int or self.memory_cap_bytes < 16 << 20:
            raise ConfigError(
                f"StoreServerConfig.memory_cap_bytes must be an int >= 16 MiB, got {self.memory_cap_bytes!r}"
            )
        for name in ("start_timeout", "stop_timeout", "sweep_interval"):
            if getattr(self, name) <= timedelta(0):
                raise ConfigError(
                    f"StoreServerConfig.{name} must be > 0, got {getattr(self, name)}"
                )


@dataclass(kw_only=True, slots=True, frozen=True)
class StoreStatus:
    """What the store process has reported so far."""

    swept: int
    """Foreign keys the process deleted since it started."""
    sample: tuple[str, ...]
    """Some of the newest of them (each cut to 64 characters)."""
    swept_at: float | None
    """This process's monotonic clock when the newest sweep report arrived."""
    pressure: bool
    """The store reached 90 % of its memory cap at least once (a flood was refused or nearly so)."""
    lost: str | None
    """Why the store is gone (it exited or was killed), ``None`` while it serves."""


class StoreHealth(Protocol):
    """What a watchdog needs of the process serving its store."""

    def status(self) -> StoreStatus: ...


class StoreServer:
    """A ``TCPStore`` served by a child process on ``host``'s address only. Use :meth:`start`."""

    def __init__(
        self, proc: subprocess.Popen[str], *, host: str, port: int, config: StoreServerConfig
    ) -> None:
        self._proc, self.host, self.port, self.config = proc, host, port, config
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._swept = 0
        self._sample: tuple[str, ...] = ()
        self._swept_at: float | None = None
        self._pressure = False
        self._lost: str | None = None
        self._closing = False
        assert proc.stdout is not None
        self._reader = threading.Thread(
            target=self._read, args=(proc.stdout,), name="gemscout-oob-store-reader", daemon=True
        )
        self._reader.start()

    @classmethod
    def start(
        cls,
        host: str,
        port: int = 0,
        *,
        namespace: str,
        world_size: int,
        keys: Iterable[str],
        config: StoreServerConfig | None = None,
    ) -> StoreServer:
        """Listen on ``host``'s address (port 0: the kernel picks; read ``.port``) and serve from a child process.

        The child keeps only ``<namespace>/<rank>/<key>`` for ranks below ``world_size`` and ``keys``. Blocks until
        the child serves or ``config.start_timeout`` passes. Raises ``OSError`` when the address cannot be bound and
        :class:`StoreServerError` when the child exits or is not ready in time (it is killed then).
        """
        cfg = config or StoreServerConfig()
        sock, bound_host = listen_socket(host, port)
        try:
            bound_port = int(sock.getsockname()[1])
            command = [
                cfg.python,
                str(_CHILD),
                "--fd",
                str(sock.fileno()),
                "--parent",
                str(os.getpid()),
            ]
            command += ["--host", bound_host, "--cap-bytes", str(cfg.memory_cap_bytes)]
            command += ["--namespace", namespace, "--world-size", str(world_size)]
            command += [arg for key in keys for arg in ("--key", key)]
            command += ["--sweep-interval", str(cfg.sweep_interval.total_seconds())]
            proc = subprocess.Popen(
                command,
                pass_fds=(sock.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
        finally:
            # Only the child listens from here on: were this process to keep the socket, a client of a dead store
            # would wait in its backlog for a timeout instead of being refused at once.
            sock.close()
        server = cls(proc, host=bound_host, port=bound_port, config=cfg)
        server._await_ready()
        return server

    @property
    def pid(self) -> int:
        return self._proc.pid

    def status(self) -> StoreStatus:
        """What the process has reported; ``lost`` set once it is gone (never blocks)."""
        with self._lock:
            if self._lost is None and not self._closing and self._proc.poll() is not None:
                self._lost = self._cause()
            return StoreStatus(
                swept=self._swept,
                sample=self._sample,
                swept_at=self._swept_at,
                pressure=self._pressure,
                lost=self._lost,
            )

    def close(self) -> None:
        """Stop the process: SIGTERM, then SIGKILL after ``config.stop_timeout``. Idempotent; never raises for a
        process that is already gone."""
        with self._lock:
            self._closing = True
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(self.config.stop_timeout.total_seconds())
            except subprocess.TimeoutExpired:
                logger.warning("OOB store process %d ignored SIGTERM; killing it", self._proc.pid)
                self._proc.kill()
                self._proc.wait(self.config.stop_timeout.total_seconds())
        self._reader.join(self.config.stop_timeout.total_seconds())
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout.total_seconds()
        while not self._ready.wait(0.05):
            if self._proc.poll() is not None:
                self._reader.join(1.0)
                raise StoreServerError(f"the OOB store process could not start: {self._cause()}")
            if time.monotonic() >= deadline:
                self._proc.kill()
                self._proc.wait(self.config.stop_timeout.total_seconds())
                raise StoreServerError(
                    f"the OOB store process was not serving within {self.config.start_timeout} (killed); "
                    "raise StoreServerConfig.start_timeout on a busy host"
                )

    def _cause(self) -> str:
        code = self._proc.returncode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with {code}"
        )
        cap = self.config.memory_cap_bytes >> 20
        near = f", having reached 90 % of its {cap} MiB cap (a flood?)" if self._pressure else ""
        if code == 75:
            how = "exited: it was full to its memory cap and could not be swept (a flood that never paused)"
        last = " | ".join(
            line for line in self._tail if not line.startswith(("swept ", "pressure "))
        )[-600:]
        return f"store process {self._proc.pid} {how}{near}" + (
            f"; its last output: {last}" if last else ""
        )

    def _read(self, stream: IO[str]) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            if line == "ready":
                self._ready.set()
                continue
            word, _, rest = line.partition(" ")
            with self._lock:
                self._tail.append(line[:300])
                if word == "swept":
                    count, _, sample = rest.partition(" ")
                    try:
                        self._swept += int(count)
                        self._sample = tuple(str(s) for s in json.loads(sample))
                    except (
                        ValueError
                    ):  # a line cut by the child's death; its count comes again or never matters
                        continue
                    self._swept_at = time.monotonic()
                elif word == "pressure":
                    self._pressure = True
            if word not in ("swept", "pressure"):
                logger.debug("OOB store process: %s", line)

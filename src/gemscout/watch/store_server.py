"""The out-of-band store served from a small child process, so that what an outsider sends cannot grow training.

``TCPStore``'s server holds every key anyone sends and has no size or key cap; served inside rank 0's training process,
a flood of keys from anyone who reaches the port grows that process until the kernel kills it. A sweeper cannot bound
that: one client writes faster than another can list and delete. So rank 0 binds and listens on the job's address
itself (the port is known at once; clients queue in the backlog) and hands the listening descriptor to a child
process (:mod:`gemscout.watch._store_child`) that adopts it and caps its own memory (``RLIMIT_DATA``): past the cap the
store refuses the message that would grow it (the sending connection is dropped), and the training process holds
nothing of the store at all. The child sweeps foreign keys itself, at once while it keeps finding some, and exits when
its parent dies or :meth:`StoreServer.close` stops it.

Its death (killed, out of memory at its cap, a crash) is reported through :meth:`StoreServer.status`, which the
watchdog turns into a ``tamper`` finding (``store_lost``); training uses its own store and goes on. A supervisor thread
then starts a fresh child on the same address and port (the child binds the port again once its imports are done:
nobody keeps a listening descriptor while no store serves, so a client of a dead store is refused at once instead of
waiting in a backlog), after
``StoreServerConfig.restart_backoff`` (doubling for each further restart), at most ``max_restarts`` times; past them
the store stays down and :meth:`StoreServer.status` says so (``restarting`` false). The fresh store is empty: its
owners re-publish their slots on their next heartbeat. The port could be taken by someone else while it is down; the
restart then fails (counted against the limit) and is reported with the cause.

What the child's lines and exit mean is :mod:`gemscout.watch.store_protocol`'s; what the watchdog reads of all this
is :class:`~gemscout.watch.store_health.StoreStatus`.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO

from gemscout.errors import ConfigError, GemscoutError
from gemscout.watch.bound_store import listen_socket
from gemscout.watch.store_health import StoreStatus
from gemscout.watch.store_protocol import death_cause, parse_line

logger = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_store_child.py")
_TAIL_LINES = 20


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
    max_restarts: int = 3
    """How many times a store process that died is started again, on the same port, over the server's life (a
    restart that does not serve within ``start_timeout`` counts too). Past them the store stays down. 0: never."""
    restart_backoff: timedelta = timedelta(seconds=1)
    """Pause before the first restart; it doubles for each further one (at most 60 s)."""

    def __post_init__(self) -> None:
        if type(self.memory_cap_bytes) is not int or self.memory_cap_bytes < 16 << 20:
            raise ConfigError(
                f"StoreServerConfig.memory_cap_bytes must be an int >= 16 MiB, got {self.memory_cap_bytes!r}"
            )
        if type(self.max_restarts) is not int or not 0 <= self.max_restarts <= 1000:
            raise ConfigError(
                f"StoreServerConfig.max_restarts must be an int in 0..1000, got {self.max_restarts!r}"
            )
        for name in ("start_timeout", "stop_timeout", "sweep_interval", "restart_backoff"):
            if getattr(self, name) <= timedelta(0):
                raise ConfigError(
                    f"StoreServerConfig.{name} must be > 0, got {getattr(self, name)}"
                )


class StoreServer:
    """A ``TCPStore`` served by a child process on ``host``'s address only, restarted when it dies. Use
    :meth:`start`."""

    def __init__(
        self, *, host: str, port: int, config: StoreServerConfig, args: Sequence[str]
    ) -> None:
        """``args``: the child's arguments but ``--fd`` (the listening descriptor differs per start)."""
        self.host, self.port, self.config = host, port, config
        self._args = list(args)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ready = threading.Event()
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._swept = 0
        self._sample: tuple[str, ...] = ()
        self._swept_at: float | None = None
        self._pressure = False
        self._lost: str | None = None
        self._last_lost: str | None = None
        self._outages = 0
        self._restarts = 0  # fresh processes that served
        self._attempts = 0  # fresh processes started (or tried) after a loss
        self._restarting = False
        self._noted: subprocess.Popen[str] | None = None  # the process whose death is counted
        self._closing = False
        self._spawned_at = 0.0
        self._proc: subprocess.Popen[str]
        self._reader: threading.Thread
        self._supervisor: threading.Thread | None = None

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
            args = ["--parent", str(os.getpid()), "--host", bound_host]
            args += ["--cap-bytes", str(cfg.memory_cap_bytes)]
            args += ["--namespace", namespace, "--world-size", str(world_size)]
            args += [arg for key in keys for arg in ("--key", key)]
            args += ["--sweep-interval", str(cfg.sweep_interval.total_seconds())]
            server = cls(host=bound_host, port=int(sock.getsockname()[1]), config=cfg, args=args)
            with server._lock:
                server._spawn_locked(sock)
        finally:
            # Only the child listens from here on: were this process to keep the socket, a client of a dead store
            # would wait in its backlog for a timeout instead of being refused at once.
            sock.close()
        server._await_ready()
        server._supervisor = threading.Thread(
            target=server._supervise, name="gemscout-oob-store-supervisor", daemon=True
        )
        server._supervisor.start()
        return server

    @property
    def pid(self) -> int:
        """The process serving now (or the newest one started)."""
        with self._lock:
            return self._proc.pid

    def status(self) -> StoreStatus:
        """What the process has reported; ``lost`` set once it is gone, until a restart serves (never blocks)."""
        with self._lock:
            if not self._closing and self._proc.poll() is not None:
                self._note_death_locked(self._proc)
            return StoreStatus(
                swept=self._swept,
                sample=self._sample,
                swept_at=self._swept_at,
                pressure=self._pressure,
                lost=self._lost,
                outages=self._outages,
                restarts=self._restarts,
                restarting=self._lost is not None and self._restarting,
                last_lost=self._last_lost,
            )

    def close(self) -> None:
        """Stop the process (and any restart): SIGTERM, then SIGKILL after ``config.stop_timeout``. Idempotent; never
        raises for a process that is already gone."""
        with self._lock:
            self._closing = True
            self._closed.set()
            proc, reader = self._proc, self._reader
        stop_s = self.config.stop_timeout.total_seconds()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(stop_s)
            except subprocess.TimeoutExpired:
                logger.warning("OOB store process %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait(stop_s)
        if self._supervisor is not None:
            self._supervisor.join(stop_s)
        reader.join(stop_s)
        if proc.stdout is not None:
            proc.stdout.close()

    def _spawn_locked(self, sock: socket.socket | None) -> None:
        """Start a child on ``sock`` (the caller closes its copy; ``None``: the child binds ``self.port`` again) with
        a reader of its own; under ``_lock``."""
        where = ["--fd", str(sock.fileno())] if sock is not None else ["--port", str(self.port)]
        command = [self.config.python, str(_CHILD), *where, *self._args]
        proc = subprocess.Popen(
            command,
            pass_fds=(sock.fileno(),) if sock is not None else (),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        ready = threading.Event()
        self._proc, self._ready, self._spawned_at = proc, ready, time.monotonic()
        self._tail = collections.deque(maxlen=_TAIL_LINES)
        self._reader = threading.Thread(
            target=self._read,
            args=(proc, proc.stdout, ready),
            name="gemscout-oob-store-reader",
            daemon=True,
        )
        self._reader.start()

    def _note_death_locked(self, proc: subprocess.Popen[str]) -> None:
        """Count ``proc``'s death once (by :meth:`status` or the supervisor, whichever sees it first)."""
        if self._noted is proc:
            return
        self._noted = proc
        cause = self._cause(proc)
        if self._lost is None:
            self._outages += 1
            self._lost = cause
        else:  # a restart that did not serve: the same outage goes on
            self._lost = f"{self._lost}; restart {self._attempts} failed: {cause}"
        self._last_lost = self._lost
        self._restarting = self._attempts < self.config.max_restarts

    def _supervise(self) -> None:
        """Wait for the child's end; restart it (bounded, with a backoff) until :meth:`close`."""
        cfg = self.config
        while True:
            with self._lock:
                proc, reader, ready, spawned = (
                    self._proc,
                    self._reader,
                    self._ready,
                    self._spawned_at,
                )
            while reader.is_alive():  # the reader ends at EOF: the child is gone
                reader.join(0.1)
                if self._closed.is_set():
                    return
                late = time.monotonic() - spawned >= cfg.start_timeout.total_seconds()
                if late and not ready.is_set() and proc.poll() is None:
                    logger.warning(
                        "restarted OOB store process %d is not serving; killing it", proc.pid
                    )
                    proc.kill()
            try:
                proc.wait(cfg.stop_timeout.total_seconds())
            except subprocess.TimeoutExpired:  # it closed its stdout but lives on: it serves nobody
                proc.kill()
                try:
                    proc.wait(cfg.stop_timeout.total_seconds())
                except subprocess.TimeoutExpired:
                    logger.error("OOB store process %d does not die; not restarting", proc.pid)
                    return
            if proc.stdout is not None:
                proc.stdout.close()
            with self._lock:
                if self._closing:
                    return
                self._note_death_locked(proc)
                attempt, lost = self._attempts + 1, self._lost
                if not self._restarting:
                    logger.error(
                        "OOB store lost and not restarted (%d restart(s) allowed, all used): %s",
                        cfg.max_restarts,
                        lost,
                    )
                    return
            delay = min(cfg.restart_backoff.total_seconds() * 2 ** (attempt - 1), 60.0)
            logger.warning(
                "OOB store lost (%s); restarting it on port %d in %.1f s (restart %d of %d)",
                lost, self.port, delay, attempt, cfg.max_restarts,
            )  # fmt: skip
            if self._closed.wait(delay):
                return
            if not self._restart(attempt):
                return

    def _restart(self, attempt: int) -> bool:
        """Start a child that binds the port again; False when there is nothing more to do."""
        try:
            with self._lock:
                if self._closing:
                    return False
                self._attempts = attempt
                self._spawn_locked(None)
        except OSError as exc:
            with self._lock:
                self._lost = f"{self._lost}; restart {attempt} could not start a process: {exc}"
                self._last_lost = self._lost
                self._restarting = self._attempts < self.config.max_restarts
                keep_on = self._restarting and not self._closing
            logger.error("OOB store restart %d could not start a process: %s", attempt, exc)
            return keep_on and self._retry_later(attempt)
        return True

    def _retry_later(self, attempt: int) -> bool:
        """After a restart that started nothing: wait the next backoff, then try again (recursion bounded by
        ``max_restarts``)."""
        delay = min(self.config.restart_backoff.total_seconds() * 2**attempt, 60.0)
        if self._closed.wait(delay):
            return False
        return self._restart(attempt + 1)

    def _await_ready(self) -> None:
        proc = self._proc
        deadline = time.monotonic() + self.config.start_timeout.total_seconds()
        while not self._ready.wait(0.05):
            if proc.poll() is not None:
                self._reader.join(1.0)
                raise StoreServerError(
                    f"the OOB store process could not start: {self._cause(proc)}"
                )
            if time.monotonic() >= deadline:
                proc.kill()
                proc.wait(self.config.stop_timeout.total_seconds())
                raise StoreServerError(
                    f"the OOB store process was not serving within {self.config.start_timeout} (killed); "
                    "raise StoreServerConfig.start_timeout on a busy host"
                )

    def _cause(self, proc: subprocess.Popen[str]) -> str:
        """Why ``proc`` (which has exited) is gone, from its exit status and its last lines."""
        return death_cause(
            proc.pid,
            proc.returncode,
            tail=self._tail,
            pressure=self._pressure,
            cap_bytes=self.config.memory_cap_bytes,
        )

    def _read(self, proc: subprocess.Popen[str], stream: IO[str], ready: threading.Event) -> None:
        try:
            for raw in stream:
                self._line(proc, raw.rstrip("\n"), ready)
        except (OSError, ValueError):  # the stream was closed under us (close())
            pass

    def _line(self, proc: subprocess.Popen[str], line: str, ready: threading.Event) -> None:
        """Take in one line of ``proc`` (the current process or one being replaced): ``ready`` sets ``ready`` and
        ends an outage; the rest is kept for the status and a death's cause."""
        report = parse_line(line)
        if report.kind == "ready":
            ready.set()
            with self._lock:
                if proc is self._proc and self._lost is not None and not self._closing:
                    logger.warning(
                        "OOB store restored: process %d serves on port %d again (restart %d of %d)",
                        proc.pid, self.port, self._attempts, self.config.max_restarts,
                    )  # fmt: skip
                    self._lost, self._restarting = None, False
                    self._restarts += 1
            return
        with self._lock:
            if proc is self._proc:
                self._tail.append(report.text)
            if report.kind == "swept" and report.count is not None:
                self._swept += report.count
                if report.sample is not None:
                    self._sample = report.sample
                    self._swept_at = time.monotonic()
            elif report.kind == "pressure":
                self._pressure = True
        if report.kind == "other":
            logger.debug("OOB store process: %s", line)

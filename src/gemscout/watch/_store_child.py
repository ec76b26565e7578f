"""The store process: serves the out-of-band ``TCPStore`` on a listening socket its parent made, under a memory cap.

Run by :class:`gemscout.watch.store_server.StoreServer` as ``python <this file> ...`` (by path, so that nothing of
``gemscout`` is imported: this process holds only the standard library and torch). It

- ignores SIGINT (a Ctrl-C at the terminal is the training process's to handle) and exits when its parent is gone
  (``getppid`` changes) or on SIGTERM;
- after its imports, sets ``RLIMIT_DATA`` to what it holds plus ``--cap-bytes`` (soft; the hard limit is a small
  reserve above, for sweeps only): every allocation of the store past that fails, the libuv server answers
  ``std::bad_alloc`` by dropping that client's connection, and the process lives on with its memory bounded whatever
  an outsider sends;
- adopts the listening descriptor (``master_listen_fd``), so the port its parent published never changes; a
  restarted one (``--port`` instead of ``--fd``) binds that port again itself, only once its imports are done, so that
  while it starts a client is refused at once rather than left waiting in a backlog (exit code 4 when it cannot);
- sweeps: deletes every key that is not one of the job's slots (``<namespace>/<rank>/<key>``, rank below
  ``--world-size``), again at once while it keeps finding some, and reports the count to its parent; when it cannot
  sweep for a few seconds even with the reserve, it exits (code 75) rather than serve a store that refuses everyone;
- talks to its parent in lines on stdout (read by :mod:`gemscout.watch.store_protocol`): ``ready``,
  ``swept <n> <json sample>``, ``pressure <cap>``, ``sweep-failed <reason>``, ``stuck: <reason>``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import sys
import time
from datetime import timedelta
from typing import Any

_PRESSURE = (
    0.9  # report when the store holds this fraction of its cap: the next flood may be refused
)
_REPORT_EVERY_S = (
    0.25  # aggregate sweep reports: a sustained flood must not become a line per key to the parent
)
_MIN_RESERVE = (
    8 << 20
)  # room above the cap for a sweep's reconnect and listing (a list of every key's name)
_LIFTED_DELETES = 16  # deletions under a lifted limit before it is lowered again
_STUCK_S = (
    5.0  # sweeps failing even with the reserve for this long: the store exits (reported as lost)
)


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _say(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (
        BrokenPipeError,
        OSError,
    ):  # the parent stopped reading: it is gone or closing; the ppid check ends us
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int)
    where.add_argument("--port", type=int)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--cap-bytes", type=int, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--key", action="append", default=[])
    parser.add_argument("--sweep-interval", type=float, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != args.parent:  # the parent died before we started
        return 3

    from torch.distributed import TCPStore

    # The cap counts from here: the interpreter and torch are what every store process holds; the store's keys, its
    # server thread and the sweeps' copies come out of the cap. Above it, a reserve only the sweeps lift into.
    soft = _vm_data() + args.cap_bytes
    hard = soft + max(_MIN_RESERVE, args.cap_bytes // 8)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    host = args.host
    if args.fd is None:
        try:
            args.fd = _listen(host, args.port)
        except OSError as exc:
            _say(f"bind-failed: port {args.port} of {host}: {exc}")
            return 4
    port = _port_of(args.fd)
    _server = TCPStore(  # serves from its own thread until the process ends
        host,
        port,
        None,
        is_master=True,
        timeout=timedelta(seconds=30),
        wait_for_workers=False,
        master_listen_fd=args.fd,
        use_libuv=True,
    )
    _say("ready")
    keep = re.compile(
        re.escape(args.namespace)
        + r"/(0|[1-9][0-9]{0,8})/("
        + "|".join(re.escape(k) for k in args.key)
        + r")\Z"
    )
    sweeper = _Sweeper(host, port, keep, args.world_size, soft=soft, hard=hard)
    swept, reported_at, failing_since = 0, time.monotonic(), None
    sample: list[str] = []
    while os.getppid() == args.parent:
        removed = sweeper.sweep()
        now = time.monotonic()
        if removed is None:
            failing_since = failing_since or now
            if now - failing_since >= _STUCK_S:
                # Full to the cap and not even the reserve lets a sweep through (a flood that never pauses): a store
                # that refuses everyone is worse than none, whose loss the watchdog reports.
                _say(
                    f"stuck: the store is full to its {args.cap_bytes >> 20} MiB cap and cannot be swept"
                )
                os._exit(75)
            time.sleep(args.sweep_interval)
            continue
        failing_since = None
        swept += len(removed)
        sample = (sample + [name[:64] for name in removed[:5]])[:5]
        if swept and now - reported_at >= _REPORT_EVERY_S:
            _say(f"swept {swept} {json.dumps(sample)}")
            if _vm_data() - (soft - args.cap_bytes) >= _PRESSURE * args.cap_bytes:
                _say(f"pressure {args.cap_bytes}")
            swept, sample, reported_at = 0, [], now
        if not removed:
            time.sleep(args.sweep_interval)
    # The parent is gone. No cleanup is owed (the kernel closes the sockets), and an interpreter tearing torch down
    # takes seconds on a busy host: long enough to look like an orphan.
    os._exit(0)


class _Sweeper:
    """Deletes the keys that are not the job's slots, over a connection of its own.

    At the cap the server can allocate nothing, not even the buffers to read the sweeper's requests: it drops every
    connection that sends, the sweeper's too, and a store full of a flood that has stopped would stay full. So a sweep
    that fails is tried once more with the soft limit lifted to the hard one (the reserve) for the reconnect and the
    listing; the deletions then free far more than the reserve.
    """

    def __init__(
        self, host: str, port: int, keep: re.Pattern[str], world_size: int, *, soft: int, hard: int
    ) -> None:
        self._host, self._port, self._keep, self._world_size = host, port, keep, world_size
        self._soft, self._hard = soft, hard
        self._store: Any = None

    def sweep(self) -> list[str] | None:
        """The keys deleted, or ``None`` when even the lifted sweep failed."""
        try:
            return self._sweep_once()
        except (MemoryError, RuntimeError):
            self._store = None
        resource.setrlimit(resource.RLIMIT_DATA, (self._hard, self._hard))
        try:
            return self._sweep_once(lifted=True)
        except (MemoryError, RuntimeError) as exc:
            self._store = None
            _say(
                f"sweep-failed {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            )
            return None
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (self._soft, self._hard))

    def _sweep_once(self, *, lifted: bool = False) -> list[str]:
        from torch.distributed import TCPStore

        if self._store is None:
            self._store = TCPStore(
                self._host,
                self._port,
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=2),
            )
        names = self._store.list_keys()
        removed = []
        for name in names:
            match = self._keep.match(name)
            if match is None or int(match.group(1)) >= self._world_size:
                self._store.delete_key(name)
                removed.append(name)
                if lifted and len(removed) == _LIFTED_DELETES:
                    # The first deletions have freed room under the cap: back under it before the flood takes the
                    # reserve too.
                    resource.setrlimit(resource.RLIMIT_DATA, (self._soft, self._hard))
        return removed


def _listen(host: str, port: int) -> int:
    """A descriptor bound to ``host:port`` and listening (what the parent's ``listen_socket`` makes; this program
    imports nothing of gemscout, so it keeps its own few lines)."""
    import socket

    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address[:2] if family == socket.AF_INET else address)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def _port_of(fd: int) -> int:
    import socket

    sock = socket.socket(fileno=fd)
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.detach()  # the store owns the descriptor


if __name__ == "__main__":
    sys.exit(main())

"""The store process: serves the out-of-band ``TCPStore`` on a listening socket its parent made, under a memory cap.

Run by :class:`gemscout.oob.store_server.StoreServer` as ``python <this file> ...`` (by path, so that nothing of
``gemscout`` is imported: this process holds only the standard library and torch). It

- ignores SIGINT (a Ctrl-C at the terminal is the training process's to handle) and exits when its parent is gone
  (``getppid`` changes) or on SIGTERM;
- after its imports, sets ``RLIMIT_DATA`` to what it holds plus ``--cap-bytes``: every allocation of the store past
  that fails, the libuv server answers ``std::bad_alloc`` by dropping that client's connection, and the process lives
  on with its memory bounded whatever an outsider sends;
- adopts the listening descriptor (``master_listen_fd``), so the port its parent published never changes;
- sweeps: deletes every key that is not one of the job's slots (``<namespace>/<rank>/<key>``, rank below
  ``--world-size``), again at once while it keeps finding some, and reports the count to its parent;
- talks to its parent in lines on stdout: ``ready``, ``swept <n> <json sample>``, ``pressure <held> <cap>``,
  ``sweep-failed <reason>``.
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

_PRESSURE = 0.9  # report when the store holds this fraction of its cap: the next flood may be refused
_REPORT_EVERY_S = 0.25  # aggregate sweep reports: a sustained flood must not become a line per key to the parent


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
    except (BrokenPipeError, OSError):  # the parent stopped reading: it is gone or closing; the ppid check ends us
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
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
    # server thread and the sweeps' copies come out of the cap.
    limit = _vm_data() + args.cap_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    host = args.host
    port = _port_of(args.fd)
    server = TCPStore(
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
        re.escape(args.namespace) + r"/(0|[1-9][0-9]{0,8})/(" + "|".join(re.escape(k) for k in args.key) + r")\Z"
    )
    sweeper: Any = None
    swept, reported_at = 0, time.monotonic()
    sample: list[str] = []
    while os.getppid() == args.parent:
        try:
            if sweeper is None:
                # A connection of its own: a list_keys the server cannot answer under the cap drops the connection,
                # and a dropped one is replaced here instead of ending the sweeps.
                sweeper = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
            removed = _sweep(sweeper, keep, args.world_size)
        except (MemoryError, RuntimeError) as exc:
            sweeper, removed = None, []
            _say(f"sweep-failed {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
            time.sleep(args.sweep_interval)
        swept += len(removed)
        sample = (sample + [name[:64] for name in removed[:5]])[:5]
        now = time.monotonic()
        if swept and now - reported_at >= _REPORT_EVERY_S:
            _say(f"swept {swept} {json.dumps(sample)}")
            held = _vm_data() - (limit - args.cap_bytes)
            if held >= _PRESSURE * args.cap_bytes:
                _say(f"pressure {held} {args.cap_bytes}")
            swept, sample, reported_at = 0, [], now
        if not removed:
            time.sleep(args.sweep_interval)
    del server
    return 0


def _sweep(store: Any, keep: re.Pattern[str], world_size: int) -> list[str]:
    removed = []
    for name in store.list_keys():
        match = keep.match(name)
        if match is None or int(match.group(1)) >= world_size:
            store.delete_key(name)
            removed.append(name)
    return removed


def _port_of(fd: int) -> int:
    import socket

    sock = socket.socket(fileno=fd)
    try:
        return int(sock.getsockname()[1])
    finally:
        sock.detach()  # the store owns the descriptor


if __name__ == "__main__":
    sys.exit(main())

"""A ``TCPStore`` server that listens on one address only, not every interface.

``TCPStore(host_name, ...)`` ignores ``host_name`` on the server side and listens on every interface; a store without
authentication must not be reachable from every network the host is on. So whoever serves one makes the listening
socket here (:func:`listen_socket`) and hands it over: :func:`serve_store` to a server in this process (tests,
experiments, :meth:`~gemscout.watch.channel.OobChannel.connect` as master), and
:class:`~gemscout.watch.store_server.StoreServer` to the capped child process that serves the watch's store.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["listen_socket", "serve_store"]


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


def serve_store(
    host: str, port: int = 0, *, timeout: timedelta = timedelta(seconds=60)
) -> TCPStore:
    """Serve a ``TCPStore`` that listens on ``host``'s address only (port 0: the kernel picks one; read ``.port``).

    ``TCPStore(host_name, ...)`` ignores ``host_name`` on the server side and listens on every interface, so the
    socket is made, bound and put to listen here and handed over through ``master_listen_fd`` (the libuv backend
    adopts it). ``host`` is resolved once; a name that resolves to loopback gives a loopback-only server, which is
    what a single-node job should use. Raises ``OSError`` when the address cannot be bound (not this host's).
    """
    from torch.distributed import TCPStore

    sock, bound_host = listen_socket(host, port)
    bound_port = sock.getsockname()[1]
    # The store owns the descriptor from here on; detach so Python never closes it under the server.
    fd = sock.detach()
    try:
        return TCPStore(
            bound_host,
            bound_port,
            None,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        socket.close(fd)
        raise

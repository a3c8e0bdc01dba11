"""TCP helpers for whatever polls a local service before it listens: the rendezvous (its
ranks, the secret gate) and the tools that wait for a vLLM server's /health; and the
listening socket the rendezvous and its gate bind (`listening_socket`)."""

from __future__ import annotations

import errno
import socket
import struct


def connect_to(host: str, port: int, timeout: float, source_address=None) -> socket.socket:
    """A TCP connection to (host, port); ConnectionRefusedError if nothing listens there.

    Where nothing listens on a local port in the ephemeral range, the kernel may pick that
    very port as the connection's source and connect the socket to itself (TCP
    simultaneous open): the attempt "succeeds", reads back what it writes, and while it
    lasts the service (FFN rank 0, a vLLM server) cannot listen there. Such a connection
    is refused here."""
    sock = socket.create_connection((host, port), timeout=timeout, source_address=source_address)
    if sock.getsockname() == sock.getpeername():
        # closed with a reset: a normal close would leave the port in TIME_WAIT for a
        # minute, where the service cannot listen on it (its SO_REUSEADDR does not cover a
        # TIME_WAIT socket that lacked it)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        raise ConnectionRefusedError(
            errno.ECONNREFUSED, f"nothing listens on {host}:{port} (a connection to itself)"
        )
    return sock


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to `host`'s address (not every interface)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock

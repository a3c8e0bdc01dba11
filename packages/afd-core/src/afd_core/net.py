"""TCP helpers for whatever polls a local service before it listens: the rendezvous (its
ranks, the secret gate) and the tools that wait for a vLLM server's /health; the
listening socket the rendezvous and its gate bind (`listening_socket`); and the port a
local server about to start is given (`free_port`)."""

from __future__ import annotations

import collections
import errno
import os
import random
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


PORT_RANGE_ENV = "AFD_PORT_RANGE"
# this process's latest picks, perhaps not bound yet by whoever took them
_handed_out: collections.deque[int] = collections.deque(maxlen=512)


def port_range(value: str) -> range:
    """AFD_PORT_RANGE's value, "LOW-HIGH" (both included), as a range."""
    low, sep, high = value.partition("-")
    try:
        ports = range(int(low), int(high) + 1) if sep else None
    except ValueError:
        ports = None
    if ports is None or not 1024 <= ports.start < ports.stop <= 65536:
        raise ValueError(
            f"{PORT_RANGE_ENV}={value!r}: expected LOW-HIGH, two port numbers with "
            "1024 <= LOW < HIGH <= 65535"
        )
    return ports


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server about to start. The kernel picks it,
    unless AFD_PORT_RANGE="LOW-HIGH" names a range to pick from: runs that share a machine
    (test workers, several `afd demo`s) each given their own range below the kernel's
    ephemeral ports (net.ipv4.ip_local_port_range) never have a port of theirs handed to
    another run, or to a connection's local end, between the pick and the bind."""
    value = os.environ.get(PORT_RANGE_ENV)
    if not value:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    ports = port_range(value)
    start = random.randrange(len(ports))
    for i in range(len(ports)):
        port = ports[(start + i) % len(ports)]
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.append(port)
        return port
    raise RuntimeError(f"{PORT_RANGE_ENV}={value}: no port of the range is free")

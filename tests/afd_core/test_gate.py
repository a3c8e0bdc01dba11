"""The rendezvous gate stays open to members whatever strangers do (issue 36, review finding
M2): a failed accept (out of file descriptors) used to end its acceptor thread for good, and
every later member was told the rendezvous "did not ask for the deployment secret"; and
each stranger's connection held a thread for the whole handshake bound, without limit."""

from __future__ import annotations

import socket
import time

import pytest

from afd_core.connectors.transports import gate
from afd_core.net import listening_socket

SECRET = b"0123456789abcdef0123456789abcdef"


class _FailingAccepts:
    """A listener whose first `fails` accepts raise as accept(2) does out of descriptors."""

    def __init__(self, sock: socket.socket, fails: int):
        self._sock, self._fails = sock, fails

    def accept(self):
        if self._fails:
            self._fails -= 1
            raise OSError(24, "Too many open files")
        return self._sock.accept()

    def shutdown(self, how):
        self._sock.shutdown(how)

    def close(self):
        self._sock.close()


@pytest.fixture
def store():
    """Stands for the store behind the gate: accepts and holds connections."""
    sock = listening_socket("127.0.0.1", 0)
    yield sock.getsockname()[1]
    sock.close()


def _member(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        gate.client_handshake(sock, SECRET, f"127.0.0.1:{port}")


def test_a_failed_accept_backs_off_and_members_still_get_in(store, monkeypatch):
    monkeypatch.setattr(gate, "ACCEPT_BACKOFF_S", (0.01, 0.05), raising=False)
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    door = gate.Gate(_FailingAccepts(sock, fails=3), store, SECRET)
    try:
        _member(port)  # accepted after three failed accepts
    finally:
        door.close()


def test_strangers_holding_handshakes_are_bounded_and_the_door_reopens(store, monkeypatch):
    """With 3 handshakes allowed at once, 3 strangers that send nothing hold them until
    the handshake bound; a fourth connection is closed at once (counted), and once the
    strangers' bound passed a member gets in."""
    monkeypatch.setattr(gate, "MAX_HANDSHAKES", 3, raising=False)
    monkeypatch.setattr(gate, "HANDSHAKE_S", 0.5)
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    door = gate.Gate(sock, store, SECRET)
    strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        time.sleep(0.1)  # all three in their handshake
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            t0 = time.monotonic()
            extra.settimeout(2)
            data = extra.recv(64)  # closed at once: no greeting
            assert data == b"" and time.monotonic() - t0 < 0.4
        assert door.refused >= 1
        time.sleep(0.6)  # the strangers' handshakes timed out
        _member(port)
        assert door.refused >= 4  # the extra one and the three strangers
    finally:
        for s in strangers:
            s.close()
        door.close()

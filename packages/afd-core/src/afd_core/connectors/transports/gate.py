"""The rendezvous gate: with a deployment secret set, every connection to the store proves
it before a byte reaches the store.

PyTorch's TCPStore has no authentication: whoever reaches it can claim a rank or write the
failure flag. With a secret, FFN rank 0's store listens on loopback only, and a `Gate`
listens on `afd.host:afd.port` in its place: each connection first completes a mutual
challenge (HMAC-SHA256 of fresh nonces under the secret), then the gate relays it to the
store. Every other rank's store client connects to a local `Forwarder`, which connects to
the gate, answers the challenge and relays. A stranger without the secret is closed before
anything reaches the store: it changes nothing. The secret comes from the environment
(AFD_DEPLOYMENT_SECRET, or a file named by AFD_DEPLOYMENT_SECRET_FILE), never from a
command line that `ps` shows. The data and control channels (gloo, NCCL) are not covered:
docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import selectors
import socket
import threading
import time

from afd_core import envs
from afd_core.log import get_logger
from afd_core.net import connect_to, listening_socket

logger = get_logger(__name__)

SECRET_ENV, SECRET_FILE_ENV = envs.AFD_DEPLOYMENT_SECRET, envs.AFD_DEPLOYMENT_SECRET_FILE
GREETING = b"AFDGATE1"
NONCE = 32
MAC = 32
HANDSHAKE_S = 5.0
MIN_SECRET_BYTES = 16  # after stripping whitespace


class GateError(RuntimeError):
    """The rendezvous refused this rank, or did not ask for the secret this rank has."""


def deployment_secret() -> bytes | None:
    """The deployment secret from the environment, or None; a named error for a file that
    cannot be read or a secret that is empty."""
    from afd_core.errors import AFDConfigError

    path = os.environ.get(SECRET_FILE_ENV)
    value = os.environ.get(SECRET_ENV)
    if path and value:
        raise AFDConfigError(
            f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set; allowed: one of them", SECRET_ENV
        )
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise AFDConfigError(
                f"{SECRET_FILE_ENV}={path!r} cannot be read ({exc.strerror}); allowed: a "
                "readable file holding the deployment secret",
                SECRET_FILE_ENV,
            ) from None
        where = f"the file {SECRET_FILE_ENV}={path!r}"
    elif value is not None:
        secret, where = value.strip().encode(), SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise AFDConfigError(
            f"the deployment secret from {where} has {len(secret)} bytes; allowed: at least "
            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)",
            SECRET_ENV,
        )
    return secret


def _mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


def client_handshake(sock: socket.socket, secret: bytes, where: str) -> None:
    """Prove the secret to the gate at `where`, and check the gate knows it too."""
    sock.settimeout(HANDSHAKE_S)
    try:
        greeting = _recv_exact(sock, len(GREETING) + NONCE)
    except (TimeoutError, ConnectionError, OSError):
        raise GateError(
            f"the rendezvous at {where} did not ask for the deployment secret (its FFN "
            f"server runs without one, or this is not an AFD rendezvous); {SECRET_ENV} is "
            "set here: set it on every server of the deployment, or on none"
        ) from None
    if not greeting.startswith(GREETING):
        raise GateError(f"the rendezvous at {where} is not an AFD gate")
    server_nonce = greeting[len(GREETING) :]
    nonce = os.urandom(NONCE)
    sock.sendall(nonce + _mac(secret, b"client", server_nonce, nonce))
    try:
        answer = _recv_exact(sock, 2 + MAC)
    except (TimeoutError, ConnectionError, OSError):
        answer = b""
    if answer[:2] != b"OK" or not hmac.compare_digest(
        answer[2:], _mac(secret, b"server", nonce, server_nonce)
    ):
        raise GateError(
            f"the rendezvous at {where} refused this rank: its deployment secret differs "
            f"({SECRET_ENV} / {SECRET_FILE_ENV} must hold the same secret on every server)"
        )
    sock.settimeout(None)


def _server_handshake(sock: socket.socket, secret: bytes) -> bool:
    sock.settimeout(HANDSHAKE_S)
    nonce = os.urandom(NONCE)
    try:
        sock.sendall(GREETING + nonce)
        reply = _recv_exact(sock, NONCE + MAC)
    except (TimeoutError, ConnectionError, OSError):
        return False
    client_nonce, proof = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", nonce, client_nonce)):
        return False
    sock.sendall(b"OK" + _mac(secret, b"server", client_nonce, nonce))
    sock.settimeout(None)
    return True


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""
    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ, b)
    sel.register(b, selectors.EVENT_READ, a)
    try:
        while True:
            for key, _ in sel.select():
                data = key.fileobj.recv(1 << 16)
                if not data:
                    return
                key.data.sendall(data)
    except OSError:
        return
    finally:
        sel.close()
        for s in (a, b):
            try:
                s.close()
            except OSError:
                pass


MAX_HANDSHAKES = 32  # handshakes in progress at once; more connections are closed at once
ACCEPT_BACKOFF_S = (0.05, 1.0)  # after a failed accept (out of descriptors): first, most


class _Acceptor:
    """Accept on a listening socket in a daemon thread; each connection in its own.

    Strangers cannot stop it: a failed accept (out of file descriptors) or a thread that
    cannot start backs off and accepts again, and at most MAX_HANDSHAKES connections are
    in their handshake at once (each may take HANDSHAKE_S): more are closed at once and
    counted in `refused`. Until it is closed, the door stays open to members."""

    def __init__(self, listener: socket.socket, serve, name: str):
        self._listener = listener
        self._serve = serve
        self._closed = False
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.refused = 0  # connections closed without a handshake, or that failed it
        self._last_warning = 0.0
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        backoff = ACCEPT_BACKOFF_S[0]
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                self._warn(f"accept failed ({exc}); accepting again in {backoff:.2f}s")
                time.sleep(backoff)
                backoff = min(2 * backoff, ACCEPT_BACKOFF_S[1])
                continue
            backoff = ACCEPT_BACKOFF_S[0]
            if not self._handshakes.acquire(blocking=False):
                self.refused += 1
                self._warn(f"closed a connection from {_host(peer)}: too many handshakes")
                _close(conn)
                continue
            try:
                threading.Thread(target=self._serve_counted, args=(conn, peer), daemon=True).start()
            except RuntimeError as exc:  # no thread to be had
                self._handshakes.release()
                _close(conn)
                self._warn(f"closed a connection from {_host(peer)}: {exc}")
                time.sleep(backoff)

    def _serve_counted(self, conn: socket.socket, peer) -> None:
        released = threading.Event()

        def handshake_over() -> None:
            if not released.is_set():
                released.set()
                self._handshakes.release()

        try:
            self._serve(conn, peer, handshake_over)
        finally:
            handshake_over()

    def _warn(self, what: str) -> None:
        """One log line a second at most: a scan must not flood the log."""
        now = time.monotonic()
        if now - self._last_warning >= 1.0:
            self._last_warning = now
            logger.warning("AFD rendezvous door: %s (%d refused so far)", what, self.refused)

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()


class Gate(_Acceptor):
    """FFN rank 0: the store's only door on `listener` (bound to afd.host); relays proven
    connections to the store on loopback `store_port`."""

    def __init__(self, listener: socket.socket, store_port: int, secret: bytes):
        self._store_port, self._secret = store_port, secret
        super().__init__(listener, self._serve_one, "afd-rendezvous-gate")

    def _serve_one(self, conn: socket.socket, peer, handshake_over) -> None:
        proven = _server_handshake(conn, self._secret)
        handshake_over()
        if not proven:
            self.refused += 1
            self._warn(f"refused a connection from {_host(peer)}: no valid deployment secret")
            conn.close()
            return
        try:
            store = socket.create_connection(("127.0.0.1", self._store_port))
        except OSError:
            conn.close()
            return
        _relay(conn, store)


class Forwarder(_Acceptor):
    """Any other rank: its store client connects here (loopback); each connection goes on
    to the gate at (host, port) after the handshake."""

    def __init__(self, host: str, port: int, secret: bytes):
        self._target, self._secret = (host, port), secret
        listener = listening_socket("127.0.0.1", 0)
        self.port = listener.getsockname()[1]
        super().__init__(listener, self._serve_one, "afd-rendezvous-forwarder")

    def check(self, timeout_s: float) -> None:
        """One handshake now, so a refusal is a named error instead of a store that never
        answers (GateError; OSError while the gate is not up yet)."""
        with connect_to(*self._target, timeout=timeout_s) as sock:
            client_handshake(sock, self._secret, f"{self._target[0]}:{self._target[1]}")

    def _serve_one(self, conn: socket.socket, peer, handshake_over) -> None:
        try:
            remote = connect_to(*self._target, timeout=HANDSHAKE_S)
            client_handshake(remote, self._secret, f"{self._target[0]}:{self._target[1]}")
        except (OSError, GateError):
            conn.close()
            return
        finally:
            handshake_over()
        _relay(conn, remote)


def _host(peer) -> str:
    return peer[0] if isinstance(peer, tuple) else str(peer)


def _close(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass


def gate_greets(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether the rendezvous at (host, port) is a gate (it speaks first; a plain store
    waits for its client)."""
    try:
        with connect_to(host, port, timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            return sock.recv(len(GREETING)) == GREETING
    except OSError:
        return False

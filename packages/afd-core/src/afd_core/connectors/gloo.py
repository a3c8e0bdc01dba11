"""The CPU transport: torch.distributed gloo over TCP, in process groups of AFD's own.

Rendezvous: a TCPStore hosted by FFN rank 0 at `host:port`. Each FFN rank k and its
attention peers form one group (FFN rank at group rank 0) with two gloo process groups:
`data` with the step timeout (a gloo timeout closes the pair, so it is fatal, as a lost
peer mid-step is), and `control` with a very long one, because an FFN rank waits for the
next step as long as its attention peers are idle. A dead peer closes its sockets, which
fails a pending receive at once. vLLM's own process groups are never touched.
"""

from __future__ import annotations

import datetime
import socket
import time

from afd_core.connectors.p2p import PointToPointConnector
from afd_core.connectors.transport import Handle, Transport, TransportError

# An idle deployment may wait for days between steps; peer death is detected by the socket.
CONTROL_TIMEOUT = datetime.timedelta(days=30)
STORE_ATTEMPT_S = 3.0  # one attempt to reach the rendezvous store


class GlooTransport(Transport):
    def __init__(
        self,
        host: str,
        port: int,
        group: int | str,
        group_rank: int,
        group_size: int,
        is_store_master: bool,
        timeout_s: float,
        connect_timeout_s: float,
    ):
        self.host, self.port = host, port
        self.group, self.group_rank, self.group_size = group, group_rank, group_size
        self.is_store_master = self.hosts_store = is_store_master
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._store = None
        self._data = None
        self._ctrl = None
        self._deadline = None

    def open_store(self) -> None:
        import torch.distributed as dist

        self._deadline = time.monotonic() + self.connect_timeout_s
        while True:
            # short attempts of our own: after a refused connection TCPStore's own retry
            # sleeps up to ~10 s, which would overshoot a short connect timeout
            remaining = self._deadline - time.monotonic()
            attempt = remaining if self.is_store_master else min(remaining, STORE_ATTEMPT_S)
            listening = self.is_store_master or _listening(self.host, self.port)
            if not listening and remaining > 0.5:
                time.sleep(0.2)  # not up yet: wait quietly (TCPStore logs every failure)
                continue
            try:
                self._store = dist.TCPStore(
                    self.host,
                    self.port,
                    None,
                    self.is_store_master,
                    timeout=datetime.timedelta(seconds=max(attempt, 0.1)),
                    wait_for_workers=False,
                    use_libuv=True,
                )
                break
            except Exception as exc:
                if not self.is_store_master and self._deadline - time.monotonic() > 0.5:
                    time.sleep(0.2)
                    continue
                what = "listen on" if self.is_store_master else "reach FFN rank 0's rendezvous at"
                raise TransportError(
                    f"could not {what} {self.host}:{self.port} within "
                    f"{self.connect_timeout_s:.0f}s ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200]}); check afd.host/afd.port and that the "
                    "FFN server is started"
                ) from None
        self._store.set_timeout(datetime.timedelta(seconds=self.connect_timeout_s))

    def join_group(self, fail_key: str | None = None) -> None:
        import torch.distributed as dist

        prefix = f"afd/g{self.group}"
        # Wait for the whole group in the store first: members start minutes apart (model
        # loading), and a gloo group would apply its short step timeout to that wait.
        self.barrier(
            f"{prefix}/arrived", self.group_size, self._deadline - time.monotonic(), fail_key
        )
        # a member that saw the failure while the others arrived will not connect
        if fail_key is not None and (reason := self.store_try_get(fail_key)) is not None:
            raise TransportError(reason.decode())
        try:
            self._data = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix + "/data", self._store),
                self.group_rank,
                self.group_size,
                datetime.timedelta(seconds=self.timeout_s),
            )
            self._ctrl = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix + "/ctrl", self._store),
                self.group_rank,
                self.group_size,
                CONTROL_TIMEOUT,
            )
        except Exception as exc:
            raise TransportError(
                f"AFD group {self.group} ({self.group_size} ranks) could not connect: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            ) from None

    def barrier(self, key: str, count: int, timeout_s: float, fail_key: str | None = None) -> None:
        try:
            self._barrier(key, count, timeout_s, fail_key)
        except TransportError:
            raise
        except Exception as exc:  # the store went away: FFN rank 0's process stopped
            raise TransportError(
                f"lost the rendezvous store at {self.host}:{self.port} while waiting at "
                f"{key!r} (FFN rank 0 stopped: {type(exc).__name__})"
            ) from None

    def _barrier(self, key: str, count: int, timeout_s: float, fail_key: str | None) -> None:
        deadline = time.monotonic() + max(timeout_s, 1.0)
        self._store.add(key, 1)
        while (n := self._store.add(key, 0)) < count:
            if fail_key is not None and (reason := self.store_try_get(fail_key)) is not None:
                raise TransportError(reason.decode())
            if time.monotonic() > deadline:
                raise TransportError(
                    f"only {n} of {count} AFD ranks reached {key!r} at the rendezvous "
                    f"{self.host}:{self.port} within {timeout_s:.0f}s"
                )
            time.sleep(0.05)
        # The store lives in the master's process: it leaves the barrier last, so no rank
        # still polling finds the store gone.
        left = self._store.add(key + "/left", 1)
        if self.is_store_master:
            while left < count:
                if time.monotonic() > deadline:
                    raise TransportError(f"only {left} of {count} AFD ranks left {key!r}")
                time.sleep(0.01)
                left = self._store.add(key + "/left", 0)

    def close(self) -> None:
        self._data = self._ctrl = None
        self._store = None

    def store_set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def store_get(self, key: str, timeout_s: float) -> bytes:
        self._store.set_timeout(datetime.timedelta(seconds=timeout_s))
        try:
            return self._store.get(key)
        except Exception as exc:
            raise TransportError(f"no answer for {key!r} within {timeout_s:.0f}s: {exc}") from None

    def store_add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def store_try_get(self, key: str) -> bytes | None:
        return self._store.get(key) if self._store.check([key]) else None

    def _handle(self, post, what: str) -> Handle:
        try:
            return _GlooHandle(post(), what, self.timeout_s)
        except Exception as exc:  # posting fails at once when the pair is already closed
            raise TransportError(f"{what}: {_reason(exc, self.timeout_s)}") from None

    def isend(self, tensor, peer: int, tag: int) -> Handle:
        return self._handle(lambda: self._data.send([tensor], peer, tag), "send")

    def irecv(self, tensor, peer: int, tag: int) -> Handle:
        return self._handle(lambda: self._data.recv([tensor], peer, tag), "receive")

    def isend_control(self, tensor, peer: int) -> Handle:
        return self._handle(lambda: self._ctrl.send([tensor], peer, 0), "control send")

    def irecv_control(self, tensor, peer: int) -> Handle:
        return self._handle(lambda: self._ctrl.recv([tensor], peer, 0), "control receive")


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _reason(exc: BaseException, timeout_s: float) -> str:
    text = str(exc)
    if "Connection closed by peer" in text or "Connection reset" in text:
        return "the peer closed the connection (process exited or crashed)"
    if "Timed out" in text or "timeout" in text.lower():
        return f"no answer within {timeout_s:.0f}s"
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


class _GlooHandle(Handle):
    """A posted gloo operation; the group's own timeout bounds `wait` (timeout_s for data,
    CONTROL_TIMEOUT for control)."""

    __slots__ = ("_work", "_what", "_timeout_s")

    def __init__(self, work, what: str, timeout_s: float):
        self._work, self._what, self._timeout_s = work, what, timeout_s

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            if timeout_s is None:
                self._work.wait()
            else:
                self._work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            bound = self._timeout_s if timeout_s is None else timeout_s
            raise TransportError(f"{self._what}: {_reason(exc, bound)}") from None


class GlooConnector(PointToPointConnector):
    """Connector `gloo`: the point-to-point AFD protocol over GlooTransport (CPU tensors)."""

    def make_transport(self, group: int, group_rank: int, group_size: int) -> Transport:
        return self._gloo_transport(
            group, group_rank, group_size, self.config.is_ffn and self.role_rank == 0, 1.0
        )

    def make_side_transport(
        self, name: str, group_rank: int, group_size: int, connect_scale: float
    ) -> Transport:
        return self._gloo_transport(name, group_rank, group_size, False, connect_scale)

    def _gloo_transport(self, group, group_rank, group_size, store_master, connect_scale):
        extra = self.config.extra()
        return GlooTransport(
            self.config.host,
            self.config.port,
            group,
            group_rank,
            group_size,
            is_store_master=store_master,
            timeout_s=extra.timeout_s,
            connect_timeout_s=extra.connect_timeout_s * connect_scale,
        )

    def check_tensor(self, tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"connector 'gloo' moves CPU tensors only, got a tensor on {tensor.device}"
            )

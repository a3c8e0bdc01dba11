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
import time

from afd_core.connectors.p2p import PointToPointConnector
from afd_core.connectors.transport import Handle, Transport, TransportError

# An idle deployment may wait for days between steps; peer death is detected by the socket.
CONTROL_TIMEOUT = datetime.timedelta(days=30)


class GlooTransport(Transport):
    def __init__(
        self,
        host: str,
        port: int,
        group: int,
        group_rank: int,
        group_size: int,
        is_store_master: bool,
        timeout_s: float,
        connect_timeout_s: float,
    ):
        self.host, self.port = host, port
        self.group, self.group_rank, self.group_size = group, group_rank, group_size
        self.is_store_master = is_store_master
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._store = None
        self._data = None
        self._ctrl = None

    def connect(self) -> None:
        import torch.distributed as dist

        deadline = time.monotonic() + self.connect_timeout_s
        try:
            self._store = dist.TCPStore(
                self.host,
                self.port,
                None,
                self.is_store_master,
                timeout=datetime.timedelta(seconds=self.connect_timeout_s),
                wait_for_workers=False,
                use_libuv=True,
            )
        except Exception as exc:
            what = "listen on" if self.is_store_master else "reach FFN rank 0's rendezvous at"
            raise TransportError(
                f"could not {what} {self.host}:{self.port} within {self.connect_timeout_s:.0f}s "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); check afd.host/"
                "afd.port and that the FFN server is started"
            ) from None
        prefix = f"afd/g{self.group}"
        # Wait for the whole group in the store first: members start minutes apart (model
        # loading), and a gloo group would apply its short step timeout to that wait.
        self.barrier(f"{prefix}/arrived", self.group_size, deadline - time.monotonic())
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

    def barrier(self, key: str, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + max(timeout_s, 1.0)
        self._store.add(key, 1)
        while (n := self._store.add(key, 0)) < count:
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
        extra = self.config.extra()
        return GlooTransport(
            self.config.host,
            self.config.port,
            group,
            group_rank,
            group_size,
            is_store_master=self.config.is_ffn and self.role_rank == 0,
            timeout_s=extra.timeout_s,
            connect_timeout_s=extra.connect_timeout_s,
        )

    def check_tensor(self, tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"connector 'gloo' moves CPU tensors only, got a tensor on {tensor.device}"
            )

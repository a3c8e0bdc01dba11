"""The CUDA transport: the rendezvous store and CPU control channel every transport shares
(`rendezvous.py`), and a data channel of NCCL point-to-point operations on device streams.

Each group (one FFN rank and its attention peers) gets two communicators, one per direction
(`to_first`: attention -> FFN, `from_first`: FFN -> attention), each driven on a stream of
its own: a receive enqueued before a send on one stream would hold the send back until the
peer answered, which deadlocks as soon as micro-batches overlap. NCCL matches operations in
issue order per peer and communicator, not by tag: the protocol issues every data operation
in the same order on both sides and keeps its status message on the control channel
(docs/protocol.md), so the tags the protocol passes are not needed here.

The communicator is vLLM's `PyNcclCommunicator` built from a unique id that group rank 0
mints and publishes in the rendezvous store (no process group of vLLM's is touched); the
tests swap it for a stand-in (`CommFactory`), and the device runtime for a host one.
"""

from __future__ import annotations

import ctypes
from typing import Protocol

from afd_core.connectors.device import (
    ChannelAborted,
    CudaRuntime,
    DeviceHandle,
    DeviceRuntime,
    Watchdog,
)
from afd_core.connectors.p2p import PointToPointConnector
from afd_core.connectors.rendezvous import StoreTransport
from afd_core.connectors.transport import Handle, Transport, TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)


class DeviceComm(Protocol):
    """One communicator of a group: point-to-point operations enqueued on a stream."""

    def send(self, tensor, peer: int, stream) -> None: ...

    def recv(self, tensor, peer: int, stream) -> None: ...

    def abort(self) -> None:
        """Make every enqueued operation return (after a timeout); the communicator is
        unusable afterwards."""


class CommFactory(Protocol):
    def unique_id(self) -> bytes:
        """A new communicator id (group rank 0 mints it, the others read it)."""

    def connect(self, unique_id: bytes, rank: int, size: int, device) -> DeviceComm:
        """Join the communicator; returns when all `size` ranks joined."""


class _PyNcclComm:
    def __init__(self, comm):
        self._comm = comm

    def send(self, tensor, peer: int, stream) -> None:
        self._comm.send(tensor, peer, stream)

    def recv(self, tensor, peer: int, stream) -> None:
        self._comm.recv(tensor, peer, stream)

    def abort(self) -> None:
        self._comm.destroy()  # ncclCommAbort, off the calling thread (vLLM's own guard)


class PyNcclFactory:
    """vLLM's PyNcclCommunicator, joined from a unique id shared through AFD's store."""

    def unique_id(self) -> bytes:
        from vllm.distributed.device_communicators.pynccl_wrapper import (
            NCCL_UNIQUE_ID_BYTES,
            NCCLLibrary,
        )

        uid = NCCLLibrary().ncclGetUniqueId()
        return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)

    def connect(self, unique_id: bytes, rank: int, size: int, device) -> DeviceComm:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        return _PyNcclComm(PyNcclCommunicator.from_unique_id_bytes(unique_id, rank, size, device))


DIRECTIONS = ("to_first", "from_first")  # attention -> FFN (group rank 0), and back


class NcclTransport(StoreTransport):
    def __init__(self, *args, runtime: DeviceRuntime, comm_factory: CommFactory, **kwargs):
        super().__init__(*args, **kwargs)
        self.runtime = runtime
        self._factory = comm_factory
        self._comms: dict[str, DeviceComm] = {}
        self._send_comm = self._recv_comm = None
        self._send_stream = self._recv_stream = None
        self._watchdog: Watchdog | None = None
        self._failure: str | None = None

    def _connect_data(self, prefix: str) -> None:
        for direction in DIRECTIONS:  # the same order on every member: each join waits
            key = f"{prefix}/nccl/{direction}"
            if self.group_rank == 0:
                self._store.set(key, self._factory.unique_id())
            uid = self._store.get(key)
            self._comms[direction] = self._factory.connect(
                uid, self.group_rank, self.group_size, self.runtime.device
            )
        first = self.group_rank == 0
        self._send_comm = self._comms["from_first" if first else "to_first"]
        self._recv_comm = self._comms["to_first" if first else "from_first"]
        self._send_stream = self.runtime.new_stream()
        self._recv_stream = self.runtime.new_stream()
        self._watchdog = Watchdog(
            f"afd-g{self.group}-r{self.group_rank}", self._expired, self.runtime.thread_init
        )

    def _expired(self, what: str, timeout_s: float) -> None:
        self._failure = (
            f"{what}: no answer within {timeout_s:.0f}s; the NCCL data channel was aborted "
            "(the peer stopped, or the two sides are out of step)"
        )
        logger.error("AFD group %s: %s", self.group, self._failure)
        self._abort_comms()

    def _abort_comms(self) -> None:
        for comm in self._comms.values():
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - going down anyway
                logger.debug("AFD: NCCL abort failed", exc_info=True)
        self._comms.clear()

    def _check(self) -> None:
        if self._failure is not None:
            raise ChannelAborted(self._failure)
        if self._send_comm is None:
            raise TransportError("the NCCL data channel is not connected (or already closed)")

    def _post(self, comm, stream, tensor, peer: int, what: str, send: bool) -> Handle:
        self._check()
        runtime = self.runtime
        # the operation runs after everything the caller enqueued so far (the rows are
        # computed, the receive buffer is free)
        stream.wait_stream(runtime.current_stream())
        try:
            (comm.send if send else comm.recv)(tensor, peer, stream)
        except Exception as exc:
            raise TransportError(f"{what}: NCCL {type(exc).__name__}: {exc}") from None
        event = runtime.new_event()
        event.record(stream)
        if not runtime.is_capturing():
            # a captured operation runs at replay, where no Python runs: the step's status
            # (control channel, bounded) is what notices a stuck replay
            runtime.record_stream(tensor, stream)
            self._watchdog.watch(event, what, self.timeout_s)
        return DeviceHandle(runtime, event, self._check)

    def isend(self, tensor, peer: int, tag: int) -> Handle:
        return self._post(
            self._send_comm, self._send_stream, tensor, peer, f"send to group rank {peer}", True
        )

    def irecv(self, tensor, peer: int, tag: int) -> Handle:
        return self._post(
            self._recv_comm,
            self._recv_stream,
            tensor,
            peer,
            f"receive from group rank {peer}",
            False,
        )

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        self._abort_comms()
        self._send_comm = self._recv_comm = None
        super().close()


class NcclConnector(PointToPointConnector):
    """Connector `nccl`: the point-to-point AFD protocol over NcclTransport (CUDA tensors).

    `runtime` and `comm_factory` default to this process's CUDA device and vLLM's
    PyNcclCommunicator; the tests pass stand-ins."""

    fixed_receive_buffers = True

    def __init__(self, config, role_rank: int, wire, runtime=None, comm_factory=None):
        super().__init__(config, role_rank, wire)
        self._runtime = runtime
        self.comm_factory = comm_factory or PyNcclFactory()

    @property
    def runtime(self) -> DeviceRuntime:
        if self._runtime is None:  # built on first use: a config check touches no device
            import torch

            self._runtime = CudaRuntime(torch.device("cuda", torch.cuda.current_device()))
        return self._runtime

    @property
    def device(self):
        return self.runtime.device

    def new_transport(self, *args, **kwargs) -> Transport:
        return NcclTransport(*args, runtime=self.runtime, comm_factory=self.comm_factory, **kwargs)

    def check_tensor(self, tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(
                f"connector 'nccl' moves tensors on {self.device}, got a tensor on {tensor.device}"
            )

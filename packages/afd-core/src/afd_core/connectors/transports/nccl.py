"""The CUDA data channel: NCCL point-to-point communicators in afd-core's device transport
(`device_transport.py`: two communicators per group, one per direction, each on a stream of
its own; the rendezvous store and CPU control channel shared with every transport).

The communicator is vLLM's `PyNcclCommunicator` built from a unique id that group rank 0
mints and publishes in the rendezvous store (no process group of vLLM's is touched); the
tests swap it for a stand-in (`comm_factory`), and the device runtime for a host one.
"""

from __future__ import annotations

import ctypes

from afd_core.connectors.transports.device_transport import (
    DeviceComm,
    DeviceTransport,
)
from afd_core.connectors.transports.transport import TransportError
from afd_core.errors import AFDConfigError


class _PyNcclComm:
    def __init__(self, comm):
        self._comm = comm

    def send(self, tensor, peer: int, stream) -> None:
        self._comm.send(tensor, peer, stream)

    def recv(self, tensor, peer: int, stream) -> None:
        self._comm.recv(tensor, peer, stream)

    def group_start(self) -> None:
        self._comm.group_start()  # ncclGroupStart

    def group_end(self) -> None:
        self._comm.group_end()  # ncclGroupEnd: the operations since group_start go out

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

    def connect(self, unique_id: bytes, rank: int, size: int, device, store=None) -> DeviceComm:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        comm = PyNcclCommunicator.from_unique_id_bytes(unique_id, rank, size, device)
        if comm.disabled:
            # a disabled PyNccl's send and recv return without doing anything
            raise TransportError(_disabled_reason(size))
        return _PyNcclComm(comm)


def _disabled_reason(size: int) -> str:
    if size < 2:
        return f"an NCCL communicator of {size} rank moves nothing (vLLM disables it)"
    return (
        "vLLM's PyNccl communicator is disabled (VLLM_DISABLE_PYNCCL is set), so its sends "
        "and receives would do nothing; the nccl connector needs it: unset "
        "VLLM_DISABLE_PYNCCL"
    )


def check_pynccl_enabled() -> None:
    """Start-up check, before any resource is made: the nccl connector cannot run with
    VLLM_DISABLE_PYNCCL set."""
    import vllm.envs as envs

    if envs.VLLM_DISABLE_PYNCCL:
        raise AFDConfigError(
            "connector 'nccl': VLLM_DISABLE_PYNCCL is set, which turns vLLM's NCCL "
            "communicator into one whose sends and receives do nothing; unset it (AFD's "
            "data channel is that communicator)"
        )


class NcclTransport(DeviceTransport):
    channel = "NCCL"


__all__ = ["NcclTransport", "PyNcclFactory"]

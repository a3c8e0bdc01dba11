"""Connector `hccl`: the AFD point-to-point protocol between Ascend NPUs.

Only the data channel is Ascend's: the rendezvous store, the CPU control channel (gloo) and
the whole protocol are afd-core's (`DeviceTransport`, shared with NCCL). Each group gets two
HCCL communicators, one per direction, each driven on a stream of its own; a communicator
is a torch.distributed `ProcessGroupHCCL` (torch_npu) built on AFD's own rendezvous store
under a fresh prefix, outside vLLM's world and outside vLLM-Ascend's group registry (which
shares HCCL communicators between groups of the same ranks). HCCL, like NCCL, matches
point-to-point operations in issue order per peer, not by tag, which the protocol allows.

The tests swap the HCCL process group for gloo and the NPU runtime for a host one
(tests/afd_npu): everything above the process group runs as it does on an NPU.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable

from afd_core.connectors.device_connector import DeviceConnector
from afd_core.connectors.transports.device import DeviceRuntime


class NpuRuntime(DeviceRuntime):
    """Streams and events of one NPU (torch_npu registers `torch.npu`)."""

    def __init__(self, device):
        import torch
        import torch_npu  # noqa: F401 - registers torch.npu

        self.device = torch.device(device)
        self._npu = torch.npu

    def new_stream(self):
        return self._npu.Stream(device=self.device)

    def current_stream(self):
        return self._npu.current_stream(self.device)

    def new_event(self):
        return self._npu.Event()

    def is_capturing(self) -> bool:
        # the NPU path runs eagerly (ACL graphs are rejected at start-up)
        check = getattr(self._npu, "is_current_stream_capturing", None)
        return bool(check()) if check is not None else False

    def thread_init(self) -> None:
        self._npu.set_device(self.device)

    def run_on(self, stream, fn: Callable[[], None]) -> None:
        with self._npu.stream(stream):
            fn()


def hccl_backend(store, rank: int, size: int, timeout_s: float, name: str):
    """A ProcessGroupHCCL of `size` ranks on `store` (the communicator is created on the
    first operation, on the current NPU)."""
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    options = ProcessGroupHCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options.group_id = name
    return ProcessGroupHCCL(store, rank, size, options)


class ProcessGroupComm:
    """One communicator as a torch.distributed backend (ProcessGroupHCCL): each operation is
    issued with the given stream current, and its work waited for on that stream (on a
    device backend `Work.wait()` orders the current stream after the operation; the host
    does not wait)."""

    def __init__(self, backend, runtime: DeviceRuntime):
        self._backend = backend
        self._runtime = runtime

    def send(self, tensor, peer: int, stream) -> None:
        self._runtime.run_on(stream, lambda: self._backend.send([tensor], peer, 0).wait())

    def recv(self, tensor, peer: int, stream) -> None:
        self._runtime.run_on(stream, lambda: self._backend.recv([tensor], peer, 0).wait())

    def abort(self) -> None:
        for name in ("abort", "shutdown"):  # what this torch_npu's backend offers
            stop = getattr(self._backend, name, None)
            if stop is not None:
                stop()
                return


class HcclFactory:
    """Communicators as process groups on AFD's store: the "unique id" group rank 0 mints
    is a fresh store prefix, so every communicator gets its own HCCL group."""

    def __init__(self, runtime: DeviceRuntime, timeout_s: float, new_backend=hccl_backend):
        self.runtime = runtime
        self.timeout_s = timeout_s
        self._new_backend = new_backend

    def unique_id(self) -> bytes:
        return uuid.uuid4().bytes

    def connect(self, unique_id: bytes, rank: int, size: int, device, store=None):
        import torch.distributed as dist

        name = "afd-hccl/" + unique_id.hex()
        backend = self._new_backend(dist.PrefixStore(name, store), rank, size, self.timeout_s, name)
        return ProcessGroupComm(backend, self.runtime)


class HcclConnector(DeviceConnector):
    """Connector `hccl`: the point-to-point AFD protocol over HCCL (NPU tensors); control on
    a CPU gloo channel. `runtime` and `new_backend` default to this process's NPU and
    ProcessGroupHCCL; the tests pass a host runtime and gloo."""

    name = "hccl"
    channel = "HCCL"

    def __init__(self, config, role_rank: int, wire, runtime=None, new_backend=None):
        super().__init__(config, role_rank, wire, runtime=runtime)
        self._new_backend = new_backend or hccl_backend

    def default_runtime(self) -> DeviceRuntime:
        import torch
        import torch_npu  # noqa: F401 - registers torch.npu

        return NpuRuntime(torch.device("npu", torch.npu.current_device()))

    def default_comm_factory(self):
        return HcclFactory(self.runtime, self.config.extra().timeout_s, self._new_backend)

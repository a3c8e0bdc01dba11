"""An NCCL communicator of our own, for the GPU check on a machine without vLLM.

It is AFD's `CommFactory`/`DeviceComm` (afd_core.connectors.transports.device_transport) over NCCL's
C API through ctypes, making the calls vLLM's `PyNcclCommunicator.from_unique_id_bytes`
makes (ncclGetUniqueId, ncclCommInitRank, a one-element all-reduce warm-up, ncclSend and
ncclRecv on the caller's stream, ncclGroupStart/End around a launch, ncclCommAbort off the
calling thread with a 5 s join), so the NCCL connector meets NCCL as it would under vLLM.
`factory()` returns vLLM's own (afd_core.connectors.transports.nccl.PyNcclFactory) where vLLM can be
imported, else this one; its `name` says which ran.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

UNIQUE_ID_BYTES = 128
NCCL_UINT8, NCCL_FLOAT32, NCCL_SUM = 1, 7, 0


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def _load():
    """libnccl as torch loaded it (its own wheel's copy), else the first one found."""
    import torch

    torch.cuda.init()
    candidates = ["libnccl.so.2"]
    for base in {os.path.dirname(os.path.dirname(torch.__file__))}:
        candidates += glob.glob(os.path.join(base, "nvidia", "nccl", "lib", "libnccl.so*"))
    errors = []
    for path in candidates:
        try:
            return ctypes.CDLL(path), path
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise RuntimeError("no NCCL library: " + "; ".join(errors))


class NcclLibrary:
    def __init__(self):
        self.lib, self.path = _load()
        lib = self.lib
        p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [i]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(i)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(p), i, NcclUniqueId, i]
        lib.ncclSend.argtypes = [p, sz, i, i, p, p]
        lib.ncclRecv.argtypes = [p, sz, i, i, p, p]
        lib.ncclAllReduce.argtypes = [p, p, sz, i, i, p, p]
        lib.ncclCommAbort.argtypes = [p]
        lib.ncclGroupStart.argtypes = lib.ncclGroupEnd.argtypes = []
        names = ("ncclGetUniqueId", "ncclCommInitRank", "ncclSend", "ncclRecv")
        for name in (*names, "ncclGroupStart", "ncclGroupEnd"):
            getattr(lib, name).restype = i
        lib.ncclAllReduce.restype = lib.ncclCommAbort.restype = i

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(
                f"{what}: NCCL error {result}: {self.lib.ncclGetErrorString(result).decode()}"
            )

    def version(self) -> str:
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        code = v.value  # e.g. 22805 = 2.28.5
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


class CtypesNcclComm:
    def __init__(self, nccl: NcclLibrary, comm, device):
        self._nccl, self._comm, self._device = nccl, comm, device

    def _op(self, fn, tensor, peer: int, stream, what: str) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"{what}: tensor is not contiguous")
        nbytes = tensor.numel() * tensor.element_size()
        self._nccl.check(
            fn(
                ctypes.c_void_p(tensor.data_ptr()),
                nbytes,
                NCCL_UINT8,
                peer,
                self._comm,
                ctypes.c_void_p(stream.cuda_stream),
            ),
            what,
        )

    def send(self, tensor, peer: int, stream) -> None:
        self._op(self._nccl.lib.ncclSend, tensor, peer, stream, f"ncclSend to {peer}")

    def recv(self, tensor, peer: int, stream) -> None:
        self._op(self._nccl.lib.ncclRecv, tensor, peer, stream, f"ncclRecv from {peer}")

    def group_start(self) -> None:
        self._nccl.check(self._nccl.lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self) -> None:
        self._nccl.check(self._nccl.lib.ncclGroupEnd(), "ncclGroupEnd")

    def abort(self) -> None:
        # as vLLM's PyNcclCommunicator.destroy: ncclCommAbort may wait for graphs that
        # captured this communicator's operations, so it runs off this thread, 5 s at most
        import torch

        comm, self._comm = self._comm, None
        if comm is None:
            return

        def _abort():
            with torch.cuda.device(self._device):
                self._nccl.lib.ncclCommAbort(comm)

        t = threading.Thread(target=_abort, daemon=True)
        t.start()
        t.join(timeout=5.0)


class CtypesNcclFactory:
    name = "ctypes-nccl (ours: the calls of vLLM's PyNcclCommunicator.from_unique_id_bytes)"

    def __init__(self):
        self.nccl = NcclLibrary()

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.nccl.check(self.nccl.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def connect(self, unique_id: bytes, rank: int, size: int, device, store=None):
        import torch

        uid = NcclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self.nccl.check(
                self.nccl.lib.ncclCommInitRank(ctypes.byref(comm), size, uid, rank),
                f"ncclCommInitRank(rank {rank} of {size})",
            )
            # vLLM's warm-up: a one-element all-reduce (it connects the collective links
            # only; point-to-point pairs still connect at their first operation)
            data = torch.zeros(1, device=device)
            stream = torch.cuda.current_stream(device)
            self.nccl.check(
                self.nccl.lib.ncclAllReduce(
                    ctypes.c_void_p(data.data_ptr()),
                    ctypes.c_void_p(data.data_ptr()),
                    1,
                    NCCL_FLOAT32,
                    NCCL_SUM,
                    comm,
                    ctypes.c_void_p(stream.cuda_stream),
                ),
                "warm-up ncclAllReduce",
            )
            stream.synchronize()
        return CtypesNcclComm(self.nccl, comm, device)


def factory():
    """vLLM's PyNccl factory where vLLM imports, else ours."""
    try:
        import vllm.distributed.device_communicators.pynccl  # noqa: F401
    except Exception:  # noqa: BLE001 - no vLLM on the device machine
        return CtypesNcclFactory()
    from afd_core.connectors.transports.nccl import PyNcclFactory

    f = PyNcclFactory()
    f.name = "vLLM PyNcclCommunicator"
    return f

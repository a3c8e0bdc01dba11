"""Stand-ins that let the NCCL connector run on CPU, in real processes.

* `HostRuntime`: a device runtime whose side streams are threads running their operations
  one after another (as a CUDA stream does), whose events are set when the stream reaches
  them, and whose "current stream" is the calling thread (a wait on an event blocks it).
* `OrderedGlooFactory`: communicators that behave like NCCL's point-to-point: one gloo
  process group per communicator with a single tag, so a receive takes the peer's sends in
  issue order and a size mismatch or an ordering bug shows; each operation blocks its
  stream until the peer's matching one comes, so a receive enqueued before a send on one
  stream would deadlock here as it does on a GPU; and a pair's first operation blocks the
  host until the peer's first operation on that communicator, as NCCL's lazy connection
  does. Between `group_start()` and `group_end()` operations are held back and go out
  together at the end (one launch, as ncclGroupEnd's); `launches` counts them.
* `HostRuntime.synchronize()`: a host call that waits for the whole device, as
  `cudaDeviceSynchronize` does (and as CUDA's lazy kernel loading and the caching
  allocator's cudaMalloc/cudaFree may): it blocks until every operation enqueued on any
  stream so far has completed. A posted receive whose data depends on work the same host
  has not enqueued yet never completes then: the stand-in fails after SYNC_S, naming it,
  where a GPU would hang.

Spawned test processes import this module, so it holds no test functions.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import uuid
from datetime import timedelta

from afd_core.connectors.transports.device import DeviceRuntime
from afd_core.connectors.transports.transport import TransportError


class HostEvent:
    def __init__(self):
        self._done = threading.Event()

    def record(self, stream) -> None:
        stream.enqueue(self._done.set)

    def query(self) -> bool:
        return self._done.is_set()

    def wait_host(self, check) -> None:
        while not self._done.wait(0.01):
            check()


class HostStream:
    """A side stream: a thread running enqueued operations in order; while its runtime
    captures, what is enqueued is recorded into the capture instead (run at replay)."""

    def __init__(self, name: str, runtime=None):
        self.name = name
        self._runtime = runtime
        self._queue: queue.Queue = queue.Queue()
        self.error: Exception | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def enqueue(self, fn) -> None:
        graph = getattr(self._runtime, "capture_into", None)
        if graph is not None:
            graph.append((self, fn))
            return
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a failed operation leaves its event unset
                self.error = exc

    def wait_stream(self, other) -> None:
        if isinstance(other, HostStream):
            event = HostEvent()
            event.record(other)
            self.enqueue(lambda: event.wait_host(lambda: None))
        # the calling thread's own work is done already: nothing to wait for

    def wait_event(self, event) -> None:
        self.enqueue(lambda: event.wait_host(lambda: None))


class CallerStream:
    """The current stream: the calling thread itself."""

    def __init__(self, runtime):
        self._runtime = runtime

    def wait_stream(self, other) -> None:
        raise AssertionError("the transport never orders the caller after a side stream")

    def enqueue(self, fn) -> None:
        fn()


# How long HostRuntime.synchronize waits before it calls the wait a deadlock
SYNC_S = float(os.environ.get("AFD_TEST_DEVICE_SYNC_S", "10"))


class DeviceSyncDeadlock(RuntimeError):
    """A device-wide synchronize that could never return on a GPU."""


class HostRuntime(DeviceRuntime):
    def __init__(self):
        import torch

        self.device = torch.device("cpu")
        self.streams: list[HostStream] = []
        self.capturing = False
        self.capture_into: list | None = None  # the graph being captured
        self.waits = 0  # events the caller waited for
        self._caller = threading.local()

    def new_stream(self):
        s = HostStream(f"host-stream-{len(self.streams)}", self)
        self.streams.append(s)
        return s

    def current_stream(self):
        stream = getattr(self._caller, "stream", None)
        if stream is None:  # one per thread: the same stream compares equal, as CUDA's do
            stream = self._caller.stream = CallerStream(self)
        return stream

    def new_event(self):
        return HostEvent()

    def is_capturing(self) -> bool:
        return self.capturing

    def record_stream(self, tensor, stream) -> None:
        return None

    def wait_event(self, event, check) -> None:
        self.waits += 1
        if self.capture_into is not None:
            return  # a dependency inside the graph: nothing waits while capturing
        event.wait_host(check)

    @contextlib.contextmanager
    def capture(self, graph: list):
        """Record what the streams are given into `graph`, as a CUDA stream capture does:
        nothing runs until the graph is replayed (HostGraphBackend)."""
        self.capturing, self.capture_into = True, graph
        try:
            yield graph
        finally:
            self.capturing, self.capture_into = False, None

    def run_on(self, stream, fn) -> None:
        stream.enqueue(fn)

    def synchronize(self) -> None:
        """Wait until every stream ran everything enqueued on it so far (cudaDeviceSynchronize)."""
        self.synchronizes = getattr(self, "synchronizes", 0) + 1
        events = []
        for stream in self.streams:
            event = HostEvent()
            event.record(stream)
            events.append((stream, event))
        deadline = time.monotonic() + SYNC_S
        for stream, event in events:
            if not event._done.wait(max(deadline - time.monotonic(), 0)):
                raise DeviceSyncDeadlock(
                    f"NCCL stand-in: a device-wide synchronize waited {SYNC_S:.0f}s for "
                    f"{stream.name}: an operation posted on it waits for data that depends "
                    "on work this host has not enqueued yet (a GPU would hang here)"
                )


class HostGraphBackend:
    """FFNGraphCache's backend over HostRuntime: a graph is the stream operations recorded
    while capturing. A replay enqueues them again; it does not run the Python compute
    recorded between them (a CUDA graph would), so tests replay only where the values do
    not matter."""

    def __init__(self, runtime: HostRuntime):
        self.runtime = runtime

    def capture(self, fn):
        with self.runtime.capture([]) as graph:
            fn()
        return graph

    def replay(self, graph) -> None:
        for stream, fn in graph:
            stream.enqueue(fn)


class RerunGraphBackend:
    """A graph backend whose graph is the function itself, run again at replay: what a
    CUDA graph of a pure compute does (FFNBucketGraphs' layer graphs), on CPU."""

    def __init__(self):
        self.captures = self.replays = 0

    def capture(self, fn):
        fn()
        self.captures += 1
        return fn

    def replay(self, graph) -> None:
        self.replays += 1
        graph()


# How long a pair's first operation waits on the host for the peer's first operation on
# the same communicator; NCCL waits forever, the stand-in fails the test instead
HANDSHAKE_S = float(os.environ.get("AFD_TEST_NCCL_HANDSHAKE_S", "20"))


class _Waited(threading.Event):
    error: Exception | None = None


class OrderedGlooComm:
    """One communicator. As NCCL's, a pair connects at its first operation, and that
    operation blocks the calling host thread until the peer's first operation on this
    communicator is posted: an order of first operations that NCCL would deadlock on
    fails here (after HANDSHAKE_S) instead of passing."""

    def __init__(self, pg, store, rank: int):
        self._pg = pg
        self._store, self._rank = store, rank
        self._connected: set[int] = set()
        self.sent: list[tuple[int, tuple]] = []  # (peer, shape) in issue order, for tests
        self.received: list[tuple[int, tuple]] = []
        self.aborted = False
        self.launches = 0  # operations outside a group, plus groups
        self._group: list | None = None  # (stream, fn) held back until group_end
        self._waits: queue.Queue = queue.Queue()  # (gloo work, _Waited), in issue order
        threading.Thread(target=self._waiter, name="standin-waiter", daemon=True).start()

    def group_start(self) -> None:
        assert self._group is None, "NCCL stand-in: nested group_start"
        self._group = []

    def group_end(self) -> None:
        group, self._group = self._group, None
        assert group is not None, "NCCL stand-in: group_end without group_start"
        self.launches += 1
        for stream, fn in group:
            stream.enqueue(fn)

    def _enqueue(self, stream, fn) -> None:
        if self._group is not None:
            self._group.append((stream, fn))
            return
        self.launches += 1
        stream.enqueue(fn)

    def _connect(self, peer: int) -> None:
        if peer in self._connected:
            return
        self._store.set(f"first/{self._rank}->{peer}", b"1")
        try:
            self._store.wait([f"first/{peer}->{self._rank}"], timedelta(seconds=HANDSHAKE_S))
        except Exception:  # noqa: BLE001 - the store's timeout, whatever its type
            raise TransportError(
                f"NCCL stand-in: the first operation of rank {self._rank} with rank {peer} on "
                f"this communicator found no first operation of the peer within "
                f"{HANDSHAKE_S:.0f}s (NCCL would block here forever: each side waits for "
                "the other's first operation)"
            ) from None
        self._connected.add(peer)

    def send(self, tensor, peer: int, stream) -> None:
        self._connect(peer)
        self.sent.append((peer, tuple(tensor.shape)))
        self._enqueue(stream, lambda: self._op(self._pg.send, tensor, peer))

    def recv(self, tensor, peer: int, stream) -> None:
        self._connect(peer)
        self.received.append((peer, tuple(tensor.shape)))
        self._enqueue(stream, lambda: self._op(self._pg.recv, tensor, peer))

    def _op(self, post, tensor, peer):
        """Run one operation on its stream's thread until it completes or the
        communicator is aborted (as ncclCommAbort ends a kernel waiting for a peer)."""
        if self.aborted:
            return
        try:
            work = post([tensor], peer, 0)
        except Exception as exc:  # noqa: BLE001 - a stream has nobody to raise to
            if not self.aborted:
                raise TransportError(str(exc)) from None
            return
        # gloo's point-to-point work completes only in wait(): a waiter thread waits, this
        # stream's thread watches for the end or an abort
        done = _Waited()
        self._waits.put((work, done))
        while not done.wait(0.05):
            if self.aborted:
                return  # the kernel ends; the buffer holds whatever it held
        if done.error is not None and not self.aborted:
            raise TransportError(str(done.error))

    def _waiter(self) -> None:
        while True:
            work, done = self._waits.get()
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - handed to the stream
                done.error = exc
            done.set()

    def abort(self) -> None:
        """As ncclCommAbort: the pending operations end (with garbage), later ones do
        nothing."""
        self.aborted = True


class OrderedGlooFactory:
    """Communicator ids are store prefixes; each communicator is a gloo group on them."""

    def __init__(self, host: str, port: int, timeout_s: float = 600.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.comms: list[OrderedGlooComm] = []

    def unique_id(self) -> bytes:
        return uuid.uuid4().bytes

    def connect(self, unique_id: bytes, rank: int, size: int, device, store=None):
        import torch.distributed as dist

        store = dist.TCPStore(self.host, self.port, None, False, wait_for_workers=False)
        prefix = "standin/" + unique_id.hex()
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=self.timeout_s)
        )
        comm = OrderedGlooComm(pg, dist.PrefixStore(prefix + "/handshake", store), rank)
        self.comms.append(comm)
        return comm


def nccl_standin_connector(cfg, rank, wire):
    """An NcclConnector over the stand-ins (cfg: an afd config naming connector 'nccl').
    AFD_TEST_NO_PRECONNECT=1: the transport skips connecting its pairs at start-up (to show
    the stand-in catches the deadlock that would follow)."""
    from afd_core.connectors.nccl import NcclConnector

    if os.environ.get("AFD_TEST_NO_PRECONNECT"):
        from afd_core.connectors.transports.device_transport import DeviceTransport

        DeviceTransport._preconnect = lambda self, *args: None

    return NcclConnector(
        cfg, rank, wire, runtime=HostRuntime(), comm_factory=OrderedGlooFactory(cfg.host, cfg.port)
    )


def gloo_backend(store, rank: int, size: int, timeout_s: float, name: str):
    """A gloo process group where the HCCL connector builds a ProcessGroupHCCL: the same
    torch.distributed backend calls; the connector passes one tag, so operations match in
    issue order, as HCCL's do."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))


def hccl_standin_connector(cfg, rank, wire):
    """afd-npu's HcclConnector over a host runtime and gloo (cfg names connector 'hccl')."""
    from afd_npu.connectors.hccl import HcclConnector

    return HcclConnector(cfg, rank, wire, runtime=HostRuntime(), new_backend=gloo_backend)


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False

"""What a device data channel needs of the accelerator, and its watchdog.

A device transport (NCCL, HCCL) enqueues its sends and receives on streams of its own and
returns handles whose wait makes the caller's current stream wait for the operations'
event (`DeviceRuntime.wait_event`), so the host never blocks on the device (the control
channel stays the only host-side wait of a step), and it works inside a captured graph,
where a host wait is not allowed. A `Watchdog` thread bounds every operation posted
outside a capture: one that has not completed by its deadline aborts the channel (an NCCL
kernel waiting for a dead peer never returns otherwise) and the transport's next call
raises the named error.

`DeviceRuntime` is the seam the tests swap: `CudaRuntime` on CUDA, a host stand-in on CPU.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from afd_core.connectors.transports.transport import TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)


class DeviceRuntime(ABC):
    """Streams and events of one device."""

    device = None  # the torch.device tensors of this channel live on

    @abstractmethod
    def new_stream(self):
        """A stream of the device, ordered after nothing (a stream object with
        `wait_stream(other)` and `wait_event(event)`)."""

    @abstractmethod
    def current_stream(self): ...

    @abstractmethod
    def new_event(self):
        """An event with `record(stream)` and `query()` (done?)."""

    @abstractmethod
    def is_capturing(self) -> bool:
        """Whether the current stream is being captured into a graph."""

    def record_stream(self, tensor, stream) -> None:
        """Tell the caching allocator `tensor` is in use on `stream` until it completes."""
        tensor.record_stream(stream)

    def thread_init(self) -> None:
        """Called first in a helper thread of the transport that touches the device (the
        watchdog)."""
        return None

    def wait_event(self, event, check: Callable[[], None]) -> None:
        """Order the caller's current stream after `event` (no host wait); `check` raises
        if the channel was aborted meanwhile (a runtime whose wait blocks polls it)."""
        self.current_stream().wait_event(event)

    def run_on(self, stream, fn: Callable[[], None]) -> None:
        """Run `fn` with `stream` current, so what it enqueues runs on that stream (for
        communicators that take no stream argument, like torch.distributed backends)."""
        raise NotImplementedError(f"{type(self).__name__} cannot make a stream current")


class CudaRuntime(DeviceRuntime):
    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self._torch = torch

    def new_stream(self):
        return self._torch.cuda.Stream(device=self.device)

    def current_stream(self):
        return self._torch.cuda.current_stream(self.device)

    def new_event(self):
        return self._torch.cuda.Event()

    def is_capturing(self) -> bool:
        return self._torch.cuda.is_current_stream_capturing()

    def run_on(self, stream, fn: Callable[[], None]) -> None:
        with self._torch.cuda.stream(stream):
            fn()

    def thread_init(self) -> None:
        """Put this thread's stream-capture mode to thread-local: vLLM captures its graphs in
        CUDA's global mode, which forbids `cudaEventQuery` from every other thread while a
        capture is open; a watchdog query then would invalidate the capture (PyTorch's own
        NCCL watchdog opts out the same way). The thread's device first: its first event
        query would otherwise make a context on device 0 (a stray context on another
        rank's GPU where a process sees several)."""
        import ctypes

        self._torch.cuda.set_device(self.device)

        try:
            mode = ctypes.c_int(1)  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
        except (OSError, AttributeError):
            logger.warning(
                "AFD: could not set the watchdog thread's capture mode to thread-local; "
                "a watchdog query during a graph capture may fail it"
            )


class Watchdog:
    """One thread watching the events of posted operations against their deadlines; the
    first operation past its deadline calls `on_expired(what, timeout_s)` once, and the
    watchdog stops. An operation watched with a `key` (a per-member link's) calls
    `on_key_expired(key, what, timeout_s)` instead: that key's operations leave the watch
    and the others stay watched (the link alone is aborted)."""

    POLL_S = 0.005

    def __init__(
        self,
        name: str,
        on_expired: Callable[[str, float], None],
        thread_init: Callable[[], None] = lambda: None,
        on_key_expired: Callable[[object, str, float], None] | None = None,
    ):
        self._on_expired = on_expired
        self._on_key_expired = on_key_expired
        self._thread_init = thread_init
        self._heap: list = []  # (deadline, seq, event, what, timeout_s, key)
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-watchdog", daemon=True)
        self._thread.start()

    def watch(self, event, what: str, timeout_s: float, key=None) -> None:
        with self._cond:
            entry = (time.monotonic() + timeout_s, next(self._seq), event, what, timeout_s, key)
            heapq.heappush(self._heap, entry)
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        self._thread_init()
        while True:
            with self._cond:
                while not self._heap and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                # completed operations leave in posting order (one stream per direction)
                while self._heap and _done(self._heap[0][2]):
                    heapq.heappop(self._heap)
                expired = (
                    self._heap[0] if self._heap and self._heap[0][0] < time.monotonic() else None
                )
                key = expired[5] if expired is not None else None
                alone = expired is not None and key is not None and self._on_key_expired
                if alone:  # that key's operations go; the others stay watched
                    self._heap = [e for e in self._heap if e[5] != key]
                    heapq.heapify(self._heap)
                elif expired is not None:
                    self._heap.clear()
                    self._stopped = True
            if alone:
                self._on_key_expired(key, expired[3], expired[4])
            elif expired is not None:
                self._on_expired(expired[3], expired[4])
                return
            time.sleep(self.POLL_S)


def _done(event) -> bool:
    try:
        return event.query()
    except RuntimeError:  # e.g. a capture this thread may not look into: ask again later
        logger.debug("AFD watchdog: event query failed", exc_info=True)
        return False


class ChannelAborted(TransportError):
    """The watchdog aborted the device channel: an operation did not complete in time."""

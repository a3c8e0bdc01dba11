"""Run a step's micro-batches on persistent threads that hand a baton at the DBO yield op.

Exactly one micro-batch thread runs at a time. Micro-batch i runs until its FFN proxy has
started a layer's exchange (receive posted, rows sent) and calls the yield op; the baton
then goes to the next unfinished micro-batch, whose attention runs while the FFN ranks
compute i's rows. So attention compute on this side overlaps FFN compute on the other:
the ping-pong of dual-batch overlap, for any m. vLLM's own micro-batching (UBatchWrapper)
is CUDA-only and starts new threads every step; this executor keeps its threads.

When a micro-batch raises, every other one is released from its wait and unwinds with
MicrobatchAborted, and `run` re-raises the first error: a failure never leaves a thread
waiting for a baton that will not come. No torch import here; `on_resume` lets the caller
restore per-micro-batch state (vLLM's forward context) each time a thread takes the baton.

On an accelerator every job runs on the caller's device and current stream: a new thread
starts on the device's default stream, while vLLM's model runner works on a stream of its
own, so the jobs' kernels would race the caller's inputs and the concatenated outputs.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from afd_core.step.split import MAX_MICROBATCHES


class MicrobatchAborted(RuntimeError):
    """Raised inside a micro-batch thread released because another micro-batch failed."""


class MicrobatchStalled(RuntimeError):
    """A step's micro-batches made no progress (no yield, none ended) within the bound: one
    is stuck in its own compute. Its thread cannot be stopped, so the executor is done."""


_local = threading.local()  # .executor, .index: set in micro-batch threads only


def current_microbatch() -> int | None:
    """The index of the micro-batch this thread runs, or None outside micro-batch threads."""
    return getattr(_local, "index", None)


def yield_to_next_microbatch() -> bool:
    """The yield op's first choice: hand the baton on if this thread is a micro-batch of a
    running step (True); False when no AFD micro-batching is active on this thread."""
    executor = getattr(_local, "executor", None)
    if executor is None:
        return False
    executor._yield(_local.index)
    return True


def caller_stream():
    """The calling thread's current accelerator stream (it names its device), or None where
    there is no accelerator (CPU) or torch was never imported."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_stream()


def enter_stream(stream) -> None:
    """Make `stream` (and its device) current on this thread, for torch and for vLLM.

    vLLM keeps its own record of each thread's current stream (`vllm.utils.torch_utils.
    current_stream()`, read by its PyNccl collectives when given no stream, the attention
    tensor-parallel all-gather among them, and by some MLA backends), kept by the
    `torch.cuda.set_stream` vLLM patches in. `torch.accelerator.set_stream` bypasses it:
    the thread's record would stay unset (vLLM then moves the thread to a new stream of
    its own) or name an earlier step's stream, and those kernels would run on a stream
    nobody waits for. So CUDA streams go through `torch.cuda.set_stream`, and other
    devices' record is set as vLLM's patch sets it."""
    if stream is None:
        return
    torch = sys.modules["torch"]
    if getattr(getattr(stream, "device", None), "type", None) == "cuda":
        torch.cuda.set_stream(stream)  # vLLM's patched one where vLLM is imported
        return
    torch.accelerator.set_stream(stream)
    vllm_streams = sys.modules.get("vllm.utils.torch_utils")
    if vllm_streams is not None and hasattr(vllm_streams, "_current_stream_tls"):
        vllm_streams._current_stream_tls.value = stream


class _Worker:
    def __init__(self, executor: MicrobatchExecutor, index: int):
        self.index = index
        self.baton = threading.Event()  # set: this micro-batch may run
        self.assigned = threading.Event()  # set: a job is waiting for this thread
        self.job: Callable[[], Any] | None = None
        self.thread = threading.Thread(
            target=executor._serve, args=(self,), name=f"afd-microbatch-{index}", daemon=True
        )
        self.thread.start()


class MicrobatchExecutor:
    """Runs up to MAX_MICROBATCHES jobs of one step, one at a time, switching at yields."""

    def __init__(self, on_resume: Callable[[int], None] | None = None):
        self._on_resume = on_resume or (lambda index: None)
        self._workers: list[_Worker] = []
        self._run_lock = threading.Lock()  # one step at a time
        self._state_lock = threading.Lock()
        self._closed = False
        self._stalled: str | None = None  # why no step can run any more
        self._reset(0)

    def _reset(self, n: int) -> None:
        self._n = n
        self._finished = [False] * n
        self._results: list[Any] = [None] * n
        self._error: BaseException | None = None
        self._aborted = False
        self._all_done = threading.Event()
        self._stream = None  # the caller's accelerator stream, for every job
        self._progress = 0  # yields and ends so far: a stuck step makes none
        self._running = 0  # the micro-batch holding the baton

    # -- the caller's side --------------------------------------------------------------
    def run(
        self, jobs: Sequence[Callable[[], Any]], stall_timeout_s: float | None = None
    ) -> list[Any]:
        """Run the jobs as micro-batches 0..n-1 and return their results in order;
        MicrobatchStalled if none yields or ends for stall_timeout_s (None: no bound)."""
        n = len(jobs)
        if not 1 <= n <= MAX_MICROBATCHES:
            raise ValueError(f"{n} micro-batches; allowed 1..{MAX_MICROBATCHES}")
        if getattr(_local, "executor", None) is not None:
            raise RuntimeError("a micro-batch cannot start micro-batches of its own")
        with self._run_lock:
            if self._closed:
                raise RuntimeError("the micro-batch executor is closed")
            if self._stalled is not None:
                raise RuntimeError(f"the micro-batch executor stalled earlier: {self._stalled}")
            while len(self._workers) < n:
                self._workers.append(_Worker(self, len(self._workers)))
            self._reset(n)
            self._stream = caller_stream()
            for worker, job in zip(self._workers, jobs, strict=False):
                worker.baton.clear()
                worker.job = job
                worker.assigned.set()
            self._workers[0].baton.set()
            self._wait_all_done(stall_timeout_s)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            return list(self._results)

    def _wait_all_done(self, stall_timeout_s: float | None) -> None:
        seen = -1
        while not self._all_done.wait(stall_timeout_s):
            with self._state_lock:
                progress, running = self._progress, self._running
                unfinished = [i for i in range(self._n) if not self._finished[i]]
            if progress == seen:
                self._stalled = (
                    f"micro-batch {running} of this step made no progress within "
                    f"{stall_timeout_s:g} s (no layer exchanged, not ended: stuck in its own "
                    f"compute); micro-batch(es) {unfinished} unfinished"
                )
                raise MicrobatchStalled(self._stalled)
            seen = progress

    def close(self) -> None:
        """Stop the threads (they are daemons; this only makes shutdown tidy)."""
        with self._run_lock:
            self._closed = True
            for worker in self._workers:
                worker.job = None
                worker.assigned.set()

    # -- the micro-batch threads -----------------------------------------------------------
    def _serve(self, worker: _Worker) -> None:
        _local.executor, _local.index = self, worker.index
        while True:
            worker.assigned.wait()
            worker.assigned.clear()
            job = worker.job
            if job is None:  # closed
                return
            worker.job = None
            try:
                worker.baton.wait()
                worker.baton.clear()
                if self._aborted:
                    raise MicrobatchAborted(f"micro-batch {worker.index} released: step failed")
                self._running = worker.index
                enter_stream(self._stream)
                self._on_resume(worker.index)
                self._results[worker.index] = job()
            except BaseException as exc:  # noqa: BLE001 - handed to run()
                self._abort(exc)
            finally:
                self._finish(worker.index)

    def _next_unfinished(self, index: int) -> int | None:
        for step in range(1, self._n):
            j = (index + step) % self._n
            if not self._finished[j]:
                return j
        return None

    def _yield(self, index: int) -> None:
        with self._state_lock:
            self._progress += 1
            nxt = self._next_unfinished(index)
        if nxt is None:
            return  # the others are done: keep the baton
        me = self._workers[index]
        self._workers[nxt].baton.set()
        me.baton.wait()
        me.baton.clear()
        self._running = index
        if self._aborted:
            raise MicrobatchAborted(f"micro-batch {index} released: another micro-batch failed")
        self._on_resume(index)

    def _finish(self, index: int) -> None:
        with self._state_lock:
            self._progress += 1
            self._finished[index] = True
            nxt = self._next_unfinished(index)
            done = all(self._finished)
        if done:
            self._all_done.set()
        elif nxt is not None and not self._aborted:
            self._workers[nxt].baton.set()

    def _abort(self, exc: BaseException) -> None:
        with self._state_lock:
            # the first real error wins; a released micro-batch's MicrobatchAborted only
            # stands in until then
            if self._error is None or (
                isinstance(self._error, MicrobatchAborted)
                and not isinstance(exc, MicrobatchAborted)
            ):
                self._error = exc
            self._aborted = True
        for worker in self._workers[: self._n]:
            worker.baton.set()

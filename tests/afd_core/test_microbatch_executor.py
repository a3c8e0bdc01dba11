"""The micro-batch executor: one thread runs at a time, the baton moves at each yield, a
failure releases every waiting thread and is re-raised, threads are kept between steps."""

from __future__ import annotations

import threading
import time

import pytest

from afd_core.step.microbatch import (
    MicrobatchExecutor,
    MicrobatchStalled,
    current_microbatch,
    yield_to_next_microbatch,
)


def layered_job(trace, layers):
    def job():
        mb = current_microbatch()
        for layer in range(layers):
            trace.append((mb, layer))
            assert yield_to_next_microbatch()
        return (mb, threading.current_thread().name)

    return job


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_round_robin_at_each_yield(m):
    ex = MicrobatchExecutor()
    trace: list = []
    results = ex.run([layered_job(trace, 3) for _ in range(m)])
    assert [r[0] for r in results] == list(range(m))
    # layer-major, micro-batch-minor: the order the FFN side serves them in
    assert trace == [(mb, layer) for layer in range(3) for mb in range(m)]
    ex.close()


def test_threads_are_reused_between_steps_and_resume_hook_runs():
    resumed = []
    ex = MicrobatchExecutor(on_resume=resumed.append)
    first = ex.run([layered_job([], 2) for _ in range(2)])
    second = ex.run([layered_job([], 2) for _ in range(2)])
    assert [r[1] for r in first] == [r[1] for r in second]  # same threads
    assert resumed.count(0) == resumed.count(1) == 2 * 3  # start + after each of 2 yields
    ex.close()


def test_unequal_micro_batches_finish_in_any_order():
    ex = MicrobatchExecutor()
    trace: list = []
    jobs = [layered_job(trace, n) for n in (1, 4, 2)]
    assert [r[0] for r in ex.run(jobs)] == [0, 1, 2]
    assert sorted(trace) == sorted([(0, 0)] + [(1, i) for i in range(4)] + [(2, 0), (2, 1)])
    ex.close()


def test_only_one_microbatch_runs_at_a_time():
    ex = MicrobatchExecutor()
    running = []
    lock = threading.Lock()
    overlap = []

    def job():
        for _ in range(5):
            with lock:
                running.append(1)
                if len(running) > 1:
                    overlap.append(True)
            running.pop()
            yield_to_next_microbatch()

    ex.run([job] * 4)
    assert not overlap
    ex.close()


def test_failure_releases_every_thread_and_is_reraised_then_next_step_runs():
    ex = MicrobatchExecutor()
    unwound = []

    def failing():
        yield_to_next_microbatch()
        raise ValueError("boom in micro-batch 1")

    def waiting():
        try:
            for _ in range(10):
                yield_to_next_microbatch()
        except BaseException as exc:
            unwound.append(type(exc).__name__)
            raise

    with pytest.raises(ValueError, match="boom in micro-batch 1"):
        ex.run([waiting, failing, waiting])
    assert unwound == ["MicrobatchAborted", "MicrobatchAborted"]
    trace: list = []
    assert len(ex.run([layered_job(trace, 2)] * 2)) == 2  # the executor is reusable
    ex.close()


def test_yield_outside_microbatch_threads_is_not_taken():
    assert current_microbatch() is None
    assert yield_to_next_microbatch() is False


def test_limits():
    ex = MicrobatchExecutor()
    with pytest.raises(ValueError, match="allowed 1..4"):
        ex.run([lambda: 0] * 5)

    def nested():
        return ex.run([lambda: 0])

    with pytest.raises(RuntimeError, match="cannot start micro-batches of its own"):
        MicrobatchExecutor().run([nested])
    ex.close()
    with pytest.raises(RuntimeError, match="closed"):
        ex.run([lambda: 0])


def test_every_job_runs_on_the_callers_accelerator_stream(monkeypatch):
    """A new thread starts on the device's default stream, vLLM's runner works on its own:
    each job makes the caller's current stream (read in run(), on the caller's thread)
    current before it runs, step after step. The accelerator is stood in (CPU here; the
    real CUDA streams are in tests/gpu/nccl_check.py's eager DBO scenario)."""
    import afd_core.step.microbatch as microbatch

    current = threading.local()
    monkeypatch.setattr(microbatch, "caller_stream", lambda: getattr(current, "stream", None))
    monkeypatch.setattr(microbatch, "enter_stream", lambda s: setattr(current, "stream", s))

    def job():
        seen = [getattr(current, "stream", None)]
        assert yield_to_next_microbatch()
        seen.append(getattr(current, "stream", None))
        return seen

    ex = MicrobatchExecutor()
    for stream in ("runner-stream-A", "runner-stream-B"):
        current.stream = stream  # the caller's
        assert ex.run([job, job]) == [[stream, stream], [stream, stream]]
    ex.close()


class _FakeCudaStream:
    """Stands for a torch.cuda.Stream: enter_stream tells CUDA streams by their device."""

    class device:  # noqa: N801 - read as stream.device.type
        type = "cuda"

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


@pytest.mark.vllm
def test_vllms_current_stream_in_micro_batch_threads_is_the_callers(monkeypatch):
    """vLLM records each thread's current stream in its patched torch.cuda.set_stream and
    its collectives read that record (vllm.utils.torch_utils.current_stream: PyNccl's
    all-gather with no stream given, the attention tensor-parallel all-gather among them).
    Attention TP 2 with m = 2: in every micro-batch thread of both TP ranks, each
    all-gather (before and after the DBO yield) is issued on the step's caller stream,
    step after step, as vLLM's record says; torch's own set_stream is stood in (no GPU)."""
    import torch
    import vllm.utils.torch_utils as vllm_streams

    import afd_core.step.microbatch as microbatch
    from afd_core.step.sequence_split import SequenceSplit

    # vLLM's mechanism (importing vLLM's CPU model runner V2 in this process, as another
    # test may, replaces it with a no-op: vllm/v1/worker/cpu/shm.py; put it back here)
    monkeypatch.setattr(torch.cuda, "set_stream", vllm_streams._patched_set_stream)
    set_on = {}  # thread -> the stream torch was told
    monkeypatch.setattr(
        vllm_streams, "prev_set_stream", lambda s: set_on.__setitem__(threading.get_ident(), s)
    )
    callers = threading.local()  # each TP rank's runner thread: its current stream
    monkeypatch.setattr(microbatch, "caller_stream", lambda: callers.stream)

    def rank_main(tp_rank: int, issued: list):
        def all_gather(t):
            # what PyNccl does with stream=None: vLLM's record of this thread's stream
            issued.append((tp_rank, microbatch.current_microbatch(), vllm_streams.current_stream()))
            return torch.cat([t, t])

        split = SequenceSplit(tp_rank, 2, all_gather)

        def job(n):
            def run():
                out = split.gather(torch.zeros(split.rows(n), 4), n)
                assert yield_to_next_microbatch()
                return split.gather(out[: split.rows(n)], n)

            return run

        ex = MicrobatchExecutor()
        for step in range(2):
            callers.stream = _FakeCudaStream(f"rank{tp_rank}-step{step}")
            ex.run([job(3), job(4)])
        ex.close()

    issued: dict[int, list] = {0: [], 1: []}
    ranks = [threading.Thread(target=rank_main, args=(r, issued[r])) for r in (0, 1)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(30)
    for r in (0, 1):
        # 2 steps x 2 micro-batches x 2 all-gathers, each on its step's caller stream
        assert len(issued[r]) == 8, issued[r]
        streams = [str(s) for _, _, s in issued[r]]
        assert streams == [f"rank{r}-step0"] * 4 + [f"rank{r}-step1"] * 4, issued[r]
        assert {mb for _, mb, _ in issued[r]} == {0, 1}


def test_caller_stream_is_none_without_an_accelerator():
    from afd_core.step.microbatch import caller_stream, enter_stream

    assert caller_stream() is None  # CPU (or no torch imported)
    enter_stream(None)  # nothing to do


def test_a_step_that_makes_no_progress_is_bounded_and_named():
    """A micro-batch stuck in its own compute (no yield, no end) ends the wait after
    stall_timeout_s with an error naming it; the executor refuses further steps (its
    thread is still inside the job)."""
    release = threading.Event()

    def stuck():
        release.wait(30)
        return "late"

    ex = MicrobatchExecutor()
    t0 = time.monotonic()
    with pytest.raises(MicrobatchStalled, match=r"micro-batch 0 .*no progress within 0.3 s"):
        ex.run([stuck, lambda: 1], stall_timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match="stalled"):
        ex.run([lambda: 1, lambda: 2])
    release.set()


def test_a_slow_step_that_keeps_yielding_is_not_stalled():
    def job():
        for _ in range(6):
            time.sleep(0.1)
            yield_to_next_microbatch()
        return current_microbatch()

    ex = MicrobatchExecutor()
    assert ex.run([job, job], stall_timeout_s=0.5) == [0, 1]  # 1.2 s in all, progress each 0.1
    ex.close()


def test_a_stalled_step_stops_the_attention_rank_naming_the_micro_batch():
    """The step driver bounds the wait by the connector's step timeout (times
    ATTENTION_WAIT_FACTOR + 1: an exchange may wait ATTENTION_WAIT_FACTOR of them), and a
    stall is fatal (AFDPeerError): the stuck thread may still issue this step's exchanges,
    so the step cannot be finished in protocol."""
    from types import SimpleNamespace

    from afd_core.connectors.base import AFDPeerError
    from afd_core.step.attention import AttentionStepDriver

    calls = []
    conn = SimpleNamespace(
        role_rank=3,
        config=SimpleNamespace(extra=lambda: SimpleNamespace(timeout_s=0.3)),
        begin_step=lambda rows, flags: calls.append("begin") or SimpleNamespace(step=7),
        abort_step=lambda: calls.append("abort"),
        end_step=lambda: calls.append("end"),
    )
    release = threading.Event()
    driver = AttentionStepDriver(conn)
    with pytest.raises(AFDPeerError, match=r"attention rank 3: step 7: micro-batch 0 .*0.9 s"):
        driver.run((1, 1), [lambda: release.wait(30), lambda: 1])
    assert calls == ["begin"]  # neither ended nor aborted in protocol
    release.set()

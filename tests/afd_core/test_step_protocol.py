"""The step engine across real processes (gloo): micro-batches m = 1..4 on the attention side
running on the baton threads, an in-order FFN side, peers with different m and zero-row
micro-batches, a deadlock canary, a wrong step number, and failed steps the deployment
survives."""

from __future__ import annotations

import os
import threading
import traceback

import pytest

from tests.afd_core.gloo_harness import (
    HIDDEN,
    assert_no_errors,
    free_port,
    make,
    run_processes,
)

pytestmark = pytest.mark.vllm  # needs torch (the CPU build comes with vLLM)


def initial(rank: int, step: int, mb: int, n: int):
    """Rows whose values say where they come from, so any mix-up shows."""
    import torch

    h = torch.full((n, HIDDEN), float(rank * 1000 + step * 100 + mb * 10))
    return h + torch.arange(n, dtype=torch.float32).unsqueeze(1)


def expected(rank, step, mb, n, layers):
    h = initial(rank, step, mb, n)
    for layer in range(layers):
        h = (h + 1) * 2 + layer
    return h


def ffn_compute(fail_at):
    """FFN 'MLP': h * 2 + layer; raises at (step, layer) in fail_at (its first micro-batch
    with rows), or at (step, layer, k): the layer's k-th micro-batch with rows."""
    state = {"step": 0, "calls": {}}

    def compute(layer, h, _logits, _ids):
        key = (state["step"], layer)
        k = state["calls"].get(key, 0)
        state["calls"][key] = k + 1
        if key in fail_at or (*key, k) in fail_at:
            raise RuntimeError(f"injected FFN failure at layer {layer}")
        return h * 2 + layer

    return compute, state


def _synchronizing(compute, runtime):
    """compute that first waits for the whole device, as a kernel loaded lazily, a
    cudaMalloc or a synchronize in vLLM's code may."""

    def synced(*args):
        runtime.synchronize()
        return compute(*args)

    return synced


def ffn_main(rank, a, f, port, layers, timeout, fail_at, q):
    try:
        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", rank, a, f, port, timeout=timeout, layers=layers)
        conn.init()
        compute, state = ffn_compute({tuple(f) for f in fail_at})
        if os.environ.get("AFD_TEST_FFN_DEVICE_SYNC"):  # the device stand-in's synchronize
            compute = _synchronizing(compute, conn.runtime)
        graphs = None
        if os.environ.get("AFD_TEST_FFN_GRAPHS"):  # captures over the device stand-in
            from afd_core.step.graphs import FFNGraphCache
            from tests.afd_core.nccl_standin import HostGraphBackend

            graphs = FFNGraphCache(HostGraphBackend(conn.runtime))
        if os.environ.get("AFD_TEST_FFN_BUCKETS"):  # layer graphs at padded row counts
            import torch

            from afd_core.step.ffn_buckets import FFNBucketGraphs, bucket_ladder
            from afd_core.step.graphs import FFNGraphCache
            from tests.afd_core.nccl_standin import RerunGraphBackend

            if graphs is None:  # (an empty cache is falsy: it has a length)
                graphs = FFNGraphCache(RerunGraphBackend())
            ladder = bucket_ladder(int(os.environ["AFD_TEST_FFN_BUCKETS"]))
            graphs.buckets = FFNBucketGraphs(RerunGraphBackend(), ladder)
            top = torch.zeros(ladder[-1], HIDDEN)
            graphs.buckets.capture(list(range(layers)), compute, (top, None, None))
        server = FFNStepServer(conn, list(range(layers)), compute, graphs=graphs)
        if os.environ.get("AFD_TEST_FFN_EAGER_PREFETCH"):  # mutation: the old post order
            run_layers = server._run_layers
            server._run_layers = lambda plan, agreed, prefetch=False, **kw: run_layers(
                plan, agreed, prefetch=True, **kw
            )
        rows = []
        original = conn.recv_control

        def recording():
            plan = original()
            state["step"] = plan.step
            if plan.live:
                rows.append(plan.rows)
            return plan

        conn.recv_control = recording
        try:
            server.serve(threading.Event())
        except Exception as exc:
            q.put((("ffn", rank), f"STOPPED {type(exc).__name__}: {exc}"))
            return
        conn.close()
        out = {"rows": rows, "failed": server.failed_steps}
        if graphs is not None:
            out["graphs"] = graphs.stats.as_dict()
            if graphs.buckets is not None:
                out["buckets"] = graphs.buckets.stats.as_dict()
        q.put((("ffn", rank), out))
    except Exception:
        q.put((("ffn", rank), "ERROR " + traceback.format_exc()))


def attn_main(rank, a, f, port, steps, layers, timeout, fail_at, skip_step, q):
    """steps: rows per micro-batch for each step. fail_at: {(step, mb, layer)} where this
    rank's attention raises. skip_step: a step number to skip (a protocol bug)."""
    import torch

    from afd_core.connectors.base import AFDPeerError, AFDStepError
    from afd_core.step.attention import AttentionStepDriver
    from afd_core.step.microbatch import yield_to_next_microbatch

    outcome = []
    try:
        conn = make("attention", rank, a, f, port, timeout=timeout, layers=layers)
        if os.environ.get("AFD_TEST_INDEPENDENT_SERVERS"):  # each rank a server of its own
            conn.steps_with = rank
        conn.init()
        driver = AttentionStepDriver(conn)

        def job(step, mb, n):
            def run():
                h = initial(rank, step, mb, n)
                for layer in range(layers):
                    h = h + 1  # "attention"
                    if (step, mb, layer) in fail_at:
                        raise RuntimeError(f"injected attention failure at layer {layer}")
                    ex = conn.start_exchange(h, layer, mb)
                    yield_to_next_microbatch()
                    h = ex.wait()
                return h

            return run

        for step, rows in enumerate(steps):
            if step == skip_step:
                conn._step += 1  # a control message that never went out
            try:
                out = driver.run(rows, [job(step, mb, n) for mb, n in enumerate(rows)])
            except AFDStepError as exc:
                outcome.append(f"step failed: {exc}")
                continue
            for mb, n in enumerate(rows):
                assert torch.equal(out[mb], expected(rank, step, mb, n, layers)), (step, mb)
            outcome.append("ok")
        driver.close()
        conn.close()
        q.put((("attention", rank), outcome))
    except AFDPeerError as exc:
        q.put((("attention", rank), outcome + [f"STOPPED AFDPeerError: {exc}"]))
    except Exception:
        q.put((("attention", rank), "ERROR " + traceback.format_exc()))


def deploy(
    a, f, steps_by_rank, layers=3, timeout=20.0, ffn_fail=(), attn_fail=None, skip=None, expect=None
):
    attn_fail = attn_fail or {}
    skip = skip or {}
    port = free_port()
    targets = [(ffn_main, k, a, f, port, layers, timeout, list(ffn_fail)) for k in range(f)]
    targets += [
        (
            attn_main,
            r,
            a,
            f,
            port,
            steps_by_rank[r],
            layers,
            timeout,
            set(attn_fail.get(r, ())),
            skip.get(r),
        )
        for r in range(a)
    ]
    return run_processes(targets, expect=expect)


@pytest.mark.parametrize(
    "a,f,steps",
    [
        # m = 1..4, zero-row and unequal micro-batches
        (1, 1, {0: [(5,), (3, 4), (2, 0, 3), (1, 1, 1, 1), (4, 3, 2, 1)]}),
        # peers announcing different m in the same step, and zero rows
        (2, 1, {0: [(3, 4), (2,), (1, 1, 1, 1)], 1: [(1, 1, 1, 1), (0, 5, 0), (6,)]}),
        (
            4,
            2,
            {
                0: [(2, 2), (1,), (1, 2, 3)],
                1: [(3,), (0, 2, 2, 2), (4,)],
                2: [(1, 1, 1), (5,), (2, 2)],
                3: [(0,), (1, 1), (1, 1, 1, 1)],
            },
        ),
        # four FFN ranks, two peers each; every group with its own m and zero rows
        (8, 4, {r: [(r % 3 + 1,) * (r % 4 + 1), (0,) * (r % 2) + (r + 1,)] for r in range(8)}),
        # F does not divide A: FFN rank 0 serves two peers, FFN rank 1 one
        (3, 2, {0: [(2, 2), (1,)], 1: [(0, 3, 1), (4,)], 2: [(1,), (1, 1, 1, 1)]}),
    ],
    ids=["1A1F", "2A1F", "4A2F", "8A4F", "3A2F"],
)
def test_microbatches_every_m_and_shape(a, f, steps):
    results = deploy(a, f, steps)
    assert_no_errors(results)
    from afd_core.topology import Topology

    for r in range(a):
        assert results[("attention", r)] == ["ok"] * len(steps[r])
    topo = Topology(a, f)
    for k in range(f):
        peers = topo.peers_of(k)
        served = results[("ffn", k)]["rows"]
        for s, rows in enumerate(served):
            m = max(len(steps[p][s]) for p in peers)  # the most any peer announced
            assert len(rows) == m
            for mb in range(m):
                want = tuple(
                    steps[p][s][mb] if mb < len(steps[p][s]) else 0 for p in peers
                )  # a peer with fewer micro-batches sends no rows in the rest
                assert rows[mb] == want, (k, s, mb)


def test_deadlock_canary_short_timeout_many_layers():
    """Baton threads against an in-order FFN: a receive posted after its send, or a send
    that waited for its receive, would stall here and fail within the 3 s timeout."""
    steps = {0: [(2, 2), (1, 1, 1), (3, 1, 2, 1)] * 3}
    results = deploy(1, 1, steps, layers=12, timeout=3.0)
    assert_no_errors(results)
    assert results[("attention", 0)] == ["ok"] * 9


def test_a_wrong_step_number_costs_its_sender_only():
    """Issue 36 (review M3): attention rank 1 skips a step number (a protocol bug). Its FFN
    rank drops it (its link is aborted: its steps fail from then on, and it waits for an
    FFN rank as after a loss) and serves attention rank 0 on; before, the FFN rank stopped
    and both peers lost it. (The FFN rank then waits for rank 1's restart: only the two
    attention ranks report.)"""
    steps = {0: [(2,), (2,), (2,)], 1: [(1, 1), (1, 1), (1, 1)]}
    # a short step timeout: rank 1's failing steps wait for an FFN rank that is gone
    results = deploy(2, 1, steps, skip={1: 1}, expect=2, timeout=3.0)
    assert_no_errors(results)
    assert results[("attention", 0)] == ["ok"] * 3
    out = results[("attention", 1)]
    assert out[0] == "ok", out
    for failed in out[1:]:
        assert failed.startswith("step failed") and "is gone" in failed, out
    assert len(out) == 3, out


def test_failed_steps_on_either_side_fail_only_that_step():
    steps = {0: [(2, 3), (2, 3), (2, 3), (4,)]}
    results = deploy(
        1,
        1,
        steps,
        ffn_fail=[(1, 1)],  # FFN compute raises in step 1, layer 1
        attn_fail={0: [(2, 1, 2)]},  # attention raises in step 2, micro-batch 1, layer 2
    )
    assert_no_errors(results)
    out = results[("attention", 0)]
    assert out[0] == "ok" and out[3] == "ok", out
    assert out[1].startswith("step failed") and "FFN rank 0" in out[1], out
    assert "layer 1" in out[1] and "step 1" in out[1] and "injected FFN failure" in out[1]
    assert out[2].startswith("step failed") and "step 2 failed on this rank" in out[2], out
    assert "micro-batch 1 at layer 2" in out[2] and "injected attention failure" in out[2]
    assert results[("ffn", 0)]["failed"] == 1


# every micro-batch count with a zero-row micro-batch where there is room, so the failure
# points cover first, middle and last micro-batches, each with rows
FAILURE_SHAPES = [(3,), (4, 3), (2, 0, 3), (1, 2, 0, 3)]


def test_a_failure_at_any_layer_and_micro_batch_fails_only_that_step():
    """Every failure point, on both sides: each layer x micro-batch with rows, m = 1..4 with
    zero-row micro-batches, the attention side raising before its exchange or the FFN's
    compute raising. Each such step fails alone, within the 3 s step timeout (a mis-ordered
    abort deadlocks until it and stops the deployment), and the next step of both peers is
    right; attention rank 1 shares every step with its own shapes and no failure."""
    layers = 3
    rank0, rank1, attn_fail, ffn_fail = [], [], set(), []
    for side in ("attention", "ffn"):
        for shape in FAILURE_SHAPES:
            with_rows = [mb for mb, n in enumerate(shape) if n]
            for layer in range(layers):
                for k, mb in enumerate(with_rows):
                    step = len(rank0)
                    if side == "attention":
                        attn_fail.add((step, mb, layer))
                    else:  # the layer's k-th computed micro-batch (rank 1's rows ride along)
                        ffn_fail.append((step, layer, k))
                    rank0.append(shape)
                    rank1.append(tuple(min(n, 1) for n in shape))  # rows where rank 0 has
    rank0.append((2, 2))
    rank1.append((3,))
    results = deploy(
        2,
        1,
        {0: rank0, 1: rank1},
        layers=layers,
        timeout=3.0,
        ffn_fail=ffn_fail,
        attn_fail={0: attn_fail},
    )
    assert_no_errors(results)
    out0, out1 = results[("attention", 0)], results[("attention", 1)]
    n_attn = len(attn_fail)
    assert len(out0) == len(rank0) and out0[-1] == "ok", out0[-3:]
    for i, line in enumerate(out0[:-1]):
        assert line.startswith("step failed"), (i, line)
        if i < n_attn:
            assert "failed on this rank" in line and "injected attention failure" in line
        else:
            assert "injected FFN failure" in line, (i, line)
    # rank 1's steps: fine when only rank 0's attention failed, failed with the FFN's verdict
    # when the FFN compute failed (its rows were in the failed step too)
    assert out1[:n_attn] == ["ok"] * n_attn, out1[:n_attn]
    assert all(line.startswith("step failed") for line in out1[n_attn:-1])
    assert out1[-1] == "ok"
    assert results[("ffn", 0)]["failed"] == len(ffn_fail)

"""The FFN's layer graphs at padded row counts (afd_core.step.ffn_buckets): the ladder, the
bucket a row count replays, outputs equal to eager compute with the padding zeroed, eager
above the padding bound; and in real processes over the NCCL stand-in, two attention
servers stepping independently, whose combined rows no whole-step graph matches."""

from __future__ import annotations

import pytest

from afd_core.step.ffn_buckets import FFNBucketGraphs, bucket_ladder
from tests.afd_core import test_step_protocol as step_protocol
from tests.afd_core.gloo_harness import assert_no_errors
from tests.afd_core.nccl_standin import RerunGraphBackend


def test_the_ladder_is_dense_then_grows_by_a_quarter_in_steps_of_eight():
    assert bucket_ladder(0) == []
    assert bucket_ladder(5) == [1, 2, 3, 4, 5]
    ladder = bucket_ladder(512)
    assert ladder[:16] == list(range(1, 17))
    assert ladder[-1] == 512
    for low, high in zip(ladder[16:], ladder[17:], strict=False):
        assert high % 8 == 0 or high == 512
        assert high <= max(low + 8, low * 1.25 + 8)  # never more than a quarter (+8) apart
    assert len(ladder) <= 32  # 512 rows: tens of graphs per layer, not hundreds
    # every row count up to the top replays with at most 1.5x padding (the default bound)
    buckets = FFNBucketGraphs(RerunGraphBackend(), ladder)
    assert all(buckets.bucket_for(n) is not None for n in range(1, 513))


def _buckets(max_rows=64, ratio=1.5):
    import torch

    calls = []

    def compute(layer, h, logits, ids):
        calls.append((layer, h.shape[0]))
        return h * 2 + layer

    buckets = FFNBucketGraphs(RerunGraphBackend(), bucket_ladder(max_rows), ratio)
    inputs = (torch.full((max_rows, 4), float("nan")), None, None)  # whatever was there
    buckets.capture([0, 1], compute, inputs)
    return buckets, calls, inputs


@pytest.mark.vllm  # needs torch
def test_a_layer_replays_the_smallest_bucket_that_holds_it_padding_zeroed():
    import torch

    buckets, calls, (static, _, _) = _buckets()
    assert len(buckets) == 2 * len(bucket_ladder(64))
    assert buckets.bucket_for(7) == 7 and buckets.bucket_for(17) == 24
    rows = torch.arange(19 * 4, dtype=torch.float32).reshape(19, 4)
    calls.clear()
    out = buckets.run(1, rows)
    assert calls == [(1, 24)]  # the graph of layer 1 at 24 rows ran
    assert torch.equal(out, rows * 2 + 1)
    assert torch.equal(static[19:24], torch.zeros(5, 4))  # padding zeroed, not NaN
    assert buckets.stats.as_dict() == {
        "captured": len(buckets),
        "replayed": 1,
        "eager": 0,
        "padded_rows": 5,
    }


@pytest.mark.vllm  # needs torch
def test_no_rows_too_many_rows_or_too_much_padding_run_eagerly():
    import torch

    buckets, _, _ = _buckets(max_rows=64, ratio=1.1)
    assert buckets.bucket_for(0) is None
    assert buckets.bucket_for(65) is None  # past the largest bucket
    assert buckets.bucket_for(17) is None  # 24 rows for 17: 1.41 > 1.1
    assert buckets.run(0, torch.ones(17, 4)) is None
    assert buckets.stats.eager == 1
    with pytest.raises(ValueError, match="max_padding_ratio"):
        FFNBucketGraphs(RerunGraphBackend(), [1], 0.5)


@pytest.mark.vllm  # needs torch
def test_independent_servers_steps_replay_layer_graphs_and_stay_exact(monkeypatch):
    """2A1F, each attention rank a server of its own stepping on its own: the FFN's steps
    combine whichever peers announced, in row counts no peer captured. With layer graphs
    at padded row counts every layer of every step replays one, and every output equals
    the reference exactly."""
    monkeypatch.setenv("AFD_TEST_CONNECTOR", "nccl")
    monkeypatch.setenv("AFD_TEST_INDEPENDENT_SERVERS", "1")
    monkeypatch.setenv("AFD_TEST_FFN_BUCKETS", "64")
    steps = {0: [(3,), (5,), (2, 2), (7,), (1,)], 1: [(6,), (4,), (9,), (3, 1), (2,)]}
    results = step_protocol.deploy(2, 1, steps, timeout=10.0)
    assert_no_errors(results)
    assert results[("attention", 0)] == ["ok"] * 5
    assert results[("attention", 1)] == ["ok"] * 5
    ffn = results[("ffn", 0)]
    buckets = ffn["buckets"]
    assert buckets["eager"] == 0 and buckets["replayed"] > 0, ffn
    assert ffn["graphs"]["replayed"] == 0  # no whole-step graph: nobody captured

"""Where a step splits into micro-batches: whole requests, never empty, thresholds."""

from __future__ import annotations

import pytest

from afd_core.step.split import MicrobatchSlice, SplitPolicy, split_requests


def tokens(slices):
    return [s.num_tokens for s in slices]


def test_decode_batch_splits_evenly_at_every_m():
    for m in (2, 3, 4):
        slices = split_requests([1] * 8, m)
        assert len(slices) == m
        assert max(tokens(slices)) - min(tokens(slices)) <= 1
        assert slices[0].req_start == 0 and slices[-1].req_stop == 8
        for a, b in zip(slices, slices[1:], strict=False):
            assert a.req_stop == b.req_start and a.token_stop == b.token_start


def test_split_never_cuts_a_request_and_balances_tokens():
    slices = split_requests([10, 1, 1, 1, 9, 2], 2)
    assert slices == [MicrobatchSlice(0, 3, 0, 12), MicrobatchSlice(3, 6, 12, 24)]


def test_fewer_requests_than_microbatches_gives_one_request_each():
    slices = split_requests([5, 7], 4)
    assert [(s.req_start, s.req_stop) for s in slices] == [(0, 1), (1, 2)]


def test_one_huge_request_still_leaves_no_group_empty():
    slices = split_requests([100, 1, 1], 3)
    assert [s.num_requests for s in slices] == [1, 1, 1]


@pytest.mark.parametrize("bad", [[0, 3], [2, -1]])
def test_requests_without_tokens_are_rejected(bad):
    with pytest.raises(ValueError, match="at least one token"):
        split_requests(bad, 2)


def test_policy_thresholds_and_single_request_run_unsplit():
    p = SplitPolicy(num_microbatches=2, decode_token_threshold=4, prefill_token_threshold=10)
    assert p.plan([1, 1, 1]) is None  # a decode batch below its threshold
    assert tokens(p.plan([1, 1, 1, 1])) == [2, 2]
    assert p.plan([3, 4]) is None  # a prefill batch below its threshold
    assert tokens(p.plan([6, 4])) == [6, 4]
    assert p.plan([40]) is None  # one request cannot be split
    assert SplitPolicy(num_microbatches=1).plan([1] * 64) is None  # DBO off


@pytest.mark.parametrize("m", [0, 5])
def test_policy_rejects_out_of_range_microbatches(m):
    with pytest.raises(ValueError, match="allowed 1..4"):
        SplitPolicy(num_microbatches=m)

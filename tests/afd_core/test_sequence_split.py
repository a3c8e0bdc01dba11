"""Attention tensor parallel: each TP rank exchanges one contiguous share of the rows and the
outputs are gathered back in row order."""

from __future__ import annotations

import pytest

from afd_core.step.sequence_split import SequenceSplit, share_bounds


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_shares_cover_every_row_once_in_order(n, size):
    bounds = [share_bounds(n, size, r) for r in range(size)]
    rows = [i for start, stop in bounds for i in range(start, stop)]
    assert rows == list(range(n))
    per = -(-n // size)
    assert all(stop - start <= per for start, stop in bounds)


def test_a_rank_past_the_end_sends_no_rows():
    assert [share_bounds(1, 2, r) for r in (0, 1)] == [(0, 1), (1, 1)]
    assert [share_bounds(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def test_a_rank_outside_the_group_is_named():
    with pytest.raises(ValueError, match=r"TP rank 2 is out of range 0..1"):
        SequenceSplit(2, 2, lambda t: t)


@pytest.mark.vllm  # torch
@pytest.mark.parametrize("n", [1, 4, 5])
def test_every_rank_gets_every_output_row_back(n):
    """Three TP ranks of one server, the all-gather done by hand: what the FFN ranks return
    for each share comes back, in row order, on every rank."""
    import torch

    size = 3
    rows = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)
    sent = {}

    def all_gather_from(shares):
        return lambda t: torch.cat([shares[r] for r in range(size)])

    padded = {}
    splits = [SequenceSplit(r, size, None) for r in range(size)]
    for r, split in enumerate(splits):
        sent[r] = split.take(rows, n)
        assert sent[r].shape[0] == split.rows(n)
    # the FFN output of each share (its own rows, doubled), padded by gather() on each rank
    for r, split in enumerate(splits):
        split._all_gather = lambda t, r=r: padded.setdefault(r, t)
        split.gather(sent[r] * 2, n)
    for split in splits:
        split._all_gather = all_gather_from(padded)
        assert torch.equal(split.gather(sent[split.rank] * 2, n), rows * 2)

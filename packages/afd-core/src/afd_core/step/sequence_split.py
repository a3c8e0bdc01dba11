"""Attention tensor parallel without duplicate rows: each TP rank exchanges its share.

After attention, every TP rank of an attention server holds all rows (vLLM's row-parallel
output projection all-reduces them). Sending them from every TP rank would make the FFN
ranks compute each row T times. Instead each TP rank is an attention rank of its own in the
protocol and exchanges one contiguous share of the rows, the first ceil(n/T) for TP rank 0,
the next for TP rank 1, ... (a rank past the end sends none); the FFN outputs are then
all-gathered over the TP group (each share padded to ceil(n/T), the padding dropped), so
every TP rank goes on with every row, as after a tensor-parallel MLP.

Every TP rank sees the same forwards, the same micro-batch split and the same switch
order (the baton is deterministic), so their all-gathers line up. No torch at import.
"""

from __future__ import annotations

from collections.abc import Callable


def share_bounds(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of `n` that TP rank `rank` of `size` exchanges."""
    per = -(-n // size)  # ceil
    start = min(n, rank * per)
    return start, min(n, start + per)


class SequenceSplit:
    def __init__(self, rank: int, size: int, all_gather: Callable):
        if not 0 <= rank < size:
            raise ValueError(f"sequence split: TP rank {rank} is out of range 0..{size - 1}")
        self.rank = rank
        self.size = size
        self._all_gather = all_gather  # (tensor) -> the group's tensors concatenated on dim 0

    def rows(self, n: int) -> int:
        start, stop = share_bounds(n, self.size, self.rank)
        return stop - start

    def take(self, tensor, n: int):
        """This rank's share of a tensor whose first dimension is the step's n rows."""
        if tensor is None:
            return None
        start, stop = share_bounds(n, self.size, self.rank)
        return tensor[start:stop]

    def gather(self, share, n: int):
        """Every rank's share of the output, in row order: the full n rows."""
        per = -(-n // self.size)
        if share.shape[0] != per:
            padded = share.new_zeros((per, *share.shape[1:]))
            padded[: share.shape[0]] = share
            share = padded
        return self._all_gather(share.contiguous())[:n]

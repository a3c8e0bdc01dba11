"""Rank topology of an AFD deployment (pure Python, no torch).

The AFD world puts the FFN ranks first, then the attention ranks:
world rank i < F is FFN rank i; world rank F + j is attention rank j.
Any A >= F: FFN rank k serves a contiguous block of attention ranks, the blocks in rank
order, sizes differing by at most one, the larger first. With q = A // F and r = A % F,
FFN ranks 0..r-1 serve q + 1 each and FFN ranks r..F-1 serve q each (docs/protocol.md):
3A2F is {0: [0, 1], 1: [2]}, 7A3F {0: [0, 1, 2], 1: [3, 4], 2: [5, 6]}. For A a multiple
of F that is the equal split k*A/F ... (k+1)*A/F - 1.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """An A:F shape or rank that the chosen connector cannot serve."""


def validate_point_to_point(num_attention_ranks: int, num_ffn_ranks: int) -> None:
    """Rules for connectors where each attention rank talks to exactly one FFN rank."""
    a, f = num_attention_ranks, num_ffn_ranks
    if a < 1 or f < 1:
        raise TopologyError(f"num_attention_ranks={a}, num_ffn_ranks={f}: both must be >= 1")
    if a < f:
        raise TopologyError(
            f"num_attention_ranks={a} < num_ffn_ranks={f}: point-to-point connectors need "
            "at least as many attention ranks as FFN ranks (A >= F)"
        )


@dataclass(frozen=True)
class Topology:
    num_attention_ranks: int
    num_ffn_ranks: int

    def __post_init__(self) -> None:
        validate_point_to_point(self.num_attention_ranks, self.num_ffn_ranks)

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    def _block(self, ffn_rank: int) -> tuple[int, int]:
        """FFN rank k's attention ranks: [start, stop)."""
        q, r = divmod(self.num_attention_ranks, self.num_ffn_ranks)
        start = ffn_rank * q + min(ffn_rank, r)
        return start, start + q + (ffn_rank < r)

    def _check(self, kind: str, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise TopologyError(f"{kind} rank {rank} is out of range; allowed 0..{size - 1}")

    def world_rank(self, role: str, role_rank: int) -> int:
        if role == "ffn":
            self._check("ffn", role_rank, self.num_ffn_ranks)
            return role_rank
        if role == "attention":
            self._check("attention", role_rank, self.num_attention_ranks)
            return self.num_ffn_ranks + role_rank
        raise TopologyError(f"role {role!r} is unknown; allowed 'attention' or 'ffn'")

    def ffn_rank_of(self, attention_rank: int) -> int:
        self._check("attention", attention_rank, self.num_attention_ranks)
        q, r = divmod(self.num_attention_ranks, self.num_ffn_ranks)
        big = r * (q + 1)  # the attention ranks in the r blocks of q + 1
        if attention_rank < big:
            return attention_rank // (q + 1)
        return r + (attention_rank - big) // q

    def peers_of(self, ffn_rank: int) -> list[int]:
        """The attention ranks FFN rank `ffn_rank` serves, in the order it concatenates them."""
        self._check("ffn", ffn_rank, self.num_ffn_ranks)
        return list(range(*self._block(ffn_rank)))

"""Rank topology of an AFD deployment (pure Python, no torch).

The AFD world puts the FFN ranks first, then the attention ranks:
world rank i < F is FFN rank i; world rank F + j is attention rank j.
FFN rank k serves the A/F consecutive attention ranks k*A/F ... k*A/F + A/F - 1.
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
    if a % f:
        raise TopologyError(
            f"num_attention_ranks={a} is not a multiple of num_ffn_ranks={f}: point-to-point "
            "connectors give every FFN rank the same number of attention peers (A % F == 0)"
        )


def ffn_layout(num_attention_devices: int, num_ffn_devices: int, platform: str) -> tuple[int, int]:
    """(FFN ranks, tensor-parallel devices per FFN rank) that serve A attention ranks with
    F FFN devices, or TopologyError why none can. F <= A: F FFN ranks, A a multiple of F
    (validate_point_to_point). F > A: fewer FFN ranks of several tensor-parallel devices
    each, the most ranks dividing both, on CPU only (FFN tensor parallelism is rejected on
    CUDA and Ascend, docs/cuda.md). The planner (afd_core.planner.search) and `afd plan
    --write-spec` ask this one function."""
    a, f = num_attention_devices, num_ffn_devices
    if f <= a:
        validate_point_to_point(a, f)
        return f, 1
    ranks = max(r for r in range(1, a + 1) if a % r == 0 and f % r == 0)
    if platform != "cpu":
        raise TopologyError(
            f"{a}A{f}F needs {f} FFN devices over at most {ranks} FFN rank(s), that is FFN "
            f"tensor parallelism, which AFD rejects on {platform}"
        )
    return ranks, f // ranks


@dataclass(frozen=True)
class Topology:
    num_attention_ranks: int
    num_ffn_ranks: int

    def __post_init__(self) -> None:
        validate_point_to_point(self.num_attention_ranks, self.num_ffn_ranks)

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    @property
    def peers_per_ffn_rank(self) -> int:
        return self.num_attention_ranks // self.num_ffn_ranks

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
        return attention_rank // self.peers_per_ffn_rank

    def peers_of(self, ffn_rank: int) -> list[int]:
        """The attention ranks FFN rank `ffn_rank` serves, in the order it concatenates them."""
        self._check("ffn", ffn_rank, self.num_ffn_ranks)
        n = self.peers_per_ffn_rank
        return list(range(ffn_rank * n, ffn_rank * n + n))

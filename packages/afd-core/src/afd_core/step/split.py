"""Where a step splits into micro-batches (DBO): at request boundaries, never an empty one.

Pure Python, so the policy is unit-tested without vLLM. A step is split only when the
attention server asked for micro-batches, the batch holds at least two requests, and it
reaches vLLM's own DBO thresholds (`--dbo-decode-token-threshold` for a batch of one-token
decodes, `--dbo-prefill-token-threshold` for anything else). It then gets
min(m, requests) micro-batches of whole requests with token counts as even as the request
boundaries allow. Splitting whole requests keeps every request's attention exactly what it
is unsplit (no request's KV is read before the same step wrote it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from afd_core.connectors.protocol.control import MAX_MICROBATCHES  # what a control message carries


@dataclass(frozen=True)
class MicrobatchSlice:
    """Requests [req_start, req_stop) holding tokens [token_start, token_stop) of a step."""

    req_start: int
    req_stop: int
    token_start: int
    token_stop: int

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start

    @property
    def num_requests(self) -> int:
        return self.req_stop - self.req_start


@dataclass(frozen=True)
class SplitPolicy:
    """What one attention server asked for: m micro-batches above vLLM's DBO thresholds."""

    num_microbatches: int = 1
    decode_token_threshold: int = 32
    prefill_token_threshold: int = 512

    def __post_init__(self) -> None:
        if not 1 <= self.num_microbatches <= MAX_MICROBATCHES:
            raise ValueError(
                f"num_microbatches={self.num_microbatches}; allowed 1..{MAX_MICROBATCHES}"
            )

    @property
    def enabled(self) -> bool:
        return self.num_microbatches > 1

    def threshold_for(self, tokens_per_request: Sequence[int]) -> int:
        uniform_decode = all(t == 1 for t in tokens_per_request)
        return self.decode_token_threshold if uniform_decode else self.prefill_token_threshold

    def splittable(self, tokens_per_request: Sequence[int]) -> bool:
        """Whether a step with these scheduled tokens per request may be split at all
        (micro-batching on, two requests or more, at or above the threshold)."""
        if not self.enabled or len(tokens_per_request) < 2:
            return False
        return sum(tokens_per_request) >= self.threshold_for(tokens_per_request)

    def plan(self, tokens_per_request: Sequence[int]) -> list[MicrobatchSlice] | None:
        """The micro-batches of a step with these scheduled tokens per request, or None to
        run it as one (micro-batching off, fewer than two requests, below the threshold)."""
        if not self.splittable(tokens_per_request):
            return None
        return split_requests(tokens_per_request, self.num_microbatches)


def split_requests(tokens_per_request: Sequence[int], m: int) -> list[MicrobatchSlice]:
    """min(m, requests) contiguous, non-empty groups of whole requests, each boundary placed
    at the request boundary closest to an even share of the tokens."""
    counts = list(tokens_per_request)
    if any(t <= 0 for t in counts):
        raise ValueError(f"every scheduled request has at least one token, got {counts}")
    n = len(counts)
    k = min(m, n)
    if k < 1:
        raise ValueError("nothing to split: no requests")
    cumulative = [0]
    for t in counts:
        cumulative.append(cumulative[-1] + t)
    total = cumulative[-1]
    bounds = [0]
    for i in range(1, k):
        target = total * i / k
        lo = bounds[-1] + 1  # at least one request in the group before
        hi = n - (k - i)  # at least one request left for each group after
        best = min(range(lo, hi + 1), key=lambda b: (abs(cumulative[b] - target), b))
        bounds.append(best)
    bounds.append(n)
    return [
        MicrobatchSlice(a, b, cumulative[a], cumulative[b])
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]

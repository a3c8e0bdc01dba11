"""FFN compute graphs at padded bucket sizes, for steps no whole-step graph matches.

An FFN rank replays a whole step's graph only when the step's key (rows per peer per
micro-batch) is one a peer captured. One attention server's steps hit those keys; several
independent servers sharing the FFN rank almost never do (their rows combine into counts
nobody captured), so those steps would run every layer eagerly, host-bound.

So at start-up the FFN rank also captures each layer's compute (MLP/MoE only, no
exchange) at a ladder of row counts (`bucket_ladder`), on static input buffers. In a step
run layer by layer, a layer/micro-batch of n rows replays the graph of the smallest bucket
B >= n: its rows are copied into the static input, rows n..B are zeroed (padding, computed
and dropped: an MLP/MoE computes each row on its own), and the first n rows of the graph's
output are the result. Above `max_padding_ratio` (B / n), past the largest bucket, or with
no rows, the layer runs eagerly. The exchanges stay eager; NCCL pairs them by order, so
the attention side may replay its own whole-step graph meanwhile.

`GraphBackend` (afd_core.step.graphs) is the seam: CUDA graphs on CUDA, a backend that
re-runs the function in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

DENSE_UP_TO = 16  # every row count up to here is a bucket
BUCKET_RATIO = 1.25  # above, each bucket is the previous one times this, in steps of 8
# a layer padded by more than this runs eagerly; the ladder pads by at most 24/17 = 1.41
MAX_PADDING_RATIO = 1.5


def bucket_ladder(max_rows: int, ratio: float = BUCKET_RATIO) -> list[int]:
    """Row counts 1..DENSE_UP_TO, then each about `ratio` times the last (a multiple of 8),
    up to and including `max_rows`."""
    if max_rows < 1:
        return []
    ladder = list(range(1, min(DENSE_UP_TO, max_rows) + 1))
    while ladder[-1] < max_rows:
        nxt = max(ladder[-1] + 8, math.ceil(ladder[-1] * ratio / 8) * 8)
        ladder.append(min(nxt, max_rows))
    return ladder


@dataclass
class BucketStats:
    captured: int = 0  # (layer, bucket) graphs
    replayed: int = 0  # layer computations replayed from a bucket graph
    eager: int = 0  # layer computations run eagerly (no bucket, padding too large)
    padded_rows: int = 0  # rows computed as padding in replays

    def as_dict(self) -> dict:
        return {
            "captured": self.captured,
            "replayed": self.replayed,
            "eager": self.eager,
            "padded_rows": self.padded_rows,
        }


class FFNBucketGraphs:
    """Per (layer, bucket) graphs of `compute(layer, hidden, router_logits, token_ids)`."""

    def __init__(
        self,
        backend,
        ladder: Sequence[int],
        max_padding_ratio: float = MAX_PADDING_RATIO,
    ):
        if max_padding_ratio < 1:
            raise ValueError(f"max_padding_ratio={max_padding_ratio}: must be at least 1")
        self.backend = backend
        self.ladder = sorted(set(ladder))
        self.max_padding_ratio = max_padding_ratio
        self.stats = BucketStats()
        self._graphs: dict[tuple[int, int], tuple[Any, Any]] = {}  # -> (graph, output)
        self._inputs: tuple | None = None  # static (hidden, logits or None, ids or None)

    def capture(
        self,
        layers: Sequence[int],
        compute: Callable[..., Any],
        inputs: tuple,
        context: Callable[[], Any] | None = None,
    ) -> int:
        """Capture every layer at every bucket; `inputs`: static buffers of the largest
        bucket (hidden, router logits or None, token ids or None), zero-filled;
        `context()`: entered around each capture (the forward context). Returns the
        number of graphs."""
        import contextlib

        self._inputs = inputs
        hidden, logits, ids = inputs
        if self.ladder and hidden.shape[0] < self.ladder[-1]:
            raise ValueError(
                f"static inputs of {hidden.shape[0]} rows for buckets up to {self.ladder[-1]}"
            )
        for bucket in self.ladder:
            views = _rows(inputs, bucket)
            for layer in layers:
                holder: list = []

                def body(layer=layer, views=views, holder=holder):
                    out = compute(layer, *views)
                    if holder:  # a backend that runs the function again at replay
                        holder[0].copy_(out)
                    else:  # captured: a device graph rewrites this tensor at each replay
                        holder.append(out)

                with context() if context is not None else contextlib.nullcontext():
                    graph = self.backend.capture(body)
                self._graphs[(layer, bucket)] = (graph, holder[0])
                self.stats.captured += 1
        return len(self._graphs)

    def bucket_for(self, rows: int) -> int | None:
        """The bucket a layer of `rows` rows replays, or None (eager)."""
        if rows <= 0 or not self.ladder or rows > self.ladder[-1]:
            return None
        import bisect

        bucket = self.ladder[bisect.bisect_left(self.ladder, rows)]
        return bucket if bucket <= rows * self.max_padding_ratio else None

    def run(self, layer: int, hidden, logits=None, ids=None):
        """The layer's output for these rows from its bucket's graph, or None when the
        layer must run eagerly."""
        n = hidden.shape[0]
        bucket = self.bucket_for(n)
        entry = self._graphs.get((layer, bucket)) if bucket is not None else None
        if entry is None:
            self.stats.eager += 1
            return None
        graph, output = entry
        for static, given in zip(self._inputs, (hidden, logits, ids), strict=True):
            if static is None:
                continue
            static[:n].copy_(given)
            if bucket > n:
                static[n:bucket].zero_()
        self.backend.replay(graph)
        self.stats.replayed += 1
        self.stats.padded_rows += bucket - n
        return output[:n]

    def __len__(self) -> int:
        return len(self._graphs)


def _rows(inputs: tuple, n: int) -> tuple:
    return tuple(None if t is None else t[:n] for t in inputs)

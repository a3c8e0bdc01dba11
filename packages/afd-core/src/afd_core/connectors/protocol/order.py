"""The order in which both sides issue a step's data operations, checked before each one.

Both sides walk a step layer by layer and, within a layer, micro-batch by micro-batch
(docs/protocol.md). gloo matches operations by tag, so an operation issued out of that
order fails there; NCCL and HCCL match by issue order per peer and would pair it with
another message, of another size. So each side checks, on the host, the (layer,
micro-batch) it is about to issue against the order its peer expects, and an order bug is
an error that names both, on every transport.
"""

from __future__ import annotations

from collections.abc import Sequence

from afd_core.connectors.base import AFDPeerError


class AttentionOrder:
    """The attention side of one step: its micro-batches with rows, layer-major."""

    def __init__(self, num_layers: int, rows: Sequence[int]):
        self._order = [(layer, mb) for layer in range(num_layers) for mb, n in enumerate(rows) if n]
        self._issued = 0

    def issue(self, layer: int, microbatch: int, who: str) -> None:
        """Record the exchange about to be issued; AFDPeerError if it is not the next."""
        expected = self._order[self._issued] if self._issued < len(self._order) else None
        if expected != (layer, microbatch):
            wanted = (
                f"layer {expected[0]} micro-batch {expected[1]}"
                if expected
                else "no further exchange"
            )
            raise AFDPeerError(
                f"{who} would exchange layer {layer} micro-batch {microbatch} next, but the FFN "
                f"rank expects {wanted} (both sides go layer by layer, micro-batch by "
                "micro-batch; out of that order NCCL or HCCL would pair different messages)"
            )
        self._issued += 1

    def issue_all(self) -> None:
        """Every exchange was issued without Python (a replayed graph)."""
        self._issued = len(self._order)

    def remaining(self) -> list[tuple[int, int]]:
        """The exchanges not issued yet, in order."""
        return self._order[self._issued :]


class FFNOrder:
    """The FFN side of one step: receives (or sends) of every micro-batch per layer, the
    layers in increasing order (the server's layers need not start at 0)."""

    def __init__(self, num_microbatches: int, what: str):
        self._n = num_microbatches
        self._what = what  # "receive", "send"
        self._last: tuple[int, int] | None = None

    def issue(self, layer: int, microbatch: int, who: str) -> None:
        last = self._last
        if last is None:
            ok = microbatch == 0
        elif last[1] + 1 < self._n:
            ok = (layer, microbatch) == (last[0], last[1] + 1)
        else:
            ok = layer > last[0] and microbatch == 0
        if not ok:
            after = f"after layer {last[0]} micro-batch {last[1]}" if last else "first"
            raise AFDPeerError(
                f"{who} would {self._what} layer {layer} micro-batch {microbatch} {after}, out "
                f"of the order its peers follow (each layer's {self._n} micro-batch(es) in "
                "turn, layers in increasing order)"
            )
        self._last = (layer, microbatch)

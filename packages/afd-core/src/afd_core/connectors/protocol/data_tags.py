"""The tags of a step's data operations on a channel that matches by tag (gloo): one per
(layer, micro-batch, kind), so a mix-up is an error naming the layer, never mixed data."""

from __future__ import annotations

from afd_core.connectors.protocol.control import MAX_MICROBATCHES

KIND_HIDDEN, KIND_LOGITS, KIND_TOKENS = 0, 1, 2
NUM_KINDS = 3


def data_tag(layer: int, microbatch: int, kind: int) -> int:
    return ((layer * MAX_MICROBATCHES) + microbatch) * NUM_KINDS + kind

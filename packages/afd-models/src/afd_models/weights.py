"""Which role loads which checkpoint tensor (pure Python: names only, no torch needed).

Gate on the FFN side: a decoder layer's MLP/MoE tensors (`...layers.<i>.mlp.*`: dense MLP,
router gate and its bias, routed and shared experts) belong to the FFN role; everything
else (embeddings, attention, norms, final norm, LM head) to the attention role.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

_LAYER_MLP = re.compile(r"(^|\.)layers\.(\d+)\.mlp\.")


def is_ffn_weight(name: str) -> bool:
    return _LAYER_MLP.search(name) is not None


def weight_wanted(role: str, name: str) -> bool:
    if role not in ("attention", "ffn"):
        raise ValueError(f"role {role!r} is unknown; allowed 'attention' or 'ffn'")
    return is_ffn_weight(name) if role == "ffn" else not is_ffn_weight(name)


def filter_weights(role: str, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """One streaming pass: tensors of the other role never reach the model's loader."""
    for name, tensor in weights:
        if weight_wanted(role, name):
            yield name, tensor

"""Which role loads which checkpoint tensor (pure Python: names only, no torch needed).

Gate on the FFN side: a decoder layer's MLP/MoE tensors (`...layers.<i>.mlp.*`, DeepSeek-V4:
`layers.<i>.ffn.*`: dense MLP, router gate and its bias or hash table, routed and shared
experts) belong to the FFN role; everything else (embeddings, attention, norms, V4's
`ffn_norm` and stream-mixing `hc_ffn_*`, final norm, LM head) to the attention role.

Gate on attention: the router projection (`...layers.<i>.mlp.gate.weight`) moves to the
attention role; its correction bias (`mlp.gate.e_score_correction_bias`) stays on the FFN
role, where vLLM's expert selection applies it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

_LAYER_MLP = re.compile(r"(^|\.)layers\.(\d+)\.(mlp|ffn)\.")
_ROUTER_PROJECTION = re.compile(r"(^|\.)layers\.(\d+)\.mlp\.gate\.weight$")


def is_ffn_weight(name: str, gate_on_attention: bool = False) -> bool:
    if gate_on_attention and _ROUTER_PROJECTION.search(name):
        return False
    return _LAYER_MLP.search(name) is not None


def weight_wanted(role: str, name: str, gate_on_attention: bool = False) -> bool:
    if role not in ("attention", "ffn"):
        raise ValueError(f"role {role!r} is unknown; allowed 'attention' or 'ffn'")
    ffn = is_ffn_weight(name, gate_on_attention)
    return ffn if role == "ffn" else not ffn


def filter_weights(
    role: str, weights: Iterable[tuple[str, Any]], gate_on_attention: bool = False
) -> Iterator[tuple[str, Any]]:
    """One streaming pass: tensors of the other role never reach the model's loader."""
    for name, tensor in weights:
        if weight_wanted(role, name, gate_on_attention):
            yield name, tensor

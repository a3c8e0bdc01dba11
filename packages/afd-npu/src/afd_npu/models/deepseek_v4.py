"""DeepSeek-V4 for AFD on Ascend, over vLLM-Ascend's own implementation of the model.

vLLM-Ascend registers its `AscendDeepseekV4ForCausalLM` for the architecture (its layers
call Ascend kernels: the mHC stream mixing, sparse attention, the hash-routing top-k). The
split is the GPU/CPU wrapper's (afd_models.deepseek_v4): each decoder layer's MoE is
remote, the streams, their mixing and both norms stay on attention, and the normalized
rows go out with each row's token id (the first `num_hash_layers` route by token id). What
differs is where Ascend keeps things: the MoE is `layer.mlp`, called as `mlp(x)`, and the
hash routing reads the token ids from the forward context (`input_ids`, set by
vLLM-Ascend's runner on attention and by AFD's FFN worker around every FFN call).

The model is built by vLLM-Ascend's own constructors with the other role's module classes
swapped, for the duration of the construction, by placeholders: attention builds no
experts (each `DeepseekV4MoE` becomes a `ContextTokenRemoteFFN`, and vLLM-Ascend's MoE
bookkeeping counts none), FFN builds no attention, embedding or LM head (placeholders).
The final norm and the head-mixing parameters (small) are still built on the FFN role,
unused and not loaded.

Importing this module needs vllm_ascend (the registration table names it only where
torch_npu is importable).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from vllm.model_executor.models.utils import PPMissingLayer
from vllm_ascend.models import deepseek_v4 as ascend_v4

from afd_core.config import require_afd_config
from afd_models.role import AFDRoleModel, RemoteFFN

_construction = threading.Lock()  # the swap is module-global: one construction at a time


class ContextTokenRemoteFFN(RemoteFFN):
    """Attention side, a V4 layer's MoE on Ascend: called as `mlp(x)`; the token ids of the
    rows come from the forward context, as Ascend's hash routing reads them."""

    def __init__(self, exchange_index: int):
        super().__init__(exchange_index, token_ids=True)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        ids = getattr(get_forward_context(), "input_ids", None)
        if ids is None:
            raise RuntimeError(
                "AFD DeepSeek-V4 on Ascend: the forward context has no input_ids (the hash-"
                "routed layers need each row's token id)"
            )
        return super().forward(hidden_states, ids[: hidden_states.shape[0]])


def _layer_index(prefix: str) -> int:
    # "model.layers.<i>.mlp" (vLLM-Ascend builds the MoE under the layer's prefix)
    return int(prefix.split(".")[-2])


def _builds(make):
    """A class that stands for one of vLLM-Ascend's module classes during construction:
    calling it builds `make(*args, **kwargs)` instead, which is no instance of it, so
    vLLM-Ascend's `isinstance(layer.mlp, DeepseekV4MoE)` bookkeeping (set_moe_parameters),
    run inside the constructor, finds no MoE layer on the attention role."""

    class Placeholder:
        def __new__(cls, *args, **kwargs):
            return make(*args, **kwargs)

    return Placeholder


def _remote_moe(*args, prefix: str = "", **kwargs):
    return ContextTokenRemoteFFN(_layer_index(prefix))


def _missing(*args, **kwargs):
    return PPMissingLayer()


# the module classes of vLLM-Ascend's V4 module each role does not build
SWAPS = {
    "attention": {"DeepseekV4MoE": _remote_moe},
    # the vocabulary-sized embedding and LM head are attention's too (the small final norm
    # and head-mixing parameters are still built on FFN, never loaded)
    "ffn": {
        "DeepseekV4Attention": _missing,
        "VocabParallelEmbedding": _missing,
        "ParallelLMHead": _missing,
    },
}


@contextlib.contextmanager
def role_construction(role: str):
    """Swap the other role's module classes of vLLM-Ascend's V4 module for placeholders
    while the model is built; the module is restored afterwards, even on failure."""
    swaps = SWAPS[role]
    with _construction:
        saved = {name: getattr(ascend_v4, name) for name in swaps}
        try:
            for name, make in swaps.items():
                setattr(ascend_v4, name, _builds(make))
            yield
        finally:
            for name, cls in saved.items():
                setattr(ascend_v4, name, cls)


class AFDDeepseekV4ForCausalLM(AFDRoleModel, ascend_v4.AscendDeepseekV4ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        afd = require_afd_config(vllm_config)
        with role_construction(afd.role):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.afd = afd

    def routes_by_token_id(self) -> bool:
        return True

    def compute_ffn_output(self, layer_idx: int, hidden_states, router_logits=None, token_ids=None):
        # token_ids reach the hash routing through the forward context the FFN worker sets
        return self.model.layers[layer_idx].mlp(hidden_states)

"""What every role-aware model shares: the role lookup, the FFN proxy, the weight filter.

The attention role keeps embeddings, attention, norms and LM head and replaces each decoder
layer's MLP/MoE with `RemoteFFN`; the FFN role keeps only the MLP/MoE modules and puts
placeholders (vLLM's PPMissingLayer) everywhere else. Placeholders and proxies subclass
PPMissingLayer, so vLLM's own weight loaders skip them, and since unbuilt modules own no
parameters the loader's strict check still holds.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.utils import PPMissingLayer

from afd_core.dbo import current_microbatch_id, dbo_yield
from afd_core.runtime import active_connector
from afd_models.weights import filter_weights, weight_wanted


def attention_side(layer: torch.nn.Module, exchange_index: int, config) -> None:
    """Attention role: the layer's norms, and its MLP/MoE computed remotely."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    layer.mlp = RemoteFFN(exchange_index)
    layer.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    layer.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def ffn_side(layer: torch.nn.Module) -> None:
    """FFN role: placeholders where attention and the norms would be."""
    layer.self_attn = PPMissingLayer()
    layer.input_layernorm = PPMissingLayer()
    layer.post_attention_layernorm = PPMissingLayer()


class RemoteFFN(PPMissingLayer):
    """Attention side: a decoder layer's MLP/MoE, computed by the FFN ranks.

    Starts the exchange of the calling micro-batch (the FFN output's receive is posted
    before the rows are sent, so neither side ever waits on the other's order), yields to
    the next micro-batch (DBO: its attention runs while the FFN ranks compute these rows),
    then waits for the FFN output.
    """

    def __init__(self, exchange_index: int):
        super().__init__()
        self.exchange_index = exchange_index

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        exchange = active_connector().start_exchange(
            hidden_states, self.exchange_index, current_microbatch_id()
        )
        dbo_yield(hidden_states)
        return exchange.wait()

    def extra_repr(self) -> str:
        return f"exchange_index={self.exchange_index}"


class AFDRoleModel:
    """Mixin for the top-level AFD model classes (needs `self.afd` and `self.model`)."""

    def ffn_layer_indices(self) -> list[int]:
        """Layers whose MLP/MoE is exchanged each step, in protocol order."""
        return list(range(self.model.start_layer, self.model.end_layer))

    def compute_ffn_output(self, layer_idx: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """FFN role: one layer's MLP/MoE, inside a forward context set by the caller."""
        return self.model.layers[layer_idx].mlp(hidden_states)

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        # vLLM skips checkpoint shards whose tensors all belong to the other role
        return not weight_wanted(self.afd.role, name)

    def load_weights(self, weights):
        return super().load_weights(filter_weights(self.afd.role, weights))

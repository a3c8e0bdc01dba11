"""What every role-aware model shares: the role lookup, the FFN proxy, the weight filter.

The attention role keeps embeddings, attention, norms and LM head and replaces each decoder
layer's MLP/MoE with `RemoteFFN`; the FFN role keeps only the MLP/MoE modules and puts
placeholders (vLLM's PPMissingLayer) everywhere else. Placeholders and proxies subclass
PPMissingLayer, so vLLM's own weight loaders skip them, and since unbuilt modules own no
parameters the loader's strict check still holds.

Gate on attention (`compute_gate_on_attention`): a MoE layer's router projection stays on
the attention side (`GatedRemoteFFN`, a plain module so its `mlp.gate.weight` loads) and its
logits travel with the rows; the FFN side routes with them and runs the experts only.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.utils import PPMissingLayer

from afd_core.exchange import ffn_exchange_op
from afd_models.weights import filter_weights, weight_wanted


def attention_side(
    layer: torch.nn.Module, exchange_index: int, config, mlp: torch.nn.Module | None = None
) -> None:
    """Attention role: the layer's norms, and its MLP/MoE computed remotely (`mlp`: the
    proxy to use, default a RemoteFFN without router logits)."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    layer.mlp = mlp if mlp is not None else RemoteFFN(exchange_index)
    layer.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    layer.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def ffn_side(layer: torch.nn.Module) -> None:
    """FFN role: placeholders where attention and the norms would be."""
    layer.self_attn = PPMissingLayer()
    layer.input_layernorm = PPMissingLayer()
    layer.post_attention_layernorm = PPMissingLayer()


# the layer exchange, an opaque op for torch.compile and graph capture (afd_core.exchange)
_EXCHANGE = ffn_exchange_op()


def _exchange(hidden_states: torch.Tensor, exchange_index: int, router_logits=None, token_ids=None):
    return _EXCHANGE(hidden_states, exchange_index, router_logits, token_ids)


class RemoteFFN(PPMissingLayer):
    """Attention side: a decoder layer's MLP/MoE, computed by the FFN ranks.

    `router_width` > 0 (gate on attention, a layer without a router: a dense MLP): the
    protocol carries logits for every exchanged layer, so this one sends zeros, which the
    FFN side's dense MLP never reads.

    `token_ids`: the model calls its FFN as `ffn(hidden_states, input_ids)` and routes by
    token id (DeepSeek-V4's hash layers): the ids travel with the rows.
    """

    def __init__(self, exchange_index: int, router_width: int = 0, token_ids: bool = False):
        super().__init__()
        self.exchange_index = exchange_index
        self.router_width = router_width
        self.token_ids = token_ids

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        logits = ids = None
        if self.router_width:
            logits = hidden_states.new_zeros(
                hidden_states.shape[0], self.router_width, dtype=torch.float32
            )
        if self.token_ids:
            ids = args[0] if args else kwargs.get("input_ids")
        return _exchange(hidden_states, self.exchange_index, logits, ids)

    def extra_repr(self) -> str:
        return (
            f"exchange_index={self.exchange_index}, router_width={self.router_width}, "
            f"token_ids={self.token_ids}"
        )


class GatedRemoteFFN(torch.nn.Module):
    """Attention side, gate on attention: a MoE layer's router projection runs here and its
    logits (float32 on the wire) go to the FFN ranks with the rows. A plain module, not a
    placeholder: vLLM's loader must fill `mlp.gate.weight`."""

    def __init__(self, exchange_index: int, gate: torch.nn.Module):
        super().__init__()
        self.exchange_index = exchange_index
        self.gate = gate

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        router_logits, _ = self.gate(hidden_states)
        return _exchange(hidden_states, self.exchange_index, router_logits.float())

    def extra_repr(self) -> str:
        return f"exchange_index={self.exchange_index}"


# vLLM's torch.compile dims of a decoder stack's forward arguments (tokens first; positions
# last, as M-RoPE's are (3, tokens)); the role models compile eagerly on CPU but keep them
DYNAMIC_ARG_DIMS = {"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}


def role_lm_head(afd, config, quant_config, prefix: str, embed_tokens=None) -> torch.nn.Module:
    """Attention role: vLLM's LM head (tied to `embed_tokens` when the config says so and
    one is given); FFN role, or not the last pipeline stage: a placeholder."""
    from vllm.distributed import get_pp_group
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    if not (afd.is_attention and get_pp_group().is_last_rank):
        return PPMissingLayer()
    head = ParallelLMHead(
        config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=prefix
    )
    if getattr(config, "tie_word_embeddings", False) and embed_tokens is not None:
        head = head.tie_weights(embed_tokens)
    return head


def moe_bookkeeping(model: torch.nn.Module, blocks: list) -> None:
    """vLLM's MixtureOfExperts attributes from the MoE blocks this role built: real on the
    FFN role, empty on attention (which builds none)."""
    model.moe_layers = [b.experts for b in blocks]
    model.num_moe_layers = len(blocks)
    model.num_expert_groups = 1
    model.num_shared_experts = 0
    example = blocks[-1] if blocks else None
    for attr in (
        "n_logical_experts",
        "n_physical_experts",
        "n_local_physical_experts",
        "n_routed_experts",
        "n_redundant_experts",
    ):
        setattr(model, "num_" + attr[2:], getattr(example, attr) if example else 0)


class AFDRoleModel:
    """Mixin for the top-level AFD model classes (needs `self.afd` and `self.model`)."""

    def ffn_layer_indices(self) -> list[int]:
        """Layers whose MLP/MoE is exchanged each step, in protocol order."""
        return list(range(self.model.start_layer, self.model.end_layer))

    # whether this wrapper can run the router on the attention side (checked at start-up)
    supports_gate_on_attention = False

    def router_width(self) -> int:
        """Router logits per row on the wire: the routed experts when the gate runs on
        attention, else 0."""
        return 0

    def routes_by_token_id(self) -> bool:
        """Whether the FFN side needs each row's token id (hash-routed MoE layers)."""
        return False

    def compute_ffn_output(
        self, layer_idx: int, hidden_states: torch.Tensor, router_logits=None, token_ids=None
    ) -> torch.Tensor:
        """FFN role: one layer's MLP/MoE, inside a forward context set by the caller."""
        return self.model.layers[layer_idx].mlp(hidden_states)

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        # vLLM skips checkpoint shards whose tensors all belong to the other role
        return not weight_wanted(self.afd.role, name, self.afd.compute_gate_on_attention)

    def load_weights(self, weights):
        return super().load_weights(
            filter_weights(self.afd.role, weights, self.afd.compute_gate_on_attention)
        )

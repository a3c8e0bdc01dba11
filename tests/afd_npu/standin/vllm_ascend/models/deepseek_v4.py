"""Stand-in of vllm_ascend/models/deepseek_v4.py: the module structure AFD's Ascend V4
wrapper relies on (vllm-ascend 0.23.0.post1): the causal LM builds `model`, whose
`make_layers` builds `DeepseekV2DecoderLayer`s; each layer builds `self_attn` from the
module-global `DeepseekV4Attention` and `mlp` from `DeepseekV4MoE(config, parallel_config,
quant_config, prefix=f"{prefix}.mlp", is_draft_layer)`, and calls `self.mlp(x)`; hash
routing reads `get_forward_context().input_ids`; the embedding and LM head come from the
module-level `VocabParallelEmbedding` / `ParallelLMHead`; the constructor ends with
`set_moe_parameters`, which keeps the layers whose `mlp` is a `DeepseekV4MoE` (isinstance
on the module-level name). The arithmetic is a toy (no mHC)."""

from torch import nn
from vllm.forward_context import get_forward_context


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, quant_config=None, prefix=""):
        super().__init__(num_embeddings, embedding_dim)


class ParallelLMHead(nn.Linear):
    def __init__(self, num_embeddings, embedding_dim, quant_config=None, prefix=""):
        super().__init__(embedding_dim, num_embeddings, bias=False)


class DeepseekV4Attention(nn.Module):
    def __init__(self, vllm_config, prefix=""):
        super().__init__()
        hidden = vllm_config.model_config.hf_config.hidden_size
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, positions, hidden_states, llama_4_scaling=None):
        return self.proj(hidden_states)


class DeepseekV4MoE(nn.Module):
    def __init__(self, config, parallel_config, quant_config, prefix="", is_draft_layer=False):
        super().__init__()
        self.layer_idx = int(prefix.split(".")[-2])
        self.is_hash = self.layer_idx < config.num_hash_layers
        self.up = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.experts = self.up
        self.n_logical_experts = self.n_physical_experts = self.n_routed_experts = 4
        self.n_local_physical_experts, self.n_shared_experts, self.n_redundant_experts = 4, 1, 0

    def forward(self, hidden_states, input_ids=None):
        out = self.up(hidden_states)
        if self.is_hash:  # Ascend's hash routing reads the ids from the forward context
            ids = get_forward_context().input_ids[: hidden_states.shape[0]]
            out = out + ids.to(out.dtype)[:, None]
        return out


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, vllm_config, prefix, topk_indices_buffer=None):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.layer_idx = int(prefix.split(".")[-1])
        self.self_attn = DeepseekV4Attention(vllm_config, prefix=f"{prefix}.self_attn")
        self.mlp = DeepseekV4MoE(
            config, vllm_config.parallel_config, None, prefix=f"{prefix}.mlp", is_draft_layer=False
        )
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, positions, hidden_states, residual, llama_4_scaling=None):
        x = self.input_layernorm(hidden_states)
        x = hidden_states + self.self_attn(positions=positions, hidden_states=x)
        return x + self.mlp(self.post_attention_layernorm(x)), residual


class DeepseekV4Model(nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.start_layer, self.end_layer = 0, config.num_hidden_layers
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(vllm_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )

    def forward(self, input_ids, positions):
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return x


class AscendDeepseekV4ForCausalLM(nn.Module):
    model_cls = DeepseekV4Model

    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.model = self.model_cls(vllm_config=vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        self.set_moe_parameters()

    def set_moe_parameters(self):
        self.moe_layers = []
        example_moe = None
        for layer in self.model.layers:
            if isinstance(layer.mlp, DeepseekV4MoE):
                example_moe = layer.mlp
                self.moe_layers.append(layer.mlp.experts)
        self.num_moe_layers = len(self.moe_layers)
        self.num_logical_experts = example_moe.n_logical_experts if example_moe else 0

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded

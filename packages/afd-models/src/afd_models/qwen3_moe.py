"""Role-aware Qwen3-MoE for AFD (gate on the FFN side, split at the whole-MLP boundary).

As for DeepSeek, the decoder layer's forward is vLLM's; only construction is per role.
"""

from __future__ import annotations

from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding,
)
from vllm.model_executor.models import qwen3_moe as native
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)

from afd_core.config import require_afd_config
from afd_models.role import (
    AFDRoleModel,
    attention_side,
    ffn_side,
    moe_bookkeeping,
    role_lm_head,
)


def _is_moe_layer(config, layer_idx: int) -> bool:
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class AFDQwen3MoeDecoderLayer(native.Qwen3MoeDecoderLayer):
    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str = "",
        is_fused_checkpoint_transposed=False,
        mrope_positions_factor: int = 4,
    ) -> None:
        nn.Module.__init__(self)
        afd = require_afd_config(vllm_config)
        config = vllm_config.model_config.hf_text_config
        quant_config = vllm_config.quant_config
        self.hidden_size = config.hidden_size
        layer_idx = extract_layer_index(prefix)
        self.layer_idx = layer_idx
        if afd.is_attention:
            self.self_attn = native.Qwen3MoeAttention(
                hidden_size=self.hidden_size,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                rope_parameters=config.rope_parameters,
                max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
                rms_norm_eps=config.rms_norm_eps,
                qkv_bias=getattr(config, "attention_bias", False),
                head_dim=getattr(config, "head_dim", None),
                cache_config=vllm_config.cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.self_attn",
                dual_chunk_attention_config=getattr(config, "dual_chunk_attention_config", None),
                mrope_positions_factor=mrope_positions_factor,
            )
            attention_side(self, layer_idx, config)
        else:
            ffn_side(self)
            if _is_moe_layer(config, layer_idx):
                self.mlp = native.Qwen3MoeSparseMoeBlock(
                    vllm_config=vllm_config,
                    prefix=f"{prefix}.mlp",
                    is_fused_checkpoint_transposed=is_fused_checkpoint_transposed,
                )
            else:
                self.mlp = native.Qwen3MoeMLP(
                    hidden_size=config.hidden_size,
                    intermediate_size=config.intermediate_size,
                    hidden_act=config.hidden_act,
                    quant_config=quant_config,
                    prefix=f"{prefix}.mlp",
                )


@support_torch_compile
class AFDQwen3MoeModel(native.Qwen3MoeModel):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        afd = require_afd_config(vllm_config)
        config = vllm_config.model_config.hf_text_config
        self.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts
        self.vocab_size = config.vocab_size
        self.config = config
        self.quant_config = vllm_config.quant_config
        if afd.is_attention:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                quant_config=self.quant_config,
                prefix=f"{prefix}.embed_tokens",
            )
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.embed_tokens = PPMissingLayer()
            self.norm = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: AFDQwen3MoeDecoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )


class AFDQwen3MoeForCausalLM(AFDRoleModel, native.Qwen3MoeForCausalLM):
    packed_modules_mapping = {
        k: list(v) for k, v in native.Qwen3MoeForCausalLM.packed_modules_mapping.items()
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        self.afd = require_afd_config(vllm_config)
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        if getattr(config, "mlp_only_layers", []):
            self.packed_modules_mapping["gate_up_proj"] = ["gate_proj", "up_proj"]
        self.model = AFDQwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = role_lm_head(
            self.afd,
            config,
            self.quant_config,
            maybe_prefix(prefix, "lm_head"),
            getattr(self.model, "embed_tokens", None),
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        moe_bookkeeping(
            self,
            [
                layer.mlp
                for layer in self.model.layers
                if isinstance(getattr(layer, "mlp", None), native.Qwen3MoeSparseMoeBlock)
            ],
        )

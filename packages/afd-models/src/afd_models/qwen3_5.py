"""Role-aware Qwen3.5-MoE for AFD: the multimodal model and its text-only form.

The decoder layer's forward is vLLM's (Qwen3-Next's): its attention is a linear-attention
(Gated DeltaNet) or a full-attention layer as `layer_types` says, its norms are Gemma-style
(weight + 1), and an optional `layer_scale` rescales the MLP's output after the exchange;
all of that stays on the attention side with the vision tower. Every layer's MLP is a
sparse MoE with a gated shared expert, which the FFN side holds whole (router included).

vLLM's `qwen3_5` module imports the Qwen-VL image processor, which needs torchvision: the
wrapper cannot be imported without it, and AFD's start-up check names that.
"""

from __future__ import annotations

from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models import qwen3_5 as native
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)

from afd_core.config import require_afd_config
from afd_models.role import (
    DYNAMIC_ARG_DIMS,
    AFDRoleModel,
    RemoteFFN,
    ffn_side,
    moe_bookkeeping,
    role_lm_head,
)


class AFDQwen3_5DecoderLayer(native.Qwen3_5DecoderLayer):
    def __init__(self, vllm_config: VllmConfig, layer_type: str, prefix: str = "") -> None:
        nn.Module.__init__(self)
        afd = require_afd_config(vllm_config)
        config = vllm_config.model_config.hf_text_config
        if config.model_type != "qwen3_5_moe_text":
            raise ValueError(
                f"AFD: Qwen3.5 model_type {config.model_type!r} has no MoE layers to "
                "disaggregate; AFD serves Qwen3.5-MoE (qwen3_5_moe_text)"
            )
        self.layer_type = layer_type
        self.layer_idx = extract_layer_index(prefix)
        # sequence-parallel MoE would split rows across TP ranks before the exchange
        self.use_attn_reduce_scatter_for_moe = False
        self.layer_scale = getattr(config, "layer_scale", False)
        if not afd.is_attention:
            ffn_side(self)
            self.mlp = native.Qwen3NextSparseMoeBlock(
                vllm_config=vllm_config, prefix=f"{prefix}.mlp"
            )
            return
        if layer_type == "linear_attention":
            self.linear_attn = native.QwenGatedDeltaNetAttention(
                config=config,
                vllm_config=vllm_config,
                prefix=f"{prefix}.linear_attn",
                gqa_interleaved_layout=False,
                reduce_results=True,
            )
        elif layer_type == "full_attention":
            self.self_attn = native.Qwen3NextAttention(
                config,
                model_config=vllm_config.model_config,
                cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.self_attn",
                reduce_results=True,
                mrope_positions_factor=native.mrope_positions_factor(vllm_config),
            )
        else:
            raise ValueError(f"Invalid layer_type {layer_type}")
        self.mlp = RemoteFFN(self.layer_idx)
        self.input_layernorm = native.Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = native.Qwen3_5RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )
        if self.layer_scale:
            import torch

            for name in ("attn_layer_scale", "ffn_layer_scale"):
                setattr(self, name, nn.Parameter(torch.zeros(1, 1, config.hidden_size)))


@support_torch_compile(dynamic_arg_dims=DYNAMIC_ARG_DIMS)
class AFDQwen3_5Model(native.Qwen3_5Model):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        afd = require_afd_config(vllm_config)
        config = vllm_config.model_config.hf_text_config
        self.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.vocab_size = config.vocab_size
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: AFDQwen3_5DecoderLayer(
                vllm_config,
                layer_type=config.layer_types[extract_layer_index(prefix)],
                prefix=prefix,
            ),
            prefix=f"{prefix}.layers",
        )
        self.is_fused_shared_expert_enabled = False  # AFD loads the shared expert unfused
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )
        self.aux_hidden_state_layers = ()
        if afd.is_attention:
            self.embed_tokens = VocabParallelEmbedding(self.vocab_size, config.hidden_size)
            self.norm = native.Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.embed_tokens = PPMissingLayer()
            self.norm = PPMissingLayer()


def _moe_blocks(layers) -> list:
    return [ly.mlp for ly in layers if isinstance(ly.mlp, native.Qwen3NextSparseMoeBlock)]


class AFDQwen3_5MoeForCausalLM(AFDRoleModel, native.Qwen3_5MoeForCausalLM):
    packed_modules_mapping = {
        k: list(v) for k, v in native.Qwen3_5MoeForCausalLM.packed_modules_mapping.items()
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        self.afd = require_afd_config(vllm_config)
        config = vllm_config.model_config.hf_text_config
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.quant_config = vllm_config.quant_config
        self.config = config
        self.scheduler_config = vllm_config.scheduler_config
        self.model = AFDQwen3_5Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = role_lm_head(
            self.afd,
            config,
            self.quant_config,
            maybe_prefix(prefix, "lm_head"),
            getattr(self.model, "embed_tokens", None),
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        moe_bookkeeping(self, _moe_blocks(self.model.layers))
        self.weights_filtered_by_parent = False

    def load_weights(self, weights):
        if self.weights_filtered_by_parent:  # inside the multimodal model: already filtered
            return native.Qwen3_5MoeForCausalLM.load_weights(self, weights)
        return super().load_weights(weights)


class AFDQwen3_5MoeForConditionalGeneration(
    AFDRoleModel, native.Qwen3_5MoeForConditionalGeneration
):
    """The multimodal model: the vision tower on the attention side, the language model
    split as the text-only one."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model"):
        nn.Module.__init__(self)
        self.afd = require_afd_config(vllm_config)
        config = vllm_config.model_config.hf_config
        multimodal_config = vllm_config.model_config.get_multimodal_config()
        self.config = config
        self.model_config = vllm_config.model_config
        self.multimodal_config = multimodal_config
        self.use_data_parallel = multimodal_config.mm_encoder_tp_mode == "data"
        self.is_multimodal_pruning_enabled = multimodal_config.is_multimodal_pruning_enabled()
        self.video_pruning_rate = multimodal_config.video_pruning_rate
        self._tokenizer = native.cached_tokenizer_from_config(vllm_config.model_config)
        self.use_deepstack = hasattr(config.vision_config, "deepstack_visual_indexes")
        self.deepstack_num_level = (
            len(config.vision_config.deepstack_visual_indexes) if self.use_deepstack else 0
        )
        self.visual_dim = config.vision_config.out_hidden_size
        self.multiscale_dim = self.visual_dim * self.deepstack_num_level
        if self.afd.is_attention:
            with self._mark_tower_model(vllm_config, {"image", "video"}):
                self.visual = native.Qwen3_VisionTransformer(
                    config.vision_config,
                    norm_eps=getattr(config, "rms_norm_eps", 1e-6),
                    quant_config=vllm_config.quant_config,
                    input_norm=native.build_mm_input_norm(self.model_config),
                    prefix=maybe_prefix(prefix, "visual"),
                )
        else:
            self.visual = PPMissingLayer()
        with self._mark_language_model(vllm_config):
            self.language_model = AFDQwen3_5MoeForCausalLM(
                vllm_config=vllm_config, prefix=maybe_prefix(prefix, "language_model")
            )
        self.language_model.weights_filtered_by_parent = True
        self.make_empty_intermediate_tensors = self.language_model.make_empty_intermediate_tensors
        moe_bookkeeping(self, _moe_blocks(self.language_model.model.layers))

    @property
    def model(self):  # AFDRoleModel's view: the decoder stack
        return self.language_model.model

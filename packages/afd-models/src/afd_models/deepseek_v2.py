"""Role-aware DeepSeek V1/V2/V3 (and V3.2, GLM-MoE-DSA aliases) for AFD.

The decoder layer's forward is vLLM's, unchanged: on the attention role its `mlp` is a
RemoteFFN, so the post-attention-norm hidden states go to the FFN ranks exactly where the
native MLP would have run. Construction is overridden only to build the modules of one role
(building and dropping the other role's modules would register them in vLLM's forward
context and allocate their weights); the arguments are vLLM's own.
"""

from __future__ import annotations

import typing

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding,
)
from vllm.model_executor.models import deepseek_v2 as native
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)

from afd_core.config import require_afd_config
from afd_models.role import (
    AFDRoleModel,
    GatedRemoteFFN,
    RemoteFFN,
    attention_side,
    ffn_side,
    role_lm_head,
)


def _is_moe_layer(config, layer_idx: int) -> bool:
    return (
        config.n_routed_experts is not None
        and layer_idx >= config.first_k_dense_replace
        and layer_idx % getattr(config, "moe_layer_freq", 1) == 0
    )


class AFDDeepseekV2DecoderLayer(native.DeepseekV2DecoderLayer):
    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str,
        config=None,
        topk_indices_buffer=None,
        index_group_builder=None,
    ) -> None:
        nn.Module.__init__(self)
        afd = require_afd_config(vllm_config)
        config = config or vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.hidden_size = config.hidden_size
        self.layer_idx = layer_idx = int(prefix.split(sep=".")[-1])
        qk_nope_head_dim = getattr(config, "qk_nope_head_dim", 0)
        qk_rope_head_dim = getattr(config, "qk_rope_head_dim", 0)
        self.use_mha = config.model_type == "deepseek" or all(
            d == 0 for d in (qk_nope_head_dim, qk_rope_head_dim)
        )
        is_moe_layer = _is_moe_layer(config, layer_idx)
        self.is_moe_layer = is_moe_layer
        # sequence-parallel MoE would split rows across TP ranks before the exchange
        self.use_sequence_parallel_moe = False
        self.routed_scaling_factor = getattr(config, "routed_scaling_factor", 1.0)

        if afd.is_attention:
            attn_cls: typing.Any
            if self.use_mha:
                attn_cls = native.DeepseekAttention
            elif vllm_config.model_config.use_mla:
                attn_cls = native.DeepseekV2MLAAttention
            else:
                attn_cls = native.DeepseekV2Attention
            attn_kwargs = (
                {"index_group_builder": index_group_builder}
                if attn_cls is native.DeepseekV2MLAAttention
                else {}
            )
            self.self_attn = attn_cls(
                vllm_config=vllm_config,
                config=config,
                hidden_size=self.hidden_size,
                num_heads=config.num_attention_heads,
                qk_nope_head_dim=qk_nope_head_dim,
                qk_rope_head_dim=qk_rope_head_dim,
                v_head_dim=getattr(config, "v_head_dim", 0),
                q_lora_rank=getattr(config, "q_lora_rank", None),
                kv_lora_rank=getattr(config, "kv_lora_rank", 0),
                max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
                cache_config=vllm_config.cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.self_attn",
                topk_indices_buffer=topk_indices_buffer,
                reduce_results=True,
                **attn_kwargs,
            )
            attention_side(self, layer_idx, config, self._remote_mlp(afd, config, prefix))
        else:
            ffn_side(self)
            if is_moe_layer:
                from vllm._aiter_ops import rocm_aiter_ops

                self.mlp = native.DeepseekV2MoE(
                    config=config,
                    parallel_config=vllm_config.parallel_config,
                    quant_config=quant_config,
                    prefix=f"{prefix}.mlp",
                    apply_routed_scale_to_output=not rocm_aiter_ops.is_fused_moe_enabled(),
                )
                if afd.compute_gate_on_attention:
                    _route_with_received_logits(self.mlp)
            else:
                self.mlp = native.DeepseekV2MLP(
                    hidden_size=config.hidden_size,
                    intermediate_size=config.intermediate_size,
                    hidden_act=config.hidden_act,
                    quant_config=quant_config,
                    prefix=f"{prefix}.mlp",
                )

    def _remote_mlp(self, afd, config, prefix: str) -> nn.Module:
        """The attention side's proxy for this layer's MLP/MoE."""
        if not afd.compute_gate_on_attention:
            return RemoteFFN(self.layer_idx)
        if not self.is_moe_layer:
            return RemoteFFN(self.layer_idx, router_width=config.n_routed_experts)
        gate = GateLinear(
            config.hidden_size,
            config.n_routed_experts,
            out_dtype=native._get_moe_router_dtype(config),
            prefix=f"{prefix}.mlp.gate",
        )
        return GatedRemoteFFN(self.layer_idx, gate)

    def compute_ffn_output(self, hidden_states: torch.Tensor, router_logits=None) -> torch.Tensor:
        if router_logits is not None and self.is_moe_layer:
            out = _experts_only(self.mlp, hidden_states, router_logits)
        else:
            out = self.mlp(hidden_states)
        # vLLM's decoder layer keeps an fp16 residual stream scaled by 1/routed_scaling_factor
        # and rescales a dense MLP's output itself (MoE outputs are rescaled inside the MoE).
        if out.dtype == torch.float16 and isinstance(self.mlp, native.DeepseekV2MLP):
            out = out * (1.0 / self.routed_scaling_factor)
        return out


class _RoutingBias(nn.Module):
    """FFN side, gate on attention: what stays of a MoE layer's gate, the correction bias
    vLLM's expert selection adds (loaded from `mlp.gate.e_score_correction_bias`)."""

    def __init__(self, bias: nn.Parameter):
        super().__init__()
        self.e_score_correction_bias = bias


def _route_with_received_logits(moe: native.DeepseekV2MoE) -> None:
    """FFN side, gate on attention: the MoE runs its experts on the logits the attention
    side sent; the router projection is not built here (its weight loads on attention)."""
    # vLLM's MoE runner applies its gate when it holds one; without it, it routes with the
    # router_logits it is given
    moe.experts.gate = None
    moe.router_dtype = moe.gate.out_dtype
    bias = moe.gate.e_score_correction_bias
    moe.gate = _RoutingBias(bias) if bias is not None else None


def _experts_only(moe: native.DeepseekV2MoE, hidden_states, router_logits) -> torch.Tensor:
    """DeepseekV2MoE.forward (sequence-parallel MoE is off in AFD) with received logits."""
    logits = router_logits.to(moe.router_dtype or hidden_states.dtype)
    return moe.experts(hidden_states=hidden_states, router_logits=logits)


@support_torch_compile
class AFDDeepseekV2Model(native.DeepseekV2Model):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        afd = require_afd_config(vllm_config)
        config = vllm_config.model_config.hf_config
        self.config = config
        self.device = native.current_platform.device_type
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.is_v32 = hasattr(config, "index_topk")
        topk_indices_buffer = index_group_builder = None
        if self.is_v32 and afd.is_attention:  # the V3.2 indexer is part of attention
            topk_indices_buffer = torch.empty(
                vllm_config.scheduler_config.max_num_batched_tokens,
                config.index_topk,
                dtype=torch.int32,
                device=self.device,
            )
            index_group_builder = native.SparseMLAIndexGroupBuilder(
                topk_indices_buffer, native.get_sparse_mla_index_group_max_rows(vllm_config)
            )
        if afd.is_attention and get_pp_group().is_first_rank:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size,
                self.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.embed_tokens",
            )
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: AFDDeepseekV2DecoderLayer(
                vllm_config=vllm_config,
                prefix=prefix,
                topk_indices_buffer=topk_indices_buffer,
                index_group_builder=index_group_builder,
            ),
            prefix=f"{prefix}.layers",
        )
        self.is_fused_shared_expert_enabled = native.is_model_fused_shared_expert_compatible(
            self.layers, native.DeepseekV2MoE, "mlp"
        )
        if afd.is_attention and get_pp_group().is_last_rank:
            self.norm = RMSNorm(self.hidden_size, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], self.hidden_size
        )
        self.aux_hidden_state_layers = tuple[int, ...]()
        self.use_mha = config.model_type == "deepseek" or all(
            getattr(config, d, 0) == 0 for d in ("qk_nope_head_dim", "qk_rope_head_dim")
        )
        self.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts


class AFDDeepseekV2ForCausalLM(AFDRoleModel, native.DeepseekV2ForCausalLM):
    # vLLM's __init__ adds entries to the class-level dict; keep ours separate
    packed_modules_mapping = dict(native.DeepseekV2ForCausalLM.packed_modules_mapping)
    model_cls = AFDDeepseekV2Model

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        self.afd = require_afd_config(vllm_config)
        config = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.use_mha = config.model_type == "deepseek" or all(
            getattr(config, d, 0) == 0 for d in ("qk_nope_head_dim", "qk_rope_head_dim")
        )
        if self.use_mha:
            self.packed_modules_mapping["qkv_proj"] = ["q_proj", "k_proj", "v_proj"]
        self.fuse_qkv_a_proj = getattr(config, "q_lora_rank", None) is not None
        if self.fuse_qkv_a_proj:
            self.packed_modules_mapping["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]
        self.model = self.model_cls(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        # vLLM's DeepSeek never ties its head to the embeddings
        self.lm_head = role_lm_head(
            self.afd, config, self.quant_config, maybe_prefix(prefix, "lm_head")
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.num_moe_layers = config.num_hidden_layers - config.first_k_dense_replace
        self.set_moe_parameters()

    supports_gate_on_attention = True

    def router_width(self) -> int:
        return self.config.n_routed_experts if self.afd.compute_gate_on_attention else 0

    def compute_ffn_output(
        self, layer_idx: int, hidden_states: torch.Tensor, router_logits=None, token_ids=None
    ) -> torch.Tensor:
        return self.model.layers[layer_idx].compute_ffn_output(hidden_states, router_logits)


class AFDDeepseekForCausalLM(AFDDeepseekV2ForCausalLM):
    pass


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM):
    pass


class AFDGlmMoeDsaForCausalLM(AFDDeepseekV2ForCausalLM):
    pass

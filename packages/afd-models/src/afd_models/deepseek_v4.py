"""Role-aware DeepSeek-V4 for AFD, over vLLM's CPU implementation of the model.

V4's decoder layer keeps several residual streams (mHC): around its FFN it mixes them into
one (`hc_pre`), normalizes (`ffn_norm`), runs `ffn(x, input_ids)` and mixes the result back
(`hc_post`). Only `ffn` is remote: the streams, their mixing parameters and both norms stay
on the attention side, and the exchange carries the normalized rows (hidden size) and each
row's token id, because the first `num_hash_layers` MoE layers route by token id
(`tid2eid`). Every V4 layer is a MoE layer; the router runs on the FFN side.

vLLM picks V4's implementation by platform (`vllm.models.deepseek_v4`); this wrapper splits
the CPU one. The CUDA implementation (fused mHC, its own gate metadata) is not split yet:
on any other platform the model is rejected at start-up with that reason. On vLLM's CPU
build the model is built and loaded, but its first step stops in Triton kernels of the
attention metadata that have no CPU backend here, so V4 is tested at the module level.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.platforms import current_platform

from afd_core.config import require_afd_config
from afd_models.not_implemented import not_implemented_model
from afd_models.role import DYNAMIC_ARG_DIMS, AFDRoleModel, RemoteFFN, role_lm_head


def _split_cpu_implementation():
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )
    from vllm.model_executor.models.utils import (
        PPMissingLayer,
        extract_layer_index,
        make_layers,
        maybe_prefix,
    )
    from vllm.models.deepseek_v4.cpu import model as native

    class AFDDeepseekV4DecoderLayer(native.DeepseekV4DecoderLayer):
        """vLLM's V4 block; construction builds one role. The forward is vLLM's: on the
        attention side `self.ffn` is a RemoteFFN that sends the rows and token ids."""

        def __init__(self, vllm_config: VllmConfig, prefix: str, topk_indices_buffer=None):
            nn.Module.__init__(self)
            import vllm.model_executor.layers.mhc  # noqa: F401 - registers the mHC ops

            afd = require_afd_config(vllm_config)
            config = vllm_config.model_config.hf_config
            self.hidden_size = config.hidden_size
            self.rms_norm_eps = config.rms_norm_eps
            self.layer_idx = extract_layer_index(prefix)
            if not afd.is_attention:
                self.ffn = native.DeepseekV4MoE(vllm_config, prefix=f"{prefix}.ffn")
                self.attn = PPMissingLayer()
                return
            self.attn = native.DeepseekV4CPUAttention(
                vllm_config, prefix=f"{prefix}.attn", topk_indices_buffer=topk_indices_buffer
            )
            self.ffn = RemoteFFN(self.layer_idx, token_ids=True)
            self.attn_norm = RMSNorm(self.hidden_size, self.rms_norm_eps)
            self.ffn_norm = RMSNorm(self.hidden_size, self.rms_norm_eps)
            self.hc_mult = config.hc_mult
            self.hc_sinkhorn_iters = config.hc_sinkhorn_iters
            self.hc_eps = config.hc_eps
            self.hc_post_alpha = 2.0
            mix_hc = (2 + self.hc_mult) * self.hc_mult
            hc_dim = self.hc_mult * self.hidden_size
            for side in ("attn", "ffn"):  # the streams' mixing parameters (fp32, as vLLM's)
                for name, shape in (("fn", (mix_hc, hc_dim)), ("base", (mix_hc,)), ("scale", (3,))):
                    param = nn.Parameter(torch.empty(shape, dtype=torch.float32), False)
                    setattr(self, f"hc_{side}_{name}", param)
            self.mhc_pre = native.MHCPreOp()
            self.mhc_post = native.MHCPostOp()
            self.mhc_fused_post_pre = native.MHCFusedPostPreOp()
            self.use_fused_mhc = native.HAS_TILELANG_MHC and not (
                native.HAS_AITER_MHC and self.hidden_size % 256 == 0
            )

    @support_torch_compile(dynamic_arg_dims=DYNAMIC_ARG_DIMS)
    class AFDDeepseekV4Model(native.DeepseekV4Model):
        def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
            nn.Module.__init__(self)
            afd = require_afd_config(vllm_config)
            config = vllm_config.model_config.hf_config
            self.config = config
            self.vocab_size = config.vocab_size
            self.hc_eps = config.hc_eps
            self.hc_mult = config.hc_mult
            self.hc_dim = self.hc_mult * config.hidden_size
            self.rms_norm_eps = config.rms_norm_eps
            self.device = current_platform.device_type
            self.topk_indices_buffer = None
            self._mtp_hidden_buffer = None  # speculative decoding is rejected under AFD
            if afd.is_attention:  # the indexer layers' shared buffer is attention's
                self.topk_indices_buffer = torch.empty(
                    vllm_config.scheduler_config.max_num_batched_tokens,
                    config.index_topk,
                    dtype=torch.int32,
                    device=self.device,
                )
            self.start_layer, self.end_layer, self.layers = make_layers(
                config.num_hidden_layers,
                lambda prefix: AFDDeepseekV4DecoderLayer(
                    vllm_config, prefix=prefix, topk_indices_buffer=self.topk_indices_buffer
                ),
                prefix=f"{prefix}.layers",
            )
            self.is_fused_shared_expert_enabled = False  # vLLM's CPU V4 never fuses them
            if not afd.is_attention:
                self.embed_tokens = PPMissingLayer()
                self.norm = PPMissingLayer()
                return
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.embed_tokens",
            )
            self.norm = RMSNorm(config.hidden_size, self.rms_norm_eps)
            for name, shape in (
                ("hc_head_fn", (self.hc_mult, self.hc_dim)),
                ("hc_head_base", (self.hc_mult,)),
                ("hc_head_scale", (1,)),
            ):
                setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch.float32), False))
            self.hc_head_op = native.HCHeadOp()

    class AFDDeepseekV4ForCausalLM(AFDRoleModel, native.DeepseekV4ForCausalLM):
        model_cls = AFDDeepseekV4Model
        packed_modules_mapping = dict(native.DeepseekV4ForCausalLM.packed_modules_mapping)

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
            nn.Module.__init__(self)
            self.afd = require_afd_config(vllm_config)
            config = vllm_config.model_config.hf_config
            self.config = config
            self.model = self.model_cls(
                vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model")
            )
            expert_dtype = getattr(config, "expert_dtype", "fp4")
            if expert_dtype != "fp4":
                self.hf_to_vllm_mapper = native._make_deepseek_v4_weights_mapper(expert_dtype)
            # as vLLM's V4: an unquantized head, never tied to the embeddings
            self.lm_head = role_lm_head(self.afd, config, None, maybe_prefix(prefix, "lm_head"))
            self.logits_processor = LogitsProcessor(config.vocab_size)
            self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

        def routes_by_token_id(self) -> bool:
            return True

        def compute_ffn_output(
            self, layer_idx: int, hidden_states, router_logits=None, token_ids=None
        ):
            return self.model.layers[layer_idx].ffn(hidden_states, token_ids)

    return AFDDeepseekV4ForCausalLM


if current_platform.is_cpu():
    AFDDeepseekV4ForCausalLM = _split_cpu_implementation()
else:
    AFDDeepseekV4ForCausalLM = not_implemented_model(
        "AFDDeepseekV4ForCausalLM",
        f"on the {current_platform.device_type} platform: it splits vLLM's CPU "
        "implementation of DeepSeek-V4; the CUDA one (fused mHC) comes with the CUDA path",
    )

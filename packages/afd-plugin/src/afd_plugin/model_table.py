"""The AFD model-registration table: vLLM architecture -> lazy "module:Class" of its wrapper.

register_afd registers each under "AFD" + architecture. Native names are never overridden;
an AFD worker resolves the AFD name for its own model config only.
"""

from __future__ import annotations

import importlib.util
from types import MappingProxyType


def _deepseek_v4_target() -> str:
    # The Ascend wrapper needs torch_npu; everywhere else the GPU/CPU one.
    if importlib.util.find_spec("torch_npu") is not None:
        return "afd_npu.models.deepseek_v4:AFDDeepseekV4ForCausalLM"
    return "afd_models.deepseek_v4:AFDDeepseekV4ForCausalLM"


def build_model_registrations() -> MappingProxyType:
    return MappingProxyType(
        {
            "DeepseekForCausalLM": "afd_models.deepseek_v2:AFDDeepseekForCausalLM",
            "DeepseekV2ForCausalLM": "afd_models.deepseek_v2:AFDDeepseekV2ForCausalLM",
            "DeepseekV3ForCausalLM": "afd_models.deepseek_v2:AFDDeepseekV3ForCausalLM",
            # V3.2 has the V3 layer structure (plus the indexer, which stays on attention).
            "DeepseekV32ForCausalLM": "afd_models.deepseek_v2:AFDDeepseekV3ForCausalLM",
            "DeepseekV4ForCausalLM": _deepseek_v4_target(),
            "GlmMoeDsaForCausalLM": "afd_models.deepseek_v2:AFDGlmMoeDsaForCausalLM",
            "Qwen3MoeForCausalLM": "afd_models.qwen3_moe:AFDQwen3MoeForCausalLM",
            "Qwen3_5MoeForConditionalGeneration": (
                "afd_models.qwen3_5:AFDQwen3_5MoeForConditionalGeneration"
            ),
        }
    )


MODEL_REGISTRATIONS = build_model_registrations()


def afd_name(architecture: str) -> str:
    return "AFD" + architecture

"""Role-filtered loading of quantized checkpoints (docs/features.md): every tensor a
quantization method adds next to a weight (scales, zero points, packed values) goes to
the role of that weight, so each role loads a whole quantized layer and nothing of the
other role's. The names are the checkpoints' own (DeepSeek-V3's FP8 block scales, FP8
per-tensor scales, AWQ/GPTQ and compressed-tensors tensors). Pure Python: no checkpoint
is loaded; vLLM's CPU build cannot run FP8 experts without AMX."""

import pytest

from afd_models.weights import weight_wanted

# (weight, the tensors a quantization method stores beside it)
DEEPSEEK_V3_FP8 = [  # deepseek-ai/DeepSeek-V3: float8_e4m3fn, 128x128 blocks
    ("model.layers.0.mlp.gate_proj.weight", ["model.layers.0.mlp.gate_proj.weight_scale_inv"]),
    (
        "model.layers.3.mlp.experts.17.down_proj.weight",
        ["model.layers.3.mlp.experts.17.down_proj.weight_scale_inv"],
    ),
    (
        "model.layers.3.mlp.shared_experts.up_proj.weight",
        ["model.layers.3.mlp.shared_experts.up_proj.weight_scale_inv"],
    ),
    (
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        ["model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv"],
    ),
    (
        "model.layers.3.self_attn.o_proj.weight",
        ["model.layers.3.self_attn.o_proj.weight_scale_inv"],
    ),
]
FP8_PER_TENSOR = [  # e.g. Qwen3 FP8 / compressed-tensors float-quantized
    (
        "model.layers.1.mlp.experts.5.up_proj.weight",
        [
            "model.layers.1.mlp.experts.5.up_proj.weight_scale",
            "model.layers.1.mlp.experts.5.up_proj.input_scale",
        ],
    ),
    (
        "model.layers.1.self_attn.q_proj.weight",
        ["model.layers.1.self_attn.q_proj.weight_scale", "model.layers.1.self_attn.k_scale"],
    ),
]
INT4 = [  # AWQ / GPTQ / compressed-tensors pack-quantized: no `.weight` at all
    (
        "model.layers.2.mlp.experts.0.gate_proj.qweight",
        [
            "model.layers.2.mlp.experts.0.gate_proj.qzeros",
            "model.layers.2.mlp.experts.0.gate_proj.scales",
            "model.layers.2.mlp.experts.0.gate_proj.g_idx",
        ],
    ),
    (
        "model.layers.2.mlp.experts.0.down_proj.weight_packed",
        [
            "model.layers.2.mlp.experts.0.down_proj.weight_scale",
            "model.layers.2.mlp.experts.0.down_proj.weight_shape",
        ],
    ),
    (
        "model.layers.2.self_attn.v_proj.qweight",
        ["model.layers.2.self_attn.v_proj.scales", "model.layers.2.self_attn.v_proj.qzeros"],
    ),
]
CASES = DEEPSEEK_V3_FP8 + FP8_PER_TENSOR + INT4


def _role(name: str, gate_on_attention: bool = False) -> str:
    ffn = weight_wanted("ffn", name, gate_on_attention)
    attention = weight_wanted("attention", name, gate_on_attention)
    assert ffn != attention, f"{name}: exactly one role must load it"
    return "ffn" if ffn else "attention"


@pytest.mark.parametrize("weight, extras", CASES, ids=[w for w, _ in CASES])
@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_a_quantized_weights_scales_go_with_it(weight, extras, gate_on_attention):
    expected = "ffn" if ".mlp." in weight else "attention"
    assert _role(weight, gate_on_attention) == expected
    for extra in extras:
        assert _role(extra, gate_on_attention) == expected, extra


def test_deepseek_v3_fp8s_router_moves_alone_with_the_gate_on_attention():
    """DeepSeek-V3 FP8 keeps its router projection in bf16 (no scale): with the gate on
    attention it alone moves; the correction bias stays with the experts."""
    assert _role("model.layers.3.mlp.gate.weight", gate_on_attention=True) == "attention"
    assert _role("model.layers.3.mlp.gate.e_score_correction_bias", True) == "ffn"
    assert _role("model.layers.3.mlp.gate.weight") == "ffn"

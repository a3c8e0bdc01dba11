"""Reading HF config.json files for the planner (afd_core.planner.model_shape): strict types
and ranges, dense and Mixtral-style configs, hybrid (linear + full) attention. Pure Python."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import pytest

from afd_core.planner import PlanInputError, costs
from afd_core.planner.hardware import PRESETS as HW_PRESETS
from afd_core.planner.model_shape import PRESETS, RANGES, from_hf_config, load_model

QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "intermediate_size": 6144, "vocab_size": 151936, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "torch_dtype": "bfloat16",
}  # fmt: skip

# Qwen/Qwen3.5-35B-A3B's text config: the defaults of transformers' Qwen3_5MoeTextConfig
QWEN3_5_TEXT = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8, "num_experts": 256, "full_attention_interval": 4,
}  # fmt: skip
QWEN3_5 = {"model_type": "qwen3_5_moe", "text_config": QWEN3_5_TEXT, "torch_dtype": "bfloat16"}


def _write(tmp_path, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        # the five of issue 23
        ("num_hidden_layers", "forty-eight", "an integer in [1, 1024]"),
        ("hidden_size", [2048], "an integer in [1, 262144]"),
        ("num_hidden_layers", True, "an integer in [1, 1024]"),
        ("hidden_size", 2048.7, "an integer in [1, 262144]"),
        ("num_hidden_layers", 1e12, "an integer in [1, 1024]"),
        # integers out of range, integral floats, strings, bools elsewhere
        ("num_hidden_layers", 10**12, "an integer in [1, 1024]"),
        ("num_hidden_layers", 0, "an integer in [1, 1024]"),
        ("vocab_size", -1, "an integer in [1, 10000000]"),
        ("vocab_size", 10**7 + 1, "an integer in [1, 10000000]"),
        ("num_experts", 65537, "an integer in [1, 65536]"),
        ("num_experts_per_tok", "8", "an integer in [1, 65536]"),
        ("moe_intermediate_size", 768.0, "an integer in [1, 1048576]"),
        ("num_key_value_heads", False, "an integer in [1, 65536]"),
        ("intermediate_size", -6144, "an integer in [0, 1048576]"),
        ("decoder_sparse_step", 0, "an integer in [1, 1024]"),
        ("mlp_only_layers", "0", "a list of layer indices"),
        ("mlp_only_layers", 0, "a list of layer indices"),
        ("num_experts", False, "an integer in [1, 65536]"),
        ("n_shared_experts", "1", "an integer in [0, 1024]"),
        ("mlp_only_layers", [0, 48], "an integer in [0, 47]"),
        ("mlp_only_layers", [True], "an integer in [0, 47]"),
        ("full_attention_interval", 0, "an integer in [1, 1024]"),
        ("layer_types", ["full_attention"] * 47, "a list of num_hidden_layers (48) entries"),
        ("attn_output_gate", "yes", "true or false"),
        ("quantization_config", "fp8", "an object"),
    ],
)
def test_a_bad_field_is_named_with_file_field_value_and_what_is_allowed(
    tmp_path, field, value, allowed
):
    path = _write(tmp_path, QWEN3_MOE | {field: value})
    start = time.perf_counter()
    with pytest.raises(PlanInputError) as exc:
        load_model(path)
    assert time.perf_counter() - start < 1.0  # 1e12 layers must fail fast, not plan them
    shown = json.dumps(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."  # long values are cut
    msg = str(exc.value)
    assert msg.startswith(f"model config {path}: field {field!r} = "), msg
    if field != "mlp_only_layers":  # there the bad entry is named, not the list
        assert f"= {shown} is invalid" in msg, msg
    assert f"allowed: {allowed}" in msg, msg


def test_the_range_table_covers_every_integer_field_read():
    assert RANGES["num_hidden_layers"] == (1, 1024) and RANGES["hidden_size"] == (1, 262144)
    assert all(lo in (0, 1) and lo < hi for lo, hi in RANGES.values())


def test_a_missing_field_and_a_check_across_fields_name_the_file(tmp_path):
    cfg = {k: v for k, v in QWEN3_MOE.items() if k != "vocab_size"}
    with pytest.raises(PlanInputError, match=r"config.json: field 'vocab_size' is missing"):
        load_model(_write(tmp_path, cfg))
    path = _write(tmp_path, QWEN3_MOE | {"num_experts_per_tok": 129})
    with pytest.raises(PlanInputError, match=rf"^model config {re.escape(path)}: .*top_k=129"):
        load_model(path)
    hybrid = {k: v for k, v in QWEN3_5_TEXT.items() if k != "linear_num_value_heads"}
    with pytest.raises(PlanInputError, match=r"field 'linear_num_value_heads' is missing"):
        from_hf_config(hybrid, "q.json")
    bad_types = QWEN3_5_TEXT | {"layer_types": ["linear_attention"] * 39 + ["mamba"]}
    with pytest.raises(PlanInputError, match=r"'layer_types' = .* one of full_attention, "):
        from_hf_config(bad_types, "q.json")


def test_model_shape_checks_its_own_types_and_ranges():
    base = PRESETS["qwen3-30b-a3b"]
    for field, value, msg in [
        ("num_layers", True, r"num_layers=True is invalid; allowed: an integer"),
        ("hidden_size", 2048.7, r"hidden_size=2048.7 is invalid; allowed: an integer"),
        ("num_layers", 10**6, r"num_layers=1000000 must be <= 1024"),
        ("num_experts", 10**9, r"num_experts=1000000000 must be <= 65536"),
        ("weight_bytes", "2", r"weight_bytes='2' is invalid; allowed: a number"),
        ("num_linear_attention_layers", 49, r"num_linear_attention_layers=49 is more than"),
        ("num_linear_attention_layers", 4, r"linear-attention layers need linear_num_key_heads"),
    ]:
        with pytest.raises(PlanInputError, match=msg):
            replace(base, **{field: value})


def test_a_dense_model_is_named_not_moe(tmp_path):
    llama = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16",
    }  # fmt: skip
    path = _write(tmp_path, llama)
    with pytest.raises(PlanInputError) as exc:
        load_model(path)
    assert str(exc.value) == (
        f"model config {path}: not a MoE model (no routed experts: none of the fields "
        "'n_routed_experts', 'num_experts', 'num_local_experts' is present); AFD splits MoE "
        "models"
    )
    with pytest.raises(PlanInputError, match=r"not a MoE model"):  # 0 experts: dense too
        from_hf_config(llama | {"num_experts": 0}, "x.json")


def test_a_mixtral_config_is_read_with_the_expert_width_in_intermediate_size():
    mixtral = {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "torch_dtype": "bfloat16",
    }  # fmt: skip
    m = from_hf_config(mixtral)
    assert (m.num_experts, m.top_k, m.moe_intermediate_size) == (8, 2, 14336)
    assert (m.num_dense_layers, m.shared_intermediate_size, m.dense_intermediate_size) == (0, 0, 0)
    assert (m.num_kv_heads, m.head_dim, m.num_linear_attention_layers) == (8, 128, 0)
    total = m.attention_params_total + m.ffn_params_total
    active = m.attention_params_total + m.num_layers * (2 * m.expert_params + m.router_params)
    assert total / 1e9 == pytest.approx(46.7, rel=0.01)  # Mixtral-8x7B: 46.7B, 12.9B active
    assert active / 1e9 == pytest.approx(12.9, rel=0.01)
    # the same layout without model_type (num_local_experts, no moe_intermediate_size)
    assert replace(from_hf_config(mixtral | {"model_type": "other"}), name="mixtral") == m


def test_a_qwen3_5_hybrid_config_counts_its_linear_attention_layers():
    m = from_hf_config(QWEN3_5, "qwen3.5.json")
    assert (m.num_layers, m.num_linear_attention_layers, m.num_full_attention_layers) == (
        40, 30, 10,
    )  # fmt: skip
    assert m.attention_output_gate and (m.num_experts, m.shared_intermediate_size) == (256, 512)
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10
    by_types = {k: v for k, v in QWEN3_5_TEXT.items() if k != "full_attention_interval"}
    assert from_hf_config(by_types | {"layer_types": types}) == replace(m, name="qwen3_5_moe_text")
    no_interval = {k: v for k, v in QWEN3_5_TEXT.items() if k != "full_attention_interval"}
    assert from_hf_config(no_interval).num_linear_attention_layers == 30  # HF default: 4
    # KV cache only on the full layers; a fixed state per request on the linear ones, as
    # vLLM's gated_delta_net_state_shape: conv (4 - 1) x (2 x 16 x 128 + 32 x 128), and
    # 32 value heads x 128 x 128
    assert m.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2
    assert m.state_bytes_per_request == 30 * (3 * 8192 + 32 * 128 * 128) * 2
    # Qwen3.5-35B-A3B: 35B parameters, 3B activated (the text model; 3.5 with embeddings)
    total = m.attention_params_total + m.ffn_params_total
    assert total / 1e9 == pytest.approx(35, rel=0.02)
    # a linear layer's time does not grow with the context: at 32K the hybrid model's mean
    # attention layer is far cheaper than the same model with every layer full attention
    full = replace(m, num_linear_attention_layers=0)
    hw = HW_PRESETS["h200"]
    hybrid_t = costs.attention_layer_time(m, hw, 64, 32768)
    full_t = costs.attention_layer_time(full, hw, 64, 32768)
    assert hybrid_t < 0.5 * full_t
    growth = costs.attention_layer_time(m, hw, 64, 65536) - hybrid_t
    assert growth == pytest.approx(
        (costs.attention_layer_time(full, hw, 64, 65536) - full_t) * 10 / 40, rel=1e-6
    )


def test_presets_have_no_linear_layers_and_all_their_kv_per_token():
    for m in PRESETS.values():
        assert m.num_linear_attention_layers == 0 and m.state_bytes_per_request == 0
        assert m.kv_bytes_per_token == m.num_layers * m.kv_bytes_per_token_layer


# openai/gpt-oss-120b's config.json, the fields the planner reads (every other layer a
# 128-token sliding window)
GPT_OSS = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
    "head_dim": 64, "intermediate_size": 2880, "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_hidden_layers": 36, "num_local_experts": 128,
    "num_experts_per_tok": 4, "sliding_window": 128, "vocab_size": 201088,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_a_gpt_oss_config_counts_its_sliding_window_layers():
    m = from_hf_config(GPT_OSS, "gpt-oss.json")
    assert (m.num_layers, m.num_sliding_window_layers, m.sliding_window) == (36, 18, 128)
    assert (m.num_full_attention_layers, m.num_softmax_attention_layers) == (18, 36)
    # without layer_types, vLLM's gpt_oss.py gives every even layer the window
    no_types = {k: v for k, v in GPT_OSS.items() if k != "layer_types"}
    assert from_hf_config(no_types, "gpt-oss.json") == m
    # gpt-oss-120b: 117B parameters (116.8B, the attention of every layer counted alike)
    total = m.attention_params_total + m.ffn_params_total
    assert total / 1e9 == pytest.approx(116.8, rel=0.01)
    # the cache: full layers grow with the context, sliding ones stop at the window
    kv = m.kv_bytes_per_token_layer
    assert m.kv_bytes_per_request(4096) == 18 * 4096 * kv + 18 * 128 * kv
    assert m.kv_bytes_per_request(64) == 36 * 64 * kv  # below the window: all alike
    # the attention time per layer: the sliding half stops growing at the window
    full = replace(m, num_sliding_window_layers=0, sliding_window=0)
    hw = HW_PRESETS["h200"]
    at = costs.attention_layer_time
    assert at(m, hw, 64, 32768) < 0.6 * at(full, hw, 64, 32768)
    assert at(m, hw, 64, 65536) - at(m, hw, 64, 32768) == pytest.approx(
        (at(full, hw, 64, 65536) - at(full, hw, 64, 32768)) * 18 / 36, rel=1e-6
    )
    assert at(m, hw, 64, 100) == pytest.approx(at(full, hw, 64, 100), rel=1e-3)  # both ~window
    # so more requests fit: a memory-capped plan at a long context holds more of them
    from afd_core.planner.search import plan

    long = plan(m, hw, 1000, 131072).colocated[0]
    long_full = plan(full, hw, 1000, 131072).colocated[0]
    assert long.capped_by == long_full.capped_by == "memory"
    assert long.batch_per_device > 1.5 * long_full.batch_per_device


@pytest.mark.parametrize(
    "fields, layers",
    [
        ({"use_sliding_window": False, "sliding_window": 4096}, 0),  # Qwen3-MoE's default
        ({"sliding_window": None}, 0),
        ({"sliding_window": 0}, 0),  # vLLM: 0 is no window
        ({"use_sliding_window": True, "sliding_window": 4096}, 48),  # CacheConfig: every layer
        ({"sliding_window": 4096}, 48),  # Mixtral-style: no use_sliding_window field
        (
            {
                "sliding_window": 4096,
                "layer_types": ["full_attention"] * 47 + ["sliding_attention"],
            },
            1,
        ),
    ],
)
def test_a_configs_sliding_window_as_vllm_reads_it(fields, layers):
    m = from_hf_config(QWEN3_MOE | fields)
    assert m.num_sliding_window_layers == layers
    assert m.sliding_window == (4096 if layers else 0)


@pytest.mark.parametrize(
    "fields, msg",
    [
        ({"use_sliding_window": "yes"}, r"'use_sliding_window' = \"yes\" is invalid; allowed: true or false"),
        ({"sliding_window": 4096.0}, r"'sliding_window' = 4096.0 is invalid; allowed: an integer in \[0, 16777216\]"),
        ({"sliding_window": 1 << 25}, r"'sliding_window' = 33554432 is invalid"),
        (
            {"layer_types": ["sliding_attention"] * 48},
            r"field 'sliding_window' is missing; layer_types has 48 'sliding_attention' layers",
        ),
    ],
)  # fmt: skip
def test_bad_sliding_window_fields_are_named(fields, msg):
    with pytest.raises(PlanInputError, match=msg):
        from_hf_config(QWEN3_MOE | fields, "x.json")


def test_a_shapes_sliding_window_layers_are_checked():
    m = from_hf_config(GPT_OSS)
    with pytest.raises(PlanInputError, match=r"sliding-window layers need sliding_window > 0"):
        replace(m, sliding_window=0)
    with pytest.raises(PlanInputError, match=r"num_sliding_window_layers=37 are more than"):
        replace(m, num_sliding_window_layers=37)


def test_mxfp4_counts_the_routed_experts_at_4_25_bits_and_the_rest_at_the_dtype():
    """gpt-oss-120b ships MXFP4 experts (4-bit values, one 8-bit scale per 32) and bf16
    everything else, as vLLM 0.32's Mxfp4Config loads it. Counted at bf16 throughout the
    planner put 233.6 GB on the devices; OpenAI's model card gives the checkpoint as
    60.8 GiB."""
    m = from_hf_config(GPT_OSS | {"quantization_config": {"quant_method": "mxfp4"}}, "g.json")
    assert (m.weight_bytes, m.routed_expert_bytes) == (2.0, 4.25 / 8)
    total = m.attention_weight_bytes_total + m.ffn_weight_bytes_total
    assert total / 2**30 == pytest.approx(60.8, rel=0.01)
    plain = from_hf_config(GPT_OSS, "g.json")
    assert plain.routed_expert_bytes == 2.0 and plain.ffn_weight_bytes_total == pytest.approx(
        plain.ffn_params_total * 2.0
    )
    # decode on few rows is memory-bound: reading a quarter of the expert bytes shows
    hw = HW_PRESETS["h200"]
    assert costs.ffn_layer_time(m, hw, 8, 1) < 0.5 * costs.ffn_layer_time(plain, hw, 8, 1)
    # an explicit width overrides every weight, the experts' included
    assert m.with_bytes(weight_bytes=1.0).routed_expert_bytes == 1.0
    # as does weight_bytes when reading the config (an unknown quantization is then fine)
    awq = GPT_OSS | {"quantization_config": {"quant_method": "awq"}}
    assert from_hf_config(awq, "g.json", weight_bytes=0.5).routed_expert_bytes == 0.5
    with pytest.raises(PlanInputError, match=r"quant_method='awq' is not known to the planner"):
        from_hf_config(awq, "g.json")
    # FP8 stays one byte for every weight
    fp8 = from_hf_config(GPT_OSS | {"quantization_config": {"quant_method": "fp8"}}, "g.json")
    assert (fp8.weight_bytes, fp8.routed_expert_bytes) == (1.0, 1.0)

"""The planner (afd_core.planner): each formula against hand-computed cases, the closed forms
of the papers it cites, monotonicity, the SLO verdict and bad inputs. Pure Python, fast."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import pytest

from afd_core.capabilities import ffn_layout
from afd_core.config import parse_afd_config
from afd_core.planner import PlanInputError, costs
from afd_core.planner.hardware import PRESETS as HW_PRESETS
from afd_core.planner.hardware import HardwareProfile, load_hardware
from afd_core.planner.model_shape import PRESETS, ModelShape, from_hf_config, load_model
from afd_core.planner.pipeline import megascale_min_microbatches, megascale_step_time, step_time
from afd_core.planner.search import afd_step, plan
from tests.conftest import REPO

# 1 GB/s, 1 GFLOP/s, 2 us + 1 GB/s link: times in ns are bytes or flops
UNIT_HW = HardwareProfile("unit", 1, 1, 0.001, 2, 1)

GQA = ModelShape(
    "gqa",
    hidden_size=4,
    num_layers=2,
    num_dense_layers=0,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=3,
    shared_intermediate_size=0,
    dense_intermediate_size=8,
    vocab_size=10,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
)


# -- model shapes ------------------------------------------------------------------------------


def test_gqa_parameter_and_kv_counts_by_hand():
    # q 4x(2*2), k and v 4x(1*2) each, o (2*2)x4
    assert GQA.attention_params == 16 + 8 + 8 + 16
    assert GQA.kv_bytes_per_token_layer == 2 * 1 * 2 * 2  # k and v, 1 head of 2, bf16
    assert GQA.attention_core_flops(10) == 4 * 2 * 2 * 10
    assert GQA.expert_params == 3 * 4 * 3


def test_mla_parameter_and_kv_counts_by_hand():
    mla = replace(
        GQA, num_kv_heads=0, head_dim=0, q_lora_rank=3, kv_lora_rank=5, qk_nope_head_dim=2,
        qk_rope_head_dim=1, v_head_dim=2,
    )  # fmt: skip
    q = 4 * 3 + 3 * 2 * (2 + 1)
    kv_a = 4 * (5 + 1)
    kv_b = 5 * 2 * (2 + 2)
    o = 2 * 2 * 4
    assert mla.attention_params == q + kv_a + kv_b + o
    assert mla.kv_bytes_per_token_layer == (5 + 1) * 2  # the latent cache, bf16
    assert mla.attention_core_flops(10) == 2 * 2 * 10 * (2 * 5 + 1)


@pytest.mark.parametrize(
    "name, total_b, active_b",
    [
        ("deepseek-v3", 671, 37),  # the model card: 671B total, 37B activated
        ("qwen3-235b-a22b", 235, 22),
        ("qwen3-30b-a3b", 30.5, 3.3),
        ("glm-4.5", 355, 32),
    ],
)
def test_presets_match_the_published_parameter_counts(name, total_b, active_b):
    m = PRESETS[name]
    total = m.attention_params_total + m.ffn_params_total
    active = (
        m.attention_params_total
        + m.num_moe_layers * (m.top_k * m.expert_params + m.shared_params + m.router_params)
        + m.num_dense_layers * m.dense_mlp_params
    )
    assert total / 1e9 == pytest.approx(total_b, rel=0.02)
    assert active / 1e9 == pytest.approx(active_b, rel=0.06)


def test_hf_configs_of_each_family_are_read():
    v3 = {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
        "first_k_dense_replace": 3, "n_routed_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048, "n_shared_experts": 1, "intermediate_size": 18432,
        "vocab_size": 129280, "num_attention_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8"},
    }  # fmt: skip
    assert replace(from_hf_config(v3), name="deepseek-v3") == PRESETS["deepseek-v3"]
    qwen = {
        "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "intermediate_size": 128, "vocab_size": 100, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "decoder_sparse_step": 2,
        "mlp_only_layers": [0], "torch_dtype": "float32",
    }  # fmt: skip
    q = from_hf_config(qwen)
    assert (q.num_dense_layers, q.weight_bytes, q.num_kv_heads) == (2, 4.0, 2)  # layers 0, 2
    multimodal = {"model_type": "qwen3_5_moe", "text_config": qwen}
    assert from_hf_config(multimodal).hidden_size == 64


def test_a_generated_checkpoint_is_read(tmp_path):
    cfg = {
        "model_type": "qwen2_moe", "hidden_size": 32, "num_hidden_layers": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 16, "vocab_size": 50, "num_attention_heads": 2,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(str(tmp_path))
    assert (m.shared_intermediate_size, m.num_kv_heads, m.head_dim) == (16, 2, 16)


# -- per-layer costs -----------------------------------------------------------------------------


def test_attention_layer_time_by_hand():
    hw = replace(UNIT_HW, attention_layer_overhead_us=5)
    # bytes: 48 params x 2 + 3 rows x 10 tokens x 8 = 336; flops: 3 x (96 + 160) = 768
    assert costs.attention_layer_time(GQA, hw, 3, 10) == pytest.approx(5e-6 + 768e-9)
    # memory-bound when the context is long: bytes 96 + 1 x 1000 x 8, flops 96 + 16000
    assert costs.attention_layer_time(GQA, UNIT_HW, 1, 1000) == pytest.approx(16096e-9)
    assert costs.attention_layer_time(GQA, hw, 0, 10) == 0.0


def test_without_overlap_memory_and_compute_times_add():
    no_overlap = replace(UNIT_HW, compute_memory_overlap=0.0)
    # the hand case above: bytes 336, flops 768
    assert costs.attention_layer_time(GQA, no_overlap, 3, 10) == pytest.approx(1104e-9)
    half = replace(UNIT_HW, compute_memory_overlap=0.5)
    assert costs.attention_layer_time(GQA, half, 3, 10) == pytest.approx((768 + 168) * 1e-9)


def test_expected_active_experts_by_hand():
    assert costs.expected_active_experts(4, 2, 1) == pytest.approx(2)
    assert costs.expected_active_experts(4, 2, 2) == pytest.approx(3)  # 4 (1 - 1/4)
    assert costs.expected_active_experts(256, 8, 10_000) == pytest.approx(256)


def test_ffn_layer_time_by_hand():
    hw = replace(UNIT_HW, ffn_layer_overhead_us=1)
    # one token: 2 of 4 experts (36 params each) + router 16 -> bytes (72 + 16) x 2 = 176,
    # flops 2 x (2 x 36 + 16) = 176
    assert costs.ffn_layer_time(GQA, hw, 1, 1) == pytest.approx(1e-6 + 176e-9)
    # 100 tokens over 2 devices: ~all 4 experts, 2 per device -> bytes (72 + 16) x 2 = 176;
    # flops 2 x 100 x (72 / 2 + 16) = 10400
    assert costs.ffn_layer_time(GQA, UNIT_HW, 100, 2) == pytest.approx(10400e-9, rel=1e-6)
    # a dense layer: 3 x 4 x 8 = 96 params split over 2 devices; 10 tokens: flops 960
    assert costs.ffn_layer_time(GQA, UNIT_HW, 10, 2, dense=True) == pytest.approx(960e-9)


def test_transfer_time_by_hand():
    assert costs.dispatch_fanout(8, 1) == 1.0
    assert costs.dispatch_fanout(2, 2) == pytest.approx(1.5)
    # 3 rows of hidden 4 in bf16 = 24 bytes from each of 2 attention devices into 1 FFN
    # device: it receives 48
    lat, occ = costs.transfer_times(GQA, UNIT_HW, 3, 2, 1)
    assert (lat, occ) == (pytest.approx(2e-6), pytest.approx(48e-9))


def test_an_expert_groups_gather_and_scatter_by_hand():
    """Each of g members moves (g - 1) / g of the group's rows each way: 4 members, 8 rows
    of hidden 4 in bf16 = 64 bytes, 48 of them moved, twice, after alpha each."""
    assert costs.group_exchange_time(GQA, UNIT_HW, 8, 1) == 0.0
    assert costs.group_exchange_time(GQA, UNIT_HW, 8, 4) == pytest.approx(2 * (2e-6 + 48e-9))


def test_afd_is_priced_as_this_project_runs_it():
    """One hop to one FFN rank, then the expert group's gather and scatter on the FFN stage;
    on Ascend (no expert groups) each FFN device is a server holding every expert."""
    model, h200 = PRESETS["deepseek-v3"], HW_PRESETS["h200"]
    bd = afd_step(model, h200, 16, 8, 2, 128, 4096)
    rows = 16 * 64
    group = costs.group_exchange_time(model, h200, rows, 8)
    assert bd.ffn_layer_s == pytest.approx(costs.ffn_layer_time(model, h200, rows, 8) + group)
    assert group > 0
    ascend = ffn_layout(16, 8, "npu")
    assert (ascend.servers, ascend.ranks_per_server, ascend.devices_per_copy) == (8, 1, 1)
    npu = afd_step(model, replace(h200, platform="npu"), 16, 8, 1, 128, 4096)
    assert npu.ffn_layer_s == pytest.approx(costs.ffn_layer_time(model, h200, 2 * 128, 1))


def test_stepmesh_table_one_transfer_times():
    """StepMesh (github.com/stepfun-ai/StepMesh, Introduction.md, table 1): 2A2F, 128 tokens
    per micro-batch, hidden 7168, 161.3 Gb/s: A2F in FP8 91 us, F2A in BF16 182 us. Its A2F
    sends every token to both FFN instances; top-8 over 2 devices reaches both with
    probability 1 - 2^-7, hence 0.4% less here. (StepMesh dispatches M2N; this project
    sends each row to one FFN rank, fanout 1, which the planner charges for AFD.)"""
    link = HardwareProfile("stepmesh", 80, 1000, 100, 0, 161.3 / 8)
    model = replace(PRESETS["deepseek-v3"], wire_bytes=1)
    m2n = costs.dispatch_fanout(model.top_k, 2)
    _, a2f = costs.transfer_times(model, link, 128, 2, 2, fanout=m2n)
    _, f2a = costs.transfer_times(replace(model, wire_bytes=2), link, 128, 2, 2, fanout=m2n)
    assert a2f * 1e6 == pytest.approx(91.0, rel=0.01)
    assert f2a * 1e6 == pytest.approx(182.0, rel=0.01)


# -- the pipeline ----------------------------------------------------------------------------------


def test_one_microbatch_is_the_sum_of_the_round_trips():
    assert step_time([1, 2], [3, 4], 1, latency=0.5) == pytest.approx(1 + 3 + 2 + 4 + 4 * 0.5)


@pytest.mark.parametrize("seed", range(20))
def test_schedule_equals_megascale_closed_form_without_bubbles(seed):
    """MegaScale-Infer (arXiv 2504.02263): T = (Ta + Te + 2 Tc) + Tf (m L - 1) when
    m Tf >= Ta + Te + 2 Tc."""
    rng = random.Random(seed)
    ta, te = rng.uniform(0.5, 2), rng.uniform(0.5, 2)
    tc = rng.uniform(0, 0.5)
    layers = rng.randint(1, 10)
    m = max(2, -(-(ta + te + 2 * tc) // max(ta, te)))
    m = int(m) + rng.randint(0, 1)
    assert m * max(ta, te) >= ta + te + 2 * tc
    got = step_time([ta] * layers, [te] * layers, m, latency=tc)
    assert got == pytest.approx(megascale_step_time(ta, te, tc, m, layers))


def test_too_few_microbatches_leave_bubbles():
    # Ta = Te = 1, Tc = 1: round trip 4 > m Tf = 2, so each layer takes the round trip
    assert step_time([1] * 3, [1] * 3, 2, latency=1) > megascale_step_time(1, 1, 1, 2, 3)
    assert megascale_min_microbatches(tc=1, tf=1) == 4


@pytest.mark.parametrize("tc, m", [(0, 2), (0.25, 3), (0.5, 3), (0.51, 4), (1, 4)])
def test_megascale_minimum_microbatches(tc, m):
    assert megascale_min_microbatches(tc, 1.0) == m


def test_link_occupancy_serialises_microbatches():
    # a slow link: each micro-batch occupies it 3 per direction; 2 micro-batches, 1 layer.
    # mb 0: A 0-1, up 1-4, F 4-5, down 5-8; mb 1: A 1-2, up waits for the link 4-7,
    # F 7-8, down 8-11 (without the link's queue it would end at 2 + 3 + 1 + 3 = 9)
    assert step_time([1], [1], 2, occupancy=3) == pytest.approx(11)


# -- monotonicity --------------------------------------------------------------------------------


def _faster(hw: HardwareProfile, field: str, factor: float) -> HardwareProfile:
    return replace(hw, **{field: getattr(hw, field) * factor})


@pytest.mark.parametrize("overlap", [1.0, 0.0])
@pytest.mark.parametrize("model", ["deepseek-v3", "qwen3-235b-a22b", "glm-4.5"])
@pytest.mark.parametrize("field", ["link_bandwidth_gbps", "memory_bandwidth_gbps", "matmul_tflops"])
def test_a_faster_device_never_predicts_a_slower_step(model, field, overlap):
    m = PRESETS[model]
    # platform cpu: F > A shapes too (FFN tensor parallelism), the costs alone are tested
    hw = replace(HW_PRESETS["h200"], compute_memory_overlap=overlap, platform="cpu")
    for r, f, mb, b in itertools.product((1, 4, 16), (1, 4), (1, 2, 3), (1, 64, 512)):
        slow = afd_step(m, hw, r, f, mb, b, 4096).step_s
        for factor in (1.5, 4, 100):
            assert afd_step(m, _faster(hw, field, factor), r, f, mb, b, 4096).step_s <= slow


def test_a_lower_latency_never_predicts_a_slower_step():
    m, hw = PRESETS["deepseek-v3"], HW_PRESETS["h100"]
    for mb, b in itertools.product((1, 2, 4), (8, 256)):
        slow = afd_step(m, hw, 8, 4, mb, b, 8192).step_s
        assert afd_step(m, replace(hw, link_latency_us=2), 8, 4, mb, b, 8192).step_s <= slow


def test_more_link_bandwidth_never_plans_less_throughput():
    m = PRESETS["qwen3-30b-a3b"]
    last = 0.0
    for gbps in (5, 25, 50, 450, 900):
        hw = replace(HW_PRESETS["h100"], link_bandwidth_gbps=gbps)
        best = plan(m, hw, 30, 4096, max_devices=32).candidates[0].tokens_per_s_per_device
        assert best >= last * (1 - 1e-9)
        last = best


def test_a_larger_batch_never_predicts_a_shorter_step():
    m, hw = PRESETS["glm-4.5"], HW_PRESETS["ascend-910c"]
    steps = [afd_step(m, hw, 4, 2, 2, b, 4096).step_s for b in (2, 8, 32, 128, 512)]
    assert steps == sorted(steps)


# -- plans and verdicts -------------------------------------------------------------------------------


def test_a_plan_meets_its_target_and_ranks_by_throughput_per_device():
    p = plan(PRESETS["deepseek-v3"], HW_PRESETS["h200"], 50, 4096)
    assert p.slo_met and p.candidates and p.colocated
    tps = [c.tokens_per_s_per_device for c in p.candidates]
    assert tps == sorted(tps, reverse=True)
    for c in p.candidates:
        assert c.tpot_ms <= 50
        again = afd_step(
            PRESETS["deepseek-v3"], HW_PRESETS["h200"], c.attention_devices, c.ffn_devices,
            c.microbatches, c.batch_per_attention_device, 4096,
        )  # fmt: skip
        assert again.step_s * 1e3 == pytest.approx(c.tpot_ms)
    assert p.verdict().startswith(("AFD pays", "AFD does not pay here"))
    assert json.loads(json.dumps(p.to_dict()))["candidates"][0]["shape"] == p.candidates[0].shape


def test_an_unreachable_target_is_reported_not_relaxed():
    p = plan(PRESETS["deepseek-v3"], HW_PRESETS["h200"], 1.0, 4096)
    assert not p.slo_met and not p.candidates and not p.colocated
    assert p.fastest_afd_tpot_ms > 1.0 and p.fastest_colocated_tpot_ms > 1.0
    assert "cannot be met" in p.verdict()
    assert f"{p.fastest_afd_tpot_ms:.1f} ms" in p.verdict()


def test_batch_expansion_needs_shapes_afd_can_serve():
    """FastAFD's point (haoailab.com/blogs/fastafd: the gain is batch expansion): GLM-4.5 in
    bf16 (~705 GB) on H200s at a 32K context. On 8 devices colocated fits one request per
    device; the AFD shapes that fit there put more devices on the FFN side than on the
    attention side (3A5F), which needs FFN tensor parallelism: AFD serves that on CPU only,
    so on CUDA the planner lists no AFD shape. On 16 devices AFD's attention devices (no
    experts) hold more requests than colocated ones, but not enough to pay."""
    glm, h200 = PRESETS["glm-4.5"], HW_PRESETS["h200"]
    p = plan(glm, h200, 50, 32768, max_devices=8)
    assert p.colocated[0].batch_per_device == 1
    assert p.candidates == [] and p.verdict().startswith("AFD does not pay here: no AFD shape")
    as_if_cpu = plan(glm, replace(h200, platform="cpu"), 50, 32768, max_devices=8)
    assert as_if_cpu.candidates[0].ffn_devices > as_if_cpu.candidates[0].attention_devices
    p16 = plan(glm, h200, 50, 32768, max_devices=16)
    best, co = p16.candidates[0], p16.colocated[0]
    assert best.batch_per_attention_device > co.batch_per_device and p16.afd_gain < 1.0


@pytest.mark.parametrize("hardware", sorted(HW_PRESETS))
@pytest.mark.parametrize("model", sorted(PRESETS))
def test_every_listed_shape_is_one_the_config_accepts(model, hardware):
    """The planner asks the table the servers' start-up check reads
    (afd_core.capabilities): on CUDA and Ascend, A >= F (any ratio), on Ascend one FFN rank
    per server and m = 1, on CUDA m <= 2 (graphs); and the afd config of the layout parses.
    (tests/afd_plugin/test_plan_to_servers.py runs the servers' own start-up check.)"""
    hw = HW_PRESETS[hardware]
    for c in plan(PRESETS[model], hw, 100, 4096, top=1000).candidates:
        layout = ffn_layout(
            c.attention_devices, c.ffn_devices, hw.platform, PRESETS[model].num_heads
        )
        assert c.layout == layout and layout.devices == c.ffn_devices
        if hw.platform != "cpu":
            assert c.ffn_devices <= c.attention_devices and layout.tensor_parallel == 1
        if hw.platform == "npu":
            assert layout.ranks_per_server == 1 and c.microbatches == 1
        if hw.platform == "cuda":
            assert c.microbatches <= 2
        for role in ("attention", "ffn"):
            parse_afd_config(
                {
                    "role": role,
                    "num_attention_ranks": c.attention_devices,
                    "num_ffn_ranks": layout.ranks,
                },
                device_type="cpu",
            )


def test_shapes_of_any_ratio_are_proposed():
    """A % F need not be 0: DeepSeek-V3 on H200 lists shapes such as 48A32F."""
    shapes = {
        (c.attention_devices, c.ffn_devices)
        for c in plan(PRESETS["deepseek-v3"], HW_PRESETS["h200"], 100, 4096, top=1000).candidates
    }
    assert any(a % f for a, f in shapes), sorted(shapes)


def test_traffic_beyond_a_scale_up_domain_takes_the_scale_out_link():
    """H200: 8 GPUs per NVLink domain at 450 GB/s, a 400G NIC (50 GB/s) to the others. Of
    32 devices, 3/4 of a device's peers are in other domains: that share crosses the NIC."""
    h200, v3 = HW_PRESETS["h200"], PRESETS["deepseek-v3"]
    assert (h200.remote_fraction(8), h200.remote_fraction(32)) == (0.0, 0.75)
    fanout = costs.dispatch_fanout(v3.top_k, 16)  # colocated EP's dispatch
    lat8, occ8 = costs.transfer_times(v3, h200, 64, 4, 4, fanout=fanout)
    lat32, occ32 = costs.transfer_times(v3, h200, 64, 16, 16, fanout=fanout)
    assert (lat8, lat32) == (pytest.approx(20e-6), pytest.approx(25e-6))
    volume = 64 * v3.hidden_size * v3.wire_bytes * fanout
    assert occ32 == pytest.approx(volume * 0.75 / 50e9)  # the NIC is the slower share
    one_domain = replace(h200, scale_up_domain=0)
    occ = costs.transfer_times(v3, one_domain, 64, 16, 16, fanout=fanout)[1]
    assert occ == pytest.approx(volume / 450e9)
    # an expert group of 16 H200s (two nodes): half of each member's gather and scatter crosses the NIC
    rows = 16 * 64
    moved = rows * v3.hidden_size * v3.wire_bytes * 15 / 16
    assert costs.group_exchange_time(v3, h200, rows, 16) == pytest.approx(
        2 * (25e-6 + moved * 0.5 / 50e9)
    )


# -- bad inputs ------------------------------------------------------------------------------------


def test_missing_config_field_is_named(tmp_path):
    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10}
    with pytest.raises(PlanInputError, match=r"none of the fields 'n_routed_experts'"):
        from_hf_config(cfg, "x.json")
    cfg |= {"num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 2}
    with pytest.raises(PlanInputError, match=r"x.json: field 'moe_intermediate_size' is missing"):
        from_hf_config(cfg, "x.json")


def test_unknown_presets_list_what_is_allowed():
    with pytest.raises(PlanInputError, match=r"'llama' is neither a preset \(deepseek-v3, "):
        load_model("llama")
    with pytest.raises(PlanInputError, match=r"'h300' is neither a preset \(.*h200.*cpu\)"):
        load_hardware("h300")


def test_negative_and_out_of_range_numbers_are_refused(tmp_path):
    good = {
        "memory_gib": 80, "memory_bandwidth_gbps": 3000, "matmul_tflops": 900,
        "link_latency_us": 10, "link_bandwidth_gbps": 400,
    }  # fmt: skip
    f = tmp_path / "gpu.toml"
    f.write_text("\n".join(f"{k} = {v}" for k, v in good.items()))
    assert load_hardware(str(f)).name == "gpu"
    for field, value, msg in [
        ("link_latency_us", -1, "link_latency_us=-1 must be >= 0"),
        ("memory_bandwidth_gbps", 0, "memory_bandwidth_gbps=0 must be > 0"),
        ("matmul_efficiency", 1.5, r"matmul_efficiency=1.5 must be in \(0, 1\]"),
        ("compute_memory_overlap", -0.1, r"compute_memory_overlap=-0.1 must be in \[0, 1\]"),
    ]:
        f.write_text(json.dumps(good | {field: value}))
        f = f.rename(tmp_path / "gpu.json")
        with pytest.raises(PlanInputError, match=msg):
            load_hardware(str(f))
        f = f.rename(tmp_path / "gpu.toml")
    (tmp_path / "x.json").write_text(json.dumps(good | {"hbm_tb": 3}))
    with pytest.raises(PlanInputError, match=r"unknown field\(s\) hbm_tb; allowed: "):
        load_hardware(str(tmp_path / "x.json"))
    (tmp_path / "y.json").write_text(json.dumps({"memory_gib": 80}))
    with pytest.raises(PlanInputError, match=r"field\(s\) memory_bandwidth_gbps, .* missing"):
        load_hardware(str(tmp_path / "y.json"))
    with pytest.raises(PlanInputError, match="num_layers=-3 must be >= 0"):
        replace(GQA, num_layers=-3)
    with pytest.raises(PlanInputError, match="top_k=5 is more than num_experts=4"):
        replace(GQA, top_k=5)
    for kwargs, msg in [
        ({"tpot_target_ms": -5}, "tpot_target_ms=-5 must be > 0"),
        ({"context": 0}, "context=0 must be a positive integer"),
    ]:
        args = {"tpot_target_ms": 50, "context": 1024} | kwargs
        with pytest.raises(PlanInputError, match=msg):
            plan(PRESETS["qwen3-30b-a3b"], HW_PRESETS["h100"], **args)


def test_the_cpu_preset_is_a_measured_profile_and_profiles_round_trip(tmp_path):
    from afd_core.planner.hardware import save_hardware

    cpu = load_hardware("cpu")
    assert cpu.source.startswith("afd bench on ") and cpu.ffn_layer_overhead_us > 0
    save_hardware(cpu, tmp_path / "cpu.json")
    assert load_hardware(str(tmp_path / "cpu.json")) == cpu


def test_the_readmes_range_of_predicted_gains():
    """README and docs/planner.md: every preset model on every GPU preset at 50 ms and a 4K
    context, AFD's best over colocated's best is 0.12-0.97x; on Ascend only Qwen3-30B-A3B
    has an AFD shape (an FFN server is one NPU holding every expert)."""
    gpus = [h for h in HW_PRESETS if HW_PRESETS[h].platform == "cuda"]
    gains = [plan(PRESETS[m], HW_PRESETS[h], 50, 4096).afd_gain for m in PRESETS for h in gpus]
    assert (round(min(gains), 2), round(max(gains), 2)) == (0.12, 0.97), gains
    on_ascend = [
        m for m in PRESETS if plan(PRESETS[m], HW_PRESETS["ascend-910c"], 50, 4096).candidates
    ]
    assert on_ascend == ["qwen3-30b-a3b"]
    readme = (REPO / "README.md").read_text()
    assert "predicts 0.12–0.97× of colocated expert" in " ".join(readme.split())
    # the README's example: DeepSeek-V3 on H200 at 50 ms and 4K
    v3 = plan(PRESETS["deepseek-v3"], HW_PRESETS["h200"], 50, 4096).afd_gain
    assert f"(here {v3:.2f}×: AFD does not pay)" in readme and v3 < 1


def test_a_ratio_within_the_models_error_is_no_difference():
    """A 0.01 % edge is not "AFD pays": within ±15 % the verdict says to measure both
    (docs/planner.md, The verdict)."""
    p = plan(PRESETS["qwen3-30b-a3b"], HW_PRESETS["gb200-nvl72"], 50, 4096)
    assert 0.85 <= p.afd_gain <= 1.15
    assert p.verdict().startswith("no difference within the model's error (±15%), measure both")
    far = plan(PRESETS["deepseek-v3"], HW_PRESETS["h200"], 50, 4096)
    assert far.afd_gain < 0.85 and far.verdict().startswith("AFD does not pay here")

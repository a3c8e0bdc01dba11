"""Per-layer times of one micro-batch: attention, FFN, and one transfer between them.

Each compute time is a fixed per-layer cost plus a roofline: max(bytes / memory rate,
flops / matmul rate), or their sum where the profile says the two do not overlap (one CPU
thread) (the linear `t = k1 * rows + k2` stage model of MegaScale-Infer and
of the analytical-provisioning paper, with the slope taken from the hardware's rates).
- attention: the layer's weights once, plus every row's KV cache over `context` tokens
- FFN: the experts a micro-batch touches (expected distinct experts of n tokens routed
  top-k among E: E * (1 - (1 - k/E)^n)), the shared experts and the router, split over
  the FFN devices (expert parallel); dense layers' MLP split likewise
- transfer: alpha + bytes / link bandwidth, one direction. AFD as this project runs it:
  each attention rank sends its rows once, to its one FFN rank (`fanout` 1); colocated
  expert parallelism: each token goes to the expected number of distinct devices holding
  its top-k experts (`dispatch_fanout`)
- an FFN expert group's own traffic (`group_exchange_time`): every MoE layer and
  micro-batch, each member all-gathers the group's rows and reduce-scatters the outputs
  (vLLM's data-parallel MoE, step/expert_group.py), on the FFN stage
"""

from __future__ import annotations

from afd_core.planner.hardware import HardwareProfile
from afd_core.planner.model_shape import ModelShape


def roofline(nbytes: float, flops: float, hw: HardwareProfile) -> float:
    """The memory and compute times combined: their max when they overlap fully (overlap
    1), their sum when not at all (0)."""
    memory, compute = nbytes / hw.bytes_per_s, flops / hw.flops_per_s
    return max(memory, compute) + (1.0 - hw.compute_memory_overlap) * min(memory, compute)


def attention_layer_time(
    model: ModelShape, hw: HardwareProfile, rows: float, context: float
) -> float:
    """One attention layer for `rows` decode tokens of `context` cached tokens each.

    A model with layers of several kinds (linear-attention layers between full ones,
    Qwen3-Next/3.5; sliding-window layers, GPT-OSS) gets the mean over its layers of each
    kind's time, weighted by their counts: the step sums per-layer times, so the sum over
    layers is exact, and only the pipeline's layer-by-layer interleaving sees the mean
    instead of alternating times. A sliding-window layer reads at most its window of each
    row's cache. A linear layer reads its weights and reads and writes each row's
    fixed-size state; its work does not grow with the context."""
    if rows <= 0:
        return 0.0

    def softmax_layer(tokens: float) -> float:
        p = model.attention_params
        nbytes = p * model.weight_bytes + rows * tokens * model.kv_bytes_per_token_layer
        flops = rows * (2.0 * p + model.attention_core_flops(tokens))
        return roofline(nbytes, flops, hw)

    overhead = hw.attention_layer_overhead_us * 1e-6
    linear_layers = model.num_linear_attention_layers
    sliding_layers = model.num_sliding_window_layers
    if not linear_layers and not sliding_layers:
        return overhead + softmax_layer(context)
    total = model.num_full_attention_layers * softmax_layer(context)
    if sliding_layers:
        total += sliding_layers * softmax_layer(model.attended_tokens(context))
    if linear_layers:
        p = model.linear_attention_params
        nbytes = p * model.weight_bytes + rows * 2.0 * model.linear_state_bytes_layer
        flops = rows * (2.0 * p + model.linear_attention_core_flops)
        total += linear_layers * roofline(nbytes, flops, hw)
    return overhead + total / model.num_layers


def expected_active_experts(num_experts: int, top_k: int, tokens: float) -> float:
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def ffn_layer_time(
    model: ModelShape, hw: HardwareProfile, rows: float, ffn_devices: int, dense: bool = False
) -> float:
    """One FFN layer on each of `ffn_devices` devices for `rows` tokens arriving in one
    micro-batch from all attention devices together."""
    if rows <= 0:
        return 0.0
    f = ffn_devices
    overhead = hw.ffn_layer_overhead_us * 1e-6
    if dense:
        p = model.dense_mlp_params
        return overhead + roofline(p * model.weight_bytes / f, 2.0 * rows * p / f, hw)
    active = expected_active_experts(model.num_experts, model.top_k, rows)
    replicated = model.shared_params + model.router_params  # on every FFN device
    experts_read = active * model.expert_params / f * model.routed_expert_bytes
    nbytes = experts_read + replicated * model.weight_bytes
    per_token = model.top_k * model.expert_params + model.shared_params
    flops = 2.0 * rows * (per_token / f + model.router_params)
    return overhead + roofline(nbytes, flops, hw)


def dispatch_fanout(top_k: int, ffn_devices: int) -> float:
    """Expected distinct FFN devices a token's top-k experts live on (experts spread evenly)."""
    if ffn_devices <= 1:
        return 1.0
    return ffn_devices * (1.0 - (1.0 - 1.0 / ffn_devices) ** top_k)


def transfer_times(
    model: ModelShape,
    hw: HardwareProfile,
    rows_per_attention: float,
    attention_devices: int,
    ffn_devices: int,
    devices_total: int | None = None,
    fanout: float = 1.0,
) -> tuple[float, float]:
    """(latency, link occupancy) in seconds of one direction for one micro-batch: an
    attention device sends its rows, an FFN device receives from the attention devices it
    serves, the busiest from ceil(A/F) of them (the busier end sets the occupancy). Of `devices_total` devices, the share outside a
    device's scale-up domain goes over the scale-out link, beside the rest (the slower of
    the two sets the occupancy, the scale-out latency the latency); AFD: attention + FFN
    devices (the default), colocated EP: its devices. `ffn_devices`: the FFN ranks the
    attention ranks send to; `fanout`: the FFN ranks each token goes to."""
    if rows_per_attention <= 0:
        return 0.0, 0.0
    per_token = model.hidden_size * model.wire_bytes * fanout
    send = rows_per_attention * per_token
    # A >= F: FFN rank k receives from a block of attention ranks, the largest ceil(A/F)
    # (topology.Topology); F > A: FFN tensor parallelism, each device its share
    senders = (
        -(-attention_devices // ffn_devices)
        if attention_devices >= ffn_devices
        else attention_devices / ffn_devices
    )
    receive = senders * rows_per_attention * per_token
    volume = max(send, receive)
    remote = hw.remote_fraction(devices_total or attention_devices + ffn_devices)
    if not remote:
        return hw.link_latency_us * 1e-6, volume / hw.link_bytes_per_s
    local_s = volume * (1 - remote) / hw.link_bytes_per_s
    remote_s = volume * remote / (hw.scale_out_bandwidth_gbps * 1e9)
    return max(hw.link_latency_us, hw.scale_out_latency_us) * 1e-6, max(local_s, remote_s)


def group_exchange_time(
    model: ModelShape, hw: HardwareProfile, group_rows: float, group_size: int
) -> float:
    """An FFN expert group's all-gather of `group_rows` rows (every member's) and the
    reduce-scatter of their outputs, one MoE layer and micro-batch: each member moves the
    others' share, (g - 1) / g of the rows, each way (a ring), over the scale-up link, or the
    scale-out link for the share outside its domain."""
    if group_size <= 1 or group_rows <= 0:
        return 0.0
    g = group_size
    volume = group_rows * model.hidden_size * model.wire_bytes * (g - 1) / g
    remote = hw.remote_fraction(g)
    if not remote:
        one_way = hw.link_latency_us * 1e-6 + volume / hw.link_bytes_per_s
    else:
        one_way = max(hw.link_latency_us, hw.scale_out_latency_us) * 1e-6 + max(
            volume * (1 - remote) / hw.link_bytes_per_s,
            volume * remote / (hw.scale_out_bandwidth_gbps * 1e9),
        )
    return 2 * one_way


def step_extra_time(model: ModelShape, hw: HardwareProfile, batch: float) -> float:
    """An attention device's work outside the layers: the LM head and the fixed step cost."""
    p = model.vocab_size * model.hidden_size
    return hw.step_overhead_us * 1e-6 + roofline(p * model.weight_bytes, 2.0 * batch * p, hw)

"""From what `afd bench` measured to a hardware profile, and the planner's predictions of the
measured AFD step times made with it.

The profile takes the link's bandwidth from the connector sweep, the compute rates from the
one-thread micro-benchmarks (weight streaming, matmul), and four fixed costs from
the batch-1 AFD run only: per layer on the attention side (its busy time per step over the
layers, less the roofline), per layer on the FFN side (one layer's compute, less the
roofline), per transfer (the rest of the step over its 2 L transfers: in a serving step an
exchange costs more than the bare connector's latency, the model's Python and op dispatch
around it), and per step outside the forward (step interval less the forward step). Every other point (larger
batches, DBO) is then predicted, not fitted: the error says how far the planner's model
holds on this host.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import replace

from afd_core.planner import costs
from afd_core.planner.hardware import HardwareProfile
from afd_core.planner.model_shape import ModelShape
from afd_core.planner.search import afd_step


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 16.0


def context_of(tokens: int, short: int) -> int:
    """Average context of a decode step in the long run (prompt ~8 tokens)."""
    return 8 + (short + tokens) // 2


def build_profile(
    shape: ModelShape,
    link: tuple[float, float],
    matmul_flops: float,
    memory_bytes_per_s: float,
    cal: dict,
    context: int,
) -> HardwareProfile:
    latency, bandwidth = link
    base = HardwareProfile(
        f"cpu-{platform.node() or 'host'}",
        memory_gib=round(_memory_gib(), 1),
        memory_bandwidth_gbps=memory_bytes_per_s / 1e9,
        matmul_tflops=matmul_flops / 1e12,
        link_latency_us=latency * 1e6,
        link_bandwidth_gbps=bandwidth / 1e9,
        # one thread per role: weight reads do not hide behind arithmetic (measured: the
        # roofline's max() predicted this host's steps 20-30% fast at 64 rows)
        compute_memory_overlap=0.0,
        platform="cpu",
        source=(
            f"afd bench on {platform.node() or 'this host'}, {os.cpu_count()} cores, "
            f"{time.strftime('%Y-%m-%d')}: one thread per role"
        ),
    )
    layers = shape.num_layers
    roof_att = costs.attention_layer_time(shape, base, 1, context)
    roof_ffn = statistics.mean(
        costs.ffn_layer_time(shape, base, 1, 1, dense=i < shape.num_dense_layers)
        for i in range(layers)
    )
    forward = statistics.median(cal["steps"])
    busy = statistics.median(cal["busy"])
    ffn_layer = statistics.median(cal["ffn_compute"])
    att = busy / layers - roof_att
    ffn = ffn_layer - roof_ffn
    _, occupancy = costs.transfer_times(shape, base, 1, 1, 1)
    transfer = (forward - busy - layers * ffn_layer) / (2 * layers) - occupancy
    step = statistics.median(cal["intervals"]) - forward
    step -= costs.step_extra_time(shape, base, 1)
    return replace(
        base,
        link_latency_us=max(latency, transfer) * 1e6,
        attention_layer_overhead_us=max(0.0, att) * 1e6,
        ffn_layer_overhead_us=max(0.0, ffn) * 1e6,
        step_overhead_us=max(0.0, step) * 1e6,
    )


def predictions(
    shape: ModelShape, profile: HardwareProfile, runs: dict, batches: list[int], context: int
) -> list[dict]:
    """Predicted vs measured AFD step (forward) and TPOT for each batch and m."""
    out = []
    for b in batches:
        for m in (1, 2):
            run = runs.get(f"{b}|AFD m={m}")
            if not run:
                continue
            bd = afd_step(shape, profile, 1, 1, m, b, context)
            steps = [s for s in run["step"] if s is not None]
            measured_step = statistics.median(steps) if steps else None
            measured_tpot = statistics.median(run["tpot"])
            out.append(
                {
                    "batch": b,
                    "microbatches": m,
                    "predicted_step_ms": bd.forward_s * 1e3,
                    "measured_step_ms": None if measured_step is None else measured_step * 1e3,
                    "step_error": None
                    if measured_step is None
                    else bd.forward_s / measured_step - 1.0,
                    "predicted_tpot_ms": bd.step_s * 1e3,
                    "measured_tpot_ms": measured_tpot * 1e3,
                    "tpot_error": bd.step_s / measured_tpot - 1.0,
                }
            )
    return out

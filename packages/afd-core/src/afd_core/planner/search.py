"""Choose the AFD shape: A:F device counts, micro-batches and batch per attention device that
give the most tokens per second per device within a time-per-output-token target, next to
colocated expert parallelism on the same hardware, with a plain verdict.

A decode step of an AFD deployment with r attention devices and F FFN devices, laid out as
the platform runs them (afd_core.capabilities.ffn_layout: one FFN expert group over the F
devices, FFN servers of one rank each that each hold every expert, or tensor-parallel FFN
servers): each attention device holds B requests in m micro-batches of B/m, sent once to
its FFN rank; an expert group then all-gathers and reduce-scatters its rows every MoE
layer (costs.group_exchange_time); the busiest FFN server sets the pace. Only the shapes
and m the platform runs are searched (graphs where the platform uses them by default,
so m <= 2 on CUDA). The step time is the pipeline makespan (`pipeline.step_time`) plus
the LM head;
every request gets one token per step, so TPOT = step time and throughput per device =
r B / step / (r + F). Larger B never predicts a shorter step, so the largest B within the
target and the memory (weights + KV cache) is found by bisection.

Colocated: N devices, each with attention (data parallel) and 1/N of the experts (expert
parallel), dispatch and combine over the same link; without or with two micro-batches
overlapping communication (vLLM's DBO), whichever is faster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from afd_core.capabilities import (
    CapabilityError,
    FFNLayout,
    capabilities,
    ffn_layout,
    microbatch_problem,
)
from afd_core.planner import costs
from afd_core.planner.errors import PlanInputError
from afd_core.planner.hardware import HardwareProfile
from afd_core.planner.model_shape import ModelShape
from afd_core.planner.pipeline import step_time

# the ratio of two predictions read as "no difference, measure" (docs/planner.md, calibration)
TIE_BAND = 0.15
ATTENTION_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
FFN_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
MICROBATCHES = (1, 2, 3, 4)
MAX_BATCH = 1 << 14


@dataclass(frozen=True)
class StepBreakdown:
    step_s: float  # forward + LM head + fixed step cost: the time per output token
    forward_s: float  # the layers' pipeline alone
    attention_layer_s: float  # one micro-batch, one MoE layer
    ffn_layer_s: float
    transfer_s: float  # latency + occupancy, one direction
    bound: str  # what sets the pace: attention, ffn, transfer or round trip


@dataclass(frozen=True)
class Candidate:
    attention_devices: int
    ffn_devices: int
    microbatches: int
    batch_per_attention_device: int
    tpot_ms: float
    tokens_per_s_per_device: float
    breakdown: StepBreakdown
    capped_by: str = "tpot"  # what stopped B growing: "tpot", "memory" or "search" (MAX_BATCH)
    layout: FFNLayout | None = None  # the FFN servers the F devices form

    @property
    def shape(self) -> str:
        return f"{self.attention_devices}A{self.ffn_devices}F"

    @property
    def devices(self) -> int:
        return self.attention_devices + self.ffn_devices


@dataclass(frozen=True)
class Colocated:
    devices: int
    batch_per_device: int
    microbatches: int
    tpot_ms: float
    tokens_per_s_per_device: float
    capped_by: str = "tpot"


@dataclass
class Plan:
    model: str
    hardware: str
    tpot_target_ms: float
    context: int
    candidates: list[Candidate] = field(default_factory=list)  # best first
    colocated: list[Colocated] = field(default_factory=list)  # best first
    fastest_afd_tpot_ms: float | None = None  # batch 1 per micro-batch, best shape
    fastest_colocated_tpot_ms: float | None = None
    weights_gb: float = 0.0  # the model's weights as planned (GB: 1e9 bytes)

    @property
    def slo_met(self) -> bool:
        return bool(self.candidates or self.colocated)

    @property
    def afd_gain(self) -> float | None:
        """Best AFD tokens/s/device over best colocated (None if either meets no target)."""
        if not (self.candidates and self.colocated):
            return None
        return (
            self.candidates[0].tokens_per_s_per_device / self.colocated[0].tokens_per_s_per_device
        )

    def verdict(self) -> str:
        t = f"{self.tpot_target_ms:g} ms"
        if not self.slo_met:
            return (
                f"the target TPOT {t} cannot be met with {self.model} on {self.hardware} at "
                f"context {self.context}: the fastest AFD shape predicts "
                f"{_ms(self.fastest_afd_tpot_ms)}, colocated {_ms(self.fastest_colocated_tpot_ms)} "
                "(at the smallest batch)"
            )
        if not self.candidates:
            return f"AFD does not pay here: no AFD shape meets {t}; colocated does"
        best = self.candidates[0]
        if not self.colocated:
            return f"AFD pays: {best.shape} m={best.microbatches} meets {t}; colocated cannot"
        gain = self.afd_gain
        co = self.colocated[0]
        if abs(gain - 1.0) <= TIE_BAND:
            what = f"no difference within the model's error (±{TIE_BAND:.0%}), measure both"
        else:
            what = "AFD pays" if gain > 1.0 else "AFD does not pay here"
        return (
            f"{what}: {best.shape} m={best.microbatches} B={best.batch_per_attention_device} "
            f"gives {best.tokens_per_s_per_device:.1f} tok/s/device = {gain:.2f}x colocated "
            f"EP{co.devices} ({co.tokens_per_s_per_device:.1f} tok/s/device) at TPOT <= {t}"
        )

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "tpot_target_ms": self.tpot_target_ms,
            "context": self.context,
            "weights_gb": self.weights_gb,
            "slo_met": self.slo_met,
            "afd_gain": self.afd_gain,
            "verdict": self.verdict(),
            "fastest_afd_tpot_ms": self.fastest_afd_tpot_ms,
            "fastest_colocated_tpot_ms": self.fastest_colocated_tpot_ms,
            "candidates": [
                {**asdict(c), "shape": c.shape, "devices": c.devices} for c in self.candidates
            ],
            "colocated": [asdict(c) for c in self.colocated],
        }


def _ms(s: float | None) -> str:
    return "nothing (no shape fits in memory)" if s is None else f"{s:.1f} ms"


def afd_step(
    model: ModelShape,
    hw: HardwareProfile,
    attention_devices: int,
    ffn_devices: int,
    microbatches: int,
    batch: float,
    context: float,
    layout: FFNLayout | None = None,
) -> StepBreakdown:
    """Predicted decode step of an AFD deployment, `batch` requests per attention device,
    its F FFN devices laid out as `layout` (default: as the platform runs them)."""
    a = attention_devices
    layout = layout or ffn_layout(a, ffn_devices, hw.platform, model.num_heads)
    b = batch / microbatches
    ta = costs.attention_layer_time(model, hw, b, context)
    # the busiest FFN server: ceil(A / servers) attention ranks' rows, over its devices
    rows_ffn = -(-a // layout.servers) * b
    per_copy = layout.devices_per_copy
    group = costs.group_exchange_time(model, hw, rows_ffn, layout.ranks_per_server)
    te_moe = costs.ffn_layer_time(model, hw, rows_ffn, per_copy) + group
    te_dense = costs.ffn_layer_time(model, hw, rows_ffn, per_copy, dense=True) + group
    latency, occupancy = costs.transfer_times(
        model, hw, b, a, layout.ranks, devices_total=a + ffn_devices
    )
    dense, moe = model.num_dense_layers, model.num_moe_layers
    makespan = step_time(
        [ta] * model.num_layers,
        [te_dense] * dense + [te_moe] * moe,
        microbatches,
        latency,
        occupancy,
    )
    tc = latency + occupancy
    stages = {
        "attention": microbatches * ta,
        "ffn": microbatches * te_moe,
        "transfer": microbatches * occupancy,
        "round trip": ta + te_moe + 2 * tc,
    }
    return StepBreakdown(
        step_s=makespan + costs.step_extra_time(model, hw, batch),
        forward_s=makespan,
        attention_layer_s=ta,
        ffn_layer_s=te_moe,
        transfer_s=tc,
        bound=max(stages, key=stages.get),
    )


def colocated_step(
    model: ModelShape, hw: HardwareProfile, devices: int, batch: float, context: float
) -> tuple[float, int]:
    """(step seconds, micro-batches) of colocated EP over `devices`, `batch` per device."""
    best = None
    for m in (1, 2):
        b = batch / m
        ta = costs.attention_layer_time(model, hw, b, context)
        te_moe = costs.ffn_layer_time(model, hw, devices * b, devices)
        te_dense = costs.ffn_layer_time(model, hw, b, 1, dense=True)  # dense MLP replicated
        tc = 0.0
        if devices > 1:
            fanout = costs.dispatch_fanout(model.top_k, devices)
            lat, occ = costs.transfer_times(model, hw, b, devices, devices, devices, fanout)
            tc = lat + occ * (devices - 1) / devices  # the local share stays on the device
        per_layer_moe = (
            max(m * (ta + te_moe), ta + te_moe + 2 * tc) if m > 1 else ta + te_moe + 2 * tc
        )
        per_layer_dense = m * (ta + te_dense)
        t = model.num_moe_layers * per_layer_moe + model.num_dense_layers * per_layer_dense
        t += costs.step_extra_time(model, hw, batch)
        if best is None or t < best[0]:
            best = (t, m)
    return best


def _kv_cache_bytes(model: ModelShape, batch: int, context: float) -> float:
    return batch * model.kv_bytes_per_request(context)


def _attention_memory(model: ModelShape, batch: int, context: float) -> float:
    return model.attention_weight_bytes_total + _kv_cache_bytes(model, batch, context)


def _max_batch(fits, lo: int, step: int) -> int:
    """Largest multiple of `step` in [lo, MAX_BATCH] with fits(b) true (fits is monotone:
    true up to some b); 0 when even lo does not fit."""
    if not fits(lo):
        return 0
    good, bad = lo, None
    probe = lo
    while bad is None:
        probe *= 2
        if probe > MAX_BATCH:
            probe = MAX_BATCH
            if fits(probe):
                return probe
            bad = probe
        elif fits(probe):
            good = probe
        else:
            bad = probe
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def _capped_by(b: int, step: int, fits_memory) -> str:
    """Why the batch stopped at b: the next step up does not fit in memory, the search's
    bound, or else the TPOT target."""
    if b + step > MAX_BATCH:
        return "search"
    return "tpot" if fits_memory(b + step) else "memory"


def plan(
    model: ModelShape,
    hw: HardwareProfile,
    tpot_target_ms: float,
    context: int,
    max_devices: int = 128,
    top: int = 10,
) -> Plan:
    if not tpot_target_ms > 0:
        raise PlanInputError(f"tpot_target_ms={tpot_target_ms} must be > 0")
    if not (isinstance(context, int) and context > 0):
        raise PlanInputError(f"context={context!r} must be a positive integer (tokens)")
    if not (isinstance(max_devices, int) and max_devices >= 2):
        raise PlanInputError(f"max_devices={max_devices!r} must be an integer >= 2")
    target = tpot_target_ms * 1e-3
    # decode contexts grow during a request: plan at the given context (the worst case of
    # a request that has reached it)
    mem = hw.usable_memory_bytes
    ffn_bytes = model.ffn_weight_bytes_total
    result = Plan(model.name, hw.name, tpot_target_ms, context)
    result.weights_gb = (model.attention_weight_bytes_total + ffn_bytes) / 1e9
    best_per_shape: list[Candidate] = []
    fastest = None
    graphs = capabilities(hw.platform).default_graph_mode
    for f in FFN_COUNTS:
        for r in ATTENTION_COUNTS:
            if r + f > max_devices:
                break
            try:  # only shapes AFD can serve on this platform (the servers' own rule)
                layout = ffn_layout(r, f, hw.platform, model.num_heads)
            except CapabilityError:
                continue
            if ffn_bytes / layout.devices_per_copy > mem:
                continue
            for m in MICROBATCHES:
                if microbatch_problem(hw.platform, m, graphs):
                    continue
                if _attention_memory(model, m, context) > mem:
                    continue
                first = afd_step(model, hw, r, f, m, m, context, layout).step_s
                fastest = first if fastest is None else min(fastest, first)

                def fits(b, r=r, f=f, m=m, layout=layout):
                    if _attention_memory(model, b, context) > mem:
                        return False
                    return afd_step(model, hw, r, f, m, b, context, layout).step_s <= target

                b = _max_batch(fits, m, m)
                if not b:
                    continue
                bd = afd_step(model, hw, r, f, m, b, context, layout)
                capped = _capped_by(b, m, lambda b: _attention_memory(model, b, context) <= mem)
                best_per_shape.append(
                    Candidate(
                        r,
                        f,
                        m,
                        b,
                        bd.step_s * 1e3,
                        r * b / bd.step_s / (r + f),
                        bd,
                        capped,
                        layout,
                    )
                )
    best_per_shape.sort(key=lambda c: -c.tokens_per_s_per_device)
    result.candidates = best_per_shape[:top]
    result.fastest_afd_tpot_ms = None if fastest is None else fastest * 1e3
    colo, colo_fastest = [], None
    n = 1
    while n <= max_devices:
        per_device = model.attention_weight_bytes_total + ffn_bytes / n
        if per_device <= mem:
            first = colocated_step(model, hw, n, 1, context)[0]
            colo_fastest = first if colo_fastest is None else min(colo_fastest, first)

            def fits(b, n=n, per_device=per_device):
                if per_device + _kv_cache_bytes(model, b, context) > mem:
                    return False
                return colocated_step(model, hw, n, b, context)[0] <= target

            b = _max_batch(fits, 1, 1)
            if b:
                t, m = colocated_step(model, hw, n, b, context)
                capped = _capped_by(
                    b, 1, lambda b, p=per_device: p + _kv_cache_bytes(model, b, context) <= mem
                )
                colo.append(Colocated(n, b, m, t * 1e3, b / t, capped))
        n *= 2
    colo.sort(key=lambda c: -c.tokens_per_s_per_device)
    result.colocated = colo[:top]
    result.fastest_colocated_tpot_ms = None if colo_fastest is None else colo_fastest * 1e3
    return result

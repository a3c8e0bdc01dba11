"""`afd plan`'s predictions next to published decode throughputs: the table in
docs/planner.md ("Predicted vs published"), which tests/afd_core/test_planner_published.py
checks is this script's output.

    uv run --no-sync python benchmarks/planner_vs_published.py            # the table
    uv run --no-sync python benchmarks/planner_vs_published.py --fit      # the calibration

Each row plans the published system's model on the nearest hardware preset at its TPOT
target and context (where the source does not state them: 50 ms and 4K, marked) and takes
the planner's best colocated or best AFD throughput per device, or their ratio. The
presets' efficiency fractions were calibrated on the rows marked "fit" (one factor for
both fractions, --fit prints the search); the other rows are held out.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "afd-core" / "src"))

from afd_core.planner.hardware import PRESETS as HARDWARE  # noqa: E402
from afd_core.planner.model_shape import PRESETS as MODELS  # noqa: E402
from afd_core.planner.search import plan  # noqa: E402


@dataclass(frozen=True)
class Published:
    system: str
    model: str  # a planner preset
    hardware: str  # a planner preset
    kind: str  # "colocated" or "afd": tok/s per device; "gain": AFD over colocated
    tpot_ms: float
    context: int
    value: float
    source: str
    assumed: str = ""  # what the source does not state and the row assumes
    fit: bool = False  # used to calibrate the presets


PUBLISHED = [
    Published(
        "DeepSeek-V3, colocated EP (Step-3 report)", "deepseek-v3", "h100", "colocated",
        50, 4096, 2324, "arXiv 2507.19427: Hopper, FP8, no MTP", fit=True,
    ),
    Published(
        "DeepSeek-R1, CloudMatrix-Infer EP320", "deepseek-v3", "ascend-910c", "colocated",
        50, 4096, 1943, "arXiv 2506.12708: per NPU, INT8, TPOT < 50 ms",
        assumed="4K context", fit=True,
    ),
    Published(
        "DeepSeek-V3/R1, DeepSeek's online service", "deepseek-v3", "h100", "colocated",
        50, 4096, 1850, "DeepSeek inference system overview, 2025-03-01: 14.8k output "
        "tok/s per 8-GPU H800 node at 20-22 tok/s per request",
        assumed="4K context (mixed), no MTP",
    ),
    Published(
        "DeepSeek, vLLM wide EP + DBO", "deepseek-v3", "h200", "colocated",
        50, 4096, 2200, "vLLM blog 2025-12-17, large-scale serving: per H200",
        assumed="50 ms, 4K context",
    ),
    Published(
        "DeepSeek, xDeepServe MoE-attention disaggregated", "deepseek-v3", "ascend-910c",
        "afd", 50, 4096, 2400, "arXiv 2508.02520: per 910C chip, 480 attention + 288 MoE dies",
        assumed="4K context",
    ),
    Published(
        "Qwen3-235B-A22B FP8, FastAFD vs vLLM colocated", "qwen3-235b-a22b", "gb200-nvl72",
        "gain", 50, 8192, 1.41, "haoailab.com/blogs/fastafd: 7:1, 8K context",
        assumed="50 ms, FP8 weights",
    ),
]  # fmt: skip


def predict(row: Published, efficiency_scale: float = 1.0) -> float | None:
    model = MODELS[row.model]
    if row.model == "qwen3-235b-a22b":  # FastAFD serves the FP8 checkpoint
        model = replace(model, weight_bytes=1.0)
    hw = HARDWARE[row.hardware]
    hw = replace(
        hw,
        memory_efficiency=hw.memory_efficiency * efficiency_scale,
        matmul_efficiency=hw.matmul_efficiency * efficiency_scale,
    )
    p = plan(model, hw, row.tpot_ms, row.context, max_devices=512)
    if row.kind == "gain":
        return p.afd_gain
    best = p.colocated if row.kind == "colocated" else p.candidates
    return best[0].tokens_per_s_per_device if best else None


def table(efficiency_scale: float = 1.0) -> str:
    lines = [
        "| published system | preset, hardware | planned at | published | predicted | error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in PUBLISHED:
        got = predict(row, efficiency_scale)

        def fmt(v: float, gain: bool = row.kind == "gain") -> str:
            return f"{v:.2f}x" if gain else f"{v:,.0f} tok/s/device"

        at = f"{row.tpot_ms:g} ms, {row.context // 1024}K" + (
            f" (assumed: {row.assumed})" if row.assumed else ""
        )
        error = "none fits" if got is None else f"{(got / row.value - 1) * 100:+.0f}%"
        what = f"{row.kind}{', fit' if row.fit else ''}"
        lines.append(
            f"| {row.system} ({row.source}) | {row.model}, {row.hardware} ({what}) | {at} | "
            f"{fmt(row.value)} | {'-' if got is None else fmt(got)} | {error} |"
        )
    return "\n".join(lines)


def fit() -> None:
    """The efficiency scale that best fits the rows marked fit (already applied to the
    presets: 1.0 is the presets as they are)."""
    rows = [r for r in PUBLISHED if r.fit]
    for scale in [x / 20 for x in range(14, 27)]:
        errors = [predict(r, scale) / r.value - 1 for r in rows]
        print(f"scale {scale:.2f}: " + ", ".join(f"{e:+.1%}" for e in errors))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="print the calibration search")
    if parser.parse_args().fit:
        fit()
    else:
        print(table())

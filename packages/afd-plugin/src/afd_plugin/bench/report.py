"""`afd bench`'s outputs: the JSON rows of the sweep, the printed tables, the PNG chart."""

from __future__ import annotations

import statistics
from pathlib import Path

from afd_plugin.bench.connector import SweepPoint, spread


def sweep_rows(points: list[SweepPoint]) -> list[dict]:
    rows = []
    for p in points:
        raw, afd = spread(p.raw_s), spread(p.afd_s)
        rows.append(
            {
                "hidden": p.hidden,
                "rows": p.rows,
                "bytes": p.nbytes,
                "raw_us": {k: (v * 1e6 if k != "n" else v) for k, v in raw.items()},
                "afd_us": {k: (v * 1e6 if k != "n" else v) for k, v in afd.items()},
                "ratio": afd["median"] / raw["median"],
            }
        )
    return rows


def render(result: dict) -> str:
    lines = [
        "connector round trip vs raw gloo (bf16; median [p10, p90] us; ratio = AFD / raw)",
        f"  {'hidden':>6} {'rows':>5} {'bytes':>9} {'raw':>22} {'AFD':>22} {'ratio':>6}",
    ]
    for r in result["connector_sweep"]:
        raw, afd = r["raw_us"], r["afd_us"]
        lines.append(
            f"  {r['hidden']:>6} {r['rows']:>5} {r['bytes']:>9} "
            f"{raw['median']:>8.1f} [{raw['p10']:>5.0f},{raw['p90']:>6.0f}] "
            f"{afd['median']:>8.1f} [{afd['p10']:>5.0f},{afd['p90']:>6.0f}] {r['ratio']:>6.2f}"
        )
    fit, c = result["link_fit"], result["compute"]
    lines += [
        f"  link (one way): latency {fit['latency_us']:.1f} us, bandwidth "
        f"{fit['bandwidth_gbps']:.2f} GB/s",
        f"compute at one thread: matmul {c['matmul_gflops']:.1f} GFLOP/s, weight streaming "
        f"{c['memory_gbps']:.1f} GB/s",
    ]
    serving = result.get("serving")
    if serving:
        lines += [
            "",
            f"time per output token, {serving['model']} checkpoint ({serving['tokens']} tokens, "
            f"median [min, max] of {serving['reps']} reps)",
            f"  {'batch':>5} {'config':>10} {'TPOT ms':>24} {'vs colocated':>12} {'vs m=1':>7} "
            f"{'step ms':>8}",
        ]
        for r in serving["results"]:
            t = r["tpot_ms"]
            step = f"{r['step_ms']['median']:8.2f}" if r["step_ms"] else f"{'-':>8}"
            lines.append(
                f"  {r['batch']:>5} {r['config']:>10} {t['median']:>9.2f} [{t['min']:>5.1f},"
                f"{t['max']:>6.1f}] {r['vs_colocated']:>12.2f} {r['vs_afd_m1']:>7.2f} {step}"
            )
    cal = result.get("calibration")
    if cal:
        p = result["profile"]
        lines += [
            "",
            "planner vs measured (profile from this run; fixed costs from the batch-1 point: "
            f"attention {p['attention_layer_overhead_us']:.0f} us/layer, FFN "
            f"{p['ffn_layer_overhead_us']:.0f} us/layer, step {p['step_overhead_us']:.0f} us)",
            f"  {'batch':>5} {'m':>2} {'step pred':>9} {'measured':>9} {'error':>7} "
            f"{'TPOT pred':>9} {'measured':>9} {'error':>7}",
        ]
        errors = []
        for q in cal["points"]:
            meas = q["measured_step_ms"]
            err = q["step_error"]
            if err is not None:
                errors.append(abs(err))
            lines.append(
                f"  {q['batch']:>5} {q['microbatches']:>2} {q['predicted_step_ms']:>9.2f} "
                f"{meas if meas is not None else float('nan'):>9.2f} "
                f"{(err if err is not None else float('nan')) * 100:>+6.0f}% "
                f"{q['predicted_tpot_ms']:>9.2f} {q['measured_tpot_ms']:>9.2f} "
                f"{q['tpot_error'] * 100:>+6.0f}%"
            )
        if errors:
            lines.append(
                f"  step-time error: median {statistics.median(errors) * 100:.0f}%, worst "
                f"{max(errors) * 100:.0f}% (goal: within 20%)"
            )
    return "\n".join(lines)


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    serving = result.get("serving")
    fig, axes = plt.subplots(1, 2 if serving else 1, figsize=(12 if serving else 6, 4.5))
    ax = axes[0] if serving else axes
    hiddens = sorted({r["hidden"] for r in result["connector_sweep"]})
    for h in hiddens:
        rows = [r for r in result["connector_sweep"] if r["hidden"] == h]
        x = [r["bytes"] for r in rows]
        for key, style, label in (("raw_us", "--o", "raw gloo"), ("afd_us", "-s", "AFD")):
            med = [r[key]["median"] for r in rows]
            lo = [r[key]["median"] - r[key]["p10"] for r in rows]
            hi = [r[key]["p90"] - r[key]["median"] for r in rows]
            ax.errorbar(x, med, yerr=[lo, hi], fmt=style, capsize=3, label=f"{label}, hidden {h}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per message (bf16)")
    ax.set_ylabel("round trip, us (median, p10-p90)")
    ax.set_title("connector round trip")
    ax.legend(fontsize=8)
    if serving:
        ax = axes[1]
        configs = []
        for r in serving["results"]:
            if r["config"] not in configs:
                configs.append(r["config"])
        width = 0.8 / len(configs)
        for i, name in enumerate(configs):
            rs = [r for r in serving["results"] if r["config"] == name]
            xs = [j + i * width for j in range(len(rs))]
            med = [r["tpot_ms"]["median"] for r in rs]
            err = [
                [r["tpot_ms"]["median"] - r["tpot_ms"]["min"] for r in rs],
                [r["tpot_ms"]["max"] - r["tpot_ms"]["median"] for r in rs],
            ]
            ax.bar(xs, med, width, yerr=err, capsize=3, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(serving["batches"]))])
        ax.set_xticklabels([f"batch {b}" for b in serving["batches"]])
        ax.set_ylabel("time per output token, ms")
        ax.set_title(f"{serving['model']} checkpoint, median [min, max]")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

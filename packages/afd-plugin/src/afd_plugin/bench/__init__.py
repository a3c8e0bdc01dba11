"""`afd bench`: measure, on this machine, what AFD costs and buys, each figure next to its
baseline from the same run.

1. connector sweep: AFD's per-layer exchange vs raw gloo send/recv, rows x hidden sizes
   (`connector`); a line through it gives the link's latency and bandwidth
2. compute rates at one thread (`compute`)
3. serving: AFD (m = 1 and m = 2 micro-batches, i.e. DBO off and on) vs colocated time per
   output token on a tiny or medium checkpoint, several repetitions (`serving`)
4. calibration: a hardware profile from 1-3 (`--save-profile` writes it for `afd plan`),
   and the planner's predicted AFD step times against the measured ones (`calibration`)

Writes `bench.json` (schema in docs/planner.md) and `sweep.png` into --out, prints medians,
spread and ratios, and shows progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULT_FORMAT = 1
MODELS = ("tiny", "medium")
# the flags named as vLLM's benchmarks name them (`vllm bench latency`: --batch-size,
# --output-len, --num-iters; `vllm bench serve`: --model, the served model)
FLAGS = {
    "batch": "--batch-size",
    "tokens": "--output-len",
    "reps": "--num-iters",
    "iters": "--sweep-iters",
    "sweep_rows": "--sweep-rows",
    "sweep_hidden": "--sweep-hidden",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="folder for bench.json, sweep.png and server logs")
    p.add_argument(
        "--model",
        help="tiny: the demo-size Qwen3-MoE (fast); medium: a Qwen3-MoE with hidden 1024 and "
        "16 experts, its compute large enough to calibrate against (default: medium); with "
        "a running deployment: the checkpoint folder it serves, as given to vllm serve",
    )
    p.add_argument(
        FLAGS["batch"], dest="batch", type=int, nargs="+", default=[16, 64], metavar="B",
        help="requests per batch, one run each",
    )  # fmt: skip
    p.add_argument(
        FLAGS["tokens"], dest="tokens", type=int, default=32, metavar="N",
        help="decode tokens measured per request",
    )  # fmt: skip
    p.add_argument(
        FLAGS["reps"], dest="reps", type=int, default=3, metavar="N",
        help="repetitions of every measurement",
    )  # fmt: skip
    p.add_argument(
        "--sweep-rows", type=int, nargs="+", default=[1, 4, 16, 64, 256], metavar="ROWS",
        help="rows per exchange in the connector sweep",
    )  # fmt: skip
    p.add_argument(
        "--sweep-hidden", type=int, nargs="+", default=[2048, 7168], metavar="H",
        help="hidden sizes in the connector sweep",
    )  # fmt: skip
    p.add_argument(
        FLAGS["iters"], dest="iters", type=int, default=100, metavar="N",
        help="round trips per sweep point",
    )  # fmt: skip
    p.add_argument("--no-serving", action="store_true", help="only the sweep and compute rates")
    running = p.add_argument_group(
        "a running deployment instead of servers started here (the three together, and "
        "--model the checkpoint it serves): a colocated server and a 1A1F AFD deployment "
        "whose attention server runs with --enable-dbo and VLLM_SERVER_DEV_MODE=1, both AFD "
        "servers with AFD_STEP_TRACE"
    )
    running.add_argument("--colocated-url", help="e.g. http://127.0.0.1:8000")
    running.add_argument("--attention-url", help="the AFD attention server")
    running.add_argument("--trace", help="the AFD_STEP_TRACE prefix both AFD servers write to")
    p.add_argument(
        "--save-profile", type=Path, metavar="FILE",
        help="write the measured hardware profile (a CPU profile) here",
    )  # fmt: skip


def _check(args: argparse.Namespace) -> str | None:
    for name in ("batch", "sweep_rows", "sweep_hidden"):
        bad = [v for v in getattr(args, name) if v < 1]
        if bad:
            return f"{FLAGS[name]}={bad[0]} must be >= 1"
    for name, low in (("tokens", 1), ("reps", 1), ("iters", 2)):
        if getattr(args, name) < low:
            return f"{FLAGS[name]}={getattr(args, name)} must be >= {low}"
    if len({r * h for r in args.sweep_rows for h in args.sweep_hidden}) < 2:
        return (
            "--sweep-rows x --sweep-hidden must give at least two message sizes (for the link fit)"
        )
    given = [args.colocated_url, args.attention_url, args.trace]
    if any(given) and not all(given):
        return (
            "--colocated-url, --attention-url and --trace go together (a running deployment, "
            "with --model its checkpoint folder); missing: "
            + ", ".join(
                f"--{n}"
                for n, v in zip(("colocated-url", "attention-url", "trace"), given, strict=True)
                if not v
            )
        )
    if any(given):
        if args.model is None or not (Path(args.model) / "config.json").is_file():
            return (
                f"--model={args.model} is not a checkpoint folder holding config.json; with a "
                "running deployment, give the folder it serves, as given to vllm serve"
            )
    elif (args.model or "medium").lower() not in MODELS:
        return (
            f"--model={args.model} is invalid; allowed: tiny, medium (a checkpoint folder "
            "only with --colocated-url, --attention-url and --trace)"
        )
    if args.save_profile and args.no_serving:
        return "--save-profile needs the serving measurements (its fixed costs); drop --no-serving"
    return None


def main(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"afd bench: {problem}", file=sys.stderr)
        return 2
    if not args.attention_url:  # a generated checkpoint: its size, as one spelling
        args.model = (args.model or "medium").lower()
    try:
        import matplotlib  # noqa: F401

        chart = True
    except ImportError:  # the chart is a side output: measure anyway
        chart = False
        print(
            "afd bench: warning: no sweep.png without matplotlib (install afd-plugin[bench]); "
            "bench.json and the tables are written",
            file=sys.stderr,
        )
    out = args.out or Path(tempfile.mkdtemp(prefix="afd-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    total = 2 if args.no_serving else 4
    t_start = time.monotonic()

    def progress(stage: int, what: str) -> None:
        print(
            f"[afd bench {time.monotonic() - t_start:6.0f}s] ({stage}/{total}) {what}",
            file=sys.stderr,
            flush=True,
        )

    from afd_plugin.bench import compute, connector, report

    progress(1, f"connector sweep: hidden {args.sweep_hidden} x rows {args.sweep_rows}")
    points, step_times = connector.run_sweep(args.sweep_hidden, args.sweep_rows, args.iters)
    link = connector.fit_link(points)
    progress(2, "compute rates at one thread")
    rates = {
        "matmul_flops": compute.matmul_flops(),
        "memory_bytes_per_s": compute.memory_bandwidth(),
    }
    result: dict = {
        "format": RESULT_FORMAT,
        "machine": {"host": platform.node(), "cpus": _cpus(), "platform": platform.platform()},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "connector_sweep": report.sweep_rows(points),
        "one_layer_step": {str(h): connector.spread(v) for h, v in step_times.items()},
        "link_fit": {"latency_us": link[0] * 1e6, "bandwidth_gbps": link[1] / 1e9},
        "compute": {
            "matmul_gflops": rates["matmul_flops"] / 1e9,
            "memory_gbps": rates["memory_bytes_per_s"] / 1e9,
        },
        "serving": None,
        "calibration": None,
        "profile": None,
    }
    if not args.no_serving:
        result.update(_serving(args, out, link, rates, lambda s, w: progress(s, w)))
    (out / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    if chart:
        report.chart(result, out / "sweep.png")
    if args.save_profile and result["profile"]:
        args.save_profile.parent.mkdir(parents=True, exist_ok=True)
        args.save_profile.write_text(json.dumps(result["profile"], indent=2) + "\n")
    print(report.render(result))
    print(f"\nwrote {out / 'bench.json'}" + (f", {out / 'sweep.png'}" if chart else ""), end="")
    print(f", {args.save_profile}" if args.save_profile else "")
    return 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _serving(args, out: Path, link, rates, progress) -> dict:
    from afd_core.planner.model_shape import load_model
    from afd_models.tiny import BENCHMARK_MOE, TinySpec, tiny_checkpoint
    from afd_plugin.bench import calibration, serving
    from afd_plugin.deploy.servers import running

    def serving_progress(what: str) -> None:
        progress(3, f"serving: {what}")

    if args.attention_url:
        model_dir = args.model
        samples = serving.measure(
            args.colocated_url, args.attention_url, args.trace, args.batch, args.tokens,
            args.reps, serving_progress,
        )  # fmt: skip
    else:
        spec = BENCHMARK_MOE if args.model == "medium" else TinySpec("qwen3_moe")
        progress(3, f"serving: {args.model} checkpoint")
        model_dir = str(tiny_checkpoint(spec))
        servers, colocated_url, attention_url, trace = serving.local_servers(
            model_dir, max(args.batch), out / "logs"
        )
        serving_progress("starting the colocated, FFN and attention servers")
        with running(servers, timeout=900):
            samples = serving.measure(
                colocated_url, attention_url, trace, args.batch, args.tokens, args.reps,
                serving_progress,
            )  # fmt: skip
    progress(4, "calibration: profile and predictions")
    shape = load_model(model_dir)
    context = calibration.context_of(args.tokens, serving.SHORT)
    profile = calibration.build_profile(
        shape,
        link,
        rates["matmul_flops"],
        rates["memory_bytes_per_s"],
        samples["calibration"],
        context,
    )
    runs = samples["runs"]
    table = []
    for b in args.batch:
        colo = statistics.median(runs[f"{b}|colocated"]["tpot"])
        m1 = statistics.median(runs[f"{b}|AFD m=1"]["tpot"])
        for name, _ in serving.CONFIGS:
            r = runs[f"{b}|{name}"]
            steps = [s for s in r["step"] if s is not None]
            table.append(
                {
                    "batch": b,
                    "config": name,
                    "tpot_ms": _ms_spread(r["tpot"]),
                    "step_ms": _ms_spread(steps) if steps else None,
                    "vs_colocated": statistics.median(r["tpot"]) / colo,
                    "vs_afd_m1": statistics.median(r["tpot"]) / m1,
                }
            )
    return {
        "serving": {
            "model": args.model if not args.attention_url else "running deployment",
            "checkpoint": model_dir,
            "shape": shape.name,
            "batches": args.batch,
            "tokens": args.tokens,
            "reps": args.reps,
            "results": table,
        },
        "calibration": {
            "context": context,
            "batch1": {k: _ms_spread(v) if v else None for k, v in samples["calibration"].items()},
            "points": calibration.predictions(shape, profile, runs, args.batch, context),
        },
        "profile": profile.to_dict(),
    }


def _ms_spread(xs: list[float]) -> dict:
    from afd_plugin.bench.connector import spread

    return {k: (v * 1e3 if k != "n" else v) for k, v in spread(xs).items()}

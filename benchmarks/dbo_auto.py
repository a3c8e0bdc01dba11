"""Micro-batches chosen per step (`afd.num_microbatches: "auto"`) against every fixed m:
time per output token over batch sizes, in one run, on one deployment.

Qwen3-MoE hidden 1024, 16 experts top-2, 4 layers, fp32, random weights; 1A1F, the
attention server pinned to core 0, the FFN server to core 1 (one OpenMP thread each), DBO
thresholds 4 tokens. The attention server starts DBO-capable and switches between m = 1,
2, 3, 4 and auto at run time (vLLM's dev endpoint); auto keeps what it measured across the
switches (a warm-up batch per batch size lets every config, auto included, see that size
before it is timed). The order of the configs rotates by one each repetition, so with
--reps a multiple of 5 each config is timed equally often at each place (an offset from
the place in the order falls on all alike). Each measurement is one batch of B requests
(the scheduler is paused while they are added): time per output token =
(t(N + 8 tokens) - t(8 tokens)) / N.

Printed per batch: the median TPOT of each config; the spread over repetitions (the
largest (max - min) / median of any config: differences below it are not resolved); auto
over the best fixed m; the decode steps auto ran at each m in its timed batches (from its
tuner), and auto over the fixed m it ran most: the ratio of medians and the range of the
ratios within each repetition.

    uv run --no-sync python benchmarks/dbo_auto.py [--batch 4 16 32 64 128] [--tokens 32]
        [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import Counter
from pathlib import Path

PROMPT = "Attention and the feed-forward network"
SHORT = 8
CONFIGS = ["1", "2", "3", "4", "auto"]


def batch_seconds(url: str, batch: int, tokens: int) -> float:
    from afd_plugin.deploy.servers import complete_batch

    return complete_batch(url, [f"{PROMPT} {i}" for i in range(batch)], tokens, stagger=0)[1]


def decode_steps(stats: dict, batch: int) -> Counter:
    """Steps the tuner has run at each m for decode steps of `batch` requests (their bucket)."""
    from afd_core.step.tuner import bucket_name, bucket_of

    bucket = bucket_name(bucket_of([1] * batch))
    arms = stats.get("tuner", {}).get(bucket, {}).get("by_microbatches", {})
    return Counter({m: n for m, (n, _) in arms.items()})


def rotated(configs: list[str], rep: int) -> list[str]:
    shift = rep % len(configs)
    return configs[shift:] + configs[:shift]


def _dbo_tpot():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "dbo_tpot", Path(__file__).with_name("dbo_tpot.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    from afd_models.tiny import BENCHMARK_MOE, tiny_checkpoint
    from afd_plugin.deploy.servers import collective_rpc, running

    pinned_pair = _dbo_tpot().pinned_pair  # the same 1A1F pinning as dbo_tpot.py

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16, 32, 64, 128])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if min(a.batch) < 1 or a.tokens < 1 or a.reps < 1:
        ap.error("--batch, --tokens and --reps: allowed 1 or more")
    spec = BENCHMARK_MOE
    model = str(tiny_checkpoint(spec))
    logs = Path(tempfile.mkdtemp(prefix="afd-dbo-auto-"))
    common = ["--max-num-seqs", str(max(a.batch)), "--max-model-len", "256"]
    ffn, att = pinned_pair(model, logs, common, {}, {"VLLM_SERVER_DEV_MODE": "1"})
    fixed = CONFIGS[:-1]
    tpot: dict[tuple[int, str], list[float]] = {}  # per repetition, in order
    auto_ran = {b: Counter() for b in a.batch}  # decode steps at each m, timed batches only
    with running([ffn, att], timeout=600):
        batch_seconds(att.url, 4, 4)
        for b in a.batch:
            for m in CONFIGS:  # warm-up: this batch size once per config
                collective_rpc(att.url, "afd_set_microbatching", m)
                batch_seconds(att.url, b, SHORT)
            for rep in range(a.reps):
                for m in rotated(CONFIGS, rep):
                    before = collective_rpc(att.url, "afd_set_microbatching", m)[0]
                    short = batch_seconds(att.url, b, SHORT)
                    long = batch_seconds(att.url, b, SHORT + a.tokens)
                    tpot.setdefault((b, m), []).append((long - short) / a.tokens)
                    if m == "auto":
                        after = collective_rpc(att.url, "afd_step_stats")[0]
                        auto_ran[b] += decode_steps(after, b) - decode_steps(before, b)
    print(
        f"Qwen3-MoE hidden {spec.hidden_size}, {spec.num_experts} experts top-{spec.top_k}, "
        f"{spec.num_layers} layers, fp32; 1A1F, attention core 0, FFN core 1; {a.tokens} "
        f"tokens, median of {a.reps} reps, config order rotated each rep"
    )
    print("batch | " + " | ".join(f"m={m} ms" for m in fixed) + " | auto ms | spread | "
          "auto / best fixed | auto's decode steps by m | auto / m it ran most "
          "[range in a rep]")  # fmt: skip
    for b in a.batch:
        runs = {m: tpot[(b, m)] for m in CONFIGS}
        med = {m: statistics.median(t) for m, t in runs.items()}
        spread = max((max(t) - min(t)) / med[m] for m, t in runs.items())
        best = min(fixed, key=med.get)
        cells = " | ".join(f"{med[m] * 1e3:6.2f}" for m in CONFIGS)
        steps = auto_ran[b]
        ran = ", ".join(f"{m}: {n}" for m, n in sorted(steps.items()) if n) or "-"
        most = max(steps, key=steps.get) if steps else None
        versus = "-"
        if most in fixed:
            within = [x / y for x, y in zip(runs["auto"], runs[most], strict=True)]
            versus = (
                f"m={most}: {med['auto'] / med[most]:.3f} [{min(within):.3f}-{max(within):.3f}]"
            )
        print(
            f"{b:5d} | {cells} | {spread:.0%} | {med['auto'] / med[best]:.3f} (m={best}) | "
            f"{ran} | {versus}"
        )
    print(f"logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

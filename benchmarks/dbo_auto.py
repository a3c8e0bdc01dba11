"""Micro-batches chosen per step (`afd.num_microbatches: "auto"`) against every fixed m:
time per output token over batch sizes, in one run, on one deployment.

Qwen3-MoE hidden 1024, 16 experts top-2, 4 layers, fp32, random weights; 1A1F, the
attention server pinned to core 0, the FFN server to core 1 (one OpenMP thread each), DBO
thresholds 4 tokens. The attention server starts DBO-capable and switches between m = 1,
2, 3, 4 and auto at run time (vLLM's dev endpoint), in turn, per repetition; auto keeps
what it measured across the switches (a warm-up batch per batch size lets every config,
auto included, see that size before it is timed). Each measurement is one batch of B
requests (the scheduler is paused while they are added): time per output token =
(t(N + 8 tokens) - t(8 tokens)) / N. Printed per batch: the median TPOT of each config,
auto over the best fixed m, and the m auto ran most in decode (from its tuner).

    uv run --no-sync python benchmarks/dbo_auto.py [--batch 4 16 32 64 128] [--tokens 32]
        [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

PROMPT = "Attention and the feed-forward network"
SHORT = 8


def batch_seconds(url: str, batch: int, tokens: int) -> float:
    from afd_plugin.deploy.servers import complete_batch

    return complete_batch(url, [f"{PROMPT} {i}" for i in range(batch)], tokens, stagger=0)[1]


def decode_choice(stats: dict, batch: int) -> str:
    """The m the tuner ran most for decode steps of about `batch` tokens, with its share."""
    import math

    key = f"decode~{2 ** (round(2 * math.log2(batch)) / 2):.0f}"
    arms = stats.get("tuner", {}).get(key, {}).get("by_microbatches", {})
    if not arms:
        return "-"
    total = sum(n for n, _ in arms.values())
    m, (n, _) = max(arms.items(), key=lambda kv: kv[1][0])
    return f"m={m} ({n / total:.0%} of {total})"


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
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if min(a.batch) < 1 or a.tokens < 1 or a.reps < 1:
        ap.error("--batch, --tokens and --reps: allowed 1 or more")
    spec = BENCHMARK_MOE
    model = str(tiny_checkpoint(spec))
    logs = Path(tempfile.mkdtemp(prefix="afd-dbo-auto-"))
    common = ["--max-num-seqs", str(max(a.batch)), "--max-model-len", "256"]
    ffn, att = pinned_pair(model, logs, common, {}, {"VLLM_SERVER_DEV_MODE": "1"})
    configs = ["1", "2", "3", "4", "auto"]
    tpot: dict[tuple[int, str], list[float]] = {}
    with running([ffn, att], timeout=600):
        batch_seconds(att.url, 4, 4)
        for b in a.batch:
            for m in configs:  # warm-up: this batch size once per config
                collective_rpc(att.url, "afd_set_microbatching", m)
                batch_seconds(att.url, b, SHORT)
            for _ in range(a.reps):
                for m in configs:
                    collective_rpc(att.url, "afd_set_microbatching", m)
                    short = batch_seconds(att.url, b, SHORT)
                    long = batch_seconds(att.url, b, SHORT + a.tokens)
                    tpot.setdefault((b, m), []).append((long - short) / a.tokens)
        collective_rpc(att.url, "afd_set_microbatching", "auto")
        stats = collective_rpc(att.url, "afd_step_stats")[0]
    print(
        f"Qwen3-MoE hidden {spec.hidden_size}, {spec.num_experts} experts top-{spec.top_k}, "
        f"{spec.num_layers} layers, fp32; 1A1F, attention core 0, FFN core 1; {a.tokens} "
        f"tokens, median of {a.reps} reps"
    )
    print("batch | " + " | ".join(f"m={m} ms" for m in configs[:-1]) + " | auto ms | "
          "auto / best fixed | best fixed | auto ran in decode")  # fmt: skip
    for b in a.batch:
        med = {m: statistics.median(tpot[(b, m)]) for m in configs}
        best = min(configs[:-1], key=med.get)
        cells = " | ".join(f"{med[m] * 1e3:6.2f}" for m in configs)
        print(
            f"{b:5d} | {cells} | {med['auto'] / med[best]:.3f} | m={best} | "
            f"{decode_choice(stats, b)}"
        )
    print(f"logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

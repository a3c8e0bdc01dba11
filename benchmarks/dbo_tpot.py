"""Time per output token with micro-batches (DBO): colocated vs AFD m = 1, 2, 4.

One run, one model: a Qwen3-MoE with hidden 1024, 16 experts (top-2), 4 layers, fp32,
random weights. A colocated server uses both cores; the AFD attention server is pinned to
core 0 and the FFN server to core 1 (one OpenMP thread each). The AFD attention server
starts DBO-capable and changes m at run time, so m = 1, 2 and 4 run on the same servers,
in turn, for every repetition. Each measurement is one batch of B requests (the scheduler is
paused while they are added, so every step holds all of them): time per output token =
(t(N + 8 tokens) - t(8 tokens)) / N, so the prefill cancels out. From the AFD_STEP_TRACE
timelines of the AFD runs: the median interval between the starts of consecutive decode
steps, and the overlap: the time the attention and the FFN side compute at once over the
step time.

    uv run --no-sync python benchmarks/dbo_tpot.py [--batch 32 128] [--tokens 32] [--reps 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = "Attention and the feed-forward network"
SHORT = 8  # tokens of the short run, whose time (with the prefill) is subtracted


def decode_step_interval(trace_prefix: str, start: float, end: float) -> float:
    """Median start-to-start interval of the attention side's decode steps in [start, end]
    (the first two steps, prefill, are left out)."""
    path = Path(f"{trace_prefix}.attention0.jsonl")
    starts = sorted(
        e["t0"]
        for e in map(json.loads, path.read_text().splitlines())
        if e["kind"] == "step" and start <= e["t0"] <= end
    )[2:]
    return statistics.median(b - a for a, b in zip(starts, starts[1:], strict=False))


def batch_seconds(url: str, batch: int, tokens: int) -> tuple[float, float, float]:
    """(seconds, start, end) to generate `tokens` tokens for a batch of `batch` requests."""
    from afd_plugin.deploy.servers import complete_batch

    _, seconds = complete_batch(url, [f"{PROMPT} {i}" for i in range(batch)], tokens, stagger=0)
    end = time.monotonic()
    return seconds, end - seconds, end


def pinned_pair(model: str, logs: Path, common: list[str], ffn_env: dict, att_env: dict):
    """A 1A1F deployment, not started: the FFN server on core 1, the attention server on
    core 0 (DBO-capable, thresholds 4 tokens), one OpenMP thread each. Returns (ffn, att)."""
    from afd_plugin.deploy.servers import Server, ServerSpec, free_port

    one = {"OMP_NUM_THREADS": "1"}
    afd = {"port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": 1}
    ffn = Server(
        ServerSpec(
            "ffn",
            model,
            free_port(),
            afd={**afd, "role": "ffn"},
            extra_args=common,
            env={"VLLM_CPU_OMP_THREADS_BIND": "1", **ffn_env, **one},
        ),
        logs,
    )
    att = Server(
        ServerSpec(
            "attention",
            model,
            free_port(),
            afd={**afd, "role": "attention"},
            extra_args=common
            + ["--enable-dbo", "--dbo-decode-token-threshold", "4"]
            + ["--dbo-prefill-token-threshold", "4"],
            env={"VLLM_CPU_OMP_THREADS_BIND": "0", **att_env, **one},
        ),
        logs,
    )
    return ffn, att


def main() -> int:

    from afd_models.tiny import BENCHMARK_MOE, tiny_checkpoint
    from afd_plugin.deploy.servers import Server, ServerSpec, collective_rpc, free_port, running

    spec_ = importlib.util.spec_from_file_location(
        "dbo_overlap", Path(__file__).with_name("dbo_overlap.py")
    )
    overlap_mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(overlap_mod)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    spec = BENCHMARK_MOE
    model = str(tiny_checkpoint(spec))
    logs = Path(tempfile.mkdtemp(prefix="afd-dbo-tpot-"))
    trace = str(logs / "trace")
    common = ["--max-num-seqs", str(max(a.batch)), "--max-model-len", "256"]
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    colo = Server(
        ServerSpec(
            "colocated",
            model,
            free_port(),
            extra_args=common,
            env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2", **dev},
        ),
        logs,
    )
    traced = {"AFD_STEP_TRACE": trace}
    ffn, att = pinned_pair(model, logs, common, traced, {**traced, **dev})
    configs = [("colocated", colo.url, None), ("AFD m=1", att.url, 1)]
    configs += [("AFD m=2", att.url, 2), ("AFD m=4", att.url, 4)]
    results: dict = {}
    with running([colo, ffn, att], timeout=600):
        for _, url, _ in configs[:2]:
            batch_seconds(url, 4, 4)  # warm-up
        for b in a.batch:
            for _ in range(a.reps):
                for name, url, m in configs:
                    if m is not None:
                        collective_rpc(url, "afd_set_microbatching", str(m))
                    t_short, _, _ = batch_seconds(url, b, SHORT)
                    t_long, start, end = batch_seconds(url, b, SHORT + a.tokens)
                    r = results.setdefault((b, name), {"tpot": [], "overlap": [], "gap": []})
                    r["tpot"].append((t_long - t_short) / a.tokens)
                    if m is not None:
                        r["overlap"].append(overlap_mod.overlap(trace, start, end))
                        r["gap"].append(decode_step_interval(trace, start, end))
    print(
        f"Qwen3-MoE hidden {spec.hidden_size}, {spec.num_experts} experts top-{spec.top_k}, "
        f"{spec.num_layers} layers, fp32; colocated on cores 0-1, AFD attention core 0 + FFN "
        f"core 1; {a.tokens} tokens, median of {a.reps} reps"
    )
    print(
        "batch | config | TPOT ms | vs colocated | vs AFD m=1 | decode step ms (vs m=1) | "
        "overlap (att busy, FFN busy, both)"
    )
    for b in a.batch:
        colo_t = statistics.median(results[(b, "colocated")]["tpot"])
        m1 = statistics.median(results[(b, "AFD m=1")]["tpot"])
        gap1 = statistics.median(results[(b, "AFD m=1")]["gap"])
        for name, _, m in configs:
            r = results[(b, name)]
            t = statistics.median(r["tpot"])
            ov = gap = ""
            if r["overlap"]:
                parts = zip(*r["overlap"], strict=True)
                ov = " / ".join(f"{statistics.median(p):.2f}" for p in parts)
                g = statistics.median(r["gap"])
                gap = f"{g * 1e3:7.1f} ({g / gap1:.2f})"
            print(
                f"{b:5d} | {name:9s} | {t * 1e3:7.2f} | {t / colo_t:5.2f} | "
                f"{t / m1 if m else float('nan'):5.2f} | {gap:15s} | {ov}"
            )
    print(f"logs and timelines: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

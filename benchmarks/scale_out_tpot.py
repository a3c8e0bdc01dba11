"""Time per output token of 2A deployments with one FFN rank, one FFN rank over TP 2, two
FFN replicas, and two FFN ranks as one expert group, against a colocated server; in one run,
on one model.

Qwen3-MoE hidden 1024, 16 experts top-2, 4 layers, fp32, random weights. The attention side
is one server with two data-parallel ranks (attention ranks 0 and 1) in every deployment;
the FFN side is (1) one FFN server, (2) one FFN server with --tensor-parallel-size 2, or
(3) two FFN servers (FFN rank k serves attention rank k), or (4) one FFN server with
--data-parallel-size 2 (FFN ranks 0 and 1 run the MoE layers as one expert group: vLLM's
data-parallel MoE, experts sharded over both). Each measurement is one batch of
B requests (the scheduler is paused while they are added): time per output token =
(t(N + 8 tokens) - t(8 tokens)) / N. From the AFD_STEP_TRACE timelines: the median FFN
compute per layer (TP rank 0 of FFN rank 0; with TP 2 it includes the TP all-reduce, in the
expert group the all-gather and reduce-scatter of the rows).

All servers share this machine's cores: it shows what the code does, not what separate
devices would give (see the README).

    uv run --no-sync python benchmarks/scale_out_tpot.py [--batch 16] [--tokens 32] [--reps 2]
        [--shapes one,tp2,replicas,group]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = "Attention and the feed-forward network"
SHORT = 8


def batch_seconds(url: str, batch: int, tokens: int) -> float:
    from afd_plugin.deploy.servers import complete_batch

    return complete_batch(url, [f"{PROMPT} {i}" for i in range(batch)], tokens, stagger=0)[1]


def compute_per_layer(trace_prefix: str, start: float) -> float:
    path = Path(f"{trace_prefix}.ffn0.jsonl")
    events = [json.loads(line) for line in path.read_text().splitlines()]
    return statistics.median(
        e["t1"] - e["t0"] for e in events if e["kind"] == "compute" and e["t0"] >= start
    )


def main() -> int:
    from afd_models.tiny import BENCHMARK_MOE, tiny_checkpoint
    from afd_plugin.deploy.servers import (
        SHARED_CORES,
        Server,
        ServerSpec,
        free_port,
        local_deployment,
        running,
        scale_out_deployment,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--shapes", default="one,tp2,replicas,group", help="which deployments")
    a = ap.parse_args()
    shapes = {
        "one": ("2A, 1 FFN rank", [1]),
        "tp2": ("2A, 1 FFN rank over TP 2", [2]),
        "replicas": ("2A, 2 FFN replicas", [1, 1]),
        "group": ("2A, 2 FFN ranks, 1 group", "group"),
    }
    keys = ["one", *(k for k in a.shapes.split(",") if k != "one")]  # one: the baseline
    for key in keys:
        if key not in shapes:
            ap.error(f"--shapes: {key!r} is unknown; allowed: {', '.join(shapes)}")
    spec = BENCHMARK_MOE
    model = str(tiny_checkpoint(spec))
    logs = Path(tempfile.mkdtemp(prefix="afd-scale-out-"))
    common = ["--max-num-seqs", str(a.batch), "--max-model-len", "256"]

    def tpot(url: str) -> float:
        short = batch_seconds(url, a.batch, SHORT)
        long = batch_seconds(url, a.batch, SHORT + a.tokens)
        return (long - short) / a.tokens

    dev = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause and /resume for one batch per step
    results: dict[str, tuple[float, float | None]] = {}
    colo = Server(
        ServerSpec("colocated", model, free_port(), extra_args=common, env={**SHARED_CORES, **dev}),
        logs,
    )
    with running([colo], timeout=600):
        batch_seconds(colo.url, 4, 4)
        results["colocated"] = (statistics.median(tpot(colo.url) for _ in range(a.reps)), None)
    for key in keys:
        name, ffn = shapes[key]
        trace = str(logs / f"trace-{len(results)}")
        env = {"AFD_STEP_TRACE": trace, **dev}
        if ffn == "group":
            d = local_deployment(model, logs, attention_ranks=2, ffn_ranks=2, env=env, tag="group-")
            servers = [d["ffn"], d["attention"]]
        else:
            servers = scale_out_deployment(
                model, logs, attention=[2], ffn=ffn, env=env, tag=f"{ffn}-"
            )
        for s in servers:
            s.spec.extra_args += common
        with running(servers, timeout=900):
            att = servers[-1]
            batch_seconds(att.url, 4, 4)
            start = time.monotonic()
            t = statistics.median(tpot(att.url) for _ in range(a.reps))
            results[name] = (t, compute_per_layer(trace, start))
    print(
        f"Qwen3-MoE hidden {spec.hidden_size}, {spec.num_experts} experts top-{spec.top_k}, "
        f"{spec.num_layers} layers, fp32; batch {a.batch}, {a.tokens} tokens, median of "
        f"{a.reps}; every server shares this machine's cores"
    )
    print("config | TPOT ms | vs colocated | vs 1 FFN rank | FFN compute per layer ms")
    colo_t, one = results["colocated"][0], results["2A, 1 FFN rank"][0]
    for name, (t, c) in results.items():
        comp = f"{c * 1e3:.2f}" if c is not None else ""
        print(f"{name:26s} | {t * 1e3:7.2f} | {t / colo_t:5.2f} | {t / one:5.2f} | {comp}")
    print(f"logs and timelines: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

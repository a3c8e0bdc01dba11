"""Decode at real contexts: TPOT and throughput of AFD (m = 1, 2, auto) against colocated,
with vLLM's DecodeBenchConnector standing in for the prefill.

Qwen3-MoE hidden 1024, 16 experts top-2, 4 layers, fp32, random weights (the benchmarks'
model, afd_models.tiny.BENCHMARK_MOE), served with --max-model-len above the longest
context. Every server that holds a KV cache (the colocated one and the AFD attention server)
runs vLLM's DecodeBenchConnector (`kv_role: kv_both`, `startup_fill`: the whole KV cache
filled with dummy values once at start-up), so a prompt of C tokens is admitted with C - 1
of them reported as already computed by the connector and only its last token computed: no
prefill, and every decode step attends over the full context. The run checks this from each
server's own counters (vLLM's prompt_tokens_by_source: local_compute must be one token per
request). Prefix caching is off and every prompt is fresh random token ids.

Colocated uses cores 0-1 (two threads); the AFD attention server core 0 and the FFN server
core 1 (one thread each); the attention server starts DBO-capable (thresholds 4 tokens) and
switches m at run time through vLLM's dev endpoint. For each context C and batch B one
measurement is a batch of B requests added while the scheduler is paused (so every step holds
all of them), N output tokens each. TPOT: vLLM's own per-request time per output token
(its request_time_per_output_token histogram, (last token - first token) / (N - 1)), the
mean over the batch; decode throughput = B / TPOT. The configs run in turn, their order
rotated by one each repetition; auto gets one untimed batch at each point first (its tuner).

Where the time goes, from the AFD step timelines (AFD_STEP_TRACE) of each timed batch: per
decode step of the attention rank (start to next start): attention = its forward step less
its waits on the FFN rank; FFN = the FFN rank's layer computations inside that step;
exchange = the waits less that FFN compute (transfer and wake-up; below zero where micro-
batches hide FFN compute under attention); idle = the time between forward steps (scheduler,
sampling, output). The four add up to the step interval. FFN rank idle: the share of the
step interval in which the FFN rank computes nothing (its core waits for the attention side).

KV: 8 KiB per token (4 layers x K, V x 2 KV heads x 128 x fp32); each KV server gets
--kv-gib of KV cache (VLLM_CPU_KVCACHE_SPACE); a batch whose B x (C + N) tokens do not fit in
85 % of it is capped to the largest power of two that fits (printed).

    uv run --no-sync python benchmarks/decode_context.py [--context 1024 4096 8192]
        [--batch 1 8 32 128] [--tokens 16] [--reps 2] [--kv-gib 5] [--out run.json]
    uv run --no-sync python benchmarks/decode_context.py --from-json run.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

CONFIGS = ("colocated", "1", "2", "auto")  # the AFD configs: the m given to the server
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 128 * 4
BLOCK = 128  # vLLM's CPU block size: allocation rounds each request up to it
FILL = 0.85  # share of the KV cache a batch may take (vLLM gets 0.90-0.99 of it as blocks)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kv-gib", type=int, default=5, help="KV cache of each KV server, GiB")
    ap.add_argument("--out", type=Path, help="write the raw samples here (JSON)")
    ap.add_argument(
        "--from-json", type=Path, help="print the table of a run's --out file, run nothing"
    )
    a = ap.parse_args(argv)
    if min(a.context) < 2 or min(a.batch) < 1 or a.tokens < 2 or a.reps < 1 or a.kv_gib < 1:
        ap.error("--context >= 2, --batch >= 1, --tokens >= 2, --reps >= 1, --kv-gib >= 1")
    return a


def fits(batch: int, context: int, tokens: int, kv_gib: int) -> bool:
    blocks = -(-(context + tokens) // BLOCK)
    return batch * blocks * BLOCK * KV_BYTES_PER_TOKEN <= FILL * kv_gib * 2**30


def points(a: argparse.Namespace) -> list[tuple[int, int, int | None]]:
    """(context, batch, the largest asked batch capped to it, else None) in run order, each
    asked batch capped to the largest power of two whose KV fits."""
    out = []
    for c in a.context:
        runs: dict[int, int | None] = {}
        for b in sorted(a.batch):
            run = b
            while run > 1 and not fits(run, c, a.tokens, a.kv_gib):
                run = 1 << (run.bit_length() - 1) if run & (run - 1) else run // 2
            if run != b or run not in runs:
                runs[run] = b if run != b else None
        out += [(c, run, asked) for run, asked in runs.items()]
    return out


def kv_config() -> str:
    return json.dumps(
        {
            "kv_connector": "DecodeBenchConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"startup_fill": True, "fill_mean": 0.015},
        }
    )


def servers(model: str, logs: Path, a: argparse.Namespace, trace: str):
    """colocated, FFN and attention servers, not started."""
    from afd_plugin.deploy.servers import Server, ServerSpec, free_port

    max_len = max(a.context) + a.tokens + 8
    common = ["--max-num-seqs", str(max(a.batch)), "--no-enable-prefix-caching"]
    common += ["--hf-overrides", json.dumps({"max_position_embeddings": max_len})]
    kv = ["--kv-transfer-config", kv_config()]
    kv_env = {"VLLM_CPU_KVCACHE_SPACE": str(a.kv_gib), "VLLM_SERVER_DEV_MODE": "1"}
    one = {"OMP_NUM_THREADS": "1", "AFD_STEP_TRACE": trace}
    afd = {"port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": 1}

    def spec(name, role, args, env):
        return Server(
            ServerSpec(
                name,
                model,
                free_port(),
                afd={**afd, "role": role} if role else None,
                max_model_len=max_len,
                extra_args=common + args,
                env=env,
                log_stats=role != "ffn",
            ),
            logs,
        )

    colo = spec(
        "colocated",
        None,
        kv,
        {**kv_env, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"},
    )
    ffn = spec("ffn", "ffn", [], {"VLLM_CPU_OMP_THREADS_BIND": "1", **one})
    dbo = ["--enable-dbo", "--dbo-decode-token-threshold", "4"]
    dbo += ["--dbo-prefill-token-threshold", "4"]
    att = spec(
        "attention", "attention", kv + dbo, {**kv_env, "VLLM_CPU_OMP_THREADS_BIND": "0", **one}
    )
    return colo, ffn, att


def counters(url: str) -> dict[str, float]:
    """The vLLM counters this benchmark reads, from /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"(vllm:[a-z_]+)\{([^}]*)\} (\S+)$", line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name in (
            "vllm:request_time_per_output_token_seconds_sum",
            "vllm:request_time_per_output_token_seconds_count",
        ):
            out[name.rsplit("_", 1)[1]] = float(value)
        elif name == "vllm:prompt_tokens_by_source_total":
            source = re.search(r'source="([a-z_]+)"', labels).group(1)
            out[source] = float(value)
    return out


def prompts(rng: random.Random, batch: int, context: int) -> list[list[int]]:
    """Fresh random token ids (the vocabulary is 512; 0-2 are special)."""
    return [[rng.randrange(3, 500) for _ in range(context)] for _ in range(batch)]


def run_batch(url: str, rng, batch: int, context: int, tokens: int) -> dict:
    """One timed batch: mean TPOT, the tokens computed and filled, wall seconds and window."""
    from afd_plugin.deploy.servers import complete_batch

    ps = prompts(rng, batch, context)
    before = counters(url)
    _, seconds = complete_batch(url, ps, tokens, stagger=0)
    end = time.monotonic()
    after = counters(url)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if d["count"] != batch:
        raise RuntimeError(f"{url}: {d['count']:.0f} requests counted, {batch} sent")
    return {
        "tpot": d["sum"] / d["count"],
        "computed": d.get("local_compute", 0.0),
        "filled": d.get("external_kv_transfer", 0.0),
        "seconds": seconds,
        "window": (end - seconds, end),
    }


def _events(path: Path, start: float, end: float) -> list[tuple[str, float, float]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if start <= e["t0"] and e["t1"] <= end:
            out.append((e["kind"], e["t0"], e["t1"]))
    return out


def split(trace: str, start: float, end: float) -> dict[str, float] | None:
    """Median per decode step of attention, exchange, FFN and idle (seconds), from the
    timelines in [start, end]; the first step (the prompt's last token) left out."""
    att = _events(Path(f"{trace}.attention0.jsonl"), start, end)
    ffn = [(t0, t1) for k, t0, t1 in _events(Path(f"{trace}.ffn0.jsonl"), start, end)
           if k == "compute"]  # fmt: skip
    steps = sorted((t0, t1) for k, t0, t1 in att if k == "step")[1:]
    waits = [(t0, t1) for k, t0, t1 in att if k == "wait"]
    parts: dict[str, list[float]] = {"attention": [], "exchange": [], "ffn": [], "idle": []}
    parts["interval"] = []
    for (t0, t1), (n0, _) in zip(steps, steps[1:], strict=False):
        waited = sum(b - a for a, b in waits if t0 <= a and b <= t1)
        computed = sum(b - a for a, b in ffn if t0 <= a and b <= t1)
        parts["attention"].append(t1 - t0 - waited)
        parts["ffn"].append(computed)
        parts["exchange"].append(waited - computed)
        parts["idle"].append(n0 - t1)
        parts["interval"].append(n0 - t0)
    if not parts["interval"]:
        return None
    return {k: statistics.mean(v) for k, v in parts.items()}


def rotated(rep: int) -> list[str]:
    s = rep % len(CONFIGS)
    return list(CONFIGS[s:] + CONFIGS[:s])


def main(argv: list[str] | None = None) -> int:
    from afd_models.tiny import BENCHMARK_MOE, tiny_checkpoint
    from afd_plugin.deploy.servers import collective_rpc, running

    a = parse_args(argv)
    if a.from_json:
        saved = json.loads(a.from_json.read_text())
        a = argparse.Namespace(**saved["args"])
        plan = [tuple(p) for p in saved.get("done", points(a))]
        report(a, plan, saved["samples"], saved["minutes"], saved["logs"])
        return 0
    plan = points(a)
    model = str(tiny_checkpoint(BENCHMARK_MOE))
    logs = Path(tempfile.mkdtemp(prefix="afd-decode-context-"))
    trace = str(logs / "trace")
    colo, ffn, att = servers(model, logs, a, trace)
    url = {"colocated": colo.url, "1": att.url, "2": att.url, "auto": att.url}
    rng = random.Random(0)
    samples: dict[str, list[dict]] = {}
    t_start = time.monotonic()
    done: list[tuple[int, int, int | None]] = []  # points with every repetition measured

    def save() -> float:
        minutes = (time.monotonic() - t_start) / 60
        if a.out:  # --from-json prints the table again from this (after every point)
            args = vars(a) | {"out": str(a.out), "from_json": None}
            saved = {"args": args, "samples": samples, "minutes": minutes, "logs": str(logs)}
            saved["done"] = done
            a.out.write_text(json.dumps(saved))
        return minutes

    try:
        with running([colo, ffn, att], timeout=900):
            for u in (colo.url, att.url):  # warm-up
                run_batch(u, rng, 2, 64, 4)
            for point in plan:
                c, b, _ = point
                collective_rpc(att.url, "afd_set_microbatching", "auto")
                run_batch(att.url, rng, b, c, a.tokens)  # auto's tuner sees this size
                for rep in range(a.reps):
                    for cfg in rotated(rep):
                        if cfg != "colocated":
                            collective_rpc(att.url, "afd_set_microbatching", cfg)
                        r = run_batch(url[cfg], rng, b, c, a.tokens)
                        if cfg != "colocated":
                            r["split"] = split(trace, *r["window"])
                        samples.setdefault(f"{c}|{b}|{cfg}", []).append(r)
                        print(
                            f"  C={c} B={b} rep {rep + 1} {cfg}: TPOT {r['tpot'] * 1e3:.1f} ms",
                            flush=True,
                        )
                done.append(point)
                save()
    except Exception as exc:  # a server gone (e.g. the OOM killer): report what was measured
        print(f"stopped after {len(done)} of {len(plan)} points: {type(exc).__name__}: {exc}")
        print(f"server logs: {logs}")
        if not done:
            raise
        report(a, done, samples, save(), logs)
        return 1
    report(a, plan, samples, save(), logs)
    return 0


def report(a, plan, samples, minutes, logs) -> None:
    spec = "Qwen3-MoE hidden 1024, 16 experts top-2, 4 layers, fp32"
    print(
        f"{spec}; DecodeBenchConnector (startup fill); colocated cores 0-1, AFD 1A1F attention "
        f"core 0 + FFN core 1; {a.tokens} output tokens; median of {a.reps} reps (order "
        f"rotated); {minutes:.1f} min"
    )
    for c, b, asked in plan:
        if asked:
            print(f"  C={c}: batch {asked} capped to {b} (KV {a.kv_gib} GiB per server)")
    computed = sum(r["computed"] for rs in samples.values() for r in rs)
    filled = sum(r["filled"] for rs in samples.values() for r in rs)
    reqs = sum(int(k.split("|")[1]) * len(rs) for k, rs in samples.items())
    skipped = "prefill skipped" if computed == reqs else "PREFILL NOT SKIPPED"
    print(
        f"prefill ({skipped}): {computed:.0f} prompt tokens computed for {reqs} timed "
        f"requests, {filled:.0f} filled by the DecodeBenchConnector (vLLM's "
        "prompt_tokens_by_source counters)"
    )
    print(
        "context | batch | config | TPOT ms | vs colocated | vs AFD m=1 | decode tok/s | "
        "spread | step ms: attention / exchange / FFN / idle | FFN rank idle"
    )
    for c, b, _ in plan:
        med = {}
        for cfg in CONFIGS:
            rs = samples[f"{c}|{b}|{cfg}"]
            med[cfg] = statistics.median(r["tpot"] for r in rs)
        for cfg in CONFIGS:
            rs = samples[f"{c}|{b}|{cfg}"]
            t = [r["tpot"] for r in rs]
            spread = (max(t) - min(t)) / med[cfg]
            where = ""
            splits = [r["split"] for r in rs if r.get("split")]
            if splits:
                where = " / ".join(
                    f"{statistics.median(s[k] for s in splits) * 1e3:.1f}"
                    for k in ("attention", "exchange", "ffn", "idle")
                )
                idle = statistics.median(1 - s["ffn"] / s["interval"] for s in splits)
                where += f" | {idle:.0%}"
            name = "colocated" if cfg == "colocated" else f"AFD m={cfg}"
            vs_m1 = "" if cfg == "colocated" else f"{med[cfg] / med['1']:.2f}"
            print(
                f"{c:7d} | {b:5d} | {name:10s} | {med[cfg] * 1e3:7.1f} | "
                f"{med[cfg] / med['colocated']:5.2f} | {vs_m1:5s} | {b / med[cfg]:7.1f} | "
                f"{spread:4.0%} | {where}"
            )
    print(f"logs and timelines: {logs}")


if __name__ == "__main__":
    raise SystemExit(main())

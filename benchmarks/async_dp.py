"""Lockstep vs async DP: an attention server of two data-parallel ranks (2A1F) under skewed
load, time per output token and throughput, in one run, on one model.

Qwen3-MoE hidden 1024, 16 experts top-2, 4 layers, fp32, random weights. Two deployments
run side by side, identical but for `afd.async_dp`: one attention server with
--data-parallel-size 2, one FFN server. Each request is sent to one DP rank (vLLM's
X-data-parallel-rank header). Loads:

- one rank busy: B requests on DP rank 0, none on rank 1. In lockstep rank 1 runs a dummy
  forward (a full AFD step through the FFN rank) for every step of rank 0.
- uneven prompts: rank 1 decodes B short requests while rank 0 serves a stream of long
  prompts, prefill only (one output token each). In lockstep every decode step of rank 1
  is a step of the DP wave, so it waits for rank 0's prefill steps.

Time per output token of a request = (t(short + N tokens) - t(short tokens)) / N, the
median over the requests of the measured rank; throughput = output tokens of the measured
rank / wall time. The deployments alternate per repetition; the table prints medians and
async / lockstep ratios.

All servers share this machine's cores, so the time ratios measure core contention as much
as async DP (docs/benchmarks.md). Two things control for that:

- the work, which no core sharing changes: per output token of the measured rank, the
  forwards each attention DP rank ran (afd_steps_total on /metrics), the FFN rank's steps,
  and the CPU-seconds every process of each server used;
- `--placement ffn-own-core`: the FFN server's worker on core 1 alone and both attention DP
  workers on core 0 (default `shared`: the DP workers on cores 0 and 1, the FFN server
  unpinned, so in lockstep the idle rank's dummy forwards take the core the FFN needs).

    uv run --no-sync python benchmarks/async_dp.py [--batch 8] [--tokens 32] [--reps 3]
        [--placement shared|ffn-own-core]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

PROMPT = "Attention and the feed-forward network"
# role -> what its server's environment sets (afd_plugin.deploy.servers pins a DP server's
# workers one per core, round robin, and leaves a one-worker server unpinned)
PLACEMENTS = {
    "shared": {},
    "ffn-own-core": {
        "ffn": {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"},
        "attention": {"VLLM_CPU_OMP_THREADS_BIND": "0|0"},
    },
}
PLACEMENT_WORDS = {
    "shared": "attention DP workers on cores 0 and 1, the FFN server unpinned",
    "ffn-own-core": "the FFN server on core 1 alone, both attention DP workers on core 0",
}
# about 350 tokens with the tiny tokenizer (300 words came to more than the 512-token
# context, and the background stream died at its first request)
LONG_PROMPT = " ".join(f"word{i}" for i in range(120))
SHORT = 4


def run_load(url: str, measured: list[str], tokens: int, background: list[str]) -> tuple:
    """Requests `measured` on DP rank (load: rank 0 or 1), while `background` prompts run
    one after another on the other rank until the measured ones end. Returns (seconds of
    each measured request, wall seconds)."""
    from afd_plugin.deploy.servers import complete

    rank = 1 if background else 0
    seconds: list[float] = [0.0] * len(measured)
    done = threading.Event()

    def one(i: int) -> None:
        seconds[i] = complete(url, measured[i], tokens, data_parallel_rank=rank).seconds

    stream_errors: list[BaseException] = []
    streamed = [0]

    def stream() -> None:
        try:
            while not done.is_set():
                prompt = background[streamed[0] % len(background)]
                complete(url, prompt, 1, data_parallel_rank=0)
                streamed[0] += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller below
            stream_errors.append(exc)

    side = threading.Thread(target=stream) if background else None
    if side:
        side.start()
        time.sleep(0.5)  # the stream is under way before the measured requests arrive
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(measured))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    if side:
        side.join()
        # a load whose background died measures nothing uneven: fail, never report it
        if stream_errors or streamed[0] == 0:
            raise RuntimeError(f"the background stream failed: {stream_errors or 'no prompt'}")
    return seconds, wall


def cpu_seconds(server) -> float:
    """User + system CPU-seconds of a server's processes (API server, engine, workers)."""
    import psutil

    try:
        root = psutil.Process(server.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def work(d) -> dict:
    """What the deployment has done so far, in units no core sharing changes."""
    from afd_plugin.deploy.servers import afd_steps

    time.sleep(1.2)  # a rank publishes its counters at most once a second
    att = afd_steps(d["attention"].url, "attention")
    ffn = afd_steps(d["ffn"].url, "ffn")
    return {
        "forwards rank 0": att.get(0, 0.0),
        "forwards rank 1": att.get(1, 0.0),
        "FFN steps": sum(ffn.values()),
        "CPU-s attention": cpu_seconds(d["attention"]),
        "CPU-s FFN": cpu_seconds(d["ffn"]),
    }


def measure(d, batch: int, tokens: int, uneven: bool) -> tuple[float, float, dict]:
    """(TPOT seconds, output tokens per second, work per output token) of the measured
    rank (the uneven load's background prefills count as work, not as output)."""
    url = d["attention"].url
    prompts = [f"{PROMPT} {i}" for i in range(batch)]
    background = [f"{LONG_PROMPT} {i}" for i in range(4)] if uneven else []
    before = work(d)
    short, _ = run_load(url, prompts, SHORT, background)
    long, wall = run_load(url, prompts, SHORT + tokens, background)
    after = work(d)
    tpot = statistics.median((b - a) / tokens for a, b in zip(short, long, strict=True))
    out_tokens = batch * (2 * SHORT + tokens)
    per_token = {k: (after[k] - before[k]) / out_tokens for k in after}
    return tpot, batch * (SHORT + tokens) / wall, per_token


def main() -> int:
    from afd_models.tiny import BENCHMARK_MOE, tiny_checkpoint
    from afd_plugin.deploy.servers import local_deployment, running

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--placement", choices=sorted(PLACEMENTS), default="shared")
    a = ap.parse_args()
    for flag, value in (("--batch", a.batch), ("--tokens", a.tokens), ("--reps", a.reps)):
        if value < 1:
            ap.error(f"{flag} {value}: allowed 1 or more")
    spec = BENCHMARK_MOE
    model = str(tiny_checkpoint(spec))
    logs = Path(tempfile.mkdtemp(prefix="afd-async-dp-"))
    common = ["--max-num-seqs", str(max(a.batch, 8)), "--max-model-len", "512"]
    deployments = {}
    for name, async_dp in (("lockstep", False), ("async", True)):
        d = local_deployment(
            model, logs, attention_ranks=2, afd_extra={"async_dp": async_dp}, tag=f"{name}-"
        )
        for s in d.values():
            s.spec.extra_args += common
        for role, env in PLACEMENTS[a.placement].items():
            d[role].spec.env = {**d[role].spec.env, **env}
        deployments[name] = d
    servers = [s for d in deployments.values() for s in (d["ffn"], d["attention"])]
    loads = {"one rank busy": False, "uneven prompts": True}
    results: dict[tuple[str, str], list[tuple[float, float, dict]]] = {}
    with running(servers, timeout=900):
        for d in deployments.values():  # warm up both ranks
            for rank in (0, 1):
                from afd_plugin.deploy.servers import complete

                complete(d["attention"].url, PROMPT, 4, data_parallel_rank=rank)
        for _ in range(a.reps):
            for load, uneven in loads.items():
                for name, d in deployments.items():
                    got = measure(d, a.batch, a.tokens, uneven)
                    results.setdefault((load, name), []).append(got)
    print(
        f"Qwen3-MoE hidden {spec.hidden_size}, {spec.num_experts} experts top-{spec.top_k}, "
        f"{spec.num_layers} layers, fp32; 2A1F (attention DP 2); batch {a.batch} on the "
        f"measured rank, {a.tokens} tokens, median of {a.reps}; placement {a.placement} "
        f"({PLACEMENT_WORDS[a.placement]})"
    )
    print("load | DP | TPOT ms | tokens/s | TPOT async/lockstep | throughput async/lockstep")
    for load in loads:
        med = {
            name: tuple(statistics.median(r[i] for r in results[(load, name)]) for i in (0, 1))
            for name in deployments
        }
        for name, (tpot, tput) in med.items():
            ratios = ""
            if name == "async":
                lock = med["lockstep"]
                ratios = f" | {tpot / lock[0]:.2f} | {tput / lock[1]:.2f}"
            print(f"{load} | {name} | {tpot * 1e3:.2f} | {tput:.1f}{ratios}")
    print()
    print("work per output token of the measured rank (medians; no core sharing changes it)")
    keys = list(results[(next(iter(loads)), "lockstep")][0][2])
    print("load | DP | " + " | ".join(keys) + " | CPU-s async/lockstep")
    for load in loads:
        med = {
            name: {k: statistics.median(r[2][k] for r in results[(load, name)]) for k in keys}
            for name in deployments
        }
        for name, w in med.items():
            ratio = ""
            if name == "async":
                cpu = {n: m["CPU-s attention"] + m["CPU-s FFN"] for n, m in med.items()}
                ratio = f" | {cpu['async'] / cpu['lockstep']:.2f}"
            print(f"{load} | {name} | " + " | ".join(f"{w[k]:.3f}" for k in keys) + ratio)
    print(f"logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

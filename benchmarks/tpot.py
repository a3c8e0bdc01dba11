"""AFD vs colocated time per output token on the demo model (tiny, fp32, CPU).

Starts a colocated server and an AFD deployment (FFN + attention) side by side and, for
each prompt, times a 1-token and an N-token greedy completion on each; time per output
token = (t(N) - t(1)) / (N - 1). Prints medians and the AFD/colocated ratio. Requests are
sequential (single-sequence decode), alternating between the deployments so that machine
noise hits both alike.

    uv run --no-sync python benchmarks/tpot.py [--arch deepseek_v2] [--shape 1A1F] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

PROMPTS = [
    "The quick brown fox",
    "Attention and the feed-forward network",
    "Mixture of experts models route",
    "Hello world, this is",
]


def main() -> int:
    from afd_models.tiny import TinySpec, tiny_checkpoint
    from afd_plugin.demo import BACKENDS, _shape
    from afd_plugin.deploy.servers import complete, local_deployment, running

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="deepseek_v2", choices=sorted(BACKENDS))
    ap.add_argument("--shape", type=_shape, default=(1, 1))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    n_att, _ = a.shape
    model = str(tiny_checkpoint(TinySpec(a.arch)))
    logs = Path(tempfile.mkdtemp(prefix="afd-tpot-"))
    servers = local_deployment(
        model, logs, attention_ranks=n_att, attention_backend=BACKENDS[a.arch], baseline=True
    )
    colo, att = servers["colocated"], servers["attention"]
    per = {"colocated": [], "afd": []}
    with running(list(servers.values())):
        for url in (colo.url, att.url):  # warm-up
            complete(url, "warm up", 8)
        for _ in range(a.reps):
            for p in PROMPTS:
                for name, url in (("colocated", colo.url), ("afd", att.url)):
                    one_tok = complete(url, p, 1)
                    full = complete(url, p, a.tokens)
                    per[name].append((full.seconds - one_tok.seconds) / (a.tokens - 1))
    c, f = statistics.median(per["colocated"]), statistics.median(per["afd"])
    print(
        f"{a.arch}, AFD {n_att}A1F vs colocated, {len(PROMPTS)} prompts x {a.reps} reps, "
        f"{a.tokens} tokens, fp32, 2-core CPU"
    )
    print(
        f"  time per output token  colocated: {c * 1e3:.2f} ms   AFD: {f * 1e3:.2f} ms   "
        f"ratio AFD/colocated: {f / c:.2f}"
    )
    print(
        f"  AFD extra per token: {(f - c) * 1e3:.2f} ms over "
        f"{TinySpec(a.arch).num_layers} exchanged layers (logs: {logs})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

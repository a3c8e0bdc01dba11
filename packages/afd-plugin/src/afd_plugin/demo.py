"""`afd demo`: a real AFD deployment on this machine, next to a colocated server.

Builds a tiny checkpoint (cached), starts an FFN server and an attention server (and a
colocated baseline) on free localhost ports, sends prompts through the OpenAI API, prints
the completions, the time per output token of each and whether the tokens matched, and
stops every process it started on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_PROMPTS = [
    "The quick brown fox",
    "Attention and the feed-forward network",
    "Mixture of experts models route",
    "Hello world, this is",
]
BACKENDS = {"deepseek_v2": "CPU_MLA", "deepseek_v3": "CPU_MLA", "qwen3_moe": None}


def _shape(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)[aA](\d+)[fF]", text.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: expected <A>A<F>F with A, F >= 1, for example 1A1F or 2A1F"
        )
    return int(m.group(1)), int(m.group(2))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--arch",
        choices=sorted(BACKENDS),
        default="deepseek_v2",
        help="tiny model architecture (default: deepseek_v2)",
    )
    p.add_argument(
        "--shape",
        type=_shape,
        default=(1, 1),
        metavar="AxF",
        help="attention:FFN ranks, e.g. 1A1F (default), 2A1F (attention data parallel 2) or "
        "2A2F (also FFN data parallel 2: one expert group)",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per prompt")
    p.add_argument(
        "--prompt",
        action="append",
        dest="prompts",
        help="a prompt (repeatable; default: four built-in prompts)",
    )
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the colocated server (no timing or token comparison)",
    )
    p.add_argument("--log-dir", type=Path, help="server logs (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=600, help="start-up timeout in seconds")


def _progress(msg: str) -> None:
    print(f"  .. {msg}", flush=True)


def _tpot(url: str, prompts: list[str], max_tokens: int) -> tuple[list, float]:
    """Completions, and the median time per output token: (t(N) - t(1)) / (N - 1)."""
    from afd_plugin.deploy.servers import complete

    outs, per_token = [], []
    for p in prompts:
        one = complete(url, p, 1)
        full = complete(url, p, max_tokens)
        outs.append(full)
        if max_tokens > 1:
            per_token.append((full.seconds - one.seconds) / (max_tokens - 1))
    return outs, statistics.median(per_token) if per_token else float("nan")


def run(args) -> int:
    from afd_core.topology import TopologyError, validate_point_to_point
    from afd_models.tiny import TinySpec, tiny_checkpoint
    from afd_plugin.deploy.servers import local_deployment, running

    a, f = args.shape
    try:
        validate_point_to_point(a, f)
    except TopologyError as exc:
        print(f"afd demo: --shape {a}A{f}F: {exc}", file=sys.stderr)
        return 2
    if args.max_tokens < 1:
        print(f"afd demo: --max-tokens {args.max_tokens}: allowed 1 or more", file=sys.stderr)
        return 2
    prompts = args.prompts or DEFAULT_PROMPTS
    print(f"[1/4] tiny {args.arch} checkpoint", flush=True)
    t0 = time.monotonic()
    model = str(tiny_checkpoint(TinySpec(args.arch)))
    print(f"  .. {model} ({time.monotonic() - t0:.1f}s)", flush=True)

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="afd-demo-"))
    deployment = local_deployment(
        model,
        log_dir,
        attention_ranks=a,
        ffn_ranks=f,  # F > 1: one FFN server whose ranks are one expert group
        attention_backend=BACKENDS[args.arch],
        baseline=not args.no_baseline,
    )
    servers = list(deployment.values())
    att = deployment["attention"]
    print(
        f"[2/4] starting {a}A{f}F: {', '.join(s.spec.name for s in servers)} (logs: {log_dir})",
        flush=True,
    )
    t0 = time.monotonic()
    with running(servers, timeout=args.timeout, progress=_progress):
        print(f"  .. all healthy after {time.monotonic() - t0:.0f}s", flush=True)
        print(f"[3/4] {len(prompts)} prompts x {args.max_tokens} tokens (greedy, fp32)", flush=True)
        afd_out, afd_tpot = _tpot(att.url, prompts, args.max_tokens)
        base_out, base_tpot = (None, None)
        if not args.no_baseline:
            base_out, base_tpot = _tpot(deployment["colocated"].url, prompts, args.max_tokens)
    print("[4/4] results", flush=True)
    for i, (p, o) in enumerate(zip(prompts, afd_out, strict=True)):
        line = f"  {p!r} -> {o.text!r}"
        if base_out is not None:
            line += "  [same tokens]" if base_out[i].token_ids == o.token_ids else "  [DIFFERENT]"
        print(line)
    print(f"\n  time per output token   AFD {a}A{f}F: {afd_tpot * 1e3:.2f} ms", end="")
    if base_out is None:
        print()
        return 0
    matched = all(b.token_ids == o.token_ids for b, o in zip(base_out, afd_out, strict=True))
    print(
        f"   colocated: {base_tpot * 1e3:.2f} ms   ratio AFD/colocated: {afd_tpot / base_tpot:.2f}"
    )
    print(f"  tokens matched the colocated server: {'yes' if matched else 'NO'}")
    return 0 if matched else 1


def main(args) -> int:
    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\nafd demo: interrupted; every server it started was stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a demo reports, it does not dump a traceback
        from afd_plugin.deploy.servers import ServerError

        if not isinstance(exc, ServerError):
            raise
        print(f"afd demo: {exc}", file=sys.stderr)
        return 1

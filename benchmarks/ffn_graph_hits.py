"""How often an FFN rank shared by independent attention servers can replay a graph: 2A1F
and 4A1F, each attention rank a server of its own, over the NCCL stand-in (CPU).

Each attention server captures its decode sizes (vLLM's FULL_DECODE_ONLY: 1, 2, 4, 8, 16,
24, 32 rows), then runs decode steps of a random batch size 1..32 padded to the next
captured size, as vLLM pads a decode batch to replay a graph. The servers step on their
own, so the FFN rank's steps hold whichever servers announced together. A step replays a
whole-step graph only when its key (rows per peer) was captured; every other step runs
layer by layer, where each layer's compute either replays a layer graph captured at a
padded row count (afd_core.step.ffn_buckets) or runs eagerly.

Printed per shape, in one run: FFN steps, the fraction replayed whole, and the fraction of
layer computations of the other steps that replayed a layer graph, with and without the
layer graphs (the baseline: whole-step graphs only). Counts only: the stand-in's graphs
are recorded operations, so no time is claimed here.

    uv run --no-sync python benchmarks/ffn_graph_hits.py [--steps 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32)


def padded(n: int) -> int:
    return next(s for s in CAPTURE_SIZES if s >= n)


def attention_server(rank, a, port, steps, seed, q):
    """One attention server of one rank: its captures, then `steps` decode steps."""
    try:
        import torch
        from tests.afd_core.gloo_harness import HIDDEN, LAYERS, make

        from afd_core.connectors.protocol.control import ControlFlag
        from afd_core.step.attention import AttentionStepDriver

        conn = make("attention", rank, a, 1, port, timeout=30.0)
        conn.steps_with = rank  # a server of its own: it steps when it has work
        conn.init()
        rt = conn.runtime
        driver = AttentionStepDriver(conn)
        rng = random.Random(seed * 100 + rank)

        def job(n, capture):
            def run():
                graph = rt.capture([]) if capture else None
                if graph is not None:
                    graph.__enter__()
                try:
                    h = torch.zeros(n, HIDDEN)
                    for layer in range(LAYERS):
                        h = conn.start_exchange(h + 1, layer, 0).wait()
                    return h
                finally:
                    if graph is not None:
                        graph.__exit__(None, None, None)

            return run

        for n in CAPTURE_SIZES:
            driver.run((n,), [job(n, True)], flags=ControlFlag.CAPTURE)
        for _ in range(steps):
            n = padded(rng.randint(1, 32))
            driver.run((n,), [job(n, False)])
            if rng.random() < 0.1:
                time.sleep(rng.random() * 0.002)  # servers drift apart now and then
        driver.close()
        conn.close()
        q.put((("attention", rank), "ok"))
    except Exception:  # noqa: BLE001
        q.put((("attention", rank), "ERROR " + traceback.format_exc()))


def run_shape(a: int, steps: int, seed: int, buckets: bool) -> dict:
    from tests.afd_core import test_step_protocol as step_protocol
    from tests.afd_core.gloo_harness import LAYERS, free_port, run_processes

    os.environ["AFD_TEST_CONNECTOR"] = "nccl"
    os.environ["AFD_TEST_FFN_GRAPHS"] = "1"
    if buckets:
        os.environ["AFD_TEST_FFN_BUCKETS"] = str(a * max(CAPTURE_SIZES))
    else:
        os.environ.pop("AFD_TEST_FFN_BUCKETS", None)
    port = free_port()
    targets = [(step_protocol.ffn_main, 0, a, 1, port, LAYERS, 30.0, [])]
    targets += [(attention_server, r, a, port, steps, seed) for r in range(a)]
    results = run_processes(targets, timeout=600)
    errors = [v for v in results.values() if isinstance(v, str) and v.startswith("ERROR")]
    if errors:
        raise RuntimeError("\n".join(errors))
    return results[("ffn", 0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="decode steps per attention server")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{args.steps} decode steps per attention server, capture sizes {CAPTURE_SIZES}")
    print("shape  layer graphs  FFN steps  whole-step replays  layers replayed (other steps)")
    for a in (2, 4):
        for buckets in (False, True):
            ffn = run_shape(a, args.steps, args.seed, buckets)
            g = ffn["graphs"]
            real = g["replayed"] + g["eager"]  # the captures are not served steps
            b = ffn.get("buckets")
            layers = (
                f"{b['replayed'] / max(b['replayed'] + b['eager'], 1):.2f} "
                f"({b['replayed']} of {b['replayed'] + b['eager']}; "
                f"{b['padded_rows']} padding rows)"
                if b
                else "0.00 (all eager)"
            )
            print(
                f"{a}A1F   {'yes' if buckets else 'no ':<12}  {real:9d}  "
                f"{g['replayed'] / max(real, 1):18.2f}  {layers}"
            )


if __name__ == "__main__":
    main()

"""What served_together's per-step check costs an attention server, against what vLLM's
own per-step DP synchronisation already costs it.

(V) vLLM: `_run_ar` (v1/worker/dp_utils.py), one all-reduce of a 4 x dp_size int32 tensor
    over the DP group, every step of a lockstep DP server;
(S) AFD: `ServedTogether`'s gather (afd_core/step/served_together.py), one all-reduce of a
    dp_size int32 vector, every step of a DP attention server whose FFN ranks are expert
    groups.

`dp` local processes on one gloo group (as vLLM's DP CPU group on one host), each one
thread, interleaved iteration by iteration. Prints medians in microseconds and S / V.

    uv run --no-sync python benchmarks/served_together.py [--dp 2] [--iters 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from afd_core.net import free_port


def worker(rank: int, size: int, port: int, iters: int, q) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from afd_core.step.served_together import gather_over

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=60))
    group = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=60))
    gather = gather_over(group, rank, size)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM

    def vllm_like():
        t = torch.zeros(4, size, dtype=torch.int32)
        t[0][rank], t[1][rank], t[2][rank], t[3][rank] = 7, 8, 0, 0
        group.allreduce([t], opts).wait()

    times = {"V": [], "S": []}
    for i in range(iters + 50):
        for name, op in (("V", vllm_like), ("S", lambda: gather(1))):
            t0 = time.perf_counter()
            op()
            if i >= 50:  # warm-up
                times[name].append(time.perf_counter() - t0)
    q.put((rank, {k: statistics.median(v) * 1e6 for k, v in times.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(r, args.dp, port, args.iters, q)) for r in range(args.dp)
    ]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    v = statistics.median(r["V"] for r in results.values())
    s = statistics.median(r["S"] for r in results.values())
    print(f"dp {args.dp}, {args.iters} iterations, median per call over the ranks:")
    print(f"  vLLM's per-step DP all-reduce (4 x dp int32): {v:8.1f} us")
    print(f"  served_together's gather (dp int32):          {s:8.1f} us")
    print(f"  S / V: {s / v:.2f}")


if __name__ == "__main__":
    main()

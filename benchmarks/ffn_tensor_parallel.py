"""How the rows reach every worker of an FFN rank over tensor parallel 2: the two choices.

(A) leader: the attention rank sends its rows to TP rank 0, which forwards them to TP rank 1
    (what AFD does, afd_core/step/ffn_tp.py);
(B) fan-out: the attention rank sends its rows to both TP ranks.

Three local processes on AFD's gloo transport (attention, TP rank 0, TP rank 1), each one
thread; per iteration the attention side sends the rows and waits for a one-byte
acknowledgement from both TP ranks, so both paths are timed the same way, interleaved
iteration by iteration. Prints medians in microseconds and B / A per size.

    uv run --no-sync python benchmarks/ffn_tensor_parallel.py [--iters 200]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from afd_core.net import free_port

HIDDEN = 2048
ROWS = (1, 16, 64, 256)
ATT, TP0, TP1 = 2, 0, 1  # group ranks


def worker(group_rank: int, port: int, iters: int, q) -> None:
    import torch

    from afd_core.connectors.transports.gloo import GlooTransport

    torch.set_num_threads(1)
    t = GlooTransport("127.0.0.1", port, "bench", group_rank, 3, group_rank == TP0, 60, 60)
    t.connect()
    ack = torch.zeros(1, dtype=torch.uint8)
    times: dict = {}
    for rows in ROWS:
        buf = torch.randn(rows, HIDDEN).to(torch.bfloat16)
        for i in range(iters + 10):
            for path in ("A", "B"):
                tag = 0 if path == "A" else 1
                if group_rank == ATT:
                    t0 = time.perf_counter()
                    if path == "A":
                        t.send(buf, TP0, tag)
                    else:
                        handles = [t.isend(buf, TP0, tag), t.isend(buf, TP1, tag)]
                        for h in handles:
                            h.wait()
                    t.recv(ack, TP0, 9)
                    t.recv(ack, TP1, 9)
                    if i >= 10:
                        times.setdefault((rows, path), []).append(time.perf_counter() - t0)
                elif group_rank == TP0:
                    t.recv(buf, ATT, tag)
                    if path == "A":
                        t.send(buf, TP1, tag)
                    t.send(ack, ATT, 9)
                else:
                    t.recv(buf, TP0 if path == "A" else ATT, tag)
                    t.send(ack, ATT, 9)
    t.barrier("bench/done", 3, 60)
    if group_rank == ATT:
        q.put({k: statistics.median(v) for k, v in times.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, a.iters, q)) for r in (TP0, TP1, ATT)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join(30)
    print(f"hidden {HIDDEN}, bf16, median of {a.iters} (µs), rows on both TP ranks + ack")
    print("rows | bytes | A: via TP rank 0 | B: to both | B / A")
    for rows in ROWS:
        ta, tb = res[(rows, "A")], res[(rows, "B")]
        kib = rows * HIDDEN * 2 / 1024
        print(f"{rows:4d} | {kib:6.0f} KiB | {ta * 1e6:8.0f} | {tb * 1e6:8.0f} | {tb / ta:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

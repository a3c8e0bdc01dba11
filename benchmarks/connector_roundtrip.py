"""Connector round trip vs raw gloo send/recv of the same tensors, in the same run.

Two local processes: an "attention" side that sends h[rows, hidden] and receives the reply
into the same buffer, and an "FFN" side that echoes it. Baseline: the same exchange with
raw torch.distributed gloo send/recv on a group of its own (the FFN side receiving into a
preallocated buffer), interleaved iteration by iteration with the AFD exchange. Measured: the AFD connector's per-layer exchange (send_attn_output +
recv_ffn_output, with recv_attn_output + send_ffn_output on the FFN side). Prints medians,
p99 and the ratio per size.

    uv run --no-sync python benchmarks/connector_roundtrip.py [--iters 200] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

HIDDENS = (2048, 7168)
ROWS = (1, 4, 16, 64, 256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pctl(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def connector(role, port, hidden, layers):
    from afd_core.config import parse_afd_config
    from afd_core.connectors.base import WireSpec
    from afd_core.connectors.factory import build_connector

    cfg = parse_afd_config({"role": role, "port": port}, device_type="cpu")
    conn = build_connector(cfg, 0, WireSpec(hidden, "bfloat16", layers, max_tokens=1 << 16))
    conn.init()
    return conn


def side(role, ports, raw_port, iters, q):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = {}
    is_ffn = role == "ffn"
    store = dist.TCPStore("127.0.0.1", raw_port, 2, is_ffn, timeout=datetime.timedelta(seconds=60))
    raw = dist.ProcessGroupGloo(store, 0 if is_ffn else 1, 2, datetime.timedelta(seconds=60))
    peer = 1 if is_ffn else 0
    warm = 10
    for hidden, port in zip(HIDDENS, ports, strict=True):
        conn = connector(role, port, hidden, layers=iters + warm)
        for rows in ROWS:
            h = torch.randn(rows, hidden).to(torch.bfloat16)
            raw_t, afd_t = [], []
            # raw and AFD exchanges interleaved, so machine noise hits both alike; the AFD
            # side is one step (one control message) of iters + warm layers
            if is_ffn:
                conn.recv_control()
            else:
                conn.send_control((rows,))
            for i in range(iters + warm):
                if is_ffn:
                    raw.recv([h], peer, 0).wait()
                    raw.send([h], peer, 0).wait()
                    b = conn.recv_attn_output(i)
                    conn.send_ffn_output(b.hidden_states, i)
                    continue
                t0 = time.perf_counter()
                raw.send([h], peer, 0).wait()
                raw.recv([h], peer, 0).wait()
                t1 = time.perf_counter()
                conn.send_attn_output(h, i)
                conn.recv_ffn_output(h, i)
                t2 = time.perf_counter()
                if i >= warm:
                    raw_t.append(t1 - t0)
                    afd_t.append(t2 - t1)
            results[("raw", hidden, rows)] = raw_t
            results[("afd", hidden, rows)] = afd_t
        ctrl = []  # a whole one-layer step: control message + one 1-row exchange
        h1 = torch.zeros(1, hidden, dtype=torch.bfloat16)
        for _ in range(iters):
            if is_ffn:
                conn.recv_control()
                b = conn.recv_attn_output(0)
                conn.send_ffn_output(b.hidden_states, 0)
                continue
            t0 = time.perf_counter()
            conn.send_control((1,))
            conn.send_attn_output(h1, 0)
            conn.recv_ffn_output(h1, 0)
            ctrl.append(time.perf_counter() - t0)
        results[("step", hidden, 0)] = ctrl
        raw.barrier().wait()
        if not is_ffn:
            conn.close()  # says goodbye: the FFN side sees every peer leave
        else:
            conn.recv_control()
            conn.close()
    if not is_ffn:
        q.put({f"{k[0]}|{k[1]}|{k[2]}": v for k, v in results.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports, raw_port = [free_port() for _ in HIDDENS], free_port()
    procs = [
        ctx.Process(target=side, args=(r, ports, raw_port, a.iters, q))
        for r in ("ffn", "attention")
    ]
    for p in procs:
        p.start()
    res = q.get(timeout=1800)
    for p in procs:
        p.join(60)
    print(f"connector round trip vs raw gloo (bf16, {a.iters} iterations, medians / p99 in us)")
    print(
        f"{'hidden':>6} {'rows':>5} {'bytes':>9} {'raw med':>8} {'afd med':>8} {'raw p99':>8} "
        f"{'afd p99':>8} {'ratio':>6} {'added':>7}"
    )
    for hidden in HIDDENS:
        for rows in ROWS:
            raw = res[f"raw|{hidden}|{rows}"]
            afd = res[f"afd|{hidden}|{rows}"]
            rm, am = statistics.median(raw) * 1e6, statistics.median(afd) * 1e6
            print(
                f"{hidden:>6} {rows:>5} {rows * hidden * 2:>9} {rm:>8.1f} {am:>8.1f} "
                f"{pctl(raw, 0.99) * 1e6:>8.1f} {pctl(afd, 0.99) * 1e6:>8.1f} {am / rm:>6.2f} "
                f"{am - rm:>+7.1f}"
            )
        step = res[f"step|{hidden}|0"]
        one_row = statistics.median(res[f"afd|{hidden}|1"]) * 1e6
        print(
            f"{hidden:>6}  one-layer step incl. control message: median "
            f"{statistics.median(step) * 1e6:.1f} us (control adds "
            f"{statistics.median(step) * 1e6 - one_row:+.1f} us), p99 {pctl(step, 0.99) * 1e6:.1f} us"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The connector round-trip sweep: AFD's per-layer exchange vs raw gloo send/recv.

Two local processes: an "attention" side that sends h[rows, hidden] (bf16) and receives
the reply into the same buffer, and an "FFN" side that echoes it. Each size is measured
both ways, iteration by iteration interleaved (so machine noise hits both alike): the AFD
connector's exchange (start_exchange(...).wait(); recv_attn_output, a copy into an output
buffer and send_ffn_output on the FFN side) and raw torch.distributed gloo send/recv on a group of
its own. Also a whole one-layer step with its control message. A least-squares line
through the AFD one-way times (round trip / 2) gives the link's latency and bandwidth.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass

WARMUP = 10


@dataclass(frozen=True)
class SweepPoint:
    hidden: int
    rows: int
    nbytes: int
    raw_s: list[float]  # round trips
    afd_s: list[float]


def spread(xs: list[float]) -> dict:
    """median, p10, p90, p99, min, max of a sample."""
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, int(p * len(s)))]

    return {
        "median": statistics.median(s),
        "p10": q(0.10),
        "p90": q(0.90),
        "p99": q(0.99),
        "min": s[0],
        "max": s[-1],
        "n": len(s),
    }


def _connector(role, port, hidden, layers):
    from afd_core.config import parse_afd_config
    from afd_core.connectors.base import WireSpec
    from afd_core.connectors.factory import build_connector

    cfg = parse_afd_config({"role": role, "port": port}, device_type="cpu")
    conn = build_connector(cfg, 0, WireSpec(hidden, "bfloat16", layers, max_tokens=1 << 16))
    conn.init()
    return conn


def _close(conn, is_ffn: bool) -> None:
    if is_ffn:
        conn.recv_control()  # sees the peer leave
    conn.close()  # the attention side says goodbye


def _side(role, ports, raw_port, hiddens, rows_list, iters, q):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = {}
    is_ffn = role == "ffn"
    store = dist.TCPStore("127.0.0.1", raw_port, 2, is_ffn, timeout=datetime.timedelta(seconds=60))
    raw = dist.ProcessGroupGloo(store, 0 if is_ffn else 1, 2, datetime.timedelta(seconds=60))
    peer = 1 if is_ffn else 0
    for hidden, (port, step_port) in zip(hiddens, ports, strict=True):
        conn = _connector(role, port, hidden, layers=iters + WARMUP)
        for rows in rows_list:
            h = torch.randn(rows, hidden).to(torch.bfloat16)
            out = torch.empty_like(h)
            # the FFN side answers from an output buffer of its own, as a layer's output is:
            # echoing the receive buffer itself would make the connector copy it before
            # sending (a ring buffer is reused by the next receive), a cost real m = 1
            # steps do not pay
            echo = torch.empty_like(h)
            raw_t, afd_t = [], []
            # the AFD side is one step (one control message) of iters + WARMUP layers
            if is_ffn:
                conn.recv_control()
            else:
                conn.begin_step((rows,))
            for i in range(iters + WARMUP):
                if is_ffn:
                    raw.recv([h], peer, 0).wait()
                    raw.send([h], peer, 0).wait()
                    b = conn.recv_attn_output(i)
                    echo.copy_(b.hidden_states)
                    conn.send_ffn_output(echo, i)
                    continue
                t0 = time.perf_counter()
                raw.send([h], peer, 0).wait()
                raw.recv([h], peer, 0).wait()
                t1 = time.perf_counter()
                conn.start_exchange(h, i, out=out).wait()
                t2 = time.perf_counter()
                if i >= WARMUP:
                    raw_t.append(t1 - t0)
                    afd_t.append(t2 - t1)
            if is_ffn:
                conn.finish_step()
            else:
                conn.end_step()
            results[("raw", hidden, rows)] = raw_t
            results[("afd", hidden, rows)] = afd_t
        _close(conn, is_ffn)
        # a whole one-layer step: control message + one 1-row exchange + status
        conn = _connector(role, step_port, hidden, layers=1)
        step = []
        h1 = torch.zeros(1, hidden, dtype=torch.bfloat16)
        for _ in range(iters):
            if is_ffn:
                conn.recv_control()
                b = conn.recv_attn_output(0)
                conn.send_ffn_output(b.hidden_states, 0)
                conn.finish_step()
                continue
            t0 = time.perf_counter()
            conn.begin_step((1,))
            conn.exchange(h1, 0)
            conn.end_step()
            step.append(time.perf_counter() - t0)
        results[("step", hidden, 0)] = step
        _close(conn, is_ffn)
        raw.barrier().wait()
    if not is_ffn:
        q.put({f"{k[0]}|{k[1]}|{k[2]}": v for k, v in results.items()})


def run_sweep(
    hiddens: list[int], rows_list: list[int], iters: int, timeout_s: float = 1800.0
) -> tuple[list[SweepPoint], dict[int, list[float]]]:
    """(points, one-layer step times per hidden), measured in two spawned processes."""
    from afd_plugin.deploy.servers import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports, raw_port = [(free_port(), free_port()) for _ in hiddens], free_port()
    procs = [
        ctx.Process(target=_side, args=(r, ports, raw_port, hiddens, rows_list, iters, q))
        for r in ("ffn", "attention")
    ]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    points = [
        SweepPoint(h, r, r * h * 2, res[f"raw|{h}|{r}"], res[f"afd|{h}|{r}"])
        for h in hiddens
        for r in rows_list
    ]
    return points, {h: res[f"step|{h}|0"] for h in hiddens}


def fit_link(points: list[SweepPoint]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the least-squares line one-way time = a + bytes / bw
    through the AFD medians (one way = round trip / 2)."""
    xs = [float(p.nbytes) for p in points]
    ys = [statistics.median(p.afd_s) / 2 for p in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        raise ValueError("the link fit needs at least two different message sizes")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    latency = max(0.0, my - slope * mx)
    # a flat or falling line (noise over a tiny size range) means no measurable bandwidth
    # limit: report a bandwidth far above what the sizes could show
    bandwidth = 1.0 / slope if slope > 0 else max(xs) / 1e-9
    return latency, bandwidth

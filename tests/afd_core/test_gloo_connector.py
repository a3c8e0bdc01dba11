"""The gloo connector across real local processes: shapes, uneven and empty ranks, errors."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback

import pytest

pytestmark = pytest.mark.vllm  # needs torch (the CPU build comes with vLLM)

HIDDEN = 8
LAYERS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make(role, rank, a, f, port, timeout=20.0, hidden=HIDDEN, dtype="float32", router_width=0):
    from afd_core.config import parse_afd_config
    from afd_core.connectors.base import WireSpec
    from afd_core.connectors.factory import build_connector

    cfg = parse_afd_config(
        {
            "role": role,
            "port": port,
            "num_attention_ranks": a,
            "num_ffn_ranks": f,
            "connector_extra_config": {"timeout_s": timeout, "connect_timeout_s": 30},
        },
        device_type="cpu",
    )
    wire = WireSpec(hidden, dtype, LAYERS, max_tokens=64, router_width=router_width)
    return build_connector(cfg, rank, wire)


def ffn_main(rank, a, f, port, steps, q):
    try:
        conn = make("ffn", rank, a, f, port)
        conn.init()
        seen = []
        while True:
            conn.recv_control()
            if conn.all_peers_left:
                break
            rows = conn.rows_per_peer(0)
            seen.append(rows)
            for layer in range(LAYERS):
                batch = conn.recv_attn_output(layer)
                assert batch.rows_per_peer == rows
                conn.send_ffn_output(batch.hidden_states * 2 + layer, layer)
        conn.close()
        q.put(("ffn", rank, seen))
    except Exception:
        q.put(("ffn", rank, "ERROR " + traceback.format_exc()))


def attn_main(rank, a, f, port, counts, q):
    import torch

    try:
        conn = make("attention", rank, a, f, port)
        conn.init()
        for step, n in enumerate(counts):
            conn.send_control((n,))
            h = torch.full((n, HIDDEN), float(rank * 100 + step))
            h += torch.arange(n, dtype=torch.float32).unsqueeze(1)
            for layer in range(LAYERS):
                ref = h.clone()
                conn.send_attn_output(h, layer)
                out = conn.recv_ffn_output(h, layer)
                assert out.data_ptr() == h.data_ptr()  # received into the sent buffer
                assert torch.equal(out, ref * 2 + layer), (rank, step, layer)
        conn.close()
        q.put(("attention", rank, "ok"))
    except Exception:
        q.put(("attention", rank, "ERROR " + traceback.format_exc()))


def run_deployment(a, f, counts_by_rank):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=ffn_main, args=(k, a, f, port, None, q)) for k in range(f)]
    procs += [
        ctx.Process(target=attn_main, args=(r, a, f, port, counts_by_rank[r], q)) for r in range(a)
    ]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            role, rank, out = q.get(timeout=120)
            results[(role, rank)] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [v for v in results.values() if isinstance(v, str) and v.startswith("ERROR")]
    assert not errors, "\n".join(errors)
    return results


@pytest.mark.parametrize(
    "a,f,counts",
    [
        (1, 1, {0: [5, 1, 17]}),
        (2, 1, {0: [3, 0, 4], 1: [1, 6, 0]}),  # uneven, and a rank with no tokens
        (4, 2, {0: [2, 1], 1: [0, 3], 2: [5, 5], 3: [1, 0]}),
        (2, 2, {0: [4, 2], 1: [3, 0]}),
    ],
)
def test_shapes(a, f, counts):
    results = run_deployment(a, f, counts)
    from afd_core.topology import Topology

    topo = Topology(a, f)
    for k in range(f):
        expected = [tuple(counts[p][s] for p in topo.peers_of(k)) for s in range(len(counts[0]))]
        assert results[("ffn", k)] == expected


def lone_attention(port, q, timeout, connect_timeout):
    try:
        from afd_core.config import parse_afd_config
        from afd_core.connectors.base import WireSpec
        from afd_core.connectors.factory import build_connector

        cfg = parse_afd_config(
            {
                "role": "attention",
                "port": port,
                "connector_extra_config": {
                    "timeout_s": timeout,
                    "connect_timeout_s": connect_timeout,
                },
            },
            device_type="cpu",
        )
        conn = build_connector(cfg, 0, WireSpec(HIDDEN, "float32", LAYERS, 64))
        t0 = time.monotonic()
        conn.init()
        q.put(("connected", time.monotonic() - t0))
    except Exception as exc:
        q.put((f"{type(exc).__name__}: {exc}", time.monotonic() - t0))


def test_ffn_never_starts_is_a_clear_error_within_the_timeout():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=lone_attention, args=(free_port(), q, 5, 3))
    p.start()
    msg, elapsed = q.get(timeout=60)
    p.join(10)
    assert "AFDPeerError" in msg and "attention rank 0" in msg
    assert "could not reach FFN rank 0's rendezvous" in msg and "afd.host/afd.port" in msg
    assert elapsed < 15


def ffn_that_dies(port, q, after_layers):
    import os

    conn = make("ffn", 0, 1, 1, port)
    conn.init()
    conn.recv_control()
    for layer in range(after_layers):
        b = conn.recv_attn_output(layer)
        conn.send_ffn_output(b.hidden_states, layer)
    conn.recv_attn_output(after_layers)
    os._exit(3)  # crash mid-step


def attn_expecting_death(port, q):
    import torch

    try:
        conn = make("attention", 0, 1, 1, port, timeout=30)
        conn.init()
        conn.send_control((4,))
        h = torch.ones(4, HIDDEN)
        t0 = time.monotonic()
        for layer in range(LAYERS):
            conn.send_attn_output(h, layer)
            conn.recv_ffn_output(h, layer)
        q.put(("no error", 0))
    except Exception as exc:
        q.put((f"{type(exc).__name__}: {exc}", time.monotonic() - t0))


def test_ffn_dying_mid_step_is_reported_at_once_with_peer_and_layer():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ffn = ctx.Process(target=ffn_that_dies, args=(port, q, 1))
    att = ctx.Process(target=attn_expecting_death, args=(port, q))
    ffn.start()
    att.start()
    msg, elapsed = q.get(timeout=90)
    for p in (ffn, att):
        p.join(10)
        if p.is_alive():
            p.kill()
    assert msg.startswith("AFDPeerError"), msg
    assert "FFN rank 0" in msg and "layer 1" in msg and "closed the connection" in msg
    assert elapsed < 10  # the closed socket is noticed at once, not after the 30 s timeout


def mismatched_ffn(port, q):
    try:
        conn = make("ffn", 0, 1, 1, port, hidden=16)
        conn.init()
        q.put(("ffn", "no error"))
    except Exception as exc:
        q.put(("ffn", f"{type(exc).__name__}: {exc}"))


def mismatched_attn(port, q):
    try:
        conn = make("attention", 0, 1, 1, port, hidden=HIDDEN)
        conn.init()
        q.put(("attention", "no error"))
    except Exception as exc:
        q.put(("attention", f"{type(exc).__name__}: {exc}"))


def run_sides(*targets, timeout=90) -> dict:
    """Run each target(port, queue) in its own process; collect what each put on the queue."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=t, args=(port, q)) for t in targets]
    for p in procs:
        p.start()
    try:
        return dict(q.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def test_handshake_mismatch_fails_both_sides_with_the_field():
    out = run_sides(mismatched_ffn, mismatched_attn)
    for side in ("ffn", "attention"):
        assert "handshake failed" in out[side], out
        assert "hidden_size=8" in out[side] and "16" in out[side], out


def test_rank_outside_topology_is_rejected_before_any_socket():
    with pytest.raises(ValueError, match="attention rank 2 is out of range"):
        make("attention", 2, 2, 1, free_port())
    with pytest.raises(ValueError, match="ffn rank 1 is out of range"):
        make("ffn", 1, 2, 1, free_port())


def test_unconnected_connector_refuses_to_send():
    from afd_core.connectors.base import AFDPeerError

    conn = make("attention", 0, 1, 1, free_port())
    with pytest.raises(AFDPeerError, match="not initialized"):
        conn.send_control((1,))


def gate_ffn(port, q):
    try:
        conn = make("ffn", 0, 1, 1, port, router_width=4)
        conn.init()
        conn.recv_control()
        b = conn.recv_attn_output(0)
        assert b.router_logits is not None and b.router_logits.shape == (3, 4)
        conn.send_ffn_output(b.hidden_states + b.router_logits.sum(dim=1, keepdim=True), 0)
        conn.recv_control()  # the goodbye
        conn.close()
        q.put(("ffn", "ok"))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def gate_attn(port, q):
    import torch

    try:
        conn = make("attention", 0, 1, 1, port, router_width=4)
        conn.init()
        conn.send_control((3,))
        h = torch.ones(3, HIDDEN)
        logits = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        conn.send_attn_output(h, 0, router_logits=logits)
        conn.recv_ffn_output(h, 0)
        assert torch.equal(h[:, 0], torch.tensor([7.0, 23.0, 39.0]))  # 1 + row sums
        conn.close()
        q.put(("attention", "ok"))
    except Exception:
        q.put(("attention", "ERROR " + traceback.format_exc()))


def test_router_logits_travel_with_the_rows_when_the_gate_runs_on_attention():
    out = run_sides(gate_ffn, gate_attn)
    assert out == {"ffn": "ok", "attention": "ok"}, out

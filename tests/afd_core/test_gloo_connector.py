"""The gloo connector across real local processes: shapes, uneven and empty ranks, errors."""

from __future__ import annotations

import time
import traceback

import pytest

from tests.afd_core.gloo_harness import (
    HIDDEN,
    LAYERS,
    assert_no_errors,
    free_port,
    make,
    run_processes,
)

pytestmark = pytest.mark.vllm  # needs torch (the CPU build comes with vLLM)


def ffn_main(rank, a, f, port, q):
    try:
        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", rank, a, f, port)
        conn.init()
        seen = []
        original = conn.recv_control

        def recording_recv_control():
            plan = original()
            if plan.live:
                seen.append(plan.rows[0])
            return plan

        conn.recv_control = recording_recv_control
        server = FFNStepServer(conn, list(range(LAYERS)), lambda layer, h, *_: h * 2 + layer)
        while server.serve_step():
            pass
        conn.close()
        q.put((("ffn", rank), seen))
    except Exception:
        q.put((("ffn", rank), "ERROR " + traceback.format_exc()))


def attn_main(rank, a, f, port, counts, q):
    import torch

    try:
        conn = make("attention", rank, a, f, port)
        conn.init()
        for step, n in enumerate(counts):
            conn.begin_step((n,))
            h = torch.full((n, HIDDEN), float(rank * 100 + step))
            h += torch.arange(n, dtype=torch.float32).unsqueeze(1)
            for layer in range(LAYERS):
                ref = h.clone()
                h = conn.exchange(h, layer)
                assert torch.equal(h, ref * 2 + layer), (rank, step, layer)
            conn.end_step()
        conn.close()
        q.put((("attention", rank), "ok"))
    except Exception:
        q.put((("attention", rank), "ERROR " + traceback.format_exc()))


def run_deployment(a, f, counts_by_rank):
    port = free_port()
    targets = [(ffn_main, k, a, f, port) for k in range(f)]
    targets += [(attn_main, r, a, f, port, counts_by_rank[r]) for r in range(a)]
    results = run_processes(targets)
    assert_no_errors(results)
    return results


@pytest.mark.parametrize(
    "a,f,counts",
    [
        (1, 1, {0: [5, 1, 17]}),
        (2, 1, {0: [3, 0, 4], 1: [1, 6, 0]}),  # uneven, and a rank with no tokens
        (4, 2, {0: [2, 1], 1: [0, 3], 2: [5, 5], 3: [1, 0]}),
        (2, 2, {0: [4, 2], 1: [3, 0]}),
        # any A >= F: blocks of attention ranks differing by at most one
        (3, 2, {0: [2, 1], 1: [0, 3], 2: [5, 2]}),
        (5, 2, {r: [r + 1, 5 - r] for r in range(5)}),
        (7, 3, {r: [r % 3, r + 1] for r in range(7)}),
    ],
)
def test_shapes(a, f, counts):
    results = run_deployment(a, f, counts)
    from afd_core.topology import Topology

    topo = Topology(a, f)
    for k in range(f):
        expected = [tuple(counts[p][s] for p in topo.peers_of(k)) for s in range(len(counts[0]))]
        assert results[("ffn", k)] == expected


def lone_attention(port, timeout, connect_timeout, q):
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
                    "startup_timeout_s": connect_timeout + 1,  # the wait for FFN rank 0
                },
            },
            device_type="cpu",
        )
        conn = build_connector(cfg, 0, WireSpec(HIDDEN, "float32", LAYERS, 64))
        t0 = time.monotonic()
        conn.init()
        q.put(("lone", ("connected", time.monotonic() - t0)))
    except Exception as exc:
        q.put(("lone", (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)))


def test_ffn_never_starts_is_a_clear_error_within_the_timeout():
    msg, elapsed = run_processes([(lone_attention, free_port(), 5, 3)], timeout=60)["lone"]
    assert "AFDPeerError" in msg and "attention rank 0" in msg
    assert "could not reach FFN rank 0's rendezvous" in msg and "afd.host/afd.port" in msg
    assert elapsed < 15


def ffn_that_dies(port, after_layers, q):
    import os

    conn = make("ffn", 0, 1, 1, port)
    conn.init()
    conn.recv_control()
    for layer in range(after_layers):
        b = conn.recv_attn_output(layer)
        conn.send_ffn_output(b.hidden_states.clone(), layer)
    conn.recv_attn_output(after_layers)
    q.put(("ffn", "dying"))
    q.close()
    q.join_thread()  # flushed before the crash
    os._exit(3)  # crash mid-step


def attn_expecting_death(port, q):
    import torch

    try:
        conn = make("attention", 0, 1, 1, port, timeout=30)
        conn.init()
        conn.begin_step((4,))
        h = torch.ones(4, HIDDEN)
        t0 = time.monotonic()
        for layer in range(LAYERS):
            h = conn.exchange(h, layer)
        q.put(("attention", ("no error", 0)))
    except Exception as exc:
        q.put(("attention", (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)))


def test_ffn_dying_mid_step_is_reported_at_once_with_peer_and_layer():
    port = free_port()
    results = run_processes([(ffn_that_dies, port, 1), (attn_expecting_death, port)], timeout=90)
    msg, elapsed = results["attention"]
    # the step fails, not the attention rank: it waits for an FFN rank (test_ffn_loss.py)
    assert msg.startswith("AFDFFNLostError"), msg
    assert "FFN rank 0" in msg and "is gone" in msg
    assert "layer 1" in msg and "closed the connection" in msg
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
    port = free_port()
    return run_processes([(t, port) for t in targets], timeout=timeout)


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
        conn.begin_step((1,))


def gate_ffn(port, q):
    try:
        conn = make("ffn", 0, 1, 1, port, router_width=4, token_ids=True)
        conn.init()
        conn.recv_control()
        for layer in range(LAYERS):
            b = conn.recv_attn_output(layer)
            assert b.router_logits is not None and b.router_logits.shape == (3, 4)
            assert b.token_ids.tolist() == [5, 6, 7 + layer]
            out = b.hidden_states + b.router_logits.sum(dim=1, keepdim=True) + b.token_ids[:, None]
            conn.send_ffn_output(out, layer)
        conn.finish_step()
        conn.recv_control()  # the goodbye
        conn.close()
        q.put(("ffn", "ok"))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def gate_attn(port, q):
    import torch

    try:
        conn = make("attention", 0, 1, 1, port, router_width=4, token_ids=True)
        conn.init()
        conn.begin_step((3,))
        h = torch.ones(3, HIDDEN)
        logits = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        ids = torch.tensor([5, 6, 7], dtype=torch.int32)  # any integer dtype: int64 on the wire
        out = conn.start_exchange(h, 0, 0, logits, token_ids=ids).wait()
        assert torch.equal(out[:, 0], torch.tensor([12.0, 29.0, 46.0]))  # 1 + row sum + id
        for layer in range(1, LAYERS):
            conn.start_exchange(h, layer, 0, logits, token_ids=ids + layer * (ids == 7)).wait()
        conn.end_step()
        conn.close()
        q.put(("attention", "ok"))
    except Exception:
        q.put(("attention", "ERROR " + traceback.format_exc()))


def test_router_logits_and_token_ids_travel_with_the_rows():
    out = run_sides(gate_ffn, gate_attn)
    assert out == {"ffn": "ok", "attention": "ok"}, out

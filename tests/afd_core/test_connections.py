"""How many TCP connections an AFD group holds: only the pairs that talk (each attention
rank with its FFN rank), not a full mesh of every member of the group."""

from __future__ import annotations

import traceback

import pytest

from tests.afd_core.gloo_harness import assert_no_errors, free_port, make, run_processes

pytestmark = pytest.mark.vllm  # needs torch


def established() -> int:
    import psutil

    return sum(1 for c in psutil.Process().net_connections("tcp") if c.status == "ESTABLISHED")


def ffn(a, port, q):
    try:
        conn = make("ffn", 0, a, 1, port)
        conn.init()
        plan = conn.recv_control()
        batch = conn.recv_attn_output(0)
        conn.send_ffn_output(batch.hidden_states, 0)
        for layer in (1, 2):
            conn.send_ffn_output(conn.recv_attn_output(layer).hidden_states, layer)
        conn.finish_step()
        n = established()
        while not conn.all_peers_left:
            conn.recv_control()
        conn.close()
        q.put(("ffn", {"connections": n, "rows": plan.rows}))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def attention(a, rank, port, q):
    import torch

    try:
        conn = make("attention", rank, a, 1, port)
        conn.init()
        conn.begin_step((1,))
        for layer in range(3):
            conn.start_exchange(torch.ones(1, 8), layer, 0).wait()
        conn.end_step()
        n = established()
        conn.close()
        q.put((rank, {"connections": n}))
    except Exception:
        q.put((rank, "ERROR " + traceback.format_exc()))


def connections(a: int) -> dict:
    port = free_port()
    out = run_processes([(ffn, a, port)] + [(attention, a, r, port) for r in range(a)])
    assert_no_errors(out)
    return out


def test_an_attention_rank_holds_the_same_few_connections_however_many_peers():
    """Measured after one step: an attention rank's connections (its store client, one
    control pair and one data pair, both to its FFN rank) do not grow with the number of
    peers; the FFN rank's grow by a few per peer. A full mesh would give each attention
    rank two pairs per other member too."""
    two, eight = connections(2), connections(8)
    attn2 = {out["connections"] for key, out in two.items() if key != "ffn"}
    attn8 = {out["connections"] for key, out in eight.items() if key != "ffn"}
    print(
        f"\nconnections per process: 2 peers: FFN {two['ffn']['connections']}, attention "
        f"{sorted(attn2)}; 8 peers: FFN {eight['ffn']['connections']}, attention {sorted(attn8)}"
    )
    assert attn2 == attn8 and max(attn8) <= 3, (attn2, attn8)
    per_peer = (eight["ffn"]["connections"] - two["ffn"]["connections"]) / 6
    assert per_peer <= 4, per_peer


def attention_ranks_as_threads(a, port, q):
    """All `a` attention ranks of one server in one process, one thread each (light: one
    torch import for all), each through its own connector and connections."""
    import threading

    import torch

    errors, per_rank = [], {}

    def rank_main(rank):
        try:
            conn = make("attention", rank, a, 1, port, connect_timeout=120.0)
            conn.init()
            conn.begin_step((1,))
            for layer in range(3):
                conn.start_exchange(torch.ones(1, 8), layer, 0).wait()
            conn.end_step()
            per_rank[rank] = conn
        except Exception:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(a)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    n = established()
    for conn in per_rank.values():
        conn.close()
    q.put(("attention", {"connections": n, "ranks": len(per_rank), "errors": errors[:1]}))


def test_sixty_four_attention_ranks_cost_their_ffn_rank_a_few_connections_each():
    """64 peers (the attention ranks as threads of one process): the FFN rank holds about
    three connections per peer (its store serves the peer's client; one control and one
    data pair), and the attention process three per rank; a full mesh would be ~4,000 per
    group."""
    a, port = 64, free_port()
    out = run_processes([(ffn, a, port), (attention_ranks_as_threads, a, port)], timeout=300)
    assert_no_errors(out)
    att = out["attention"]
    assert att["ranks"] == a and not att["errors"], att["errors"]
    print(
        f"\n64 peers: FFN rank {out['ffn']['connections']} connections, the process of the "
        f"64 attention ranks {att['connections']} ({att['connections'] / a:.1f} per rank)"
    )
    assert out["ffn"]["connections"] <= 4 * a, out["ffn"]
    assert att["connections"] <= 3 * a + 4, att

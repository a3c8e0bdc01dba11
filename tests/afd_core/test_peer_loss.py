"""Lose an attention server, not the deployment (gloo): a peer whose process dies, between
steps or in the middle of one, is dropped by its FFN rank, and the other attention server
is served on without a failed step."""

from __future__ import annotations

import os
import threading
import traceback

import pytest

from tests.afd_core.gloo_harness import HIDDEN, assert_no_errors, free_port, make, run_processes

pytestmark = pytest.mark.vllm  # needs torch

LAYERS = 3
STEPS = 8


def ffn(port, q):
    try:
        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", 0, 2, 1, port, layers=LAYERS, timeout=10.0)
        conn.init()
        server = FFNStepServer(conn, list(range(LAYERS)), lambda layer, h, *_: h * 2 + layer)
        server.serve(threading.Event())
        q.put(("ffn", {"lost": conn.peers_lost, "failed": server.failed_steps}))
        conn.close()
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def attention(rank, die_at, port, q):
    """Two servers of one rank each (start_rank = rank). die_at: (step, layer) where this
    process exits at once, a layer's rows sent and its answer not awaited."""
    import torch

    try:
        conn = make("attention", rank, 2, 1, port, layers=LAYERS, timeout=10.0, start_rank=rank)
        conn.init()
        outcome = []
        for step in range(STEPS):
            conn.begin_step((2 + rank,))
            h = torch.full((2 + rank, HIDDEN), float(step))
            want = h.clone()
            for layer in range(LAYERS):
                ex = conn.start_exchange(h, layer, 0)
                if die_at == (step, layer):
                    os._exit(3)  # a crash: no goodbye, a step half done
                h = ex.wait()
                want = want * 2 + layer
            conn.end_step()
            outcome.append("ok" if torch.equal(h, want) else "wrong")
        conn.close()
        q.put((rank, outcome))
    except Exception:
        q.put((rank, "ERROR " + traceback.format_exc()))


@pytest.mark.parametrize("die_at", [(3, 0), (5, 1)], ids=["step-3-layer-0", "step-5-layer-1"])
def test_an_attention_server_that_dies_mid_step_is_dropped_and_the_other_is_served(die_at):
    port = free_port()
    targets = [(ffn, port), (attention, 0, None, port), (attention, 1, die_at, port)]
    out = run_processes(targets, timeout=90, expect=2)
    assert_no_errors(out)
    assert out[0] == ["ok"] * STEPS  # the other server: every step right, none failed
    assert out["ffn"] == {"lost": [1], "failed": 0}

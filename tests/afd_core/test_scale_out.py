"""Scale-out at the connector level, across real processes (gloo): a rank missing from the
deployment, a rank claimed twice, ranks that disagree on the deployment's shape, and an FFN
rank sharded over tensor parallel (TP rank 0 exchanges, the followers compute the same
layers with it)."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

from tests.afd_core.gloo_harness import assert_no_errors, free_port, make, run_processes
from tests.afd_core.test_step_protocol import expected, initial

pytestmark = pytest.mark.vllm  # needs torch (the CPU build comes with vLLM)

CONNECT_TIMEOUT = 15.0  # spawned processes start seconds apart on two busy cores


def init_main(index, role, rank, a, f, port, q):
    """Start up one rank; report how it ended and how long its init took."""
    t0 = time.monotonic()
    try:
        conn = make(role, rank, a, f, port, connect_timeout=CONNECT_TIMEOUT)
        import torch  # noqa: F401 - imported before the clock starts

        t0 = time.monotonic()
        conn.init()
        conn.close()
        out = "connected"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out = f"{type(exc).__name__}: {exc}"
    q.put((index, (out, time.monotonic() - t0)))


def start_up(ranks: list[tuple[str, int, int, int]]) -> list[tuple[str, float]]:
    """(role, rank, A, F) per process, all on one rendezvous; their outcomes."""
    port = free_port()
    results = run_processes(
        [(init_main, i, role, r, a, f, port) for i, (role, r, a, f) in enumerate(ranks)]
    )
    return list(results.values())


def test_a_missing_ffn_rank_fails_every_rank_naming_it_within_the_connect_timeout():
    # 2A2F, FFN rank 1's server never starts
    outcomes = start_up([("ffn", 0, 2, 2), ("attention", 0, 2, 2), ("attention", 1, 2, 2)])
    assert len(outcomes) == 3
    for text, seconds in outcomes:
        assert "FFN rank 1 of the deployment never joined" in text, text
        assert seconds < CONNECT_TIMEOUT + 8, (text, seconds)


def test_a_rank_claimed_twice_fails_every_rank_naming_it():
    # two servers both started as attention rank 0 (and so none as rank 1): the deployment
    # cannot complete, and the second claim is named to everyone at once, before the
    # connect timeout would name the missing rank. (A duplicate arriving after a deployment
    # completed is refused alone; the deployment goes on.)
    outcomes = start_up([("ffn", 0, 2, 1), ("attention", 0, 2, 1), ("attention", 0, 2, 1)])
    assert len(outcomes) == 3
    for text, seconds in outcomes:
        assert "two servers claim attention rank 0" in text, text
        assert seconds < CONNECT_TIMEOUT, (text, seconds)


def test_ranks_that_disagree_on_the_deployment_fail_every_rank_naming_the_field():
    # FFN rank 1's server was told 4 attention ranks, the others 2
    outcomes = start_up(
        [("ffn", 0, 2, 2), ("ffn", 1, 4, 2), ("attention", 0, 2, 2), ("attention", 1, 2, 2)]
    )
    assert len(outcomes) == 4
    for text, _ in outcomes:
        assert "AFD handshake failed" in text and "num_attention_ranks=" in text, text
        assert "4" in text and "2" in text, text


def older_release_init_main(index, role, rank, a, f, port, q):
    """A rank of a release that speaks wire format 2."""
    import afd_core.connectors.admission.membership as membership

    membership.CONTROL_VERSION = 2
    init_main(index, role, rank, a, f, port, q)


def test_a_rank_of_another_protocol_version_is_named_at_start_up():
    """Issue 36 (review M3): the wire format's version was in neither hello nor shape, so
    a server of another release got in and its first control message stopped the FFN rank
    for everyone. Now start-up names the field on every rank (and a rejoin is refused
    with the same check)."""
    port = free_port()
    results = run_processes(
        [(init_main, 0, "ffn", 0, 2, 1, port), (init_main, 1, "attention", 0, 2, 1, port)]
        + [(older_release_init_main, 2, "attention", 1, 2, 1, port)]
    )
    for text, _ in results.values():
        assert "AFD handshake failed" in text and "protocol_version=" in text, text


def job(conn, rank, step, mb, n, router_width=0, token_ids=False):
    """One micro-batch of attention rank `rank`: every layer exchanged, DBO yield between
    (router logits derived from the rows and token ids travel with them when asked)."""

    def run():
        import torch

        from afd_core.step.microbatch import yield_to_next_microbatch

        h = initial(rank, step, mb, n)
        for layer in range(LAYERS):
            logits = (h[:, :router_width] * 0.5 + layer) if router_width else None
            ids = torch.arange(n) * 10 + layer if token_ids else None
            ex = conn.start_exchange(h + 1, layer, mb, logits, token_ids=ids)
            yield_to_next_microbatch()
            h = ex.wait()
        return h

    return run


# -- an FFN rank over tensor parallel ------------------------------------------------------

LAYERS = 3
ROUTER = 4  # the TP group's rows come with router logits (gate on attention) and token ids
STEPS = [(2, 3), (0, 4), (1, 1, 1, 1), (5,)]  # rows per micro-batch; zero rows in step 1
FAIL_AT = {(2, 1)}  # (step, layer): TP rank 0's compute raises before it shares the layer


def tp_leader_main(port, q):
    try:
        from afd_core.step.ffn import FFNStepServer
        from afd_core.step.ffn_tp import TensorParallelLeader, tp_group_name

        conn = make("ffn", 0, 1, 1, port, layers=LAYERS, router_width=ROUTER, token_ids=True)
        conn.init()
        side = conn.make_side_transport(tp_group_name(0), 0, 2, connect_scale=2.0)
        side.connect()
        leader = TensorParallelLeader(side, 2, 0)
        computed = []
        state = {"step": 0}

        def compute(layer, h, logits, ids):
            if (state["step"], layer) in FAIL_AT:
                raise RuntimeError(f"injected failure at layer {layer}")
            leader.share(layer, h, logits, ids)
            computed.append((layer, h.shape[0], float(h.sum()), float(logits.sum()), ids.tolist()))
            return h * 2 + layer

        server = FFNStepServer(conn, list(range(LAYERS)), compute)
        original = conn.recv_control

        def recording():
            plan = original()
            state["step"] = plan.step
            return plan

        conn.recv_control = recording
        server.serve(threading.Event())
        leader.stop()
        conn.close()
        q.put(("leader", {"computed": computed, "failed": server.failed_steps}))
    except Exception:
        q.put(("leader", "ERROR " + traceback.format_exc()))


def tp_follower_main(port, q):
    try:
        import torch

        from afd_core.step.ffn_tp import TensorParallelFollower, tp_group_name
        from tests.afd_core.gloo_harness import HIDDEN

        # never initialized: not a rank
        conn = make("ffn", 0, 1, 1, port, layers=LAYERS, router_width=ROUTER, token_ids=True)
        side = conn.make_side_transport(tp_group_name(0), 1, 2, connect_scale=2.0)
        side.connect()
        follower = TensorParallelFollower(side, 0, 1, HIDDEN, torch.float32, ROUTER, True)
        computed = []
        follower.serve(
            lambda layer, h, g, ids: computed.append(
                (layer, h.shape[0], float(h.sum()), float(g.sum()), ids.tolist())
            ),
            threading.Event(),
        )
        q.put(("follower", computed))
    except Exception:
        q.put(("follower", "ERROR " + traceback.format_exc()))


def tp_attention_main(port, q):
    try:
        import torch

        from afd_core.connectors.base import AFDStepError
        from afd_core.step.attention import AttentionStepDriver

        conn = make("attention", 0, 1, 1, port, layers=LAYERS, router_width=ROUTER, token_ids=True)
        conn.init()
        driver = AttentionStepDriver(conn)
        outcome = []

        for step, rows in enumerate(STEPS):
            jobs = [job(conn, 0, step, mb, n, ROUTER, True) for mb, n in enumerate(rows)]
            try:
                out = driver.run(rows, jobs)
            except AFDStepError as exc:
                outcome.append(f"step failed: {exc}")
                continue
            for mb, n in enumerate(rows):
                assert torch.equal(out[mb], expected(0, step, mb, n, LAYERS)), (step, mb)
            outcome.append("ok")
        driver.close()
        conn.close()
        q.put(("attention", outcome))
    except Exception:
        q.put(("attention", "ERROR " + traceback.format_exc()))


def test_an_ffn_rank_over_tensor_parallel_computes_every_layer_on_every_tp_rank():
    port = free_port()
    results = run_processes(
        [(tp_leader_main, port), (tp_follower_main, port), (tp_attention_main, port)]
    )
    assert_no_errors(results)
    out = results["attention"]
    assert out[0] == out[1] == out[3] == "ok", out
    assert out[2].startswith("step failed") and "layer 1" in out[2], out
    leader = results["leader"]
    assert leader["failed"] == 1
    # the follower computed exactly what TP rank 0 computed (rows, router logits and token
    # ids), in the same order: no zero-row micro-batch, nothing of the failed step after the
    # failure; the token ids arrived as sent (row r at layer l: 10 r + l; step 0 is 2 + 3 rows)
    assert [c[4] for c in leader["computed"][:3]] == [[0, 10], [0, 10, 20], [1, 11]]
    assert results["follower"] == leader["computed"]
    n_rows = sum(1 for rows in STEPS for n in rows if n) * LAYERS
    assert len(leader["computed"]) == n_rows - 4 * (LAYERS - 1)  # step 2: only layer 0 ran


# -- attention ranks of two servers on one FFN rank --------------------------------------


def server_attention_main(rank, port, steps, delay, q):
    """Attention rank `rank` as the only rank of its own server (start_rank = rank): after
    `delay` seconds, run `steps` (rows per micro-batch each); report when it ran."""
    try:
        import torch

        from afd_core.step.attention import AttentionStepDriver

        conn = make("attention", rank, 2, 1, port, layers=LAYERS, start_rank=rank)
        conn.init()
        driver = AttentionStepDriver(conn)
        time.sleep(delay)
        t0 = time.time()

        for step, rows in enumerate(steps):
            out = driver.run(rows, [job(conn, rank, step, mb, n) for mb, n in enumerate(rows)])
            for mb, n in enumerate(rows):
                assert torch.equal(out[mb], expected(rank, step, mb, n, LAYERS)), (step, mb)
        t1 = time.time()
        driver.close()
        conn.close()
        q.put((("attention", rank), (t0, t1)))
    except Exception:
        q.put((("attention", rank), "ERROR " + traceback.format_exc()))


def plain_ffn_main(port, q):
    try:
        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", 0, 2, 1, port, layers=LAYERS)
        conn.init()
        plans = []
        original = conn.recv_control

        def recording():
            plan = original()
            if plan.live:
                plans.append(tuple(m.sender_rank for m in plan.live))
            return plan

        conn.recv_control = recording
        server = FFNStepServer(conn, list(range(LAYERS)), lambda layer, h, *_: h * 2 + layer)
        server.serve(threading.Event())
        conn.close()
        q.put(("ffn", plans))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def test_an_ffn_rank_serves_two_attention_servers_without_waiting_for_the_idle_one():
    """Two attention servers step on their own (vLLM keeps only one server's data-parallel
    ranks in lockstep): the FFN rank serves the one that announced a step and never waits
    for the idle one."""
    port = free_port()
    busy = [(2, 3), (4,), (1, 1, 1, 1), (3,)]
    results = run_processes(
        [
            (plain_ffn_main, port),
            (server_attention_main, 0, port, busy, 0.0),
            (server_attention_main, 1, port, [(2,), (1, 2)], 4.0),  # idle for 4 s first
        ]
    )
    assert_no_errors(results)
    (_, end0), (start1, _) = results[("attention", 0)], results[("attention", 1)]
    assert end0 < start1, "attention rank 0 waited for the idle server"
    plans = results["ffn"]
    assert plans[: len(busy)] == [(0,)] * len(busy), plans  # rank 0's steps, alone
    assert plans[len(busy) :] == [(1,), (1,)], plans


LATE_S = 6.0  # FFN rank 0 starts this long after attention rank 0, attention rank 1 as long again
SHORT_CONNECT_S = 2.0


def late_rank(role, rank, delay, port, q, after_rendezvous=False):
    """One rank of 2A1F that starts `delay` seconds late (`after_rendezvous`: that long
    after FFN rank 0's rendezvous listens, so the others' roll call waits that long however
    slowly FFN rank 0's process starts), with a connect timeout far below that delay;
    reports how it ended and the progress lines it logged while waiting."""
    import logging

    import afd_core.connectors.admission.formation as formation
    import afd_core.connectors.transports.rendezvous as rendezvous
    from afd_core.connectors.transports.rendezvous import _listening

    # say it often here (30 s in a server): the wait for FFN rank 0's rendezvous, then the
    # roll call's
    rendezvous.PROGRESS_EVERY_S = formation.PROGRESS_EVERY_S = 2.0
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("vllm.afd_core").addHandler(handler)
    logging.getLogger("vllm.afd_core").setLevel(logging.INFO)
    if after_rendezvous:
        deadline = time.monotonic() + 60
        while not _listening("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.1)
    time.sleep(delay)
    try:
        conn = make(role, rank, 2, 1, port, connect_timeout=SHORT_CONNECT_S)
        conn.init()
        conn.close()
        out = "connected"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out = f"{type(exc).__name__}: {exc}"
    q.put(((role, rank), (out, [line for line in lines if "waiting" in line])))


def rank_after_rendezvous(role, rank, delay, port, q):
    late_rank(role, rank, delay, port, q, after_rendezvous=True)


def test_an_ffn_server_that_loads_long_past_the_connect_timeout_is_joined(monkeypatch):
    """Issue 35, start-up for large models: attention ranks wait for FFN rank 0's
    rendezvous, and for the roll call, under startup_timeout_s (not connect_timeout_s),
    logging whom they wait for; an FFN server that comes 5x the connect timeout late is
    joined, and so is an attention server that comes later still."""
    monkeypatch.setenv("AFD_TEST_STARTUP_TIMEOUT_S", "60")
    port = free_port()
    results = run_processes(
        [
            (late_rank, "attention", 0, 0.0, port),
            (late_rank, "ffn", 0, LATE_S, port),
            # the roll call waits for it (counted from the rendezvous: CI once saw FFN rank
            # 0's process take 10 s to listen, and the roll call's wait was too short for a
            # progress line)
            (rank_after_rendezvous, "attention", 1, LATE_S, port),
        ],
        timeout=120,
    )
    assert {k: out for k, (out, _) in results.items()} == {
        ("attention", 0): "connected",
        ("attention", 1): "connected",
        ("ffn", 0): "connected",
    }
    early = results[("attention", 0)][1]
    assert any("waiting for FFN rank 0's rendezvous" in line for line in early), early
    ffn = results[("ffn", 0)][1]
    for lines in (early, ffn):  # then in the roll call, naming the rank still missing
        assert any("for attention rank 1 to join" in line for line in lines), lines
        assert all("giving up in" in line and "(startup_timeout_s)" in line for line in lines)

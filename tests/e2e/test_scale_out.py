"""Deployments of several servers per role, as real `vllm serve` processes (Qwen3-MoE, fp32
greedy): every attention server gives exactly the colocated server's tokens.

One deployment answers the scale-out cases at once (five servers start in about the time
of one on this machine, and each extra deployment costs minutes):
* two FFN servers (FFN ranks 0 and 1), FFN rank 0 sharded over tensor parallel 2;
* FFN rank 0 serving attention ranks from two servers (2A1F across servers), FFN rank 1
  serving one server's two data-parallel ranks.
Then FFN rank 0's TP follower is stopped: FFN server 0's /health answers 503 (stuck).
Then a deployment whose second FFN and second attention server never start: both servers
that did start fail within the connect timeout, naming FFN rank 1 and attention rank 1.
"""

from __future__ import annotations

import signal
import threading
import time

import psutil
import pytest

from afd_plugin.deploy.servers import complete, running, scale_out_deployment
from tests.e2e.conftest import (
    DEV_MODE,
    PROMPTS,
    assert_same,
    await_health,
    reference,
    rpc,
    run_prompts,
    with_reference,
)

pytestmark = pytest.mark.e2e

ARCH = "qwen3_moe"
TIMEOUT_S = 10  # every step's waits (start-up steps have their own bound)
STUCK_S = 3  # stuck_after_s


def test_three_attention_ranks_on_two_servers_two_ffn_servers_one_over_tp2(checkpoints, log_dir):
    """3A2F (F does not divide A): attention servers of 1 and 2 data-parallel ranks (ranks 0,
    1-2); FFN server 0 (FFN rank 0, tensor parallel 2) serves the block of ranks 0 and 1,
    which are on two servers that step on their own; FFN server 1 serves rank 2 alone, the
    other DP rank of a server whose ranks step in lockstep over two FFN ranks."""
    model = str(checkpoints(ARCH))
    afd = scale_out_deployment(
        model,
        log_dir,
        attention=[1, 2],
        ffn=[2, 1],
        afd_extra={"connector_extra_config": {"timeout_s": TIMEOUT_S, "stuck_after_s": STUCK_S}},
        env=DEV_MODE,
        tag=f"{ARCH}-3a2f-",
    )
    servers = with_reference(ARCH, model, log_dir, afd)
    with running(servers, timeout=600):
        ref = reference(ARCH, servers)
        for att in [s for s in servers if "attention" in s.spec.name]:
            assert_same(ref, run_prompts(att.url))
        ffn0, ffn1 = (next(s for s in servers if s.spec.name.endswith(f"ffn{i}")) for i in (0, 1))
        leader, follower = rpc(ffn0.url, "afd_step_stats")
        _a_stopped_tp_worker_makes_its_ffn_server_unhealthy(ffn0, ffn1, servers)
    # TP rank 0 exchanged with attention ranks 0 and 1; TP rank 1 computed every layer with it
    ranks = [(w["rank"], w["tp_rank"]) for w in (leader, follower)]
    assert ranks == [(0, 0), (0, 1)], ranks
    assert leader["steps"] > 0 and leader["failed"] == 0, leader
    assert follower["tp_computations"] == leader["tp_computations"] > 0, (leader, follower)


def _a_stopped_tp_worker_makes_its_ffn_server_unhealthy(ffn0, ffn1, servers) -> None:
    """FFN rank 0's TP follower stopped (SIGSTOP: a worker hung or cut off) mid-generation:
    the leader is held in vLLM's TP collective for good, and FFN server 0's /health answers
    503 once that step lasted its bound plus stuck_after_s (afd_core/stuck.py), so an
    orchestrator restarts it (`afd k8s` probes an FFN server's liveness there); FFN server
    1's /health stays 200. Last: the deployment is torn down after it."""
    att0 = next(s for s in servers if s.spec.name.endswith("attention0"))
    (worker,) = [
        p
        for p in psutil.Process(ffn0.proc.pid).children(recursive=True)
        if "Worker_TP1" in " ".join(p.cmdline())
    ]
    assert ffn0.health_status() == ffn1.health_status() == 200
    load = threading.Thread(target=lambda: _try(complete, att0.url, PROMPTS[0], 400), daemon=True)
    loaded = time.monotonic()  # the deployment was idle: the stuck step begins after this
    load.start()
    time.sleep(1.0)
    worker.send_signal(signal.SIGSTOP)
    try:
        took = await_health(ffn0, 503, TIMEOUT_S + STUCK_S + 15)
        print(f"FFN server 0's /health 503 {took:.1f} s after its TP follower stopped")
        assert time.monotonic() - loaded > TIMEOUT_S + STUCK_S  # not before the bound passed
        assert ffn1.health_status() == 200
    finally:
        worker.send_signal(signal.SIGCONT)  # the request goes on; the teardown stops it


def _try(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - its step may fail: the FFN rank is stuck
        pass


CONNECT_TIMEOUT_S = 20


def test_a_missing_ffn_server_fails_every_server_naming_the_rank(checkpoints, log_dir):
    model = str(checkpoints(ARCH))
    afd = scale_out_deployment(
        model,
        log_dir,
        attention=[1, 1],
        ffn=[1, 1],
        afd_extra={
            "connector_extra_config": {
                "connect_timeout_s": CONNECT_TIMEOUT_S,
                "startup_timeout_s": CONNECT_TIMEOUT_S,  # the wait for ranks still loading
            }
        },
        tag=f"{ARCH}-missing-",
    )
    # only FFN rank 0 and attention rank 0 start (two servers keep this test short)
    started = [s for s in afd if s.spec.name.endswith(("ffn0", "attention0"))]
    try:
        for s in started:
            s.start()
        t0 = time.monotonic()
        for s in started:
            # model loading (~30 s here) comes before the connect timeout starts
            s.proc.wait(timeout=CONNECT_TIMEOUT_S + 150)
        elapsed = time.monotonic() - t0
    finally:
        for s in started:
            s.stop()
    for s in started:
        log = s.log_path.read_text(errors="replace")
        assert "FFN rank 1, attention rank 1 of the deployment never joined" in log, (
            s.spec.name,
            s.log_tail(60),
        )
        assert s.proc.returncode != 0
    print(
        f"every server exited {elapsed:.0f} s after start (connect timeout {CONNECT_TIMEOUT_S} s)"
    )

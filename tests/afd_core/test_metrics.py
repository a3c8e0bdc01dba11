"""AFD's Prometheus metrics: what each rank writes, what a server's /metrics shows of it,
and that the numbers move when real gloo processes run steps (the end-to-end scrape of
both roles' /metrics is in tests/e2e/test_afd_serve.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

from afd_core.metrics import AFDCollector, RoleMetrics
from tests.afd_core.gloo_harness import HIDDEN, assert_no_errors, free_port, make, run_processes


def scrape(directory) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(AFDCollector(str(directory)))
    return generate_latest(registry).decode()


@pytest.mark.vllm  # prometheus_client comes with vLLM (not in the afd-core lane)
def test_a_published_snapshot_shows_in_prometheus_text(tmp_path):
    m = RoleMetrics("ffn", 3, str(tmp_path))
    m.set_peers([0], True)
    m.set_peers([1], False)
    for rows in (0, 5, 300):
        m.rows.observe(rows)
    m.exchange_wait.observe(0.002)
    m.add("steps", 3)
    m.add("failed_steps")
    m.add("ffn_busy_seconds", 0.25)
    m.add("peers_lost")
    m.publish(now=True)
    text = scrape(tmp_path)
    assert 'afd_peer_up{peer="0",rank="3",role="ffn"} 1.0' in text
    assert 'afd_peer_up{peer="1",rank="3",role="ffn"} 0.0' in text
    assert 'afd_steps_total{rank="3",role="ffn"} 3.0' in text
    assert 'afd_failed_steps_total{rank="3",role="ffn"} 1.0' in text
    assert 'afd_ffn_busy_seconds_total{rank="3",role="ffn"} 0.25' in text
    assert 'afd_peers_lost_total{rank="3",role="ffn"} 1.0' in text
    # cumulative buckets: 0 rows in le=0, 5 in le=8, 300 in le=512
    assert 'afd_rows_per_microbatch_bucket{le="0.0",rank="3",role="ffn"} 1.0' in text
    assert 'afd_rows_per_microbatch_bucket{le="8.0",rank="3",role="ffn"} 2.0' in text
    assert 'afd_rows_per_microbatch_bucket{le="512.0",rank="3",role="ffn"} 3.0' in text
    assert 'afd_rows_per_microbatch_count{rank="3",role="ffn"} 3.0' in text
    assert 'afd_exchange_wait_seconds_bucket{le="0.005",rank="3",role="ffn"} 1.0' in text


def test_publish_is_rate_limited_unless_asked_now(tmp_path):
    m = RoleMetrics("attention", 0, str(tmp_path))
    m.publish()
    m.add("steps")
    m.publish()  # within the interval: not written
    path = next(tmp_path.glob("*.json"))
    assert json.loads(path.read_text())["counters"]["steps"] == 0
    m.publish(now=True)
    assert json.loads(path.read_text())["counters"]["steps"] == 1


def test_a_held_back_snapshot_is_written_when_the_interval_ends(tmp_path):
    """A rank that goes idle right after a step still shows that step within a second."""
    import time

    from afd_core.metrics import PUBLISH_INTERVAL_S

    m = RoleMetrics("attention", 0, str(tmp_path))
    m.publish(now=True)
    path = next(tmp_path.glob("*.json"))
    m.add("steps")
    m.publish()  # held back
    m.add("steps")
    m.publish()  # still one write due
    assert json.loads(path.read_text())["counters"]["steps"] == 0
    deadline = time.monotonic() + PUBLISH_INTERVAL_S + 2
    while json.loads(path.read_text())["counters"]["steps"] != 2:
        assert time.monotonic() < deadline, "the held-back write never came"
        time.sleep(0.05)


@pytest.mark.vllm  # prometheus_client comes with vLLM (not in the afd-core lane)
def test_a_dead_process_snapshot_is_not_shown(tmp_path):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                           capture_output=True, text=True)  # fmt: skip
    dead = RoleMetrics("attention", 1, str(tmp_path))
    dead.add("steps", 7)
    snap = dead.snapshot() | {"pid": int(child.stdout)}
    (tmp_path / "attention-1-dead.json").write_text(json.dumps(snap))
    assert "afd_steps_total{" not in scrape(tmp_path).replace("# TYPE afd_steps_total", "")
    RoleMetrics("attention", 0, str(tmp_path)).publish(now=True)
    assert 'afd_steps_total{rank="0",role="attention"} 0.0' in scrape(tmp_path)


@pytest.mark.vllm  # prometheus_client comes with vLLM (not in the afd-core lane)
def test_only_the_servers_own_processes_are_shown(tmp_path):
    """A directory shared by several servers (inherited from one shell or test process):
    each server's /metrics shows the processes started under it, not a live stranger's
    (here: this test's parent process, with stale numbers of the same role and rank)."""
    stranger = RoleMetrics("attention", 0, str(tmp_path))
    stranger.set_peers([0], False)
    snap = stranger.snapshot() | {"pid": os.getppid()}
    (tmp_path / f"attention-0-{os.getppid()}.json").write_text(json.dumps(snap))
    mine = RoleMetrics("attention", 0, str(tmp_path))
    mine.set_peers([0], True)
    mine.publish(now=True)
    text = scrape(tmp_path)
    assert 'afd_peer_up{peer="0",rank="0",role="attention"} 1.0' in text
    assert 'afd_peer_up{peer="0",rank="0",role="attention"} 0.0' not in text


def test_without_a_directory_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("AFD_METRICS_DIR", raising=False)
    m = RoleMetrics("ffn", 0)
    m.publish(now=True)
    assert m.directory is None and not list(tmp_path.iterdir())


LAYERS, STEPS = 3, 4


def ffn(port, directory, q):
    try:
        os.environ["AFD_METRICS_DIR"] = directory
        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", 0, 1, 1, port, layers=LAYERS)
        conn.init()
        server = FFNStepServer(conn, list(range(LAYERS)), lambda layer, h, *_: h + 1)
        import threading

        server.serve(threading.Event())
        conn.close()
        q.put(("ffn", "ok"))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def attention(port, directory, q):
    import torch

    try:
        os.environ["AFD_METRICS_DIR"] = directory
        conn = make("attention", 0, 1, 1, port, layers=LAYERS)
        conn.init()
        for step in range(STEPS):
            conn.begin_step((2 + step,))
            h = torch.zeros(2 + step, HIDDEN)
            for layer in range(LAYERS):
                h = conn.start_exchange(h, layer, 0).wait()
            conn.end_step()
        conn.close()
        q.put(("attention", "ok"))
    except Exception:
        q.put(("attention", "ERROR " + traceback.format_exc()))


@pytest.mark.vllm  # needs torch
def test_the_numbers_move_when_real_processes_run_steps(tmp_path):
    port = free_port()
    out = run_processes([(ffn, port, str(tmp_path)), (attention, port, str(tmp_path))])
    assert_no_errors(out)
    snaps = {s["role"]: s for s in (json.loads(p.read_text()) for p in tmp_path.glob("*.json"))}
    att, ffn_ = snaps["attention"], snaps["ffn"]
    assert att["counters"]["steps"] == STEPS and ffn_["counters"]["steps"] == STEPS
    assert sum(att["exchange_wait"]["counts"]) == STEPS * LAYERS
    assert sum(ffn_["exchange_wait"]["counts"]) == STEPS * LAYERS
    assert sum(att["rows"]["counts"]) == STEPS and att["rows"]["sum"] == sum(
        2 + s for s in range(STEPS)
    )
    assert ffn_["counters"]["ffn_busy_seconds"] > 0 and ffn_["counters"]["ffn_idle_seconds"] > 0
    # connected while serving; gone once the peer said goodbye (the last snapshot)
    assert att["peer_up"] == {"0": 0} and ffn_["peer_up"] == {"0": 0}
    assert att["counters"]["failed_steps"] == 0 == ffn_["counters"]["failed_steps"]


def test_exchange_wait_buckets_resolve_ten_microseconds_to_ten_seconds():
    """Issue 36 (operators can watch it): GPU exchanges take 30-300 us; every bucket from
    10 us to 10 s is at most 2.5x the one below it."""
    from afd_core.metrics import WAIT_BUCKETS

    assert WAIT_BUCKETS[0] == 1e-5 and 10.0 in WAIT_BUCKETS
    inside = [b for b in WAIT_BUCKETS if b <= 10.0]
    assert all(high / low <= 2.5 + 1e-9 for low, high in zip(inside, inside[1:], strict=False))

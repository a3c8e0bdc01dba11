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
    # issue 36: each step timed once on both sides, its payload counted once per direction
    # (float32 rows of HIDDEN: the attention side sends and gets back 4 * HIDDEN per layer)
    assert sum(att["step_duration"]["counts"]) == STEPS == sum(ffn_["step_duration"]["counts"])
    assert att["step_duration"]["sum"] >= ffn_["step_duration"]["sum"] > 0
    payload = sum(2 + s for s in range(STEPS)) * LAYERS * 4 * HIDDEN
    assert att["bytes_sent"] == {"0": payload} == att["bytes_received"]
    assert ffn_["bytes_sent"] == {"0": payload} == ffn_["bytes_received"]
    assert att["info"]["connector"] == "gloo" == ffn_["info"]["connector"]
    assert att["info"]["server"] == "0" and att["info"]["torch_version"] != "none"


@pytest.mark.vllm  # prometheus_client comes with vLLM (not in the afd-core lane)
def test_info_step_duration_bytes_and_step_age_show_in_prometheus_text(tmp_path, monkeypatch):
    from afd_core import metrics

    m = RoleMetrics("attention", 2, str(tmp_path))
    m.info.update(connector="gloo", server="2")
    m.count_step(False, 0.003)
    m.count_step(True, 0.2)
    m.add_bytes(0, 1000, 400)
    m.add_bytes(0, 1000, 400)
    m.publish(now=True)
    later = m.last_step_at + 42.0
    monkeypatch.setattr(metrics.time, "time", lambda: later)
    text = scrape(tmp_path)
    v = metrics.versions()
    info = (
        f'afd_info{{afd_plugin_version="{v["afd_plugin_version"]}",'
        f'afd_version="{v["afd_version"]}",connector="gloo",rank="2",role="attention",'
        f'server="2",torch_version="{v["torch_version"]}",vllm_version="{v["vllm_version"]}"}} 1.0'
    )
    assert info in text, text
    assert v["vllm_version"] != "none" and v["afd_version"]
    assert 'afd_steps_total{rank="2",role="attention"} 2.0' in text
    assert 'afd_failed_steps_total{rank="2",role="attention"} 1.0' in text
    assert 'afd_step_duration_seconds_bucket{le="0.005",rank="2",role="attention"} 1.0' in text
    assert 'afd_step_duration_seconds_count{rank="2",role="attention"} 2.0' in text
    assert 'afd_bytes_sent_total{peer="0",rank="2",role="attention"} 2000.0' in text
    assert 'afd_bytes_received_total{peer="0",rank="2",role="attention"} 800.0' in text
    assert 'afd_last_step_age_seconds{rank="2",role="attention"} 42.0' in text


@pytest.mark.vllm  # prometheus_client comes with vLLM (not in the afd-core lane)
def test_a_snapshot_of_an_older_rank_still_scrapes(tmp_path):
    """A relayed snapshot of a rank on another host running an older afd-core has none of
    the newer fields: the collector shows what it has."""
    snap = RoleMetrics("ffn", 0, str(tmp_path)).snapshot()
    for key in ("info", "step_duration", "bytes_sent", "bytes_received", "last_step_at"):
        del snap[key]
    (tmp_path / f"ffn-0-{os.getpid()}.json").write_text(json.dumps(snap))
    text = scrape(tmp_path)
    assert 'afd_steps_total{rank="0",role="ffn"} 0.0' in text
    assert 'afd_info{afd_plugin_version=""' in text
    assert "afd_last_step_age_seconds{" not in text


def test_exchange_wait_buckets_resolve_ten_microseconds_to_ten_seconds():
    """Issue 36 (operators can watch it): GPU exchanges take 30-300 us; every bucket from
    10 us to 10 s is at most 2.5x the one below it."""
    from afd_core.metrics import WAIT_BUCKETS

    assert WAIT_BUCKETS[0] == 1e-5 and 10.0 in WAIT_BUCKETS
    inside = [b for b in WAIT_BUCKETS if b <= 10.0]
    assert all(high / low <= 2.5 + 1e-9 for low, high in zip(inside, inside[1:], strict=False))


# -- a server spanning hosts: snapshots shared through the rendezvous store ---------------


class DictStore:
    """The rendezvous store as SnapshotShare sees it, in memory; `down` fails every call
    (the store went with FFN rank 0)."""

    def __init__(self, values: dict | None = None):
        self.values = {} if values is None else values
        self.down = False
        self.closed = False

    def store_set(self, key, value):
        if self.down:
            raise ConnectionError("store gone")
        self.values[key] = value

    def store_try_get(self, key):
        if self.down:
            raise ConnectionError("store gone")
        return self.values.get(key)

    def close(self):
        self.closed = True


def two_hosts(tmp_path, role="attention"):
    """Rank 0 on the head host (relays into head/), rank 1 on another host (its own
    directory, which no API server reads), sharing one store."""
    from afd_core.metrics import SnapshotShare

    store = DictStore()
    head = RoleMetrics(role, 0, str(tmp_path / "head"))
    remote = RoleMetrics(role, 1, str(tmp_path / "remote"))
    shares = [SnapshotShare(m, 0, [0, 1], lambda: store) for m in (head, remote)]
    return store, head, remote, *shares


def shown(tmp_path) -> dict:
    return {(s["role"], s["rank"]): s for s in AFDCollector(str(tmp_path / "head"))._snapshots()}


def test_the_head_shows_another_hosts_rank_once_its_snapshot_moves(tmp_path):
    store, head, remote, head_share, remote_share = two_hosts(tmp_path)
    assert head_share.relayed == [1] and remote_share.relayed == []  # the first rank relays
    remote.set_peers([0], True)
    remote.add("steps", 3)
    remote_share.share_once()
    head_share.share_once()
    # a first value read may be an old process's: not shown until it moves
    assert ("attention", 1) not in shown(tmp_path)
    assert sorted(store.values) == ["afd/metrics/attention/0/0", "afd/metrics/attention/0/1"]
    remote.add("steps")
    remote_share.share_once()
    head_share.share_once()
    snap = shown(tmp_path)[("attention", 1)]
    assert snap["counters"]["steps"] == 4 and snap["peer_up"] == {"0": 1}
    assert "stale_s" not in snap
    assert snap["pid"] == os.getpid()  # the relay's: the collector keeps it while it lives
    # the other host's own directory is not the head's
    assert not list((tmp_path / "head").glob("attention-1-*"))


def test_a_relayed_rank_that_stops_reporting_shows_down_and_back(tmp_path, monkeypatch):
    import time

    from afd_core import metrics

    _, _, remote, head_share, remote_share = two_hosts(tmp_path)
    remote.set_peers([0], True)
    for _ in range(2):
        remote_share.share_once()
        head_share.share_once()
    assert shown(tmp_path)[("attention", 1)]["peer_up"] == {"0": 1}
    # the remote rank stops writing (its process or host stopped): the head reads the same
    # snapshot again and again; past STALE_AFTER_S it shows every peer down
    head_share.share_once()
    later = time.time() + metrics.STALE_AFTER_S + 1
    monkeypatch.setattr(metrics.time, "time", lambda: later)
    head_share.share_once()
    snap = shown(tmp_path)[("attention", 1)]
    assert snap["peer_up"] == {"0": 0} and snap["stale_s"] > metrics.STALE_AFTER_S
    # it reports again: up at once
    remote_share.share_once()
    head_share.share_once()
    snap = shown(tmp_path)[("attention", 1)]
    assert snap["peer_up"] == {"0": 1} and "stale_s" not in snap


def test_a_relay_that_stops_refreshing_shows_its_ranks_down(tmp_path, monkeypatch):
    """The store gone (FFN rank 0 lost) or the relay stuck: the relayed files are not
    refreshed, and the collector's own clock makes them stale."""
    import time

    from afd_core import metrics

    store, _, _, head_share, remote_share = two_hosts(tmp_path)
    for _ in range(2):
        remote_share.share_once()
        head_share.share_once()
    store.down = True
    remote_share.share_once()  # swallowed: metrics never stop a rank
    head_share.share_once()
    later = time.time() + metrics.STALE_AFTER_S + 1
    monkeypatch.setattr(metrics.time, "time", lambda: later)
    assert "stale_s" in shown(tmp_path)[("attention", 1)]


def test_a_failed_store_is_dropped_and_reopened(tmp_path):
    from afd_core.metrics import SnapshotShare

    values, opened = {}, []

    def open_store():
        if len(opened) == 1:  # the second open fails: FFN rank 0 not back yet
            opened.append(None)
            raise ConnectionError("nobody listens")
        opened.append(DictStore(values))
        return opened[-1]

    m = RoleMetrics("ffn", 1, str(tmp_path))
    share = SnapshotShare(m, 0, [0, 1], open_store)
    share.share_once()
    assert json.loads(values["afd/metrics/ffn/0/1"])["seq"] == 1
    opened[0].down = True
    share.share_once()  # fails: the client is closed and dropped
    assert opened[0].closed
    share.share_once()  # the open fails
    share.share_once()  # a fresh client
    assert len(opened) == 3 and json.loads(values["afd/metrics/ffn/0/1"])["seq"] == 3


def test_a_local_snapshot_wins_over_a_relayed_one(tmp_path):
    """The head host's other ranks share their snapshots too: the head's own file of a rank
    is the one shown while its process lives."""
    from afd_core.metrics import SnapshotShare

    store = DictStore()
    head = RoleMetrics("attention", 0, str(tmp_path / "head"))
    local = RoleMetrics("attention", 1, str(tmp_path / "head"))
    shares = [SnapshotShare(m, 0, [0, 1], lambda: store) for m in (head, local)]
    local.add("steps", 5)
    local.publish(now=True)
    for _ in range(2):
        for share in reversed(shares):
            share.share_once()
    assert list((tmp_path / "head").glob("relayed-attention-1-*.json"))
    snaps = [s for s in AFDCollector(str(tmp_path / "head"))._snapshots() if s["rank"] == 1]
    assert len(snaps) == 1 and "relayed" not in snaps[0]


def test_a_snapshot_published_now_is_shared_at_once(tmp_path):
    """A peer lost or back reaches the store without waiting for the next interval; the
    thread's last write is the closing rank's snapshot, and a relay removes its files."""
    import time

    from afd_core.metrics import SnapshotShare

    store = DictStore()
    m = RoleMetrics("attention", 1, str(tmp_path))
    share = SnapshotShare(m, 0, [0, 1], lambda: store, interval_s=60.0)
    m.share = share
    share.start()
    m.set_peers([0], False)
    m.publish(now=True)
    deadline = time.monotonic() + 5
    while "afd/metrics/attention/0/1" not in store.values:
        assert time.monotonic() < deadline, "not shared at once"
        time.sleep(0.01)
    assert json.loads(store.values["afd/metrics/attention/0/1"])["peer_up"] == {"0": 0}
    m.add("steps")
    share.close()
    share._thread.join(5)
    assert json.loads(store.values["afd/metrics/attention/0/1"])["counters"]["steps"] == 1
    assert store.closed


@pytest.mark.vllm  # prometheus_client comes with vLLM (not in the afd-core lane)
def test_a_stale_relayed_rank_scrapes_with_its_peers_down(tmp_path, monkeypatch):
    import time

    from afd_core import metrics

    _, _, remote, head_share, remote_share = two_hosts(tmp_path)
    remote.set_peers([0], True)
    remote.add("steps", 2)
    for _ in range(2):
        remote_share.share_once()
        head_share.share_once()
    text = scrape(tmp_path / "head")
    assert 'afd_steps_total{rank="1",role="attention"} 2.0' in text
    assert 'afd_peer_up{peer="0",rank="1",role="attention"} 1.0' in text
    later = time.time() + metrics.STALE_AFTER_S + 1
    monkeypatch.setattr(metrics.time, "time", lambda: later)
    text = scrape(tmp_path / "head")
    assert 'afd_peer_up{peer="0",rank="1",role="attention"} 0.0' in text
    assert 'afd_steps_total{rank="1",role="attention"} 2.0' in text  # its last numbers


def spanning_ffn(rank, port, marks, q):
    """FFN rank `rank` of two; FFN rank 1 crashes in the middle of a step once told to."""
    try:
        import threading

        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", rank, 2, 2, port, layers=LAYERS)
        conn.init()

        def compute(layer, h, *_):
            if rank == 1 and layer == 1 and (marks / "crash").exists():
                os._exit(9)  # its store client, links and share gone
            return h + 1

        FFNStepServer(conn, list(range(LAYERS)), compute).serve(threading.Event())
        conn.close()
        q.put((f"ffn{rank}", "ok"))
    except Exception:
        q.put((f"ffn{rank}", "ERROR " + traceback.format_exc()))


def spanning_attention(rank, port, marks, q):
    """Attention ranks 0 and 1 of one server on two "hosts" (a metrics directory each),
    served by FFN ranks 0 and 1: rank 0 (the head's) sees rank 1's steps, then rank 1
    without its FFN rank (/health's check), then rank 1 silent once it stopped."""
    import time

    import torch

    from afd_core import metrics
    from afd_core.connectors.base import AFDFFNLostError
    from tests.afd_core.gloo_harness import wait_for

    def step():
        conn.begin_step((2,))
        h = torch.zeros(2, HIDDEN)
        for layer in range(LAYERS):
            h = conn.start_exchange(h, layer, 0).wait()
        conn.end_step()

    try:
        os.environ["AFD_METRICS_DIR"] = str(marks / f"host{rank}")
        conn = make("attention", rank, 2, 2, port, layers=LAYERS)
        conn.init()
        conn.share_metrics([0, 1])
        for _ in range(STEPS):
            step()
        if rank == 1:
            wait_for(marks / "crash", 30)
            try:
                step()
            except AFDFFNLostError:
                pass
            wait_for(marks / "seen-lost", 30)
            conn.close()
            (marks / "closed").touch()
            q.put((rank, "ok"))
            return
        metrics._registered = metrics.AFDCollector(os.environ["AFD_METRICS_DIR"], os.getpid())
        deadline = time.monotonic() + 30

        def rank1(until):
            while not until(snap := next((s for s in metrics._registered._snapshots()
                                          if s["rank"] == 1), None)):  # fmt: skip
                assert time.monotonic() < deadline, f"rank 1 on the head: {snap}"
                time.sleep(0.1)
            return snap

        shown = rank1(lambda s: s is not None and s["counters"]["steps"] == STEPS)
        healthy = metrics.ffn_ranks_gone()
        (marks / "crash").touch()
        rank1(lambda s: s["peer_up"] == {"1": 0})
        lost = metrics.ffn_ranks_gone()
        (marks / "seen-lost").touch()
        wait_for(marks / "closed", 30)
        metrics.STALE_AFTER_S = 1.5
        stale = rank1(lambda s: "stale_s" in s)
        silent = metrics.ffn_ranks_gone()
        conn.close()
        q.put((rank, {"shown": shown, "healthy": healthy, "lost": lost, "stale": stale,
                      "silent": silent}))  # fmt: skip
    except Exception:
        q.put((rank, "ERROR " + traceback.format_exc()))


@pytest.mark.vllm  # needs torch
def test_a_rank_on_another_host_shows_on_the_heads_metrics_and_health(tmp_path, monkeypatch):
    """Real processes, the store behind the deployment secret's gate: each attention rank
    shares its snapshot through its own client of FFN rank 0's store, the server's first
    rank relays the other's into its directory; the other rank's FFN rank lost, and the
    other rank stopped, each make the head's /health check fail."""
    monkeypatch.setenv("AFD_DEPLOYMENT_SECRET", "a-secret-of-enough-length-for-the-gate")
    port = free_port()
    out = run_processes(
        [
            (spanning_ffn, 0, port, tmp_path),
            (spanning_ffn, 1, port, tmp_path),
            (spanning_attention, 0, port, tmp_path),
            (spanning_attention, 1, port, tmp_path),
        ],
        expect=3,  # FFN rank 1 crashes
    )
    assert_no_errors(out)
    head = out[0]
    shown, stale = head["shown"], head["stale"]
    assert shown["relayed"]["pid"] != shown["pid"] and shown["peer_up"] == {"1": 1}
    assert head["healthy"] == []
    assert head["lost"] == ["attention rank 1 has no FFN rank 1"]
    assert stale["peer_up"] == {"1": 0} and stale["counters"]["steps"] == STEPS + 1
    assert stale["counters"]["failed_steps"] == 1 and stale["counters"]["peers_lost"] == 1
    (silent,) = head["silent"]
    assert silent.startswith("attention rank 1 (another host's) has not reported for"), silent
    # the other host's directory has rank 1's own snapshot only (the head's is relayed)
    assert [p.name.split("-")[:2] for p in (tmp_path / "host1").glob("*.json")] == [
        ["attention", "1"]
    ]

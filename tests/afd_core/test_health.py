"""An attention server's /health while no FFN rank serves it (patches/health.py): 503 while
a rank of the server shows afd_peer_up 0 for its FFN rank, 200 again once it is back. The
route's behaviour is pinned against vLLM 0.32's own handler."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest

from afd_core import metrics
from afd_core.metrics import AFDCollector, RoleMetrics

pytestmark = pytest.mark.vllm


@pytest.fixture
def patch_health():
    """health's patch on a stand-in AsyncLLM class, undone after the test (the catalogue
    keys what it patched by the class's id, which a later test's class may reuse)."""
    from afd_core.patches import catalogue, health

    patched = []

    def patch(cls):
        health._patch(SimpleNamespace(AsyncLLM=cls))
        patched.append(cls)

    yield patch
    for cls in patched:
        catalogue.restore_attr(cls, "check_health")


def _vllm_health_status(engine_client) -> int:
    """What vLLM 0.32's /health route answers for this engine client."""
    from vllm.entrypoints.serve.instrumentator.health import health

    request = SimpleNamespace(
        app=SimpleNamespace(state=SimpleNamespace(engine_client=engine_client))
    )
    return asyncio.run(health(request)).status_code


def test_vllms_health_route_answers_503_only_for_engine_dead_error():
    from vllm.v1.engine.exceptions import EngineDeadError

    class Client:
        def __init__(self, error=None):
            self.error = error

        async def check_health(self):
            if self.error is not None:
                raise self.error

    assert _vllm_health_status(Client()) == 200
    assert _vllm_health_status(Client(EngineDeadError())) == 503


def test_an_attention_server_is_not_ready_while_its_ffn_rank_is_gone(
    tmp_path, monkeypatch, patch_health
):
    class AsyncLLM:  # vLLM's check: its own flag only (v1/engine/async_llm.py:1089)
        errored = False

        async def check_health(self):
            if self.errored:
                raise RuntimeError("engine dead")

    patch_health(AsyncLLM)
    monkeypatch.setattr(metrics, "_registered", AFDCollector(str(tmp_path), os.getpid()))
    engine = AsyncLLM()
    attention = RoleMetrics("attention", 2, str(tmp_path))
    ffn = RoleMetrics("ffn", 0, str(tmp_path))
    ffn.set_peers([2, 3], True)
    ffn.set_peers([3], False)  # an FFN rank's lost peer says nothing of this server
    ffn.publish(now=True)
    attention.set_peers([0], True)
    attention.publish(now=True)
    assert _vllm_health_status(engine) == 200

    attention.set_peers([0], False)  # the FFN rank is lost
    attention.publish(now=True)
    assert metrics.ffn_ranks_gone() == ["attention rank 2 has no FFN rank 0"]
    assert _vllm_health_status(engine) == 503

    attention.set_peers([0], True)  # served again
    attention.publish(now=True)
    assert _vllm_health_status(engine) == 200

    engine.errored = True  # vLLM's own check still comes first
    with pytest.raises(RuntimeError, match="engine dead"):
        asyncio.run(engine.check_health())


def test_without_a_collector_nothing_is_gone(monkeypatch):
    monkeypatch.setattr(metrics, "_registered", None)
    assert metrics.ffn_ranks_gone() == []


def test_a_server_spanning_hosts_is_not_ready_while_another_hosts_rank_is_down(
    tmp_path, monkeypatch, patch_health
):
    """The head host's /health sees the other host's attention rank through its relayed
    snapshot (metrics.SnapshotShare): 503 while that rank has no FFN rank, and while it
    stopped reporting (its process, its host or the store stopped)."""
    import time

    from afd_core.metrics import SnapshotShare
    from tests.afd_core.test_metrics import DictStore

    class AsyncLLM:
        async def check_health(self):
            return None

    patch_health(AsyncLLM)
    monkeypatch.setattr(metrics, "_registered", AFDCollector(str(tmp_path / "head"), os.getpid()))
    store = DictStore()
    head = RoleMetrics("attention", 0, str(tmp_path / "head"))
    remote = RoleMetrics("attention", 1, str(tmp_path / "remote"))
    shares = [SnapshotShare(m, 0, [0, 1], lambda: store) for m in (remote, head)]

    def share():
        for s in shares:
            s.share_once()

    head.set_peers([0], True)
    head.publish(now=True)
    remote.set_peers([0], True)
    share()
    share()
    assert _vllm_health_status(AsyncLLM()) == 200

    remote.set_peers([0], False)  # the other host's rank lost its FFN rank
    share()
    assert metrics.ffn_ranks_gone() == ["attention rank 1 has no FFN rank 0"]
    assert _vllm_health_status(AsyncLLM()) == 503

    remote.set_peers([0], True)
    share()
    assert _vllm_health_status(AsyncLLM()) == 200

    later = time.time() + metrics.STALE_AFTER_S + 1  # it stopped reporting
    monkeypatch.setattr(metrics.time, "time", lambda: later)
    (gone,) = metrics.ffn_ranks_gone()
    assert gone.startswith("attention rank 1 (another host's) has not reported for "), gone
    assert _vllm_health_status(AsyncLLM()) == 503


# -- a stuck engine (afd_core/stuck.py) ------------------------------------------------------
def test_a_stuck_engine_is_one_whose_requests_wait_with_no_step_for_stuck_after_s():
    from afd_core.stuck import ANY_RANK, StuckWatch

    def last(t):  # one DP rank (0) whose newest step ended at t
        return {0: t, ANY_RANK: t}

    watch = StuckWatch(10.0)
    assert watch.check({}, last(100.0), 500.0) is None  # idle: no step for long is fine
    assert watch.check({0: 2}, last(100.0), 500.0) is None  # seen: their wait starts now
    assert watch.check({0: 2}, last(100.0), 510.0) is None  # within the bound
    why = watch.check({0: 2}, last(100.0), 511.0)
    assert why.startswith("no step ended on attention DP rank 0 for 11 s while 2 request(s)")
    assert "stuck_after_s=10" in why
    assert watch.check({0: 2}, last(511.5), 512.0) is None  # a step ended: moving again
    assert watch.check({0: 1}, last(511.5), 521.0) is None  # 9.5 s since: within the bound
    assert watch.check({0: 1}, last(511.5), 522.0) is not None
    assert watch.check({}, last(511.5), 600.0) is None  # done: the wait is over
    assert watch.check({0: 1}, last(511.5), 601.0) is None  # a new request waits from now
    assert StuckWatch(0.0).check({0: 5}, last(0.0), 1e9) is None  # 0 turns the check off
    assert StuckWatch(10.0).check({0: 5}, {}, 1e9) is None  # no rank published yet


def test_with_async_dp_a_rank_is_stuck_while_the_others_step():
    """Async DP (issue 36): the data-parallel ranks step on their own, so a rank whose
    requests wait while another rank steps is stuck all the same; requests not routed yet
    count against the server's newest step."""
    from afd_core.stuck import ANY_RANK, StuckWatch

    watch = StuckWatch(10.0)
    steps = {0: 100.0, 1: 495.0, ANY_RANK: 495.0}  # rank 1 steps, rank 0 does not
    assert watch.check({0: 1, 1: 3}, steps, 500.0) is None
    steps = {0: 100.0, 1: 509.0, ANY_RANK: 509.0}
    why = watch.check({0: 1, 1: 3}, steps, 511.0)
    assert why.startswith("no step ended on attention DP rank 0 for 11 s while 1 request(s)")
    assert "DP rank 1" not in why
    # a rank with no snapshot of its own yet, and requests not routed yet: the newest step
    watch = StuckWatch(10.0)
    assert watch.check({2: 1, ANY_RANK: 1}, steps, 512.0) is None
    assert watch.check({2: 1, ANY_RANK: 1}, steps, 520.0) is None  # 8 s after it ended
    why = watch.check({2: 1, ANY_RANK: 1}, steps, 523.0)
    assert "any attention rank for 11 s" in why and "attention DP rank 2 for 11 s" in why


def test_each_dp_ranks_newest_step_comes_from_its_tensor_parallel_ranks_snapshots():
    from afd_core.stuck import ANY_RANK, last_step_by_dp_rank

    # a server from attention rank 4, TP 2: ranks 4-5 are DP rank 0, 6-7 DP rank 1
    snaps = [
        {"rank": 4, "last_step_at": 10.0},
        {"rank": 5, "last_step_at": 12.0},
        {"rank": 6, "last_step_at": 30.0},
        {"rank": 7},  # relayed without one: says nothing
    ]
    assert last_step_by_dp_rank(snaps, 4, 2) == {0: 12.0, 1: 30.0, ANY_RANK: 30.0}
    assert last_step_by_dp_rank([], 0, 1) == {}


def test_requests_are_counted_on_the_dp_rank_vllms_client_routed_them_to():
    """Pinned against vLLM 0.32: the data-parallel client (DPLBAsyncMPClient) records each
    request's engine in reqs_in_flight, an engine's identity is its DP rank as two
    little-endian bytes, and a client of one engine keeps it as core_engine."""
    import inspect

    from vllm.v1.engine import core_client

    from afd_core.stuck import ANY_RANK, waiting_by_dp_rank

    routing = inspect.getsource(core_client.DPLBAsyncMPClient.get_core_engine_for_request)
    assert "self.reqs_in_flight[request.request_id] = chosen_engine" in routing
    mp = inspect.getsource(core_client.MPClient.__init__)
    assert 'rank.to_bytes(2, "little") for rank in self.engine_ranks_managed' in mp
    assert "self.core_engine: EngineIdentity = self.core_engines[0]" in mp

    def engine(states, core):
        return SimpleNamespace(
            output_processor=SimpleNamespace(request_states=dict.fromkeys(states)),
            engine_core=core,
        )

    dp = [r.to_bytes(2, "little") for r in range(3)]
    routed = SimpleNamespace(reqs_in_flight={"a": dp[0], "b": dp[2], "c": dp[2], "gone": dp[1]})
    assert waiting_by_dp_rank(engine(["a", "b", "c", "new"], routed)) == {
        0: 1,
        2: 2,
        ANY_RANK: 1,
    }
    assert waiting_by_dp_rank(engine([], routed)) == {}
    one = SimpleNamespace(core_engine=dp[1])  # external load balancing: DP rank 1's own
    assert waiting_by_dp_rank(engine(["a", "b"], one)) == {1: 2}


def test_every_api_process_sees_the_stuck_engine_once_the_one_holding_requests_was_checked(
    tmp_path,
):
    """With --api-server-count 2 a check lands on either process; only one holds the
    requests. Its report in the metrics directory makes the other answer alike, until a
    step ends after that report."""
    from afd_core.stuck import ANY_RANK, StuckWatch, Waiting, read_reports

    def last(t):
        return {0: t, 1: t, ANY_RANK: t}

    holder, other = StuckWatch(10.0, str(tmp_path)), StuckWatch(10.0, str(tmp_path))
    assert holder.check({1: 3}, last(100.0), 200.0) is None  # reports: 3 on rank 1 since 200
    assert read_reports(str(tmp_path), lambda pid: True) == []  # not its own (one pid here)
    mine = Waiting(**json.loads((tmp_path / f"api-{os.getpid()}.waiting").read_text()))
    assert (mine.unfinished, mine.since, mine.checked_at) == ({"1": 3}, {"1": 200.0}, 200.0)
    assert other.check({}, last(100.0), 209.0, [mine]) is None
    why = other.check({}, last(100.0), 211.0, [mine])
    assert why is not None and "DP rank 1 for 11 s while 3 request(s) wait" in why
    # a step ended after the holder's report: the engine moved on, the report is outdated
    assert other.check({}, last(205.0), 300.0, [mine]) is None
    # another release's report (one count for the whole server) is left out
    (tmp_path / "api-1.waiting").write_text(
        json.dumps({"pid": 1, "unfinished": 3, "since": 1.0, "checked_at": 2.0})
    )
    assert read_reports(str(tmp_path), lambda pid: True) == []


def test_a_stuck_attention_engine_answers_503_and_200_once_it_steps(
    tmp_path, monkeypatch, patch_health
):
    """The patch reads the attention server's afd config (stuck_after_s), its tensor
    parallel size, and vLLM's output processor and client (this API process's unfinished
    requests and the DP rank each went to)."""
    import time

    from afd_core.metrics import server_processes

    config = {
        "role": "attention",
        "connector": "gloo",
        "connector_extra_config": {"stuck_after_s": 5},
    }

    class AsyncLLM:
        vllm_config = SimpleNamespace(
            additional_config={"afd": config},
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        )

        def __init__(self):
            self.output_processor = SimpleNamespace(request_states={})
            self.engine_core = SimpleNamespace(core_engine=(0).to_bytes(2, "little"))

        async def check_health(self):
            return None

    patch_health(AsyncLLM)
    monkeypatch.setattr(metrics, "_registered", AFDCollector(str(tmp_path), os.getpid()))
    assert server_processes()[0] == str(tmp_path)
    engine = AsyncLLM()
    rank = RoleMetrics("attention", 0, str(tmp_path))
    rank.set_peers([0], True)
    rank.last_step_at = time.time() - 100  # idle for long
    rank.publish(now=True)
    assert _vllm_health_status(engine) == 200
    engine.output_processor.request_states["r1"] = object()
    assert _vllm_health_status(engine) == 200  # the first check that sees it
    engine._afd_stuck_watch.waiting_since[0] -= 6  # as if seen 6 s ago
    assert _vllm_health_status(engine) == 503
    rank.count_step(failed=False)
    rank.publish(now=True)
    assert _vllm_health_status(engine) == 200


def _ffn_server(patch_health, monkeypatch, tmp_path, stuck_after_s: float):
    """A stand-in AsyncLLM class of an FFN server's API process (its afd config, vLLM's own
    check passing), patched, with this test's collector over tmp_path."""

    class AsyncLLM:
        vllm_config = SimpleNamespace(
            additional_config={
                "afd": {
                    "role": "ffn",
                    "connector": "gloo",
                    "connector_extra_config": {"stuck_after_s": stuck_after_s},
                }
            }
        )

        async def check_health(self):
            return None

    patch_health(AsyncLLM)
    monkeypatch.setattr(metrics, "_registered", AFDCollector(str(tmp_path), os.getpid()))
    return AsyncLLM


def test_an_ffn_server_answers_503_while_a_rank_is_in_one_step_past_its_bound(
    tmp_path, monkeypatch, patch_health
):
    """An FFN server's ranks publish the step in flight and its waits' bound: /health
    answers 503 once a rank has been in it longer than the bound plus stuck_after_s (a
    stalled attention peer is dropped within the bound: longer, the rank itself is stuck),
    200 once the step ends."""
    import time

    AsyncLLM = _ffn_server(patch_health, monkeypatch, tmp_path, stuck_after_s=5)
    engine = AsyncLLM()
    rank = RoleMetrics("ffn", 1, str(tmp_path))
    rank.publish(now=True)
    assert _vllm_health_status(engine) == 200  # idle between steps, however long
    rank.begin_step(3.0)
    rank.step_started_at = time.time() - 7.5  # within 3 + 5 s
    rank.publish(now=True)
    assert _vllm_health_status(engine) == 200
    rank.step_started_at = time.time() - 8.5
    rank.publish(now=True)
    assert _vllm_health_status(engine) == 503
    with pytest.raises(
        Exception,
        match=r"FFN rank 1 has been in one step for \d+ s \(its waits' bound 3 s \+ stuck_after_s=5\)",
    ):
        asyncio.run(engine.check_health())
    rank.count_step(failed=False)
    rank.publish(now=True)
    assert _vllm_health_status(engine) == 200


def test_vllms_api_process_counts_its_unfinished_requests_where_the_patch_reads_them():
    """Pinned against vLLM 0.32: AsyncLLM keeps its OutputProcessor as output_processor
    (its requests in request_states, by the id the client routes them by), its client as
    engine_core, and its vllm_config, which the patch reads."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    init = inspect.getsource(AsyncLLM.__init__)
    assert "self.output_processor = OutputProcessor(" in init
    assert "self.vllm_config = vllm_config" in init
    assert "self.engine_core = EngineCoreClient.make_async_mp_client(" in init
    add = inspect.getsource(OutputProcessor.add_request)
    assert "self.request_states[request_id] = req_state" in add
    assert "request_id = request.request_id" in add
    processor = OutputProcessor.__new__(OutputProcessor)
    processor.request_states = {"a": object(), "b": object()}
    assert processor.get_num_unfinished_requests() == 2


def test_a_rank_rewrites_its_snapshot_while_alive_and_stops_when_closed(tmp_path, monkeypatch):
    """Idle or busy, a rank's own thread rewrites its snapshot every REFRESH_S: only a
    stopped or hung process leaves it to age."""
    import time

    monkeypatch.setattr(metrics, "REFRESH_S", 0.2)
    rank = RoleMetrics("ffn", 0, str(tmp_path))
    rank.publish(now=True)
    path = next(tmp_path.glob("ffn-0-*.json"))
    first = json.loads(path.read_text())["published_at"]
    time.sleep(0.7)  # no step, no publish
    second = json.loads(path.read_text())["published_at"]
    assert second > first
    rank.close()
    time.sleep(0.5)
    assert json.loads(path.read_text())["published_at"] - second < 0.45  # at most one more


def test_a_server_whose_rank_stopped_refreshing_answers_503(tmp_path, monkeypatch, patch_health):
    """A rank's process stopped (SIGSTOP) or hung holding the interpreter, idle: its
    snapshot ages past max(stuck_after_s, 3 x REFRESH_S); the FFN server answers 503."""
    import time

    from afd_core.stuck import ranks_not_refreshing

    now = 1000.0
    snaps = [
        {"role": "ffn", "rank": 0, "published_at": now - 14},
        {"role": "ffn", "rank": 1, "published_at": now - 16},
        {"role": "ffn", "rank": 2, "published_at": None},  # relayed from a rank writing none
    ]
    (why,) = ranks_not_refreshing(snaps, 5.0, now)  # the bound: 3 x REFRESH_S = 15 s
    assert why.startswith("ffn rank 1 has not refreshed its numbers for 16 s"), why
    assert ranks_not_refreshing(snaps, 20.0, now) == []
    assert ranks_not_refreshing(snaps, 0.0, now) == []  # off

    AsyncLLM = _ffn_server(patch_health, monkeypatch, tmp_path, stuck_after_s=20)
    rank = RoleMetrics("ffn", 0, str(tmp_path))
    rank.close()  # no refresh thread: this test moves its time by hand
    rank.publish(now=True)
    engine = AsyncLLM()
    assert _vllm_health_status(engine) == 200
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 21)
    assert _vllm_health_status(engine) == 503

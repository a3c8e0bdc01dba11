"""An attention server's /health while no FFN rank serves it (patches/health.py): 503 while
a rank of the server shows afd_peer_up 0 for its FFN rank, 200 again once it is back. The
route's behaviour is pinned against vLLM 0.32's own handler."""

from __future__ import annotations

import asyncio
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

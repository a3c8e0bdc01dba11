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


def test_an_attention_server_is_not_ready_while_its_ffn_rank_is_gone(tmp_path, monkeypatch):
    from afd_core.patches import health

    class AsyncLLM:  # vLLM's check: its own flag only (v1/engine/async_llm.py:1089)
        errored = False

        async def check_health(self):
            if self.errored:
                raise RuntimeError("engine dead")

    health._patch(SimpleNamespace(AsyncLLM=AsyncLLM))
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

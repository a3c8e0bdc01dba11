"""vLLM 0.32's fault-tolerance contract, and AFD's answer to it on attention servers
(afd_core/fault_tolerance.py, patch `fault_tolerance`).

The contract is read from vLLM's code objects: its router's paths and methods, its
instructions, its state names, its client's status body, its routes' answers to good and
bad input (run in a FastAPI test client next to AFD's), and what its flag requires."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from argparse import Namespace
from types import SimpleNamespace

import pytest

from afd_core import fault_tolerance as ft
from afd_core import metrics
from afd_core.metrics import AFDCollector, RoleMetrics

pytestmark = pytest.mark.vllm


# -- vLLM's contract ------------------------------------------------------------------------
def _routes(router) -> set[tuple[str, str]]:
    return {(r.path, m) for r in router.routes for m in r.methods}


def test_vllms_routes_and_instructions_are_afds():
    from vllm.entrypoints.serve.fault_tolerance import api_router

    assert _routes(api_router.router) == {(ft.STATUS_PATH, "GET"), (ft.APPLY_PATH, "POST")}
    assert _routes(ft.make_router()) == _routes(api_router.router)
    assert set(api_router._ALLOWED_INSTRUCTIONS) == set(ft.INSTRUCTIONS)


def test_vllms_state_names_are_afds():
    from vllm.v1.engine import EngineStatusType

    assert {s.name.lower() for s in EngineStatusType} == {ft.HEALTHY, ft.UNHEALTHY, ft.DEAD}


def test_vllms_status_body():
    """AsyncMPClient.get_status (v1/engine/core_client.py), run on its own state: the body
    AFD's status has, key for key."""
    from vllm.v1.engine.core_client import AsyncMPClient

    client = SimpleNamespace(
        engine_ranks_managed=[0, 1],
        _engine_status={
            0: {"id": 0, "status": "healthy"},
            1: {"id": 1, "status": "unhealthy", "fault_info": "RuntimeError"},
        },
    )
    vllm = asyncio.run(AsyncMPClient.get_status(client))
    afd = ft.engine_states(
        [0, 1], lambda e: range(e, e + 1), [(1, "attention rank 1 has no FFN rank 0")], False
    )
    assert vllm.keys() == afd.keys() == {"schema_version", "total_engines", "engines"}
    assert (vllm["schema_version"], vllm["total_engines"]) == (afd["schema_version"], 2)
    assert [e.keys() for e in vllm["engines"]] == [e.keys() for e in afd["engines"]]
    assert [e["status"] for e in afd["engines"]] == ["healthy", "unhealthy"]


def test_vllm_registers_its_routes_only_with_its_flag():
    from fastapi import FastAPI
    from vllm.entrypoints.launchers.api_server.routers import register_api_routers

    def paths(flag: bool) -> set[str]:
        app = FastAPI()
        app.state.args = Namespace(enable_fault_tolerance=flag)
        register_api_routers(app.state.args, app, ("generate",))
        return {r.path for r in app.routes}

    assert {ft.STATUS_PATH, ft.APPLY_PATH} <= paths(True)
    assert not {ft.STATUS_PATH, ft.APPLY_PATH} & paths(False)


def test_vllms_flag_needs_data_parallel_with_external_load_balancing(checkpoints):
    """Why AFD answers the routes without the flag: vLLM refuses it on a server with one
    data-parallel rank, and its GPU worker (the CPU worker's base) wants an all2all backend
    an attention server has no use for."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.sentinel.gpu_worker_sentinel import FT_BACKEND_SET

    model = str(checkpoints("qwen3_moe"))

    def build(**kw):
        return EngineArgs(
            model=model, max_model_len=128, enforce_eager=True, enable_fault_tolerance=True, **kw
        ).create_engine_config()

    with pytest.raises(ValueError, match="external load balancer mode"):
        build()
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        build(data_parallel_rank=0)
    with pytest.raises(ValueError, match="single API server process"):
        ParallelConfig(enable_fault_tolerance=True, _api_process_count=2)
    assert issubclass(CPUWorker, Worker)
    assert {"deepep_low_latency", "nixl_ep"} == FT_BACKEND_SET


# -- the routes, vLLM's and AFD's, in a test client -------------------------------------------
class Engine:
    """A stand-in engine client: vLLM's routes call get_status/handle_fault, AFD's
    collective_rpc (through the engine core where it has one)."""

    def __init__(self, tp: int = 1, start_rank: int = 0):
        self.vllm_config = SimpleNamespace(
            additional_config={
                "afd": {"role": "attention", "num_attention_ranks": 4, "start_rank": start_rank}
            },
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_rank=0),
        )
        self.errored = False
        self.rpcs: list[str] = []
        self.faults: list = []

    async def get_status(self):
        return {"schema_version": 1, "total_engines": 1, "engines": []}  # flag off

    async def handle_fault(self, request):
        from vllm.v1.fault_tolerance.utils import FaultToleranceResult

        self.faults.append(request)
        return FaultToleranceResult(request_id=request.request_id, success=True)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append(method)
        return [{"rank": 0, "retried": True}]


def _client(router_app):
    from fastapi.testclient import TestClient

    return TestClient(router_app)


def _app(routes: str, engine: Engine):
    from fastapi import FastAPI
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app = FastAPI()
    app.state.args = Namespace(log_error_stack=False, api_server_count=1)
    app.state.engine_client = engine
    if routes == "vllm":
        from vllm.entrypoints.serve.fault_tolerance.api_router import (
            register_fault_tolerance_api_router,
        )

        register_fault_tolerance_api_router(app)
    else:
        plugin = ft.AFDFaultToleranceRoutes()
        plugin.attach_router(app)
        asyncio.run(plugin.init_state(engine, app.state, app.state.args))
    init_exception_handler(app)
    return app


@pytest.fixture
def no_ranks(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "_registered", AFDCollector(str(tmp_path), os.getpid()))
    return tmp_path


BAD = {
    "unknown instruction": ({"instruction": "reboot"}, "Invalid instruction: 'reboot'"),
    "no instruction": ({"params": {}}, "'instruction' is required"),
    "params not an object": ({"instruction": "retry", "params": 3}, "'params' must be an object"),
    "not an object": ([1, 2], "Request body must be a JSON object"),
    "malformed JSON": (b"{instruction: retry", "Invalid JSON format"),
}


def _post(client, body):
    if isinstance(body, bytes):
        return client.post(
            ft.APPLY_PATH, content=body, headers={"content-type": "application/json"}
        )
    return client.post(ft.APPLY_PATH, json=body)


def test_afds_routes_answer_as_vllms_do(no_ranks):
    vllm, afd = _client(_app("vllm", Engine())), _client(_app("afd", Engine()))
    v, a = vllm.get(ft.STATUS_PATH), afd.get(ft.STATUS_PATH)
    assert v.status_code == a.status_code == 200
    assert v.json().keys() == a.json().keys()

    v, a = _post(vllm, {"instruction": "retry"}), _post(afd, {"instruction": "retry"})
    assert v.status_code == a.status_code == 202
    assert v.json().keys() == a.json().keys() == {"message", "request_id"}
    assert v.json()["message"] == a.json()["message"] == ft.ACCEPTED_MESSAGE

    for case, (body, vllm_start) in BAD.items():
        v, a = _post(vllm, body), _post(afd, body)
        assert v.status_code == a.status_code == 400, case
        assert v.json().keys() == a.json().keys() == {"error"}, case  # ErrorResponse
        assert v.json()["error"].keys() == a.json()["error"].keys(), case
        assert a.json()["error"]["message"].startswith(vllm_start), (case, a.json())

    # JSON only, as vLLM: its own check and message
    v = vllm.post(ft.APPLY_PATH, content=b"x", headers={"content-type": "text/plain"})
    a = afd.post(ft.APPLY_PATH, content=b"x", headers={"content-type": "text/plain"})
    assert v.status_code == a.status_code and v.json() == a.json()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_field_the_value_and_what_is_allowed(case, no_ranks):
    body = BAD[case][0]
    message = _post(_client(_app("afd", Engine())), body).json()["error"]["message"]
    print(f"{case}: {message}")
    expected = {
        "unknown instruction": ["'reboot'", "allowed: 'retry'"],
        "no instruction": ["'instruction'", "missing", "allowed: 'retry'"],
        "params not an object": ["'params'", "got 3"],
        "not an object": ["got list [1, 2]", '{"instruction": "retry"'],
        "malformed JSON": ["line 1 column 2", '{"instruction": "retry"'],
    }[case]
    for part in expected:
        assert part in message, (case, message)


# -- AFD's states --------------------------------------------------------------------------
def _states(engine: Engine) -> list[tuple]:
    body = asyncio.run(ft.FaultTolerance(engine).status())
    return [(e["id"], e["status"], e.get("fault_info")) for e in body["engines"]]


def test_a_lost_ffn_rank_is_unhealthy_and_a_dead_engine_dead(no_ranks):
    engine = Engine(start_rank=2)
    attention = RoleMetrics("attention", 2, str(no_ranks))
    ffn = RoleMetrics("ffn", 0, str(no_ranks))
    ffn.set_peers([2, 3], True)
    ffn.set_peers([3], False)  # an FFN rank's lost peer says nothing of this server
    ffn.publish(now=True)
    attention.set_peers([0], True)
    attention.publish(now=True)
    assert _states(engine) == [(0, "healthy", None)]

    attention.set_peers([0], False)  # the FFN rank is lost: unhealthy, not dead
    attention.publish(now=True)
    assert _states(engine) == [(0, "unhealthy", "AFD: attention rank 2 has no FFN rank 0")]

    attention.set_peers([0], True)  # served again
    attention.publish(now=True)
    assert _states(engine) == [(0, "healthy", None)]

    attention.set_peers([0], False)
    attention.publish(now=True)
    engine.errored = True  # vLLM's engine died: dead, whatever AFD says
    assert _states(engine) == [(0, "dead", None)]


def test_each_engine_counts_its_own_attention_ranks():
    """Engine e (DP rank) holds attention ranks start_rank + e * TP ... (TP of them)."""
    lost = [(5, "attention rank 5 has no FFN rank 1")]
    body = ft.engine_states([0, 1], lambda e: range(2 + 2 * e, 4 + 2 * e), lost, False)
    assert [e["status"] for e in body["engines"]] == ["healthy", "unhealthy"]
    # a rank outside every engine's ranks counts for all of them
    body = ft.engine_states([0, 1], lambda e: range(e, e + 1), lost, False)
    assert [e["status"] for e in body["engines"]] == ["unhealthy", "unhealthy"]
    # vLLM's own state (its flag on) stands
    own = [{"id": 0, "status": "unhealthy", "fault_info": "RuntimeError"}]
    body = ft.engine_states([0], lambda e: range(9, 10), [], False, own)
    assert body["engines"] == own


def test_retry_reaches_the_attention_workers_of_an_unhealthy_engine_only(no_ranks):
    engine = Engine()
    fault = ft.FaultTolerance(engine)
    asyncio.run(fault.retry("r1", {}))  # healthy: rejected as vLLM rejects it
    assert engine.rpcs == []
    body = asyncio.run(fault.status())
    assert body["engines"][0]["last_ft_request_id"] == "r1"
    assert "rejecting retry on engine 0: status is HEALTHY" in body["engines"][0]["ft_error"]

    attention = RoleMetrics("attention", 0, str(no_ranks))
    attention.set_peers([0], False)
    attention.publish(now=True)
    asyncio.run(fault.retry("r2", {}))
    assert engine.rpcs == [ft.RETRY_METHOD]
    assert engine.faults == []  # vLLM's own retry only where vLLM says unhealthy


def test_retry_goes_to_every_engine_through_the_engine_core(no_ranks):
    calls = []

    class Core:
        engine_ranks_managed = [0, 1]

        async def call_utility_all_async(self, method, *args):
            calls.append((method, *args))
            return [[{"rank": 0, "retried": True}], [{"rank": 1, "retried": False}]]

    engine = Engine()
    engine.engine_core = Core()
    attention = RoleMetrics("attention", 0, str(no_ranks))
    attention.set_peers([0], False)
    attention.publish(now=True)
    asyncio.run(ft.FaultTolerance(engine).retry("r", {}))
    assert calls == [("collective_rpc", ft.RETRY_METHOD, None, (), None)]


def test_vllms_engine_client_has_what_afd_calls():
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import AsyncMPClient

    for name in ("get_status", "handle_fault", "collective_rpc", "errored", "vllm_config"):
        assert hasattr(AsyncLLM, name) or name == "vllm_config", name
    assert hasattr(AsyncMPClient, "call_utility_all_async")


# -- the attention rank's side -------------------------------------------------------------
def test_retry_starts_the_next_attempt_at_once(monkeypatch):
    from afd_core.connectors.admission import ffn_return
    from afd_core.connectors.admission.ffn_return import AwaitingFFN, FFNReturnWatch

    monkeypatch.setattr(ffn_return, "RETRY_S", 60.0)
    attempted = threading.Event()

    class Connector(AwaitingFFN):
        role_rank = 0
        _closed = False
        _ffn_lost = None

        def __init__(self):
            self._lock = threading.Lock()
            self._ffn_watch = None

        def _me(self):
            return "attention rank 0"

        def _try_return(self):
            attempted.set()
            return False

    c = Connector()
    assert c.retry_ffn_now() is False  # served: nothing to retry
    c._ffn_lost = "closed the connection"
    c._ffn_watch = FFNReturnWatch(c, None)
    c._ffn_watch.start()
    try:
        assert not attempted.wait(0.3)  # the next attempt is a minute away
        t0 = time.monotonic()
        assert c.retry_ffn_now() is True
        assert attempted.wait(5.0)
        print(f"attempt {1000 * (time.monotonic() - t0):.1f} ms after retry")
        assert c._ffn_watch.attempts == 1
    finally:
        c._ffn_watch.close()


def test_the_worker_method_the_route_calls():
    from afd_core.workers.role_workers import AttentionWorkerMixin

    def worker(retried):
        connector = SimpleNamespace(retry_ffn_now=lambda: retried)
        return SimpleNamespace(afd=SimpleNamespace(rank=3, connector=connector))

    assert AttentionWorkerMixin.afd_retry_ffn(worker(True)) == {"rank": 3, "retried": True}
    assert AttentionWorkerMixin.afd_retry_ffn(worker(False)) == {"rank": 3, "retried": False}
    no_retry = SimpleNamespace(afd=SimpleNamespace(rank=1, connector=object()))
    assert AttentionWorkerMixin.afd_retry_ffn(no_retry) == {"rank": 1, "retried": False}


# -- the patch: vLLM's endpoint-plugin wiring loads the routes ---------------------------------
@pytest.fixture
def patched_plugins():
    from afd_core.patches import catalogue
    from afd_core.patches import fault_tolerance as patch

    module = SimpleNamespace(load_endpoint_plugins=lambda supported_tasks=None: [])
    patch._patch(module)
    yield module
    catalogue.restore_attr(module, "load_endpoint_plugins")


@pytest.mark.parametrize(
    "role, tasks, loaded",
    [("attention", ("generate",), True), ("ffn", ("generate",), False),
     ("attention", ("render",), False), (None, ("generate",), False)],
)  # fmt: skip
def test_the_routes_load_on_attention_servers_only(role, tasks, loaded, patched_plugins):
    from afd_core import envs

    if role is None:
        os.environ.pop(envs.AFD_DEPLOYMENT_ROLE, None)
    else:
        os.environ[envs.AFD_DEPLOYMENT_ROLE] = role
    names = [p.name for p in patched_plugins.load_endpoint_plugins(tasks)]
    assert names == ([ft.PLUGIN_NAME] if loaded else [])


def test_afds_routes_replace_vllms_where_its_flag_registered_them(monkeypatch, no_ranks):
    """vLLM's attach_endpoint_plugins (build_app) with the patch: AFD's routes win."""
    import vllm.plugins
    from fastapi import FastAPI
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.fault_tolerance.api_router import (
        register_fault_tolerance_api_router,
    )
    from vllm.plugins.endpoint_plugins.interface import (
        attach_endpoint_plugins,
        init_endpoint_plugins_state,
    )

    from afd_core import envs
    from afd_core.patches import catalogue
    from afd_core.patches import fault_tolerance as patch

    monkeypatch.setenv(envs.AFD_DEPLOYMENT_ROLE, "attention")
    patch._patch(vllm.plugins)
    try:
        app = FastAPI()
        app.state.args = Namespace(log_error_stack=False, api_server_count=1)
        register_fault_tolerance_api_router(app)  # --enable-fault-tolerance
        attach_endpoint_plugins(app, ("generate",))
        init_exception_handler(app)
    finally:
        catalogue.restore_attr(vllm.plugins, "load_endpoint_plugins")
    engine = Engine()
    asyncio.run(init_endpoint_plugins_state(engine, app.state, app.state.args))
    paths = [r.path for r in app.routes if r.path.startswith("/fault_tolerance")]
    assert sorted(paths) == [ft.APPLY_PATH, ft.STATUS_PATH]  # one each: AFD's
    message = _post(_client(app), {"instruction": "reboot"}).json()["error"]["message"]
    assert "allowed: 'retry'" in message


def test_not_served_with_several_api_server_processes(no_ranks):
    from fastapi import FastAPI

    app = FastAPI()
    app.state.args = Namespace(api_server_count=2)
    ft.AFDFaultToleranceRoutes().attach_router(app)
    assert not [r for r in app.routes if r.path.startswith("/fault_tolerance")]


def test_a_broken_set_up_answers_503_and_keeps_the_server_up(no_ranks):
    engine = Engine()
    engine.vllm_config.additional_config = {}  # no afd key: FaultTolerance cannot start
    response = _client(_app("afd", engine)).get(ft.STATUS_PATH)
    assert response.status_code == 503
    assert "not available" in response.json()["error"]["message"]

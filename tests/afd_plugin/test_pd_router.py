"""`afd pd-router` (afd_plugin.deploy.pd_router) against stand-in backends in this process:
what the prefill and decode servers are sent, round robin, streaming, and every failure as
the client sees it (status, the JSON error naming the backend, how long it took)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from afd_core.net import free_port
from afd_plugin.cli import main
from afd_plugin.deploy.pd_router import (
    PREFILL_KV_TRANSFER_PARAMS,
    AppThread,
    RouterConfig,
    RunningRouter,
)

pytest.importorskip("aiohttp")


class Backend:
    """A stand-in vLLM server: records each request, answers as told."""

    def __init__(self, name: str, *, params: dict | None = None):
        self.name, self.params = name, params
        self.requests: list[tuple[str, dict, dict]] = []
        self.status = 200  # of generation requests
        self.health = 200
        self.delay_s = 0.0
        self.thread = AppThread(self.app)

    def app(self):
        from aiohttp import web

        async def generate(request):
            body = await request.json()
            self.requests.append((request.path, body, request.headers.copy()))
            await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return web.json_response({"error": self.name}, status=self.status)
            answer = {"server": self.name, "choices": [{"text": "x"}]}
            if self.params is not None:
                answer["kv_transfer_params"] = self.params
            if body.get("stream"):
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                for i in range(3):
                    await response.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                await response.write(b"data: [DONE]\n\n")
                return response
            return web.json_response(answer)

        async def health(request):
            return web.Response(status=self.health)

        async def models(request):
            return web.json_response({"data": [{"id": self.name}]})

        app = web.Application()
        app.router.add_post("/v1/completions", generate)
        app.router.add_post("/v1/chat/completions", generate)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        return app

    @property
    def url(self) -> str:
        return self.thread.url


@pytest.fixture
def backends():
    made: list[Backend] = []

    def make(name: str, **kw) -> Backend:
        b = Backend(name, **kw)
        b.thread.start()
        made.append(b)
        return b

    yield make
    for b in made:
        b.thread.stop()


def closed_port() -> int:
    return free_port()  # free now, and this worker's own (AFD_PORT_RANGE)


def router(prefill, decode, **kw) -> RunningRouter:
    config = RouterConfig(prefill=tuple(prefill), decode=tuple(decode), port=0, **kw)
    return RunningRouter(config).start()


def call(url: str, path: str, body: dict | None = None, headers: dict | None = None):
    """(status, decoded JSON or text, seconds)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    seconds = time.monotonic() - t0
    try:
        return status, json.loads(text), seconds
    except json.JSONDecodeError:
        return status, text, seconds


def test_a_completion_goes_to_prefill_with_one_token_then_to_decode_with_its_params(backends):
    params = {"remote_engine_id": "e", "remote_block_ids": [1, 2]}
    p, d = backends("p", params=params), backends("d")
    r = router([p.url], [d.url])
    try:
        body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": False, "logprobs": 0}
        status, answer, _ = call(r.url, "/v1/completions", body, {"Authorization": "Bearer k"})
    finally:
        r.stop()
    assert status == 200 and answer["server"] == "d"
    ((path, sent, p_headers),) = p.requests
    assert path == "/v1/completions"
    assert sent == {**body, "max_tokens": 1, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    ((path, got, d_headers),) = d.requests
    assert got == {**body, "kv_transfer_params": params}
    # the client's headers go to both, with one request id
    assert p_headers["Authorization"] == d_headers["Authorization"] == "Bearer k"
    assert p_headers["X-Request-Id"] == d_headers["X-Request-Id"]


def test_a_streamed_chat_request_prefills_unstreamed_and_streams_the_decode(backends):
    p, d = backends("p"), backends("d")  # a prefill answer without kv_transfer_params
    r = router([p.url], [d.url])
    try:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        req = urllib.request.Request(
            r.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Request-Id": "mine"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            kind, text = resp.headers["Content-Type"], resp.read().decode()
    finally:
        r.stop()
    assert kind.startswith("text/event-stream")
    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
    ((_, sent, headers),) = p.requests
    assert sent["max_tokens"] == sent["max_completion_tokens"] == 1
    assert sent["stream"] is False and "stream_options" not in sent
    assert headers["X-Request-Id"] == "mine"
    ((_, got, _),) = d.requests
    assert got == body  # no kv_transfer_params: the prefill answer had none


def test_backends_take_turns(backends):
    ps, ds = [backends(f"p{i}") for i in range(2)], [backends(f"d{i}") for i in range(3)]
    r = router([b.url for b in ps], [b.url for b in ds])
    try:
        served = [
            call(r.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})[1]["server"]
            for _ in range(6)
        ]
    finally:
        r.stop()
    assert served == ["d0", "d1", "d2", "d0", "d1", "d2"]
    assert [len(b.requests) for b in ps] == [3, 3]


def test_a_dead_prefill_server_is_skipped_and_with_none_left_the_client_gets_502(backends):
    dead = f"http://127.0.0.1:{closed_port()}"
    p, d = backends("p"), backends("d")
    r = router([dead, p.url], [d.url])
    try:
        answers = [call(r.url, "/v1/completions", {"prompt": "x"})[:2] for _ in range(2)]
    finally:
        r.stop()
    assert [(s, a["server"]) for s, a in answers] == [(200, "d"), (200, "d")]
    assert len(p.requests) == 2
    r = router([dead], [d.url])
    try:
        status, answer, seconds = call(r.url, "/v1/completions", {"prompt": "x"})
    finally:
        r.stop()
    assert status == 502 and seconds < 5, (status, seconds)
    error = answer["error"]
    assert error["stage"] == "prefill" and dead in error["message"], error
    assert "no prefill server takes connections" in error["message"]
    assert len(d.requests) == 2  # nothing went to the decode server


def test_a_failing_prefill_server_gives_502_naming_it_and_a_bad_request_passes_through(backends):
    p, d = backends("p"), backends("d")
    r = router([p.url], [d.url])
    try:
        p.status = 500
        status, answer, _ = call(r.url, "/v1/completions", {"prompt": "x"})
        assert status == 502, answer
        assert answer["error"]["backend"] == p.url and "answered 500" in answer["error"]["message"]
        p.status = 400
        status, answer, _ = call(r.url, "/v1/completions", {"prompt": "x"})
        assert (status, answer) == (400, {"error": "p"})
    finally:
        r.stop()
    assert d.requests == []


def test_a_prefill_server_that_does_not_answer_gives_504_within_the_timeout(backends):
    p, d = backends("p"), backends("d")
    p.delay_s = 5.0
    r = router([p.url], [d.url], prefill_timeout_s=0.5)
    try:
        status, answer, seconds = call(r.url, "/v1/completions", {"prompt": "x"})
    finally:
        r.stop()
    assert status == 504 and 0.4 < seconds < 3, (status, seconds)
    assert "--prefill-timeout" in answer["error"]["message"]


def test_decode_failures_pass_through_and_a_dead_decode_server_gives_502(backends):
    p, d = backends("p"), backends("d")
    r = router([p.url], [d.url])
    try:
        d.status = 500
        status, answer, _ = call(r.url, "/v1/completions", {"prompt": "x"})
        assert (status, answer) == (500, {"error": "d"})
    finally:
        r.stop()
    dead = f"http://127.0.0.1:{closed_port()}"
    r = router([p.url], [dead])
    try:
        status, answer, seconds = call(r.url, "/v1/completions", {"prompt": "x"})
    finally:
        r.stop()
    assert status == 502 and seconds < 5
    assert answer["error"]["stage"] == "decode" and answer["error"]["backend"] == dead


def test_health_is_200_only_when_every_backend_is_and_models_come_from_decode(backends):
    p, d = backends("p"), backends("d")
    r = router([p.url], [d.url])
    try:
        status, answer, _ = call(r.url, "/health")
        assert status == 200 and answer == {"prefill": {p.url: 200}, "decode": {d.url: 200}}
        d.health = 503
        status, answer, _ = call(r.url, "/health")
        assert status == 503 and answer["decode"] == {d.url: 503}
        status, answer, _ = call(r.url, "/v1/models")
        assert status == 200 and answer == {"data": [{"id": "d"}]}
        status, answer, _ = call(r.url, "/v1/completions", ["not", "an", "object"])
        assert status == 400 and "not a JSON object" in answer["error"]["message"]
    finally:
        r.stop()
    dead = f"http://127.0.0.1:{closed_port()}"
    r = router([dead], [d.url])
    try:
        status, answer, _ = call(r.url, "/health")
    finally:
        r.stop()
    assert status == 503 and "ClientConnectorError" in answer["prefill"][dead]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--prefill", "localhost:8200", "--decode", "http://a:1", "--port", "9"], "--prefill"),
        (["--prefill", "http://a:1", "--decode", "http://a:1/v1", "--port", "9"], "--decode"),
        (["--prefill", "http://a:1", "--decode", "http://a", "--port", "9"], "--decode"),
        (["--prefill", "http://a:1", "--decode", "http://a:2", "--port", "70000"], "--port"),
        (["--prefill", "http://a:1", "--decode", "http://a:2"], "--port"),
        (["--decode", "http://a:2", "--port", "9"], "--prefill"),
        (
            ["--prefill", "http://a:1", "--decode", "http://a:2", "--port", "9"]
            + ["--prefill-timeout", "0"],
            "--prefill-timeout",
        ),
    ],
)
def test_bad_command_lines_name_the_flag_and_value(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["pd-router", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {named}" in err or f"{named}" in err.split("error:", 1)[1], err


def test_a_port_in_use_is_named(backends):
    p = backends("p")
    port = int(p.url.rsplit(":", 1)[1])
    rc = main(["pd-router", "--prefill", p.url, "--decode", p.url, "--port", str(port),
               "--host", "127.0.0.1"])  # fmt: skip
    assert rc == 1

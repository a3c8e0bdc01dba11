"""`afd pd-router`: a prefill/decode router in front of ordinary vLLM prefill servers and
an AFD decode deployment's attention servers (docs/pd.md).

Each POST /v1/completions or /v1/chat/completions goes first to a prefill server, as
vLLM's own P/D proxies send it (examples/online_serving/disaggregated_serving in vLLM's
repository): the client's body with `max_tokens` 1 (and `max_completion_tokens` 1 for
chat), `stream` false, no `stream_options`, and `kv_transfer_params` asking for a remote
decode. Then the client's body goes to a decode server, with the prefill answer's
`kv_transfer_params` added when it has them (NIXL's block ids and address; vLLM's
ExampleConnector gives none, its decode server finds the blocks in the shared folder), and
the decode server's answer (streamed or not) goes back to the client as it comes. Both
requests carry one X-Request-Id (the client's, else a new one) and the client's other
end-to-end headers (Authorization for `--api-key` servers).

Servers of each stage take turns (round robin). A prefill server that takes no connection
is skipped for the next one (the request never reached it); when none takes it, or one
fails (a 5xx answer, a lost connection, no answer within `--prefill-timeout`), the client
gets 502 (504 for the timeout) with a JSON error naming the stage, the backend and the
cause, and nothing goes to a decode server. A prefill server's 4xx answer (a bad request)
is passed through as it is. A decode server's answer is passed through with its status; a
decode server that takes no connection or fails before answering gives 502 naming it.

GET /health answers 200 only when every backend answers its /health 200 (each asked at
once, within `--health-timeout`), else 503; both with each backend's status. GET /v1/models
is a decode server's answer.

aiohttp (a dependency of vLLM) serves and sends; it is imported when the router starts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import threading
import urllib.parse
import uuid
from dataclasses import dataclass

PREFILL_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
# headers not forwarded either way (hop-by-hop, or set by aiohttp for the new message)
_SKIP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Host",
        "Content-Length",
        "Transfer-Encoding",
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Upgrade",
        "Content-Encoding",
    )
)


def backend_url(value: str) -> str:
    """A backend's base URL, http(s)://HOST:PORT (no path), or ValueError saying why."""
    parts = urllib.parse.urlsplit(value.strip())
    why = None
    if parts.scheme not in ("http", "https"):
        why = "no http:// or https:// scheme"
    elif not parts.hostname:
        why = "no host"
    elif parts.path not in ("", "/") or parts.query or parts.fragment:
        why = "a path, query or fragment (the router adds /v1/...)"
    else:
        try:
            if parts.port is None:
                why = "no port"
        except ValueError:
            why = "a port that is not 1..65535"
    if why:
        raise ValueError(f"{value!r} has {why}; allowed: http://HOST:PORT or https://HOST:PORT")
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    # a whole prefill request (the prompt's forward and one token); past it: 504
    prefill_timeout_s: float = 300.0
    # a connection to any backend
    connect_timeout_s: float = 10.0
    # silence between two pieces of a decode server's answer (None: no bound)
    decode_read_timeout_s: float | None = 600.0
    health_timeout_s: float = 5.0

    def __post_init__(self):
        for flag, urls in (("--prefill", self.prefill), ("--decode", self.decode)):
            if not urls:
                raise ValueError(f"{flag} is missing; allowed: one or more http://HOST:PORT")
            for url in urls:
                backend_url(url)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is out of range; allowed: 1..65535 (0: any)")
        for flag, seconds in (
            ("--prefill-timeout", self.prefill_timeout_s),
            ("--connect-timeout", self.connect_timeout_s),
            ("--health-timeout", self.health_timeout_s),
            ("--decode-read-timeout", self.decode_read_timeout_s),
        ):
            if seconds is not None and not seconds > 0:
                raise ValueError(f"{flag} {seconds} is invalid; allowed: seconds above 0")


class _Failed(Exception):
    """A backend failure, answered to the client as `status` with a JSON error."""

    def __init__(self, status: int, stage: str, backend: str, cause: str):
        super().__init__(cause)
        self.status, self.stage, self.backend, self.cause = status, stage, backend, cause


class _Answer(Exception):
    """A backend's answer the client gets as it is (a prefill server's 4xx)."""

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(status)
        self.status, self.body, self.content_type = status, body, content_type


def error_body(status: int, stage: str, backend: str | None, cause: str) -> dict:
    where = f"the {stage} server {backend}" if backend else f"the {stage} stage"
    return {
        "error": {
            "message": f"afd pd-router: {where} failed: {cause}",
            "type": "BadGateway" if status == 502 else "GatewayTimeout" if status == 504 else "",
            "code": status,
            "stage": stage,
            "backend": backend,
        }
    }


def prefill_body(body: dict) -> dict:
    """The prefill request of a client body: one token, not streamed, a remote decode."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


class Router:
    """The aiohttp application and its client session; `app()` builds it."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.prefill = tuple(backend_url(u) for u in config.prefill)
        self.decode = tuple(backend_url(u) for u in config.decode)
        self._prefill_turn = itertools.count()
        self._decode_turn = itertools.count()
        self.session = None

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path in ROUTED_PATHS:
            app.router.add_post(path, self.handle_generate)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False,
        )

    async def _close(self, app) -> None:
        if self.session is not None:
            await self.session.close()

    @staticmethod
    def _headers(request, request_id: str) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_HEADERS}
        out = {k: v for k, v in out.items() if k.lower() not in ("x-request-id", "content-type")}
        out["X-Request-Id"] = request_id
        out["Content-Type"] = "application/json"
        return out

    def _turn(self, urls: tuple[str, ...], counter) -> list[str]:
        """Every backend of a stage, starting from this request's turn."""
        first = next(counter) % len(urls)
        return [*urls[first:], *urls[:first]]

    @staticmethod
    def _json_error(status: int, body: dict):
        from aiohttp import web

        return web.json_response(body, status=status)

    async def handle_generate(self, request):
        from aiohttp import web

        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return self._json_error(
                400, {"error": {"message": f"the request body is not JSON ({exc})", "code": 400}}
            )
        if not isinstance(body, dict):
            return self._json_error(
                400, {"error": {"message": "the request body is not a JSON object", "code": 400}}
            )
        request_id = request.headers.get("X-Request-Id") or f"afd-pd-{uuid.uuid4().hex}"
        headers = self._headers(request, request_id)
        try:
            params = await self._prefill(request.path, body, headers)
        except _Failed as exc:
            return self._json_error(
                exc.status, error_body(exc.status, exc.stage, exc.backend, exc.cause)
            )
        except _Answer as exc:  # a prefill server's 4xx, as it answered
            return web.Response(body=exc.body, status=exc.status, content_type=exc.content_type)
        decode = dict(body)
        if params:
            decode["kv_transfer_params"] = params
        return await self._decode(request, decode, headers)

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | None:
        """The prefill server's kv_transfer_params (None if it gave none)."""
        import aiohttp

        refused = []
        for url in self._turn(self.prefill, self._prefill_turn):
            try:
                async with self.session.post(
                    url + path,
                    json=prefill_body(body),
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(
                        total=self.config.prefill_timeout_s,
                        sock_connect=self.config.connect_timeout_s,
                    ),
                ) as r:
                    text = await r.read()
                    if 400 <= r.status < 500:
                        raise _Answer(r.status, text, r.content_type)
                    if r.status != 200:
                        cause = f"it answered {r.status}: {text[:500].decode(errors='replace')}"
                        raise _Failed(502, "prefill", url, cause)
                    try:
                        answer = json.loads(text)
                    except json.JSONDecodeError:
                        raise _Failed(502, "prefill", url, "its answer is not JSON") from None
                    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
                    return params or None
            except aiohttp.ClientConnectorError as exc:
                refused.append(f"{url} ({exc.os_error.strerror or exc})")
                continue  # it never had the request: the next one may take it
            except TimeoutError:
                raise _Failed(
                    504,
                    "prefill",
                    url,
                    f"no answer within {self.config.prefill_timeout_s:g} s (--prefill-timeout)",
                ) from None
            except aiohttp.ClientError as exc:
                raise _Failed(502, "prefill", url, f"{type(exc).__name__}: {exc}") from None
        raise _Failed(
            502,
            "prefill",
            ", ".join(self.prefill),
            "no prefill server takes connections: " + "; ".join(refused),
        )

    async def _decode(self, request, body: dict, headers: dict):
        import aiohttp
        from aiohttp import web

        url = self._turn(self.decode, self._decode_turn)[0]
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.config.connect_timeout_s,
            sock_read=self.config.decode_read_timeout_s,
        )
        response = None
        try:
            async with self.session.post(
                url + request.path, json=body, headers=headers, timeout=timeout
            ) as r:
                response = web.StreamResponse(status=r.status, reason=r.reason)
                for k, v in r.headers.items():
                    if k.lower() not in _SKIP_HEADERS:
                        response.headers[k] = v
                await response.prepare(request)
                async for chunk in r.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (TimeoutError, aiohttp.ClientError) as exc:
            cause = (
                f"no answer within {self.config.decode_read_timeout_s:g} s (--decode-read-timeout)"
                if isinstance(exc, asyncio.TimeoutError)
                else f"{type(exc).__name__}: {exc}"
            )
            status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
            if response is None or not response.prepared:
                return self._json_error(status, error_body(status, "decode", url, cause))
            # the status went out already: cut the answer short, the client sees it broken
            if request.transport is not None:
                request.transport.close()
            return response

    async def _status(self, url: str) -> int | str:
        import aiohttp

        try:
            async with self.session.get(
                url + "/health",
                timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s),
            ) as r:
                return r.status
        except TimeoutError:
            return f"no answer within {self.config.health_timeout_s:g} s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"

    async def handle_health(self, request):
        from aiohttp import web

        urls = [*self.prefill, *self.decode]
        statuses = await asyncio.gather(*(self._status(u) for u in urls))
        by = dict(zip(urls, statuses, strict=True))
        body = {
            "prefill": {u: by[u] for u in self.prefill},
            "decode": {u: by[u] for u in self.decode},
        }
        ok = all(s == 200 for s in statuses)
        return web.json_response(body, status=200 if ok else 503)

    async def handle_models(self, request):
        import aiohttp
        from aiohttp import web

        url = self._turn(self.decode, self._decode_turn)[0]
        try:
            async with self.session.get(
                url + "/v1/models",
                headers=self._headers(request, f"afd-pd-{uuid.uuid4().hex}"),
                timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s * 6),
            ) as r:
                return web.Response(
                    body=await r.read(), status=r.status, content_type="application/json"
                )
        except (TimeoutError, aiohttp.ClientError) as exc:
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return self._json_error(502, error_body(502, "decode", url, cause))


class AppThread:
    """An aiohttp application serving in a thread of this process, on its own event loop
    (`make_app` is called there)."""

    def __init__(self, make_app, host: str = "127.0.0.1", port: int = 0):
        self.make_app, self.host, self.port = make_app, host, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._runner = None
        self._thread = threading.Thread(target=self._run, name="afd-app", daemon=True)

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:  # noqa: BLE001 - given to start()'s caller
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _start(self) -> None:
        from aiohttp import web

        self._runner = web.AppRunner(self.make_app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def start(self):
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RunningRouter(AppThread):
    """The router serving in a thread of this process (tests)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        super().__init__(lambda: Router(config).app(), config.host, config.port)


# -- the command line ----------------------------------------------------------------------


def _url_arg(value: str) -> str:
    try:
        return backend_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds_arg(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is invalid; allowed: seconds above 0")
    return seconds


def _port_arg(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is invalid; allowed: a port, 1..65535")
    return int(value)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        type=_url_arg,
        required=True,
        metavar="URL",
        help="the prefill servers (ordinary vLLM, kv_producer), http://HOST:PORT each",
    )
    parser.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        type=_url_arg,
        required=True,
        metavar="URL",
        help="the decode servers (the AFD attention servers, kv_consumer), http://HOST:PORT each",
    )
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on")
    parser.add_argument("--port", type=_port_arg, required=True, help="the port to listen on")
    parser.add_argument(
        "--prefill-timeout",
        type=_seconds_arg,
        default=RouterConfig.prefill_timeout_s,
        help="seconds a prefill request may take before the client gets 504",
    )
    parser.add_argument(
        "--connect-timeout",
        type=_seconds_arg,
        default=RouterConfig.connect_timeout_s,
        help="seconds to connect to a backend",
    )
    parser.add_argument(
        "--decode-read-timeout",
        type=_seconds_arg,
        default=RouterConfig.decode_read_timeout_s,
        help="seconds a decode server may stay silent within its answer",
    )
    parser.add_argument(
        "--health-timeout",
        type=_seconds_arg,
        default=RouterConfig.health_timeout_s,
        help="seconds each backend's /health may take (GET /health)",
    )


def config_from_args(args) -> RouterConfig:
    return RouterConfig(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        host=args.host,
        port=args.port,
        prefill_timeout_s=args.prefill_timeout,
        connect_timeout_s=args.connect_timeout,
        decode_read_timeout_s=args.decode_read_timeout,
        health_timeout_s=args.health_timeout,
    )


def main(args) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: afd pd-router: {exc}", file=sys.stderr)
        return 2
    try:
        from aiohttp import web
    except ImportError:
        print("error: afd pd-router needs aiohttp (installed with vLLM)", file=sys.stderr)
        return 2
    print(
        f"afd pd-router on {config.host}:{config.port}: prefill {', '.join(config.prefill)}; "
        f"decode {', '.join(config.decode)}",
        flush=True,
    )
    try:
        web.run_app(
            Router(config).app(),
            host=config.host,
            port=config.port,
            access_log=None,
            print=None,
            handle_signals=True,
        )
    except OSError as exc:
        print(
            f"error: afd pd-router: cannot listen on {config.host}:{config.port} ({exc.strerror})",
            file=sys.stderr,
        )
        return 1
    return 0

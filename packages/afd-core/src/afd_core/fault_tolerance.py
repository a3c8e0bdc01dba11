"""vLLM's fault-tolerance routes on an AFD attention server, answered with AFD's states.

vLLM 0.32 serves two routes when started with `--enable-fault-tolerance`
(`vllm/entrypoints/serve/fault_tolerance/api_router.py`, registered by
`vllm/entrypoints/launchers/api_server/routers.py`):

  GET  /fault_tolerance/status  200 {"schema_version": 1, "total_engines": N, "engines":
       [{"id": <DP rank>, "status": "healthy" | "unhealthy" | "dead", ...}]}: an unhealthy
       engine also has "fault_info"; one whose last instruction failed "last_ft_request_id"
       and "ft_error" (`v1/engine/core_client.py`, AsyncMPClient.get_status/handle_fault;
       the names are `v1/engine/__init__.py` EngineStatusType's, lower case)
  POST /fault_tolerance/apply   {"instruction": "retry", "params": {...}}, JSON only: 202
       {"message": ..., "request_id": <uuid>} at once, the instruction runs in the
       background (its failure shows on the status); bad input 400, vLLM's ErrorResponse

vLLM's flag is for DP+EP MoE servers and an AFD attention server is not one: vLLM refuses
it without external load balancing (`--data-parallel-external-lb` or
`--data-parallel-rank`; `engine/arg_utils.py`) and with more than one API server process
(`config/parallel.py`), its GPU worker refuses it unless the all2all backend is
`deepep_low_latency` or `nixl_ep` (`v1/worker/sentinel/gpu_worker_sentinel.py`), and it
turns every exception of the engine's busy loop into a wait for `retry` (up to 120 s,
`v1/fault_tolerance/engine_core_sentinel.py`). An attention server whose FFN rank is lost
raises nothing there: its steps fail their requests at once and it waits for an FFN rank
(connectors/admission/ffn_return.py), so vLLM's own status would say healthy. So AFD answers the two
routes itself on every attention server, flag or not, as a vLLM endpoint plugin (the
`vllm.endpoint_plugins` contract: its routes replace vLLM's where the flag registered
them); the patch `fault_tolerance` loads it.

AFD's states, per engine (a data-parallel rank of the server, its attention ranks
start_rank + id * TP ...):
  healthy    every attention rank of the engine is served by its FFN rank
  unhealthy  one of them is not (afd_peer_up 0, or a rank on another host stopped
             reporting, as /health sees it: afd_core.metrics); `fault_info` names it. The
             engine is up and fails requests at once until an FFN rank serves it again
  dead       vLLM's engine is dead (AsyncLLM.errored)
`retry` makes every attention rank of the server that waits for its FFN rank try to be
served again now (worker method `afd_retry_ffn`; it otherwise tries every second). As in
vLLM, it is rejected on an engine that is not unhealthy (`ft_error` on the status).
"""

# no `from __future__ import annotations`: FastAPI reads the routes' annotations, whose
# types make_router imports locally
import json
import uuid
from collections.abc import Callable, Iterable

from afd_core.log import get_logger

logger = get_logger(__name__)

STATUS_PATH = "/fault_tolerance/status"
APPLY_PATH = "/fault_tolerance/apply"
SCHEMA_VERSION = 1
INSTRUCTIONS = ("retry",)  # vLLM 0.32's _ALLOWED_INSTRUCTIONS
HEALTHY, UNHEALTHY, DEAD = "healthy", "unhealthy", "dead"  # EngineStatusType, lower case
ACCEPTED_MESSAGE = "Request accepted; poll /fault_tolerance/status for updates."
RETRY_METHOD = "afd_retry_ffn"  # the attention workers' method (workers/role_workers.py)
PLUGIN_NAME = "afd_fault_tolerance"
_EXAMPLE = '{"instruction": "retry", "params": {}}'


class BadInstruction(ValueError):
    """A POST /fault_tolerance/apply body that cannot be run (HTTP 400)."""


def parse_apply(body: bytes) -> tuple[str, dict]:
    """(instruction, params) of a POST /fault_tolerance/apply body, checked as vLLM checks
    it, with messages that name the field, the value and what is allowed."""
    allowed = ", ".join(repr(i) for i in INSTRUCTIONS)
    try:
        payload = json.loads(body)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise BadInstruction(
            f"Invalid JSON format: {exc}; send a JSON object such as {_EXAMPLE}"
        ) from None
    if not isinstance(payload, dict):
        raise BadInstruction(
            f"Request body must be a JSON object such as {_EXAMPLE}, got "
            f"{type(payload).__name__} {json.dumps(payload)[:80]}"
        )
    instruction = payload.get("instruction")
    if not instruction:
        got = "missing" if "instruction" not in payload else f"got {instruction!r}"
        raise BadInstruction(f"'instruction' is required ({got}); allowed: {allowed}")
    if not isinstance(instruction, str) or instruction not in INSTRUCTIONS:
        raise BadInstruction(f"Invalid instruction: {instruction!r}; allowed: {allowed}")
    params = payload.get("params", {})
    if not isinstance(params, dict):
        raise BadInstruction(f"'params' must be an object, got {json.dumps(params)[:80]}")
    return instruction, params


def engine_states(
    engine_ids: Iterable[int],
    ranks_of: Callable[[int], range],
    unserved: list[tuple[int, str]],
    dead: bool,
    vllm_engines: Iterable[dict] = (),
    ft_errors: dict[int, tuple[str, str]] | None = None,
) -> dict:
    """The body of GET /fault_tolerance/status: vLLM's shape, AFD's states.

    `unserved`: (attention rank, why) of the ranks no FFN rank serves; `vllm_engines`:
    vLLM's own entries (only with its flag on), whose unhealthy or dead stands; `ft_errors`:
    engine id -> (request id, reason) of its last failed instruction."""
    ids = list(engine_ids)
    mine = {e: ranks_of(e) for e in ids}
    # a rank outside every engine's ranks (not expected) counts for every engine: better
    # unhealthy than healthy by mistake
    stray = [why for rank, why in unserved if not any(rank in r for r in mine.values())]
    own = {e["id"]: e for e in vllm_engines if isinstance(e, dict) and "id" in e}
    engines = []
    for e in ids:
        entry = dict(own.get(e, {"id": e, "status": HEALTHY}))
        reasons = [why for rank, why in unserved if rank in mine[e]] + stray
        if dead:
            entry["status"] = DEAD
            entry.pop("fault_info", None)
        elif entry.get("status") == HEALTHY and reasons:
            entry["status"] = UNHEALTHY
            entry["fault_info"] = "AFD: " + "; ".join(reasons)
        if ft_errors and e in ft_errors:
            entry["last_ft_request_id"], entry["ft_error"] = ft_errors[e]
        engines.append(entry)
    return {"schema_version": SCHEMA_VERSION, "total_engines": len(ids), "engines": engines}


class FaultTolerance:
    """The routes' state on one API server: its engine client, the last failed
    instruction of each engine."""

    def __init__(self, engine_client):
        self.client = engine_client
        self.ft_errors: dict[int, tuple[str, str]] = {}
        from afd_core.config import require_afd_config

        vllm_config = engine_client.vllm_config
        self.start_rank = require_afd_config(vllm_config).start_rank
        pc = vllm_config.parallel_config
        self.tp = pc.tensor_parallel_size
        self.default_engine = pc.data_parallel_rank or 0

    def engine_ids(self) -> list[int]:
        """The engines (DP ranks) this API server manages, as vLLM's status numbers them."""
        core = getattr(self.client, "engine_core", None)
        ids = getattr(core, "engine_ranks_managed", None)
        return list(ids) if ids else [self.default_engine]

    def ranks_of(self, engine: int) -> range:
        first = self.start_rank + engine * self.tp  # workers/roles.py role_rank
        return range(first, first + self.tp)

    async def _vllm_engines(self) -> list[dict]:
        """vLLM's own entries: empty unless vLLM's fault tolerance is on."""
        try:
            return list((await self.client.get_status()).get("engines", []))
        except Exception:  # noqa: BLE001 - a client without vLLM's status (NotImplementedError)
            return []

    async def status(self) -> dict:
        from afd_core.metrics import unserved_attention_ranks

        return engine_states(
            self.engine_ids(),
            self.ranks_of,
            unserved_attention_ranks(),
            dead=bool(getattr(self.client, "errored", False)),
            vllm_engines=await self._vllm_engines(),
            ft_errors=self.ft_errors,
        )

    async def retry(self, request_id: str, params: dict) -> None:
        """POST /fault_tolerance/apply `retry`, after the 202: every waiting attention rank
        tries to be served again now; an engine that is not unhealthy rejects it."""
        status = await self.status()
        unhealthy = []
        for engine in status["engines"]:
            if engine["status"] == UNHEALTHY:
                unhealthy.append(engine["id"])
            else:
                reason = (
                    f"AFD: rejecting retry on engine {engine['id']}: status is "
                    f"{engine['status'].upper()} (retry is for an UNHEALTHY engine)"
                )
                logger.warning(reason)
                self.ft_errors[engine["id"]] = (request_id, reason)
        if not unhealthy:
            return
        try:
            results = await self._retry_on_workers()
        except Exception as exc:  # noqa: BLE001 - the status says so; the route answered
            logger.exception("AFD: retry %s failed", request_id)
            for e in unhealthy:
                self.ft_errors[e] = (request_id, f"AFD: retry failed: {type(exc).__name__}: {exc}")
            return
        retried = sorted(r["rank"] for r in results if isinstance(r, dict) and r.get("retried"))
        logger.info(
            "AFD: retry %s: attention ranks %s try to be served by an FFN rank again now",
            request_id,
            retried,
        )
        own = {e.get("id"): e for e in await self._vllm_engines()}
        if any(own.get(e, {}).get("status") == UNHEALTHY for e in unhealthy):
            await self._vllm_retry(request_id, params)  # vLLM's fault tolerance is on too

    async def _retry_on_workers(self) -> list:
        core = getattr(self.client, "engine_core", None)
        call_all = getattr(core, "call_utility_all_async", None)
        if call_all is None:
            return list(await self.client.collective_rpc(RETRY_METHOD))
        # every engine the server manages (collective_rpc reaches one of them only where
        # the client is not load-balancing over them)
        per_engine = await call_all("collective_rpc", RETRY_METHOD, None, (), None)
        return [r for results in per_engine for r in results]

    async def _vllm_retry(self, request_id: str, params: dict) -> None:
        from vllm.v1.fault_tolerance.utils import FaultToleranceRequest

        request = FaultToleranceRequest(instruction="retry", params=params, request_id=request_id)
        result = await self.client.handle_fault(request)
        if not result.success:
            logger.error("AFD: vLLM's retry %s failed: %s", request_id, result.reason)


def make_router():
    """The two routes, with vLLM's paths, methods, status codes and bodies."""
    from fastapi import APIRouter, BackgroundTasks, Depends, HTTPException, Request
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.serve.utils.api_utils import validate_json_request

    router = APIRouter()

    def state(raw_request: Request) -> FaultTolerance:
        ft = getattr(raw_request.app.state, "afd_fault_tolerance", None)
        if ft is None:
            raise HTTPException(
                503, "AFD fault tolerance is not available on this server (see its log)"
            )
        return ft

    @router.post(APPLY_PATH, dependencies=[Depends(validate_json_request)])
    async def apply(raw_request: Request, background_tasks: BackgroundTasks):
        try:
            instruction, params = parse_apply(await raw_request.body())
        except BadInstruction as exc:
            raise HTTPException(400, str(exc)) from None
        ft = state(raw_request)
        request_id = str(uuid.uuid4())
        background_tasks.add_task(ft.retry, request_id, params)  # the one instruction
        return JSONResponse(
            status_code=202,
            content={"message": ACCEPTED_MESSAGE, "request_id": request_id},
            background=background_tasks,
        )

    @router.get(STATUS_PATH)
    async def status(raw_request: Request):
        return JSONResponse(content=await state(raw_request).status())

    return router


class AFDFaultToleranceRoutes:
    """vLLM endpoint plugin (vllm/plugins/endpoint_plugins/interface.py): the routes on an
    AFD attention server."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        count = getattr(getattr(app.state, "args", None), "api_server_count", None) or 1
        if count > 1:  # vLLM refuses its own fault tolerance there too (config/parallel.py)
            logger.warning(
                "AFD: %s and %s are not served with --api-server-count %d: an API server "
                "process of several does not see the attention ranks (docs/metrics.md)",
                STATUS_PATH,
                APPLY_PATH,
                count,
            )
            return
        app.include_router(make_router())

    async def init_state(self, engine_client, state, args) -> None:
        state.afd_fault_tolerance = None
        if engine_client is None:
            return
        try:  # the routes never keep the server from starting
            state.afd_fault_tolerance = FaultTolerance(engine_client)
        except Exception:  # noqa: BLE001 - logged; the routes answer 503
            logger.exception("AFD: %s and %s are not available", STATUS_PATH, APPLY_PATH)

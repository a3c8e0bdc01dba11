"""Patch `health`: an attention server reports not ready while no FFN rank serves it.

vLLM's `/health` answers 503 only when `AsyncLLM.check_health` raises EngineDeadError, and
vLLM 0.32's check looks at nothing but its own `errored` flag
(`v1/engine/async_llm.py:1089`; `entrypoints/serve/instrumentator/health.py`). An
attention server whose FFN rank is lost stays up and fails each step's requests at once
(connectors/admission/ffn_return.py) until an FFN rank serves it again: a load balancer must send
requests elsewhere meanwhile. This wraps `check_health` in the API process: after vLLM's
own check, it raises EngineDeadError while any of the server's attention ranks shows
`afd_peer_up` 0 for its FFN rank on /metrics (the snapshots of afd_core.metrics). The
engine is not marked dead: /health answers 200 again once the FFN rank is back.

It also raises while the engine is stuck: alive (vLLM's flag unset, its peers up) but no
rank of the server ends a step while requests wait, for longer than `stuck_after_s`
(afd_core/stuck.py, which every API process of the server answers alike).
"""

from __future__ import annotations

import time

from afd_core.patches.catalogue import PatchInfo, apply_when_imported, install
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="health",
    why="an attention server's /health answers 503 while no FFN rank serves it, and while "
    "its engine is stuck (requests wait, no rank steps)",
    replaces=("vllm.v1.engine.async_llm.AsyncLLM.check_health",),
    remove_when="vLLM's health check can ask a plugin or the engine core whether it is ready",
)

ASYNC_LLM_MODULE = "vllm.v1.engine.async_llm"


def stuck_watch_for(vllm_config):
    """An attention server's StuckWatch, from its afd config; None elsewhere."""
    from afd_core.config import parse_optional_afd_config
    from afd_core.stuck import StuckWatch

    config = parse_optional_afd_config(getattr(vllm_config, "additional_config", None))
    if config is None or not config.is_attention:
        return None
    return StuckWatch(config.extra().stuck_after_s)


def _patch(module) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    from afd_core.log import get_logger
    from afd_core.metrics import ffn_ranks_gone, last_attention_step_at, server_processes
    from afd_core.stuck import read_reports

    logger = get_logger(__name__)
    async_llm = module.AsyncLLM
    original = async_llm.check_health

    def stuck(engine) -> list[str]:
        if (watch := engine.__dict__.get("_afd_stuck_watch", False)) is False:
            watch = engine._afd_stuck_watch = stuck_watch_for(getattr(engine, "vllm_config", None))
        if watch is None:
            return []
        unfinished = engine.output_processor.get_num_unfinished_requests()
        server = server_processes()  # the collector may come after the first check
        watch.directory = server[0] if server else None
        others = read_reports(*server) if server else []
        why = watch.check(unfinished, last_attention_step_at(), time.time(), others)
        return [why] if why else []

    async def check_health(self) -> None:
        await original(self)
        if gone := ffn_ranks_gone() + stuck(self):
            logger.warning("AFD: not ready (/health 503): %s", "; ".join(gone))
            raise EngineDeadError("AFD: " + "; ".join(gone))

    install(INFO, async_llm, "check_health", check_health)


def apply() -> tuple[StepStatus, str]:
    # only API server processes import AsyncLLM
    return apply_when_imported(INFO, ASYNC_LLM_MODULE, _patch, "API server processes")

"""Patch `health`: an attention server reports not ready while no FFN rank serves it, and
any AFD server while its engine is stuck.

vLLM's `/health` answers 503 only when `AsyncLLM.check_health` raises EngineDeadError, and
vLLM 0.32's check looks at nothing but its own `errored` flag
(`v1/engine/async_llm.py:1089`; `entrypoints/serve/instrumentator/health.py`). An
attention server whose FFN rank is lost stays up and fails each step's requests at once
(connectors/admission/ffn_return.py) until an FFN rank serves it again: a load balancer must send
requests elsewhere meanwhile. This wraps `check_health` in the API process: after vLLM's
own check, it raises EngineDeadError while any of the server's attention ranks shows
`afd_peer_up` 0 for its FFN rank on /metrics (the snapshots of afd_core.metrics). The
engine is not marked dead: /health answers 200 again once the FFN rank is back.

On any AFD server it also raises while the engine is stuck: alive (vLLM's flag unset, its
peers up) but not moving for longer than `stuck_after_s` (afd_core/stuck.py: an FFN rank
in one step past its bound, or an attention data-parallel rank that ends no step while
requests routed to it wait; every API process of the server answers alike).
"""

from __future__ import annotations

import time

from afd_core.patches.catalogue import PatchInfo, apply_when_imported, install
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="health",
    why="an attention server's /health answers 503 while no FFN rank serves it, and any AFD "
    "server's while its engine is stuck (alive, not stepping)",
    replaces=("vllm.v1.engine.async_llm.AsyncLLM.check_health",),
    remove_when="vLLM's health check can ask a plugin or the engine core whether it is ready",
)

ASYNC_LLM_MODULE = "vllm.v1.engine.async_llm"


def _patch(module) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    from afd_core.config import parse_optional_afd_config
    from afd_core.log import get_logger
    from afd_core.metrics import (
        ffn_ranks_gone,
        role_snapshots,
        server_processes,
    )
    from afd_core.stuck import (
        StuckWatch,
        ffn_steps_stuck,
        last_step_by_dp_rank,
        ranks_not_refreshing,
        read_reports,
        waiting_by_dp_rank,
    )

    logger = get_logger(__name__)
    async_llm = module.AsyncLLM
    original = async_llm.check_health

    def stuck(engine) -> list[str]:
        if (config := engine.__dict__.get("_afd_config", False)) is False:
            additional = getattr(getattr(engine, "vllm_config", None), "additional_config", None)
            config = engine._afd_config = parse_optional_afd_config(additional)
            engine._afd_stuck_watch = StuckWatch(config.extra().stuck_after_s) if config else None
        if config is None:
            return []
        watch, now = engine._afd_stuck_watch, time.time()
        ranks = role_snapshots(config.role)
        frozen = ranks_not_refreshing(ranks, watch.after_s, now)
        if config.is_ffn:
            return frozen + ffn_steps_stuck(ranks, watch.after_s, now)
        server = server_processes()  # the collector may come after the first check
        watch.directory = server[0] if server else None
        others = read_reports(*server) if server else []
        tp = engine.vllm_config.parallel_config.tensor_parallel_size
        last_steps = last_step_by_dp_rank(ranks, config.start_rank, tp)
        why = watch.check(waiting_by_dp_rank(engine), last_steps, now, others)
        return frozen + ([why] if why else [])

    async def check_health(self) -> None:
        await original(self)
        if gone := ffn_ranks_gone() + stuck(self):
            logger.warning("AFD: not ready (/health 503): %s", "; ".join(gone))
            raise EngineDeadError("AFD: " + "; ".join(gone))

    install(INFO, async_llm, "check_health", check_health)


def apply() -> tuple[StepStatus, str]:
    # only API server processes import AsyncLLM
    return apply_when_imported(INFO, ASYNC_LLM_MODULE, _patch, "API server processes")

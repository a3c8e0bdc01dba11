"""Patch `engine_core`: FFN server mode.

vLLM 0.32 runs attention-free engines natively: an FFN worker that reports no KV cache
specs gets no KV cache, no memory profiling and nothing to schedule, and its EngineCore
idles on its input queue while the worker's AFD thread serves the attention ranks. So,
unlike the reference plugin (five EngineCore methods replaced), EngineCore is not patched.
The one thing left is the API: a request sent to an FFN server must fail at once with a
clear message instead of waiting forever for a scheduler that never runs it. This patch
wraps `AsyncLLM.check_admission`, which every generate/encode path calls first in the API
process, to answer HTTP 400 on the FFN role.
"""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo, apply_when_imported, install
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="engine_core",
    why="FFN server mode: reject requests sent to an FFN server (EngineCore itself runs "
    "unpatched: empty KV cache specs make it attention-free)",
    replaces=("vllm.v1.engine.async_llm.AsyncLLM.check_admission",),
    remove_when="vLLM can mark an engine as serving no requests",
)

FFN_REJECTION = (
    "This is an AFD FFN server: it computes the FFN half of every layer for its attention "
    "servers and serves no requests. Send requests to an attention server."
)


def _is_ffn_engine(engine) -> bool:
    from afd_core.config import parse_optional_afd_config

    cached = getattr(engine, "_afd_is_ffn", None)
    if cached is None:
        cfg = parse_optional_afd_config(engine.vllm_config.additional_config)
        cached = cfg is not None and cfg.is_ffn
        engine._afd_is_ffn = cached
    return cached


ASYNC_LLM_MODULE = "vllm.v1.engine.async_llm"


def _patch(module) -> None:
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError

    async_llm = module.AsyncLLM
    original = async_llm.check_admission

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        if _is_ffn_engine(self):
            raise GracefulHTTPError(FFN_REJECTION, HTTPStatus.BAD_REQUEST)
        return original(self, n, request_id)

    install(INFO, async_llm, "check_admission", check_admission)


def apply() -> tuple[StepStatus, str]:
    # AsyncLLM costs ~1.5 s to import; only API-server processes import (and need) it
    return apply_when_imported(INFO, ASYNC_LLM_MODULE, _patch, "API-server processes")

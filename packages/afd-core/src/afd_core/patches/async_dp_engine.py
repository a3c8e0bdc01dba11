"""Patch `async_dp_engine`: NOT IMPLEMENTED in this release.

Async-DP attention ranks step independently: plain EngineCoreProc instead of DP
lockstep, DP coordinator for stats only. It is needed only when `afd.async_dp` is
true, which no connector of this release supports (config validation rejects it); the
patch arrives with the first asynchronous connector.
This module applies nothing and says so.
"""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="async_dp_engine",
    why=(
        "Async-DP attention ranks step independently: plain EngineCoreProc instead of DP "
        "lockstep, DP coordinator for stats only."
    ),
    replaces=(
        "vllm.v1.engine.core.EngineCoreProc.run_engine_core",
        "vllm.v1.engine.utils.launch_core_engines",
    ),
    remove_when="never needed by synchronous connectors; written with the first async connector",
    implemented=False,
)


def apply() -> tuple[StepStatus, str]:
    return StepStatus.NOT_IMPLEMENTED, "async DP is not implemented in this release"

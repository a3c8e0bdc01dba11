"""Patch `async_dp_forward_context`: NOT IMPLEMENTED in this release.

Async-DP skips the cross-DP token all-reduce when building the forward context.
It is needed only when `afd.async_dp` is true, which no connector of this release supports
(config validation rejects it); the patch arrives with the first asynchronous connector.
This module applies nothing and says so.
"""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="async_dp_forward_context",
    why="Async-DP skips the cross-DP token all-reduce when building the forward context.",
    replaces=("vllm.forward_context.set_forward_context",),
    remove_when="never needed by synchronous connectors; written with the first async connector",
    implemented=False,
)


def apply() -> tuple[StepStatus, str]:
    return StepStatus.NOT_IMPLEMENTED, "async DP is not implemented in this release"

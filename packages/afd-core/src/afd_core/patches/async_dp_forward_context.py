"""Patch `async_dp_forward_context`: an async-DP attention server builds no cross-DP token
metadata for its forwards.

vLLM's `set_forward_context` all-reduces every DP rank's token count (DP metadata, for the
MoE layers' gather and scatter) when the parallel config says the model is MoE
(`ParallelConfig.is_moe_model`, set from `ModelConfig.is_moe` early in
`VllmConfig.__post_init__`, before a platform hook runs). With `afd.async_dp`, AFD's config
patch sets it False on the attention server, as vLLM sets it for a dense model: no
forward waits for the other DP ranks' token counts (vLLM's `DPMetadata.make` asserts it is
not False, so none is made). The engines then run at DP size 1 each (async_dp_engine),
which skips vLLM's batch coordination across DP (`coordinate_batch_across_dp`) as well.
No vLLM function is replaced.
"""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo, require_supported_vllm
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="async_dp_forward_context",
    why="Async-DP skips the cross-DP token all-reduce when building the forward context "
    "(ParallelConfig.is_moe_model False on the attention server, as for a dense model)",
    # a value, not a function: what set_forward_context reads
    replaces=("vllm.config.parallel.ParallelConfig.is_moe_model",),
    remove_when="vLLM lets a MoE model's DP ranks step independently where a server holds "
    "no MoE layer",
)


def apply() -> tuple[StepStatus, str]:
    require_supported_vllm(INFO.name)
    return StepStatus.APPLIED, "used at config time by attention servers with async_dp"


def skip_dp_metadata(vllm_config) -> None:
    vllm_config.parallel_config.is_moe_model = False

"""Patch `async_dp_engine`: an async-DP attention server's data-parallel ranks run as
independent engines, vLLM's own path for dense models.

vLLM keeps the DP ranks of a MoE model in lockstep (`DPEngineCoreProc`: DP waves, a dummy
forward on an idle rank) because every MoE layer runs collectives across them. An AFD
attention server holds no MoE layer, so with `afd.async_dp` its DP ranks need not wait
for each other. vLLM 0.32 already runs a dense model's DP ranks independently, choosing
by `ModelConfig.is_moe` in:

- `EngineCoreProc.run_engine_core`: plain `EngineCoreProc` (no waves, no dummy batches),
  after `ParallelConfig.reconfigure_for_independent_dp_rank()` (each rank DP size 1, its
  `data_parallel_index` kept: AFD numbers attention ranks by it);
- `launch_core_engines`: a DP coordinator for load-balancing stats only, no wave
  coordination, and the dense start-up handshake;
- `VllmConfig.needs_dp_coordinator` and the compilation splitting ops.

So this patch makes only this server's `ModelConfig` answer `is_moe` False: its class is
swapped for a subclass that overrides that one property (`dense_attention_config`); no vLLM
function is replaced and no other config changes. The subclass travels with the config to
the engine-core and worker processes (pickled by reference to its module, which any
process that unpickles it imports). Called at config time by the config patch
(`config_validation.prepare_afd_config`), for an attention server with `afd.async_dp` and
`--data-parallel-size` > 1, after AFD's own checks.
"""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo, require_supported_vllm
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="async_dp_engine",
    why=(
        "Async-DP attention ranks step independently: vLLM's dense-model DP path (plain "
        "EngineCoreProc, coordinator for stats only) chosen by ModelConfig.is_moe, answered "
        "False for this attention server's config only"
    ),
    replaces=("vllm.config.model.ModelConfig.is_moe",),
    remove_when="vLLM lets a MoE model's DP ranks step independently where a server holds "
    "no MoE layer",
)

# vLLM 0.32's branch this relies on (pinned by tests/afd_plugin/test_async_dp.py)
VLLM_BRANCH = "if data_parallel and vllm_config.model_config.is_moe:"


def apply() -> tuple[StepStatus, str]:
    require_supported_vllm(INFO.name)
    return StepStatus.APPLIED, "used at config time by attention servers with async_dp"


def make_independent(vllm_config) -> None:
    """This attention server's DP ranks: independent engines (see the module doc)."""
    from afd_core.patches.dense_attention_config import dense_model_config

    vllm_config.model_config = dense_model_config(vllm_config.model_config)

"""Patch `mrv2_ubatch_runner`: vLLM's model runner V2 builds no micro-batch runner of its own
on an AFD attention server.

MRV2 builds its `UBatchRunner` (vLLM's DBO: one thread per micro-batch, CUDA streams)
whenever micro-batching is on and data parallel > 1 (`maybe_build_ubatch_runner` in
`vllm/v1/worker/gpu/ubatch_utils.py`, called from `GPUModelRunner.initialize_kv_cache`).
On an AFD attention server micro-batching is on for AFD's own split (AFD asks vLLM for one
attention-metadata builder per micro-batch; workers/attention_runner_v2.py): vLLM's runner
would call AFD's step wrapper once per micro-batch thread, so each half-step would go out
as a step of its own, and on CPU it cannot even be built (`torch.cuda.Stream`). The
builder is called inside `initialize_kv_cache`, after the metadata builders AFD needs are
made, so no override of the runner can skip it alone: this replaces the name in MRV2's
model-runner module with one that builds nothing in an AFD attention server's processes
and vLLM's runner everywhere else.
"""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo, apply_when_imported, install
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="mrv2_ubatch_runner",
    why="AFD splits an attention server's steps itself; vLLM's MRV2 UBatchRunner must not",
    replaces=("vllm.v1.worker.gpu.model_runner.maybe_build_ubatch_runner",),
    remove_when="vLLM's MRV2 runner lets a runner subclass choose its micro-batch runner",
)

MODEL_RUNNER_V2_MODULE = "vllm.v1.worker.gpu.model_runner"


def afd_splits_steps(vllm_config) -> bool:
    """An AFD attention server: AFD's step engine splits its steps."""
    afd = (getattr(vllm_config, "additional_config", None) or {}).get("afd")
    return isinstance(afd, dict) and afd.get("role") == "attention"


def _patch(module) -> None:
    original = module.maybe_build_ubatch_runner

    def maybe_build_ubatch_runner(vllm_config, *args, **kwargs):
        if afd_splits_steps(vllm_config):
            return None
        return original(vllm_config, *args, **kwargs)

    install(INFO, module, "maybe_build_ubatch_runner", maybe_build_ubatch_runner)


def apply() -> tuple[StepStatus, str]:
    # only worker processes import MRV2's runner, and only where vLLM chose it
    return apply_when_imported(INFO, MODEL_RUNNER_V2_MODULE, _patch, "MRV2 worker processes")

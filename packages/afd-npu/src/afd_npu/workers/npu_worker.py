"""AFD workers for the Ascend platform (vLLM-Ascend's NPUWorker; connector `hccl`).

The shared role logic (afd_core.workers.role_workers) bound to vLLM-Ascend's worker and V1
runner, as cpu_worker/cuda_worker bind it to vLLM's. What differs on Ascend:

* the FFN serving thread sets its NPU and runs on a stream of its own;
* Ascend's MoE layers read per-call state from the forward context (the MoE communication
  method is chosen per token count; hash-routed layers read the token ids): every FFN
  call enters `set_ascend_forward_context` for its rows and token ids, not only vLLM's
  forward context once per step.

Importing this module needs vllm_ascend (a worker process on an Ascend machine).
"""

from __future__ import annotations

import contextlib

from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
from vllm_ascend.worker.worker import NPUWorker

from afd_core.workers.attention_runner import AFDAttentionRunnerMixin
from afd_core.workers.role_workers import AttentionWorkerMixin, FFNWorkerMixin
from afd_npu.ascend_api import check_ascend_api

check_ascend_api("worker")  # a drifted worker/runner API stops here, named


class AFDNPUAttentionModelRunner(AFDAttentionRunnerMixin, NPUModelRunner):
    """vLLM-Ascend's V1 NPU model runner with AFD's step planning."""


class AFDNPUAttentionWorker(AttentionWorkerMixin, NPUWorker):
    """vLLM-Ascend's worker whose model sends every layer's MLP/MoE to the FFN ranks."""

    # vLLM-Ascend's worker builds its own runner (a subclass of vLLM's V1 GPUModelRunner)
    afd_runner_classes = {NPUModelRunner: AFDNPUAttentionModelRunner}


class AFDNPUFFNWorker(FFNWorkerMixin, NPUWorker):
    """vLLM-Ascend's worker holding only MLP/MoE weights; a thread serves the attention
    ranks on the worker's NPU, on a stream of its own."""

    def afd_thread_context(self) -> contextlib.AbstractContextManager:
        import torch

        npu = torch.npu  # registered by torch_npu, which vllm_ascend imports
        npu.set_device(self.device)
        return npu.stream(npu.Stream(self.device))

    def afd_layer_context(self, rows: int, token_ids) -> contextlib.AbstractContextManager:
        from vllm_ascend.ascend_forward_context import set_ascend_forward_context

        return set_ascend_forward_context(
            None, self.vllm_config, num_tokens=rows, input_ids=token_ids
        )

"""AFD workers for vLLM's CUDA platform (NCCL between the roles, connector `nccl`).

The attention worker is vLLM's GPU worker with AFD's attention runner on the runner vLLM
chose: model runner V2 (eager only, see patches/config_validation.py) or V1 GPUModelRunner (
vLLM wraps the model in its CUDAGraphWrapper under FULL_DECODE_ONLY, or its UBatchWrapper
with DBO and graphs, and AFD's step wrapper goes around that, so the control message is
sent before every replay). The FFN worker holds the MLP/MoE weights only; its serving
thread runs on the worker's device with a stream of its own, and with FULL_DECODE_ONLY it
captures whole steps per key (afd_core.step.graphs).
"""

from __future__ import annotations

import contextlib

from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from afd_core.step.graphs import CudaGraphBackend, FFNGraphCache, graph_mode_name
from afd_core.step.vllm_ubatch import uses_vllm_ubatching
from afd_core.workers.attention_runner import AFDAttentionRunnerMixin
from afd_core.workers.attention_runner_v2 import AFDAttentionRunnerV2Mixin
from afd_core.workers.role_workers import AttentionWorkerMixin, FFNWorkerMixin


class AFDCUDAAttentionModelRunner(AFDAttentionRunnerMixin, GPUModelRunner):
    """vLLM's V1 GPU model runner with AFD's step planning (see AFDAttentionRunnerMixin)."""


class AFDCUDAAttentionModelRunnerV2(AFDAttentionRunnerV2Mixin, GPUModelRunnerV2):
    """vLLM's GPU model runner V2 with AFD's step planning (see AFDAttentionRunnerV2Mixin)."""


class AFDCUDAAttentionWorker(AttentionWorkerMixin, Worker):
    """vLLM's GPU worker whose model sends every layer's MLP/MoE to the FFN ranks."""

    afd_runner_classes = {
        GPUModelRunner: AFDCUDAAttentionModelRunner,
        GPUModelRunnerV2: AFDCUDAAttentionModelRunnerV2,
    }

    def afd_vllm_ubatching(self, num_microbatches: int) -> bool:
        # DBO with graphs: vLLM's UBatchWrapper captures both micro-batches in one graph
        return uses_vllm_ubatching(num_microbatches, graph_mode_name(self.vllm_config))


def ffn_graphs_enabled(vllm_config) -> bool:
    """The FFN server captures whole steps when it runs with FULL_DECODE_ONLY graphs."""
    return graph_mode_name(vllm_config) == "FULL_DECODE_ONLY"


class AFDCUDAFFNWorker(FFNWorkerMixin, Worker):
    """vLLM's GPU worker holding only MLP/MoE weights; a thread serves the attention ranks
    on the worker's device, on a stream of its own."""

    def afd_thread_context(self) -> contextlib.AbstractContextManager:
        import torch

        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(torch.cuda.Stream(self.device)))
        return stack

    def afd_graph_cache(self):
        return FFNGraphCache(CudaGraphBackend()) if ffn_graphs_enabled(self.vllm_config) else None

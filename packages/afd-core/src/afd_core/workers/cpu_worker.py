"""AFD workers for vLLM's CPU platform (torch.distributed gloo between the roles)."""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from afd_core.workers.attention_runner import AFDAttentionRunnerMixin
from afd_core.workers.role_workers import AttentionWorkerMixin, FFNWorkerMixin


class AFDCPUAttentionModelRunner(AFDAttentionRunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner with AFD's step planning (see AFDAttentionRunnerMixin)."""


class AFDCPUAttentionWorker(AttentionWorkerMixin, CPUWorker):
    """vLLM's CPU worker whose model sends every layer's MLP/MoE to the FFN ranks."""

    vllm_runner_cls = CPUModelRunner
    afd_runner_cls = AFDCPUAttentionModelRunner


class AFDCPUFFNWorker(FFNWorkerMixin, CPUWorker):
    """vLLM's CPU worker holding only MLP/MoE weights; a thread serves the attention ranks."""

"""AFD workers for vLLM's CPU platform (torch.distributed gloo between the roles).

vLLM's CPU worker builds its V1 runner, or its model runner V2 where Triton has a CPU
backend (vLLM's choice, `VllmConfig.use_v2_model_runner`); AFD's attention worker takes
either (attention_runner.py, attention_runner_v2.py).
"""

from __future__ import annotations

from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from afd_core.workers.attention_runner import AFDAttentionRunnerMixin
from afd_core.workers.attention_runner_v2 import AFDAttentionRunnerV2Mixin
from afd_core.workers.role_workers import AttentionWorkerMixin, FFNWorkerMixin


class AFDCPUAttentionModelRunner(AFDAttentionRunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner with AFD's step planning (see AFDAttentionRunnerMixin)."""


class AFDCPUAttentionModelRunnerV2(AFDAttentionRunnerV2Mixin, CPUModelRunnerV2):
    """vLLM's CPU model runner V2 with AFD's step planning (see AFDAttentionRunnerV2Mixin)."""


class AFDCPUAttentionWorker(AttentionWorkerMixin, CPUWorker):
    """vLLM's CPU worker whose model sends every layer's MLP/MoE to the FFN ranks."""

    afd_runner_classes = {
        CPUModelRunner: AFDCPUAttentionModelRunner,
        CPUModelRunnerV2: AFDCPUAttentionModelRunnerV2,
    }


class AFDCPUFFNWorker(FFNWorkerMixin, CPUWorker):
    """vLLM's CPU worker holding only MLP/MoE weights; a thread serves the attention ranks."""

"""AFD workers for vLLM's CPU platform (torch.distributed gloo between the roles).

vLLM's CPU worker builds its V1 runner, or its model runner V2 where Triton has a CPU
backend (vLLM's choice, `VllmConfig.use_v2_model_runner`); AFD's attention worker takes
either (attention_runner.py, attention_runner_v2.py).
"""

from __future__ import annotations

import functools

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from afd_core.workers.attention_runner import AFDAttentionRunnerMixin
from afd_core.workers.role_workers import AttentionWorkerMixin, FFNWorkerMixin

CPU_RUNNER_V2_MODULE = "vllm.v1.worker.cpu.model_runner"


class AFDCPUAttentionModelRunner(AFDAttentionRunnerMixin, CPUModelRunner):
    """vLLM's CPU model runner with AFD's step planning (see AFDAttentionRunnerMixin)."""


@functools.cache
def afd_cpu_runner_v2() -> type:
    """vLLM's CPU model runner V2 with AFD's step planning (AFDAttentionRunnerV2Mixin).
    Made only where vLLM built that runner, so vLLM imported its module already: importing
    it replaces torch.cuda.set_stream with a no-op (vllm/v1/worker/cpu/shm.py), which a
    process on the V1 runner must not get from AFD."""
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2

    from afd_core.workers.attention_runner_v2 import AFDAttentionRunnerV2Mixin

    class AFDCPUAttentionModelRunnerV2(AFDAttentionRunnerV2Mixin, CPUModelRunnerV2):
        __doc__ = afd_cpu_runner_v2.__doc__

    return AFDCPUAttentionModelRunnerV2


class AFDCPUAttentionWorker(AttentionWorkerMixin, CPUWorker):
    """vLLM's CPU worker whose model sends every layer's MLP/MoE to the FFN ranks."""

    afd_runner_classes = {CPUModelRunner: AFDCPUAttentionModelRunner}

    def afd_runner_class(self, built: type) -> type | None:
        if built.__module__ == CPU_RUNNER_V2_MODULE and built.__name__ == "CPUModelRunner":
            return afd_cpu_runner_v2()
        return super().afd_runner_class(built)


class AFDCPUFFNWorker(FFNWorkerMixin, CPUWorker):
    """vLLM's CPU worker holding only MLP/MoE weights; a thread serves the attention ranks."""

"""AFD workers for vLLM's CPU platform (torch.distributed gloo between the roles)."""

from __future__ import annotations

from vllm.distributed import get_tensor_model_parallel_rank
from vllm.forward_context import set_forward_context
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.worker_base import CompilationTimes

from afd_core.log import get_logger
from afd_core.workers.roles import (
    AttentionRole,
    FFNRole,
    afd_architecture,
    terminate_this_process,
)
from afd_core.workers.selection import assert_compatible_afd_stack

logger = get_logger(__name__)


class _AFDWorker(CPUWorker):
    """What both CPU role workers do around vLLM's CPU worker."""

    afd = None  # the AttentionRole / FFNRole, set in load_model

    def init_device(self):
        assert_compatible_afd_stack(self.vllm_config, self)
        super().init_device()

    def shutdown(self) -> None:
        if self.afd is not None:
            self.afd.close()
        super().shutdown()


class AFDCPUAttentionWorker(_AFDWorker):
    """A normal CPU worker whose model sends every layer's MLP/MoE to the FFN ranks."""

    def load_model(self, *args, **kwargs) -> None:
        with afd_architecture(self.model_config):
            super().load_model(*args, **kwargs)
        self.afd = AttentionRole(self.vllm_config, get_tensor_model_parallel_rank())
        self.afd.attach(self.model_runner.model)


class AFDCPUFFNWorker(_AFDWorker):
    """Holds only MLP/MoE weights and no KV cache; a thread serves the attention ranks."""

    def load_model(self, *args, **kwargs) -> None:
        with afd_architecture(self.model_config):
            super().load_model(*args, **kwargs)
        self.afd = FFNRole(self.vllm_config, get_tensor_model_parallel_rank())
        self.afd.attach(
            self.model_runner.model, lambda: set_forward_context(None, self.vllm_config)
        )
        self.afd.start(on_fatal=terminate_this_process)

    def get_kv_cache_spec(self):
        return {}  # an attention-free engine: vLLM then allocates and schedules nothing

    def initialize_from_config(self, kv_cache_config) -> None:
        return None

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def execute_model(self, *args, **kwargs):
        raise RuntimeError(
            "AFD FFN worker: this server computes the FFN half for its attention servers and "
            "runs no requests of its own; send requests to an attention server"
        )

    sample_tokens = execute_model

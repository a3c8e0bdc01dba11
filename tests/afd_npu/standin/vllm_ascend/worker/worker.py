"""Stand-in of vllm_ascend/worker/worker.py: NPUWorker(WorkerBase) initialises the Ascend
config in its constructor and builds its runner in init_device, as vllm-ascend 0.23 does
(worker.py:89-1013); what touches a device is left out."""

from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_ascend.ascend_config import get_ascend_config, init_ascend_config  # noqa: F401
from vllm_ascend.worker.model_runner_v1 import NPUModelRunner


class NPUWorker(WorkerBase):
    def __init__(
        self,
        vllm_config,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
        **kwargs,
    ):
        init_ascend_config(vllm_config)
        super().__init__(
            vllm_config=vllm_config,
            local_rank=local_rank,
            rank=rank,
            distributed_init_method=distributed_init_method,
            is_driver_worker=is_driver_worker,
        )

    def init_device(self):
        self.device = "npu:0"
        self.model_runner = NPUModelRunner(self.vllm_config, self.device)

    def determine_available_memory(self) -> int:
        return 0

    def execute_model(self, scheduler_output):
        raise NotImplementedError("stand-in")

    def sample_tokens(self, grammar_output):
        raise NotImplementedError("stand-in")

    def load_model(self) -> None:
        self.model_runner.load_model()

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=1.0, encoder=0.0)

    def get_kv_cache_spec(self):
        return self.model_runner.get_kv_cache_spec()

    def initialize_from_config(self, kv_cache_config) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def shutdown(self) -> None:
        return None

"""The entry's driver: always active, CPU tensors (Triton's interpreter runs kernels)."""

import os

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterCPUDriver(DriverBase):
    @staticmethod
    def is_active() -> bool:
        # only meaningful under the interpreter: a real compile would need triton-cpu
        return os.environ.get("TRITON_INTERPRET") == "1"

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("Triton's interpreter runs kernels; nothing is compiled")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", "interpreter", 0)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_device_interface(self):
        return torch.cpu

    def get_benchmarker(self):
        from triton.testing import do_bench

        return do_bench

    def get_empty_cache_for_benchmark(self):
        return torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int)

    def clear_cache(self, cache) -> None:
        cache.zero_()

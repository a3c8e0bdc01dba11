"""The entry's compiler: refuses, because under the interpreter nothing is compiled."""

from triton.backends.compiler import BaseBackend, GPUTarget


class InterpreterCPUBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "afd-test-triton-cpu-interpreter"

    def parse_options(self, options: dict) -> object:
        raise RuntimeError(_NO_COMPILER)

    def add_stages(self, stages: dict, options: object, language=None) -> None:
        raise RuntimeError(_NO_COMPILER)

    def load_dialects(self, context) -> None:
        pass

    def get_module_map(self) -> dict:
        return {}


_NO_COMPILER = (
    "afd_test_triton_cpu is a test-only backend entry for Triton's interpreter: set "
    "TRITON_INTERPRET=1 (tests/support/triton_cpu_site)"
)

"""Stand-in torch_npu: only what the afd-npu tests reach (a 910B's SoC version)."""

__version__ = "0.0.0+standin"


class npu:  # noqa: N801 - torch_npu.npu
    @staticmethod
    def get_soc_version() -> int:
        return 220  # Ascend 910B (vllm-ascend: 220..225 is A2)

"""Stand in for an x86-64 CPU with AVX2 and no AVX-512 (tests/conftest.py avx2_only_env puts
this folder on PYTHONPATH): torch's CPU-feature queries, which vLLM's CPU platform asks to
pick its kernel library (vllm._C_AVX2) and its AMX / AVX-512 paths, answer no."""

import torch.cpu

for _name in (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    setattr(torch.cpu, _name, lambda: False)

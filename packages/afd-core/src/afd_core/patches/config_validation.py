"""Patch `config_validation`: check the AFD config and pick the role worker at config time.

Wraps the platform's `check_and_update_config` (classmethod), which vLLM calls once, from
VllmConfig.__post_init__ in the API-server process, before any engine, process group or
socket exists. For a config with an `afd` key it:

* parses it (AFDConfigError names the field, the value and what is allowed);
* stops if a registration step this deployment needs failed in this process;
* checks the deployment shape: DP x TP workers must equal num_attention_ranks (attention)
  or num_ffn_ranks (FFN, TP 1), eager execution on CPU;
* maps worker class `auto` to the AFD worker of the role; an explicit `--worker-cls` that
  is not that worker is an error naming both;
* on the FFN role, turns prefix caching off (an engine with no KV cache groups needs it off).

Then it calls vLLM's original, which leaves a non-`auto` worker class alone.
"""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo, replace_attr, require_supported_vllm
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="config_validation",
    why="validate the afd config and map worker class 'auto' to the AFD role worker",
    replaces=("vllm.platforms.cpu.CpuPlatform.check_and_update_config",),
    remove_when="vLLM lets a plugin choose the worker class per config (no such hook in 0.32)",
)


class AFDDeploymentError(ValueError):
    pass


def validate_deployment(afd, vllm_config, device_type: str) -> None:
    pc = vllm_config.parallel_config
    workers = pc.data_parallel_size * pc.tensor_parallel_size
    if pc.pipeline_parallel_size != 1:
        raise AFDDeploymentError(
            f"AFD: --pipeline-parallel-size={pc.pipeline_parallel_size} is not supported; "
            "allowed: 1"
        )
    if afd.is_attention and workers != afd.num_attention_ranks:
        raise AFDDeploymentError(
            f"afd config: num_attention_ranks={afd.num_attention_ranks}, but this attention "
            f"server runs {workers} workers (data parallel {pc.data_parallel_size} x tensor "
            f"parallel {pc.tensor_parallel_size}); they must be equal"
        )
    if afd.is_ffn:
        if pc.tensor_parallel_size != 1:
            raise AFDDeploymentError(
                f"AFD: an FFN server runs one FFN rank per worker and does not shard it; "
                f"--tensor-parallel-size={pc.tensor_parallel_size} is not supported, allowed: 1"
            )
        if workers != afd.num_ffn_ranks:
            raise AFDDeploymentError(
                f"afd config: num_ffn_ranks={afd.num_ffn_ranks}, but this FFN server runs "
                f"{workers} workers (data parallel {pc.data_parallel_size}); they must be equal"
            )
    from vllm.config import CompilationMode

    if device_type == "cpu" and vllm_config.compilation_config.mode != CompilationMode.NONE:
        raise AFDDeploymentError(
            "AFD on CPU runs the model eagerly (the layer exchange is Python code that "
            "torch.compile must not trace): add --enforce-eager"
        )


def _check_and_update_config(original, cls, vllm_config) -> None:
    from afd_core.config import check_supported, parse_optional_afd_config
    from afd_core.registration import assert_steps_ok_for
    from afd_core.workers.selection import resolve_worker_cls

    afd = parse_optional_afd_config(vllm_config.additional_config, device_type=cls.device_type)
    if afd is not None:
        assert_steps_ok_for(afd)
        check_supported(afd)
        validate_deployment(afd, vllm_config, cls.device_type)
        pc = vllm_config.parallel_config
        pc.worker_cls = resolve_worker_cls(pc.worker_cls, cls.device_type, afd.role)
        if afd.is_ffn:
            vllm_config.cache_config.enable_prefix_caching = False
    original(vllm_config)


def apply() -> tuple[StepStatus, str]:
    require_supported_vllm(INFO.name)
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config  # bound classmethod

    def check_and_update_config(cls, vllm_config):
        return _check_and_update_config(original, cls, vllm_config)

    check_and_update_config.__afd_patch__ = INFO.name
    replace_attr(CpuPlatform, "check_and_update_config", classmethod(check_and_update_config))
    return StepStatus.APPLIED, ""

"""Patch `ascend_config`: AFD's config handling on vLLM-Ascend.

register_afd applies it in every process whose platform's device type is `npu`, before
vLLM builds its config (the API server) and before vLLM-Ascend's engine core builds its
scheduler. Two wrappers:

* `NPUPlatform.check_and_update_config` (a classmethod, so every alias of the class sees
  it): AFD's checks and decisions of afd_core's `config_validation`, shared with CPU/CUDA
  (the afd config, the deployment shape, the model's wrapper, the micro-batch count taken
  from vLLM's DBO flags before vLLM-Ascend clears them, prefix caching off on the FFN
  role), plus what the NPU path does not run (graphs, DBO, FFN tensor or data parallel).
  Then vLLM-Ascend's original runs with worker class `auto`, so it applies its NPU
  defaults (the all2all backend that keeps sequence-parallel MoE off) and picks its
  worker; AFD then puts its role worker in that worker's place, and refuses a deployment
  where vLLM-Ascend picked another worker (310P, xlite), or an explicit worker class
  that is not AFD's.
* `vllm_ascend.ascend_config.init_ascend_config`, which builds vLLM-Ascend's AscendConfig
  from `additional_config` in the API server and again in every worker: the `afd` key is
  hidden from it while it reads the dict, so AFD's settings are accepted by whatever
  validation that AscendConfig does (0.23 ignores unknown keys; a stricter one would not)
  and reach the workers unchanged. Modules that bound the function by name before the
  patch (`from vllm_ascend.ascend_config import init_ascend_config`: platform.py,
  worker/worker.py, the Mooncake connectors) are patched too.

Idempotent (a second call changes nothing), version-gated (vLLM 0.32 and the vllm-ascend
API pinned in afd_npu.ascend_api), listed in the patch catalogue, and reversible
(`restore_afd_ascend_config_patch`, for tests and tools).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

from afd_core.capabilities import ffn_server_problem, microbatch_problem
from afd_core.config import AFD_KEY
from afd_core.log import get_logger
from afd_core.patches.catalogue import PatchInfo, replace_attr, require_supported_vllm, restore_attr
from afd_core.patches.config_validation import AFDDeploymentError
from afd_core.registration import StepStatus

logger = get_logger(__name__)

INFO = PatchInfo(
    name="ascend_config",
    why="validate the afd config on Ascend, pick the NPU role worker after vLLM-Ascend's "
    "defaults, and keep the afd settings out of vLLM-Ascend's AscendConfig",
    replaces=(
        "vllm_ascend.platform.NPUPlatform.check_and_update_config",
        "vllm_ascend.ascend_config.init_ascend_config (and its module-level aliases)",
    ),
    remove_when="vLLM-Ascend lets a plugin choose the worker class per config and passes "
    "unknown additional_config keys through by contract",
)
WHY = INFO.why

CONFIG_MODULE = "vllm_ascend.ascend_config"
_lock = threading.Lock()
_patched: list[tuple[object, str]] = []  # (owner, attribute) this patch replaced


# -- the platform hook ------------------------------------------------------------------
def validate_npu(afd, microbatches: int, vllm_config) -> None:
    """What the NPU path does not run yet, each with the reason and the alternative."""
    from afd_core.step.graphs import graph_mode_name

    mode = graph_mode_name(vllm_config)
    pc = vllm_config.parallel_config
    problem = microbatch_problem("npu", microbatches, mode) or (
        afd.is_ffn and ffn_server_problem("npu", pc.tensor_parallel_size, pc.data_parallel_size)
    )
    if problem:
        raise AFDDeploymentError(problem)


def _check_and_update_config(original, cls, vllm_config) -> None:
    from afd_core.patches.config_validation import prepare_afd_config
    from afd_core.workers.selection import resolve_worker_cls
    from afd_npu.ascend_api import ASCEND_DEFAULT_WORKER

    prepared = prepare_afd_config(cls.device_type, vllm_config)
    if prepared is None:
        return original(vllm_config)
    afd, microbatches = prepared
    validate_npu(afd, microbatches, vllm_config)
    pc = vllm_config.parallel_config
    worker = resolve_worker_cls(pc.worker_cls, cls.device_type, afd.role)  # rejects a wrong one
    pc.worker_cls = "auto"  # vLLM-Ascend applies its NPU defaults only for "auto"
    original(vllm_config)
    if pc.worker_cls != ASCEND_DEFAULT_WORKER:
        raise AFDDeploymentError(
            f"AFD on Ascend: vLLM-Ascend chose worker {pc.worker_cls!r} for this config (a 310P "
            "device, or xlite graphs); AFD's NPU workers extend "
            f"{ASCEND_DEFAULT_WORKER!r}: run on a 910B/910C without "
            "additional_config.xlite_graph_config"
        )
    pc.worker_cls = worker


# -- AscendConfig -----------------------------------------------------------------------
@contextlib.contextmanager
def afd_key_hidden(vllm_config):
    """`additional_config` without the `afd` key while vLLM-Ascend reads it."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict) or AFD_KEY not in additional:
        yield
        return
    afd = additional.pop(AFD_KEY)
    try:
        yield
    finally:
        additional[AFD_KEY] = afd


def _wrap_init_ascend_config(original):
    @functools.wraps(original)
    def init_ascend_config(vllm_config):
        with afd_key_hidden(vllm_config):
            return original(vllm_config)

    init_ascend_config.__afd_patch__ = INFO.name
    return init_ascend_config


def _install(owner, name: str, new) -> None:
    replace_attr(owner, name, new)
    _patched.append((owner, name))


def _install_init_ascend_config() -> None:
    config_module = sys.modules[CONFIG_MODULE]
    original = config_module.init_ascend_config
    wrapper = _wrap_init_ascend_config(original)
    _install(config_module, "init_ascend_config", wrapper)
    # modules that imported the function by name before this patch hold the original
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("vllm_ascend")
            and module is not config_module
            and getattr(module, "init_ascend_config", None) is original
        ):
            _install(module, "init_ascend_config", wrapper)


def _install_platform_hook(platform_cls) -> None:
    from afd_core.patches.config_validation import wrap_check_and_update_config

    wrap_check_and_update_config(platform_cls, _check_and_update_config, INFO.name)
    _patched.append((platform_cls, "check_and_update_config"))


def is_applied() -> bool:
    return bool(_patched)


def apply_afd_ascend_config_patch(guard=None) -> tuple[StepStatus, str]:
    """Install both wrappers once; later calls report the patch applied and change nothing.
    Returns FAILED with the reason (never raises) when this vLLM or vllm-ascend is not the
    one afd-npu was written for: every vLLM process loads the plugin, and one that does
    not run AFD must keep working; an AFD config then stops at start-up with the reason,
    checked by `guard` (a platform class; default: vLLM's current platform's)."""
    import importlib

    from afd_core.patches.catalogue import PatchVersionError
    from afd_npu.ascend_api import AscendAPIError, check_ascend_api

    with _lock:
        if _patched:
            return StepStatus.APPLIED, ""
        try:
            require_supported_vllm(INFO.name)
            check_ascend_api("patch")
        except (PatchVersionError, AscendAPIError) as exc:
            _refuse_afd(guard, str(exc))
            return StepStatus.FAILED, str(exc)
        importlib.import_module(CONFIG_MODULE)
        platform = importlib.import_module("vllm_ascend.platform")
        _install_init_ascend_config()
        _install_platform_hook(platform.NPUPlatform)
        logger.debug("AFD: %s patch applied", INFO.name)
        return StepStatus.APPLIED, ""


def restore_afd_ascend_config_patch() -> int:
    """Put back what the patch replaced; returns how many attributes were restored."""
    with _lock:
        restored = 0
        while _patched:
            owner, name = _patched.pop()
            restore_attr(owner, name)
            restored += 1
        return restored


def _refuse_afd(platform_cls, reason: str) -> None:
    """The patch could not be installed: make an AFD config stop at start-up with the
    reason instead of running vLLM-Ascend's own worker without AFD."""
    from afd_core.patches.config_validation import refuse_afd_on

    if platform_cls is None:
        from vllm.platforms import current_platform

        platform_cls = type(current_platform)
    refuse_afd_on(platform_cls, f"the {INFO.name} patch was not applied: {reason}")

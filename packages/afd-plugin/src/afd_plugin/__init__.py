"""afd-plugin: the vLLM entry point of Attention-FFN Disaggregation.

vLLM calls `register_afd` through the `vllm.general_plugins` entry point in every process
it starts. The body runs once per process, never needs vLLM to import this package, and
records the outcome of each step in `afd_core.registration` (see `afd doctor`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

from afd_core.spawn import force_spawn_multiprocessing_if_requested

_logger = logging.getLogger("vllm.afd_plugin")
_registered = False

_LAZY = {
    "AFDAttentionWorker": "afd_core.workers.cpu_worker:AFDCPUAttentionWorker",
    "AFDFFNWorker": "afd_core.workers.cpu_worker:AFDCPUFFNWorker",
    "assert_compatible_afd_stack": "afd_core.workers.selection:assert_compatible_afd_stack",
}


def _read_version() -> str:
    try:
        from importlib.metadata import version

        return version("afd-plugin")
    except Exception:
        return "0.0.0+unknown"


__version__ = _read_version()


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'afd_plugin' has no attribute {name!r}")
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


# At import time too: Ascend workers import worker classes directly, without the entry point.
force_spawn_multiprocessing_if_requested()


def register_afd() -> None:
    """Install AFD into this vLLM process (entry point `vllm.general_plugins: afd`)."""
    global _registered
    if _registered:
        _logger.debug("AFD plugin: register_afd() already completed in this process")
        return

    force_spawn_multiprocessing_if_requested()
    _logger.debug("AFD plugin: register_afd() called")
    if importlib.util.find_spec("vllm") is None:
        _logger.debug("AFD plugin: vLLM not found, skipping runtime registration")
        _registered = True
        return

    from afd_core import registration as reg

    try:
        from afd_core.version_gate import check_vllm_version

        if check_vllm_version(strict=False):
            reg.record(reg.STEP_VERSION_CHECK, reg.StepStatus.APPLIED)
        else:
            reg.record(reg.STEP_VERSION_CHECK, reg.StepStatus.FAILED, "unsupported vLLM version")
    except Exception as exc:
        reg.record(reg.STEP_VERSION_CHECK, reg.StepStatus.FAILED, repr(exc))
        _logger.debug("AFD plugin: vLLM version check could not be completed", exc_info=True)

    from afd_core.patches import CORE_PATCHES

    for name in CORE_PATCHES:  # one try per patch: a failure never skips the others
        step = reg.patch_step(name)
        try:
            module = importlib.import_module(f"afd_core.patches.{name}")
            status, reason = module.apply()
            reg.record(step, status, reason)
        except Exception as exc:
            reg.record(step, reg.StepStatus.FAILED, f"{type(exc).__name__}: {exc}")
            _logger.debug("AFD plugin: patch %s could not be applied", name, exc_info=True)

    # Not wrapped: a broken routing registration is a bug that must surface.
    from afd_core.routing_simulator import register_afd_balanced_routing_strategy

    if not register_afd_balanced_routing_strategy():  # when applied, it records itself
        reg.record(
            reg.STEP_ROUTING_STRATEGY,
            reg.StepStatus.DEFERRED,
            "registered when vLLM imports its MoE router",
        )

    try:
        from afd_core.dbo import register_dbo_yield_custom_op

        register_dbo_yield_custom_op()
        reg.record(reg.STEP_DBO_YIELD_OP, reg.StepStatus.APPLIED)
    except Exception as exc:
        reg.record(reg.STEP_DBO_YIELD_OP, reg.StepStatus.FAILED, f"{type(exc).__name__}: {exc}")
        _logger.debug("AFD plugin: DBO yield custom op could not be registered", exc_info=True)

    # Not wrapped: on Ascend the scheduler is built before AFD workers start, so the config
    # patch must be in place now; a failure there must stop the process.
    from vllm.platforms import current_platform

    if current_platform.device_type == "npu":
        try:
            from afd_npu.patches.ascend_config import apply_afd_ascend_config_patch
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "afd_npu":
                raise
            # afd-plugin without its [npu] extra on an Ascend machine: every vLLM process
            # loads this plugin, so do not stop them; an AFD config stops at start-up with
            # this reason (the step is needed by every AFD deployment)
            reason = "afd-npu is not installed; AFD on Ascend needs pip install 'afd-plugin[npu]'"
            reg.record(reg.STEP_ASCEND_CONFIG, reg.StepStatus.FAILED, reason)
            _logger.warning("AFD plugin: %s", reason)
            from afd_core.patches.config_validation import refuse_afd_on

            refuse_afd_on(type(current_platform), reason)
        else:
            status, reason = apply_afd_ascend_config_patch()
            reg.record(reg.STEP_ASCEND_CONFIG, status, reason)
    else:
        reg.record(reg.STEP_ASCEND_CONFIG, reg.StepStatus.SKIPPED, "not an NPU platform")

    # Not wrapped: without the AFD<arch> names no AFD worker can build its model.
    from vllm.model_executor.models import ModelRegistry

    from afd_plugin.model_table import MODEL_REGISTRATIONS, afd_name

    for arch, target in MODEL_REGISTRATIONS.items():
        ModelRegistry.register_model(afd_name(arch), target)
    reg.record(reg.STEP_MODELS, reg.StepStatus.APPLIED)

    _registered = True

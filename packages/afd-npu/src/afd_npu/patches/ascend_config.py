"""Ascend config patch: NOT IMPLEMENTED in this release.

On Ascend, EngineCore builds vLLM-Ascend schedulers before AFD workers start, and
vLLM-Ascend clears AFD-relevant settings (DBO, all2all backend) while normalising the
config. The patch that keeps them arrives with the Ascend path; until then this module
applies nothing and reports it, so an AFD config parsed on an NPU stops with that reason.
"""

from __future__ import annotations

from afd_core.registration import StepStatus

WHY = "keep AFD's DBO / all2all settings through vLLM-Ascend's config normalisation"


def apply_afd_ascend_config_patch() -> tuple[StepStatus, str]:
    return StepStatus.NOT_IMPLEMENTED, "the Ascend path is not implemented in this release"

"""Patch `config_validation`: filled in by the CPU end-to-end work."""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo
from afd_core.registration import StepStatus

INFO = PatchInfo(name="config_validation", why="", replaces=(), remove_when="", implemented=False)


def apply() -> tuple[StepStatus, str]:
    return StepStatus.NOT_IMPLEMENTED, "not implemented yet"

"""The patch catalogue: metadata of every patch and the originals it replaced."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from afd_core.registration import StepStatus, patch_step, record
from afd_core.version_gate import SUPPORTED_VLLM_VERSION, installed_vllm, is_supported


@dataclass(frozen=True)
class PatchInfo:
    name: str
    why: str
    replaces: tuple[str, ...]  # dotted names of the vLLM functions it replaces
    remove_when: str
    implemented: bool = True


class PatchVersionError(RuntimeError):
    pass


_lock = threading.Lock()
_originals: dict[tuple[int, str], Any] = {}


def require_supported_vllm(patch: str) -> None:
    """Refuse to patch a vLLM the patch was not written against."""
    found = installed_vllm()
    if found is None or not is_supported(found.version):
        have = "no vLLM" if found is None else f"vLLM {found.version}"
        raise PatchVersionError(
            f"patch {patch!r} is written for vLLM {SUPPORTED_VLLM_VERSION}; found {have}, "
            "so it was not applied"
        )


def replace_attr(owner: Any, name: str, new: Any) -> Any:
    """Set owner.name = new once, remembering the original; returns the original."""
    with _lock:
        key = (id(owner), name)
        if key in _originals:  # already patched in this process
            return _originals[key]
        own = isinstance(owner, type) and name in owner.__dict__  # else inherited
        orig = owner.__dict__[name] if own else getattr(owner, name)
        _originals[key] = orig
        setattr(owner, name, new)
        return orig


def restore_attr(owner: Any, name: str) -> bool:
    """Undo replace_attr(owner, name, ...): vLLM's attribute back; False if not patched."""
    with _lock:
        key = (id(owner), name)
        if key not in _originals:
            return False
        setattr(owner, name, _originals.pop(key))
        return True


def install(info: PatchInfo, owner: Any, name: str, new: Any) -> None:
    """Replace owner.name by `new` (marked as this patch's) and record the patch applied."""
    new.__afd_patch__ = info.name
    replace_attr(owner, name, new)
    record(patch_step(info.name), StepStatus.APPLIED, "")


def apply_when_imported(
    info: PatchInfo, module: str, patch: Callable[[ModuleType], None], why_deferred: str
) -> tuple[StepStatus, str]:
    """Apply `patch(module)` now if vLLM imported the module already, else right after it
    does (a failure then is recorded under the patch's step, and stops the process if it
    belongs to an AFD server: envs.in_deployment)."""
    require_supported_vllm(info.name)
    from afd_core import envs
    from afd_core.patches.import_hooks import when_imported

    # in a process of an AFD server a failure stops it at that import (start-up), instead
    # of being recorded after the start-up check already passed
    if when_imported(module, patch, step=patch_step(info.name), propagate=envs.in_deployment):
        return StepStatus.APPLIED, ""
    return StepStatus.DEFERRED, f"applied when {module} is imported ({why_deferred})"


def original(owner: Any, name: str) -> Any:
    """The attribute as vLLM defined it, before any AFD patch."""
    with _lock:
        key = (id(owner), name)
        if key in _originals:
            return _originals[key]
    own = isinstance(owner, type) and name in owner.__dict__
    return owner.__dict__[name] if own else getattr(owner, name)


def is_patched(owner: Any, name: str) -> bool:
    with _lock:
        return (id(owner), name) in _originals


def info(module: str) -> PatchInfo:
    return importlib.import_module(f"afd_core.patches.{module}").INFO


def all_infos() -> list[PatchInfo]:
    from afd_core.patches import CORE_PATCHES

    return [info(m) for m in CORE_PATCHES]

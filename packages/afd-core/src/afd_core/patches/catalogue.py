"""The patch catalogue: metadata of every patch and the originals it replaced."""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any

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
        orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        _originals[key] = orig
        setattr(owner, name, new)
        return orig


def original(owner: Any, name: str) -> Any:
    """The attribute as vLLM defined it, before any AFD patch."""
    with _lock:
        key = (id(owner), name)
        if key in _originals:
            return _originals[key]
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def is_patched(owner: Any, name: str) -> bool:
    with _lock:
        return (id(owner), name) in _originals


def info(module: str) -> PatchInfo:
    return importlib.import_module(f"afd_core.patches.{module}").INFO


def all_infos() -> list[PatchInfo]:
    from afd_core.patches import CORE_PATCHES

    return [info(m) for m in CORE_PATCHES]

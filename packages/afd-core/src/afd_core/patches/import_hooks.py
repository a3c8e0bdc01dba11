"""Run a callback when a module is imported, or now if it already is.

register_afd runs in every vLLM process, most of which never import the heavy vLLM modules
some registrations touch (AsyncLLM: ~1.5 s, the fused-MoE stack: ~0.4 s). Deferring those
registrations to the moment vLLM imports the module keeps the plugin cheap everywhere and
still in place before the module is used.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType

_lock = threading.RLock()
_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        with _lock:
            if fullname not in _callbacks:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            with _lock:
                callbacks = _callbacks.pop(fullname, [])
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module  # this loader instance serves this module only
        return spec


_finder = _PostImportFinder()


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> bool:
    """Call callback(module) now if imported (True), else right after its import (False)."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return True
    with _lock:
        _callbacks.setdefault(module_name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    return False


def pending() -> list[str]:
    with _lock:
        return sorted(_callbacks)

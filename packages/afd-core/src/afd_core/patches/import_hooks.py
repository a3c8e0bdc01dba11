"""Run a callback when a module is imported, or now if it already is.

register_afd runs in every vLLM process, most of which never import the heavy vLLM modules
some registrations touch (AsyncLLM: ~1.5 s, the fused-MoE stack: ~0.4 s). Deferring those
registrations to the moment vLLM imports the module keeps the plugin cheap everywhere and
still in place before the module is used.

A deferred registration that fails is recorded as failed under its step name (so `afd
doctor` and the AFD start-up check see it) and logged; it does not break vLLM's import of
the module unless the step says the failure must propagate (`propagate()` true: the
registration is needed in this process, e.g. the routing strategy the environment selects).
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType

_lock = threading.RLock()
_callbacks: dict[str, list[_Deferred]] = {}


class _Deferred:
    def __init__(self, callback, step: str, propagate: Callable[[], bool]):
        self.callback, self.step, self.propagate = callback, step, propagate

    def __call__(self, module: ModuleType) -> None:
        try:
            self.callback(module)
        except Exception as exc:
            from afd_core.log import get_logger
            from afd_core.registration import StepStatus, record

            record(self.step, StepStatus.FAILED, f"{type(exc).__name__}: {exc}")
            get_logger(__name__).error(
                "AFD plugin: deferred step %s failed when %s was imported: %s",
                self.step,
                module.__name__,
                exc,
            )
            if self.propagate():
                raise


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


def when_imported(
    module_name: str,
    callback: Callable[[ModuleType], None],
    step: str,
    propagate: Callable[[], bool] = lambda: False,
) -> bool:
    """Call callback(module) now if imported (True), else right after its import (False).
    A failure is recorded under `step`; it propagates now, and later only if propagate()."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return True
    with _lock:
        _callbacks.setdefault(module_name, []).append(_Deferred(callback, step, propagate))
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    return False


def pending() -> list[str]:
    with _lock:
        return sorted(_callbacks)

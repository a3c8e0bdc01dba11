"""Opt-in override of Python's default multiprocessing start method.

AFD_FORCE_SPAWN_MULTIPROCESSING=1 makes `spawn` the default context and redirects the
`forkserver` context to it too, for runtimes whose helpers use Python's default context
(not vLLM's VLLM_WORKER_MULTIPROC_METHOD) and cannot survive forkserver.

It lives with the workers: importing `afd_core.workers` applies it (runtimes that import a
worker class directly never call the entry point), and so do `afd_plugin` and register_afd.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context as mp_context

from afd_core import envs

_saved_forkserver = None


def force_spawn_multiprocessing_if_requested() -> bool:
    """Apply the override when requested; True if it is in force afterwards."""
    global _saved_forkserver
    if not envs.force_spawn_requested():
        return False
    spawn = multiprocessing.get_context("spawn")
    if multiprocessing.get_start_method(allow_none=True) != "spawn":
        multiprocessing.set_start_method("spawn", force=True)
    concrete = mp_context._concrete_contexts
    if concrete.get("forkserver") is not spawn:
        _saved_forkserver = concrete.get("forkserver")
        concrete["forkserver"] = spawn
    return True

"""Patch `fault_tolerance`: an attention server answers vLLM's fault-tolerance routes.

vLLM 0.32 serves `GET /fault_tolerance/status` and `POST /fault_tolerance/apply` only with
`--enable-fault-tolerance`, which an AFD attention server cannot use and whose states would
not see its FFN rank (afd_core/fault_tolerance.py says why). AFD answers the same routes
with AFD's states as a vLLM endpoint plugin (`vllm.endpoint_plugins`: vLLM attaches its
routes after its own, replacing any with the same path and method, and gives it the engine
client). vLLM loads endpoint plugins only when VLLM_PLUGINS names them, and setting
VLLM_PLUGINS also restricts the general plugins (AFD's among them): so this wraps
`vllm.plugins.load_endpoint_plugins` to add AFD's plugin to the ones vLLM loaded, on an
attention server's API process only (its role is set when vLLM parses the AFD config,
before the app is built). It is applied when vLLM imports `vllm.plugins`, which it does
before it loads general plugins: at once.
"""

from __future__ import annotations

import os

from afd_core import envs
from afd_core.patches.catalogue import PatchInfo, apply_when_imported, install
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="fault_tolerance",
    why="an attention server answers vLLM's /fault_tolerance/status and /apply with AFD's "
    "states, without vLLM's --enable-fault-tolerance",
    replaces=("vllm.plugins.load_endpoint_plugins",),
    remove_when="vLLM loads an endpoint plugin that a general plugin registers without the "
    "VLLM_PLUGINS allowlist, or its fault-tolerance status can ask a plugin for the states",
)

PLUGINS_MODULE = "vllm.plugins"


def _patch(module) -> None:
    original = module.load_endpoint_plugins

    def load_endpoint_plugins(supported_tasks=None):
        plugins = original(supported_tasks)
        from afd_core.fault_tolerance import PLUGIN_NAME, AFDFaultToleranceRoutes

        attention = os.environ.get(envs.AFD_DEPLOYMENT_ROLE) == "attention"
        if (
            attention
            and "generate" in (supported_tasks or ())
            and not any(getattr(p, "name", None) == PLUGIN_NAME for p in plugins)
        ):
            plugins.append(AFDFaultToleranceRoutes())
        return plugins

    install(INFO, module, "load_endpoint_plugins", load_endpoint_plugins)


def apply() -> tuple[StepStatus, str]:
    return apply_when_imported(INFO, PLUGINS_MODULE, _patch, "every vLLM process")

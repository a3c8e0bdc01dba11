"""Narrow, version-gated patches of vLLM, one module each.

Every patch module defines INFO (why it exists, what it replaces, when it can go) and
`apply()`, which returns a StepStatus or raises. A patch replaces the smallest vLLM function
it can, checks the vLLM version first, and keeps the original reachable through
`afd_core.patches.catalogue.original(owner, name)`.
"""

CORE_PATCHES = (
    "async_dp_engine",
    "async_dp_forward_context",
    "config_validation",
    "cpu_dp_collectives",
    "engine_core",
    "fault_tolerance",
    "health",
    "metrics_registry",
    "mrv2_ubatch_runner",
    "step_failure",
)

"""Patch `metrics_registry`: the AFD ranks' metrics on /metrics with several API servers.

With `--api-server-count` above 1, `vllm serve` sets PROMETHEUS_MULTIPROC_DIR, and vLLM
0.32's /metrics in each API server process no longer reads prometheus_client's default
registry, where AFD's collector is registered (`entrypoints/serve/instrumentator/
metrics.py`, `attach_router`): the instrumentator's own /metrics route, which answers
first, then serves a registry it makes per scrape with the multiprocess collector alone,
and vLLM's `Mount("/metrics")` behind it the registry of `get_prometheus_registry()`
(`v1/metrics/prometheus.py`), made the same way. This patch wraps both in that module:
the registry `get_prometheus_registry()` returns also serves the process's AFD collector
(afd_core.metrics.serve_on), and in multiprocess mode vLLM's Mount goes first, so it
answers /metrics. Every API server process reads the same snapshot files, so each answers
the same afd_* numbers, whichever of them a scrape reaches; vLLM's own numbers are those
of the multiprocess collector either way. With one API server nothing changes.
"""

from __future__ import annotations

import os

from afd_core.patches.catalogue import PatchInfo, apply_when_imported, install
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="metrics_registry",
    why="the afd_* metrics on /metrics with --api-server-count above 1 (multiprocess mode)",
    replaces=(
        "vllm.entrypoints.serve.instrumentator.metrics.get_prometheus_registry",
        "vllm.entrypoints.serve.instrumentator.metrics.attach_router",
    ),
    remove_when="vLLM's /metrics serves collectors registered on the default registry in "
    "multiprocess mode, or lets a plugin add one",
)

METRICS_MODULE = "vllm.entrypoints.serve.instrumentator.metrics"


def _patch(module) -> None:
    from starlette.routing import Mount

    from afd_core.metrics import serve_on

    get_registry, attach = module.get_prometheus_registry, module.attach_router

    def get_prometheus_registry():
        registry = get_registry()
        serve_on(registry)
        return registry

    def attach_router(app) -> None:
        attach(app)
        if os.getenv("PROMETHEUS_MULTIPROC_DIR") is None:
            return  # the instrumentator's route serves the default registry: AFD's too
        routes = app.router.routes
        for route in [r for r in routes if isinstance(r, Mount) and r.path == "/metrics"]:
            routes.remove(route)
            routes.insert(0, route)

    install(INFO, module, "get_prometheus_registry", get_prometheus_registry)
    install(INFO, module, "attach_router", attach_router)


def apply() -> tuple[StepStatus, str]:
    # only API server processes build the HTTP app
    return apply_when_imported(INFO, METRICS_MODULE, _patch, "API server processes")

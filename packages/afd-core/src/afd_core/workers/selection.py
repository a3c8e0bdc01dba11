"""Which worker class runs a role on a platform (no vLLM import here)."""

from __future__ import annotations

WORKERS = {
    ("cpu", "attention"): "afd_core.workers.cpu_worker.AFDCPUAttentionWorker",
    ("cpu", "ffn"): "afd_core.workers.cpu_worker.AFDCPUFFNWorker",
    ("cuda", "attention"): "afd_core.workers.cuda_worker.AFDCUDAAttentionWorker",
    ("cuda", "ffn"): "afd_core.workers.cuda_worker.AFDCUDAFFNWorker",
    # in afd-npu (they extend vLLM-Ascend's NPUWorker)
    ("npu", "attention"): "afd_npu.workers.npu_worker.AFDNPUAttentionWorker",
    ("npu", "ffn"): "afd_npu.workers.npu_worker.AFDNPUFFNWorker",
}


class WorkerSelectionError(ValueError):
    pass


def worker_class_for(device_type: str, role: str) -> str:
    try:
        return WORKERS[(device_type, role)]
    except KeyError:
        platforms = sorted({d for d, _ in WORKERS})
        raise WorkerSelectionError(
            f"AFD has no {role} worker for platform {device_type!r} in this release; "
            f"supported platforms: {', '.join(platforms)}"
        ) from None


def resolve_worker_cls(requested: str, device_type: str, role: str) -> str:
    """`auto` becomes the role worker; an explicit class must be that worker."""
    expected = worker_class_for(device_type, role)
    if requested in ("auto", "", None):
        return expected
    if requested != expected:
        raise WorkerSelectionError(
            f"--worker-cls {requested!r} does not match AFD role {role!r}, which needs "
            f"{expected!r}; pass --worker-cls auto (the default) or that class"
        )
    return requested


def assert_compatible_afd_stack(vllm_config, worker) -> None:
    """Called by AFD workers at start: this worker must be the one the role needs."""
    from afd_core.config import parse_optional_afd_config

    afd = parse_optional_afd_config(vllm_config.additional_config)
    if afd is None:
        raise WorkerSelectionError(
            f"{type(worker).__qualname__} is an AFD worker, but the vLLM config has no 'afd' key"
        )
    from vllm.platforms import current_platform

    expected = worker_class_for(current_platform.device_type, afd.role)
    actual = f"{type(worker).__module__}.{type(worker).__qualname__}"
    if actual != expected:
        raise WorkerSelectionError(
            f"worker {actual!r} cannot run AFD role {afd.role!r}; it needs {expected!r}"
        )

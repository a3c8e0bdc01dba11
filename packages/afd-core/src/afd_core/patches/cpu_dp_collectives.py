"""Patch `cpu_dp_collectives`: vLLM's CPU communicator gets the variable-size collectives
that data-parallel MoE needs.

With `--data-parallel-size` > 1, vLLM's MoE layers gather every DP rank's rows before the
experts (`all_gatherv`, sizes from the forward context's DP metadata) and reduce-scatter the
result back (`reduce_scatterv`). vLLM 0.32's `CpuCommunicator` inherits both from the base
class, which raises NotImplementedError, so no DP MoE model (colocated, or an FFN server
with several FFN ranks) can run on CPU. This adds them, on gloo:

- all_gatherv: every rank pads its rows to the largest size, one all_gather, then the pads
  are dropped (the padding costs at most (D-1) x max rows; CPU DP groups are small).
- reduce_scatterv: one all_reduce of the whole tensor, each rank keeps its own slice. The
  sums are the same as a reduce-scatter's, in the same order on every rank.

Only on the CPU platform, only where the class still lacks its own implementation (a vLLM
that adds them keeps its own).
"""

from __future__ import annotations

from afd_core.patches.catalogue import PatchInfo, apply_when_imported, install
from afd_core.registration import StepStatus

INFO = PatchInfo(
    name="cpu_dp_collectives",
    why=(
        "data-parallel MoE on CPU (several FFN ranks with one expert group, or a colocated "
        "DP reference) needs all_gatherv/reduce_scatterv, which vLLM 0.32's CPU "
        "communicator leaves NotImplemented"
    ),
    replaces=(
        "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator.all_gatherv",
        "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator.reduce_scatterv",
    ),
    remove_when="vLLM's CpuCommunicator implements all_gatherv and reduce_scatterv",
)

CPU_COMMUNICATOR_MODULE = "vllm.distributed.device_communicators.cpu_communicator"


def _check_sizes(comm, sizes, what: str) -> list[int]:
    if sizes is None or len(sizes) != comm.world_size:
        raise ValueError(
            f"{what}: sizes={sizes!r} must give one row count per rank of the group "
            f"({comm.world_size} ranks)"
        )
    return [int(s) for s in sizes]


def all_gatherv(comm, input_, dim: int = 0, sizes=None):
    """Concatenate every rank's tensor(s) along `dim`; rank r contributes sizes[r] rows."""
    import torch
    import torch.distributed as dist

    sizes = _check_sizes(comm, sizes, "all_gatherv")
    width = max(sizes)
    single = isinstance(input_, torch.Tensor)
    outputs = []
    for tensor in [input_] if single else input_:
        d = dim % tensor.dim()
        rows = tensor.movedim(d, 0)
        if rows.shape[0] != sizes[comm.rank_in_group]:
            raise ValueError(
                f"all_gatherv: rank {comm.rank_in_group} has {rows.shape[0]} rows, its size "
                f"says {sizes[comm.rank_in_group]}"
            )
        padded = rows.new_zeros((width, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        gathered = rows.new_empty((comm.world_size * width, *rows.shape[1:]))
        # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, padded, group=comm.device_group)
        parts = [gathered[r * width : r * width + n] for r, n in enumerate(sizes)]
        outputs.append(torch.cat(parts).movedim(0, d).contiguous())
    return outputs[0] if single else outputs


def reduce_scatterv(comm, input_, dim: int = -1, sizes=None):
    """Sum `input_` over the group; rank r keeps its sizes[r] rows along `dim`."""
    import torch.distributed as dist

    sizes = _check_sizes(comm, sizes, "reduce_scatterv")
    d = dim % input_.dim()
    total = input_.movedim(d, 0).contiguous()
    if total.shape[0] != sum(sizes):
        raise ValueError(
            f"reduce_scatterv: {total.shape[0]} rows, the sizes {sizes} sum to {sum(sizes)}"
        )
    dist.all_reduce(total, group=comm.device_group)
    start = sum(sizes[: comm.rank_in_group])
    mine = total[start : start + sizes[comm.rank_in_group]]
    return mine.movedim(0, d).contiguous()


def _patch(module) -> None:
    cls = module.CpuCommunicator
    for name, fn in (("all_gatherv", all_gatherv), ("reduce_scatterv", reduce_scatterv)):
        if name in cls.__dict__:  # this vLLM has its own
            continue

        def method(self, input_, dim=0 if name == "all_gatherv" else -1, sizes=None, _fn=fn):
            return _fn(self, input_, dim, sizes)

        method.__name__ = name
        install(INFO, cls, name, method)


def apply() -> tuple[StepStatus, str]:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return StepStatus.SKIPPED, "not the CPU platform (its communicator has these)"
    return apply_when_imported(INFO, CPU_COMMUNICATOR_MODULE, _patch, "workers with DP groups")

"""The cpu_dp_collectives patch: vLLM's CPU communicator's all_gatherv / reduce_scatterv,
on real gloo process groups, equal to the collectives they stand for."""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest

from tests.afd_core.gloo_harness import assert_no_errors, free_port, run_processes

pytestmark = pytest.mark.vllm  # needs torch (the CPU build comes with vLLM)

SIZES = [3, 0, 2]  # rows per rank, one rank with none (an FFN rank without rows this layer)


def _rows(rank: int, n: int, width: int = 4):
    import torch

    return torch.arange(n * width, dtype=torch.float32).reshape(n, width) + 100 * rank


def member_main(rank, port, q):
    try:
        import torch
        import torch.distributed as dist

        from afd_core.patches.cpu_dp_collectives import all_gatherv, reduce_scatterv

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(SIZES)
        )
        comm = SimpleNamespace(world_size=len(SIZES), rank_in_group=rank, device_group=None)
        mine = _rows(rank, SIZES[rank])
        ids = torch.arange(SIZES[rank], dtype=torch.int64) + 10 * rank
        gathered, gathered_ids = all_gatherv(comm, [mine, ids], 0, SIZES)
        single = all_gatherv(comm, mine.t().contiguous(), -1, SIZES)  # along the last dim
        # every rank holds a full-size partial sum; each keeps its own rows of the total
        partial = torch.full((sum(SIZES), 2), float(rank + 1))
        scattered = reduce_scatterv(comm, partial, 0, SIZES)
        dist.destroy_process_group()
        out = (gathered, gathered_ids, single, scattered)
        q.put((rank, tuple(t.tolist() for t in out)))  # plain data: this process ends now
    except Exception:
        q.put((rank, "ERROR " + traceback.format_exc()))


def test_all_gatherv_and_reduce_scatterv_on_gloo_with_a_rank_without_rows():
    import torch

    port = free_port()
    results = run_processes([(member_main, r, port) for r in range(len(SIZES))])
    assert_no_errors(results)
    want = torch.cat([_rows(r, n) for r, n in enumerate(SIZES)])
    want_ids = torch.cat([torch.arange(n) + 10 * r for r, n in enumerate(SIZES)])
    total = float(sum(r + 1 for r in range(len(SIZES))))
    for rank, (gathered, gathered_ids, single, scattered) in results.items():
        assert gathered == want.tolist()
        assert gathered_ids == want_ids.tolist()
        assert single == want.t().tolist()
        assert scattered == [[total, total]] * SIZES[rank]


def test_sizes_that_do_not_fit_the_group_are_named():
    import torch

    from afd_core.patches.cpu_dp_collectives import all_gatherv, reduce_scatterv

    comm = SimpleNamespace(world_size=2, rank_in_group=0, device_group=None)
    with pytest.raises(ValueError, match=r"sizes=\[3\] must give one row count per rank"):
        all_gatherv(comm, torch.zeros(3, 2), 0, [3])
    with pytest.raises(ValueError, match=r"rank 0 has 3 rows, its size says 2"):
        all_gatherv(comm, torch.zeros(3, 2), 0, [2, 1])
    with pytest.raises(ValueError, match=r"5 rows, the sizes \[2, 1\] sum to 3"):
        reduce_scatterv(comm, torch.zeros(5, 2), 0, [2, 1])


def test_vllm_032_cpu_communicator_lacks_them_and_the_patch_adds_them():
    """Pinned: vLLM 0.32's CpuCommunicator inherits NotImplemented all_gatherv and
    reduce_scatterv (so DP MoE cannot run on CPU); the patch gives it ours."""
    from vllm.distributed.device_communicators import cpu_communicator
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )

    from afd_core.patches import cpu_dp_collectives
    from afd_core.patches.catalogue import original

    cls = cpu_communicator.CpuCommunicator
    cpu_dp_collectives._patch(cpu_communicator)
    for name in ("all_gatherv", "reduce_scatterv"):
        assert original(cls, name) is getattr(DeviceCommunicatorBase, name)
        assert getattr(cls, name).__afd_patch__ == "cpu_dp_collectives"
    with pytest.raises(NotImplementedError):
        DeviceCommunicatorBase.all_gatherv(None, None)

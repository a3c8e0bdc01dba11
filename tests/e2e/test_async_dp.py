"""Async DP over two FFN ranks: 4A2F, one attention server of four data-parallel ranks that
step independently (afd.async_dp), two FFN servers (FFN rank 0 serves attention ranks 0
and 1, FFN rank 1 serves 2 and 3). The 2A1F case is in test_afd_serve.py (DeepSeek-V2)."""

from __future__ import annotations

import pytest

from afd_plugin.deploy.servers import complete, running, scale_out_deployment
from tests.e2e.conftest import (
    DEV_MODE,
    MAX_TOKENS,
    PROMPTS,
    assert_same,
    reference,
    run_prompts,
    settled_rank_steps,
    steps_on_one_rank,
    with_reference,
)

pytestmark = pytest.mark.e2e

ARCH = "qwen3_moe"


def test_4a2f_async_dp_gives_colocated_tokens_on_every_rank_and_idle_ranks_run_nothing(
    checkpoints, log_dir
):
    model = str(checkpoints(ARCH))
    afd = scale_out_deployment(
        model,
        log_dir,
        attention=[4],
        ffn=[1, 1],
        afd_extra={"async_dp": True},
        env=DEV_MODE,
        tag=f"{ARCH}-4a2f-async-",
    )
    servers = with_reference(ARCH, model, log_dir, afd)
    with running(servers, timeout=600):
        ref = reference(ARCH, servers)
        att = next(s for s in servers if "attention" in s.spec.name)
        ffn = [s for s in servers if "ffn" in s.spec.name]
        assert_same(ref, run_prompts(att.url))
        # every data-parallel rank, named by vLLM's header, computes what colocated does
        for rank, prompt in enumerate(PROMPTS[:4]):
            got = complete(att.url, prompt, MAX_TOKENS, data_parallel_rank=rank)
            assert_same([ref[rank]], [got], [prompt])
        # load on attention rank 2 only: the other three run no forward at all, and FFN
        # rank 0 (which serves ranks 0 and 1) no step
        # settled: FFN rank 0's snapshot may not yet count the last request on rank 1
        ffn0_before = settled_rank_steps(ffn[0].url, "ffn")
        steps = steps_on_one_rank(att.url, 2, PROMPTS[:2])
        assert steps.get(2, 0) >= MAX_TOKENS, steps
        assert [steps.get(r, 0) for r in (0, 1, 3)] == [0, 0, 0], steps
        assert settled_rank_steps(ffn[0].url, "ffn") == ffn0_before

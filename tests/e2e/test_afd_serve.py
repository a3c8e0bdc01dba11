"""Real `vllm serve` processes: AFD gives exactly the tokens the colocated server gives.

Per architecture: a colocated server, a 1 attention : 1 FFN deployment, and a 2A1F one
(one attention server with two data-parallel ranks, one FFN server). fp32 greedy.
"""

from __future__ import annotations

import pytest

from afd_plugin.launcher import (
    SHARED_CORES,
    Server,
    ServerSpec,
    free_port,
    local_deployment,
    running,
)
from tests.e2e.conftest import BACKENDS, MAX_TOKENS, PROMPTS, run_prompts

pytestmark = pytest.mark.e2e

_REFERENCE: dict[str, list] = {}


def afd_pair(model, arch, log_dir, tag, dp=1):
    d = local_deployment(
        model, log_dir, attention_ranks=dp, attention_backend=BACKENDS[arch], tag=f"{arch}-{tag}-"
    )
    return d["ffn"], d["attention"]


def colocated_server(model, arch, log_dir):
    spec = ServerSpec(
        f"{arch}-colocated",
        model,
        free_port(),
        attention_backend=BACKENDS[arch],
        env=SHARED_CORES,
    )
    return Server(spec, log_dir)


def assert_same(reference, afd):
    for prompt, ref, got in zip(PROMPTS, reference, afd, strict=True):
        assert len(ref.token_ids) == len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == ref.token_ids, prompt
        worst = max(abs(a - b) for a, b in zip(ref.logprobs, got.logprobs, strict=True))
        assert worst <= 1e-5, (prompt, worst)


@pytest.mark.parametrize("arch", list(BACKENDS))
def test_1a1f_matches_colocated(arch, checkpoints, log_dir):
    model = str(checkpoints(arch))
    colocated = colocated_server(model, arch, log_dir)
    ffn, att = afd_pair(model, arch, log_dir, "1a1f")
    with running([colocated, ffn, att]):
        _REFERENCE[arch] = run_prompts(colocated.url)
        assert_same(_REFERENCE[arch], run_prompts(att.url))
        # the FFN server answers requests with a clear error instead of hanging
        from afd_plugin.launcher import ServerError, complete

        with pytest.raises(ServerError, match="400.*AFD FFN server.*attention server"):
            complete(ffn.url, "hi", 4, timeout=30)


@pytest.mark.parametrize("arch", list(BACKENDS))
def test_2a1f_data_parallel_attention_matches_colocated(arch, checkpoints, log_dir):
    model = str(checkpoints(arch))
    ffn, att = afd_pair(model, arch, log_dir, "2a1f", dp=2)
    servers = [ffn, att]
    if arch not in _REFERENCE:  # run alone: start the colocated reference alongside
        servers.insert(0, colocated_server(model, arch, log_dir))
    with running(servers):
        if arch not in _REFERENCE:
            _REFERENCE[arch] = run_prompts(servers[0].url)
        assert_same(_REFERENCE[arch], run_prompts(att.url))

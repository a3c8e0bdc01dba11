"""AFD on vLLM's model runner V2 (MRV2), end to end on CPU: real `vllm serve` processes
that run V2 because vLLM picked it, greedy tokens identical to a colocated server on V2.

vLLM's CPU build picks MRV2 only where Triton has a CPU backend; here Triton's interpreter
and a test-only backend entry named "cpu" stand in for triton-cpu (tests/conftest.py
`mrv2_env`; docs/development.md). Nothing sets VLLM_USE_V2_MODEL_RUNNER: each server runs
on the runner vLLM chose, and the tests check from its log that it was V2. Qwen3-MoE, fp32.

One module-wide deployment (a colocated V2 server and a 1A1F deployment whose attention
server micro-batches up to m = 4) answers the 1A1F, micro-batch and failed-step tests; the
data-parallel and tensor-parallel shapes start their own. The same shapes on V1 are
tests/e2e/test_afd_serve.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from afd_plugin.deploy.servers import (
    SHARED_CORES,
    Server,
    ServerError,
    ServerSpec,
    complete,
    free_port,
    local_deployment,
    running,
)
from tests.conftest import mrv2_env
from tests.e2e.conftest import (
    DEV_MODE,
    MAX_TOKENS,
    PROMPTS,
    assert_same,
    rpc,
    run_batch,
    run_prompts,
)

pytestmark = pytest.mark.e2e

ARCH = "qwen3_moe"
# AFD's own micro-batches (afd.num_microbatches, not --enable-dbo: with DBO asked of vLLM,
# vLLM 0.32 picks its V1 runner unless VLLM_USE_V2_MODEL_RUNNER=1); every batch of two or
# more requests is above the thresholds
MICROBATCH_ARGS = ["--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "4"]
STEP_TIMEOUT_S = 30
V2_WORKER_LOG = "Using V2 Model Runner"  # vLLM's CPU worker, when it builds MRV2


def mrv2_deployment(model, log_dir, tag, microbatches=1, **shape) -> dict[str, Server]:
    servers = local_deployment(
        model,
        log_dir,
        env=mrv2_env(DEV_MODE),
        afd_extra={"connector_extra_config": {"timeout_s": STEP_TIMEOUT_S}},
        attention_args=MICROBATCH_ARGS if microbatches > 1 else None,
        tag=f"mrv2-{tag}-",
        **shape,
    )
    if microbatches > 1:
        servers["attention"].spec.afd["num_microbatches"] = microbatches
    return servers


def on_v2(*servers: Server) -> None:
    for server in servers:
        log = server.log_path.read_text(errors="replace")
        assert V2_WORKER_LOG in log, (server.spec.name, server.log_tail(40))
        assert "VLLM_USE_V2_MODEL_RUNNER" not in server.spec.env


@pytest.fixture(scope="module")
def v2(checkpoints, log_dir):
    model = str(checkpoints(ARCH))
    colocated = Server(
        ServerSpec(
            "mrv2-colocated", model, free_port(), env=mrv2_env({**SHARED_CORES, **DEV_MODE})
        ),
        log_dir,
    )
    d = mrv2_deployment(model, log_dir, "1a1f", microbatches=2)
    with running([colocated, d["ffn"], d["attention"]]):
        alone = run_prompts(colocated.url)
        pairs = run_batch(colocated.url, PROMPTS[:2]) + run_batch(colocated.url, PROMPTS[2:])
        yield SimpleNamespace(
            model=model,
            colocated=colocated,
            ffn=d["ffn"],
            att=d["attention"],
            alone=alone,
            pairs=pairs,
            batch=run_batch(colocated.url),
        )


def set_m(att, m) -> dict:
    return rpc(att.url, "afd_set_microbatching", str(m))[0]


def split_steps(att) -> dict:
    return rpc(att.url, "afd_step_stats")[0]["by_microbatches"]


def test_every_server_runs_the_v2_runner_vllm_picked(v2):
    on_v2(v2.colocated, v2.ffn, v2.att)
    log = v2.att.log_path.read_text(errors="replace")
    assert "AFD: vLLM's V2 model runner" in log, v2.att.log_tail(40)


def test_1a1f_on_v2_matches_colocated_v2(v2):
    set_m(v2.att, 1)
    assert_same(v2.alone, run_prompts(v2.att.url))
    assert_same(v2.batch, run_batch(v2.att.url))


def test_afds_microbatches_on_v2_compute_what_their_requests_compute(v2):
    before = split_steps(v2.att)
    set_m(v2.att, 4)  # four micro-batches of one request each
    assert_same(v2.alone, run_batch(v2.att.url))
    set_m(v2.att, 2)  # the first two requests and the last two
    assert_same(v2.pairs, run_batch(v2.att.url))
    after = split_steps(v2.att)
    ran = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert ran == {"4": MAX_TOKENS, "2": MAX_TOKENS}, ran
    set_m(v2.att, 1)


@pytest.mark.parametrize("side", ["ffn", "attention"])
def test_a_failed_step_on_v2_fails_its_request_and_the_next_one_is_served(v2, side):
    set_m(v2.att, 2)
    if side == "ffn":
        rpc(v2.ffn.url, "afd_inject_step_failure", "1", "test")
    else:
        rpc(v2.att.url, "afd_inject_step_failure", "test")
    with pytest.raises(ServerError, match="500"):
        complete(v2.att.url, PROMPTS[0], MAX_TOKENS)
    assert_same(v2.alone, run_prompts(v2.att.url))
    assert_same(v2.pairs, run_batch(v2.att.url))  # split steps after the failure, too
    log = v2.att.log_path.read_text(errors="replace")
    assert f"injected {'FFN' if side == 'ffn' else 'attention'} step failure (test)" in log
    assert "finish with an error" in log, v2.att.log_tail(60)
    assert v2.att.proc.poll() is None and v2.ffn.proc.poll() is None
    set_m(v2.att, 1)


@pytest.mark.parametrize(
    ("shape", "ms"),
    [
        # 2A2F: data-parallel attention and an expert group (2A1F adds nothing on V2)
        ({"attention_ranks": 2, "ffn_ranks": 2}, (2, 4)),
        ({"attention_tensor_parallel": 2}, ()),  # attention TP 2
    ],
    ids=["2a2f", "tp2"],
)
def test_parallel_attention_on_v2(v2, log_dir, shape, ms):
    """Each data-parallel rank splits its share of a batch of four (two requests each)
    into micro-batches of one request, computing what each computes alone; over TP the
    ranks exchange their shares of every step's rows."""
    tag = "-".join(f"{k.split('_')[-1]}{v}" for k, v in shape.items())
    d = mrv2_deployment(v2.model, log_dir, tag, microbatches=2 if ms else 1, **shape)
    with running([d["ffn"], d["attention"]]):
        on_v2(d["ffn"], d["attention"])
        att = d["attention"]
        if ms:
            set_m(att, 1)
        assert_same(v2.alone, run_prompts(att.url))
        for m in ms:
            set_m(att, m)
            assert_same(v2.alone, run_batch(att.url))
        if not ms:
            assert_same(v2.batch, run_batch(att.url))

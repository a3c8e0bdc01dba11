"""Async DP over two FFN ranks: 4A2F, one attention server of four data-parallel ranks that
step independently (afd.async_dp), two FFN servers (FFN rank 0 serves attention ranks 0
and 1, FFN rank 1 serves 2 and 3). The 2A1F case is in test_afd_serve.py (DeepSeek-V2).
Then one DP rank's engine stopped while another serves: /health sees that rank stuck."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from afd_plugin.deploy.servers import complete, running, scale_out_deployment
from tests.e2e.conftest import (
    DEV_MODE,
    MAX_TOKENS,
    PROMPTS,
    assert_same,
    await_health,
    engine_core,
    reference,
    run_prompts,
    settled_rank_steps,
    steps_on_one_rank,
    with_reference,
)

pytestmark = pytest.mark.e2e

ARCH = "qwen3_moe"
STUCK_S = 4  # stuck_after_s: well under the stopped-rank check's 15 s and liveness's 30 s


def test_4a2f_async_dp_gives_colocated_tokens_on_every_rank_and_idle_ranks_run_nothing(
    checkpoints, log_dir
):
    model = str(checkpoints(ARCH))
    afd = scale_out_deployment(
        model,
        log_dir,
        attention=[4],
        ffn=[1, 1],
        afd_extra={"async_dp": True, "connector_extra_config": {"stuck_after_s": STUCK_S}},
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
        # DP rank 3's engine core stopped (SIGSTOP) with a request routed to it, while rank 0
        # serves on: the server's newest step stays fresh, yet /health answers 503 naming
        # rank 3 (afd_core/stuck.py: per DP rank, where vLLM's client routed the request)
        core = engine_core(att, dp_rank=3)
        stopped, outcome = threading.Event(), {}
        core.send_signal(signal.SIGSTOP)
        try:
            waiting = threading.Thread(
                target=lambda: outcome.update(
                    got=complete(att.url, PROMPTS[3], MAX_TOKENS, data_parallel_rank=3)
                )
            )
            waiting.start()
            served = threading.Thread(target=serve_rank_0, args=(att.url, stopped, outcome))
            served.start()
            took = await_health(att, 503, STUCK_S + 10, every_s=0.25)
            print(f"\nDP rank 3 stopped: /health 503 after {took:.1f} s, rank 0 serving")
            stopped.set()
            served.join(60)
        finally:
            core.send_signal(signal.SIGCONT)
        waiting.join(120)
        assert_same([ref[3]], [outcome["got"]], [PROMPTS[3]])  # resumed: nothing lost
        served_0 = outcome["rank0"]  # served throughout, and right
        assert served_0 and "error" not in outcome, outcome
        assert_same([ref[0]] * len(served_0), served_0, [PROMPTS[0]] * len(served_0))
        assert "no step ended on attention DP rank 3" in att.log_path.read_text()
        await_health(att, 200, 15)


def serve_rank_0(url: str, stop: threading.Event, outcome: dict) -> None:
    """Requests on DP rank 0, one after another, until `stop`."""
    outcome["rank0"] = []
    try:
        while not stop.is_set():
            outcome["rank0"].append(complete(url, PROMPTS[0], MAX_TOKENS, data_parallel_rank=0))
            time.sleep(0.1)
    except Exception as exc:  # noqa: BLE001 - the test reports it
        outcome["error"] = repr(exc)

"""afd_balanced inside a real vLLM engine on CPU (single process, tiny Qwen3-MoE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
PROBE = Path(__file__).with_name("routing_engine_probe.py")


def run(ckpt, **env):
    full = {k: v for k, v in os.environ.items() if k != "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"}
    full.update(env)
    return subprocess.run(
        [sys.executable, str(PROBE), str(ckpt)],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


def test_balanced_routing_is_used_by_the_engine_and_changes_output(checkpoints):
    from concurrent.futures import ThreadPoolExecutor

    ckpt = checkpoints("qwen3_moe")
    with ThreadPoolExecutor(2) as pool:  # two engines at once: most of each is start-up
        normal = pool.submit(run, ckpt)
        balanced = pool.submit(
            run,
            ckpt,
            VLLM_MOE_ROUTING_SIMULATION_STRATEGY="afd_balanced",
            AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK="4",
        )
        normal, balanced = normal.result(), balanced.result()
    assert normal.returncode == 0, normal.stderr[-3000:]
    assert balanced.returncode == 0, balanced.stderr[-3000:]
    n, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (normal, balanced))
    assert n["calls"] == []
    assert b["calls"], "the engine never asked afd_balanced for a routing"
    assert all(c["matches"] and c["weights_ok"] for c in b["calls"]), b["calls"]
    assert {c["dtype"] for c in b["calls"]} == {"torch.int32"}  # what the CPU MoE kernel takes
    # it really replaced the router: the model's output changes
    assert max(abs(x - y) for x, y in zip(b["logprobs"], n["logprobs"], strict=True)) > 1e-3
    out = balanced.stdout + balanced.stderr
    assert "afd_balanced" in out and "benchmarks only, model output will be wrong" in out


def test_rejected_top_n_stops_the_engine_with_a_clear_error(checkpoints):
    r = run(
        checkpoints("qwen3_moe"),
        VLLM_MOE_ROUTING_SIMULATION_STRATEGY="afd_balanced",
        AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK="99",
    )
    assert r.returncode != 0
    assert (
        "AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK=99 is out of range; allowed: 0 (all) or 1..16"
        in r.stderr
    )

"""Shared fixtures and helpers for the end-to-end tests: one tiny checkpoint per
architecture per session, requests one at a time or as one batch, vLLM's dev endpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

# attention backend each architecture needs in fp32 on CPU
BACKENDS = {"deepseek_v2": "CPU_MLA", "qwen3_moe": None}
# architectures only some modules serve (no module-wide parametrization over them)
BACKENDS_MORE = {"deepseek_v3": "CPU_MLA"}
# token lengths 4, 7, 5, 5 with the tiny tokenizer: two micro-batches of a batch of all four
# are the first two and the last two requests, in prefill and in decode
PROMPTS = [
    "The quick brown fox",
    "Attention and the feed-forward network",
    "Hello world, this is",
    "Numbers 0 1 2 3",
]
MAX_TOKENS = 32
# DBO-capable attention servers: m changes at run time (/collective_rpc), every batch of
# two or more requests is above the thresholds
DBO_ARGS = ["--enable-dbo", "--dbo-decode-token-threshold", "2"]
DBO_ARGS += ["--dbo-prefill-token-threshold", "4"]
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
# arch -> the colocated server's results for PROMPTS, one request at a time; filled by the
# first module that runs a colocated server, reused by the others of the session
COLOCATED_ALONE: dict[str, list] = {}


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


def run_prompts(url: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS):
    """One prompt at a time."""
    from afd_plugin.deploy.servers import complete

    return [complete(url, p, max_tokens) for p in prompts]


def rpc(url: str, method: str, *args: str) -> list:
    from afd_plugin.deploy.servers import collective_rpc

    return collective_rpc(url, method, *args)


def rank_steps(url: str, role: str = "attention") -> dict[int, float]:
    from afd_plugin.deploy.servers import afd_steps

    return afd_steps(url, role)


def settled_rank_steps(url: str, role: str = "attention") -> dict[int, float]:
    """rank_steps once the counters stop moving for two publish intervals (each rank
    shares its snapshot at most once a second, so a read right after a request can be
    one interval behind it)."""
    import time

    last, same = rank_steps(url, role), 0
    while same < 2:
        time.sleep(1.2)
        now = rank_steps(url, role)
        same = same + 1 if now == last else 0
        last = now
    return last


def steps_on_one_rank(url: str, rank: int, prompts, max_tokens: int = MAX_TOKENS) -> dict:
    """Each attention rank's AFD steps while `prompts` run on data-parallel rank `rank` only."""
    from afd_plugin.deploy.servers import complete

    before = settled_rank_steps(url)
    for p in prompts:
        complete(url, p, max_tokens, data_parallel_rank=rank)
    after = settled_rank_steps(url)
    return {r: after[r] - before.get(r, 0) for r in after}


def run_batch(url: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS):
    """All prompts as one batch in this order (vLLM's CPU path is not batch-invariant: only
    equal batches compare exactly)."""
    from afd_plugin.deploy.servers import complete_batch

    return complete_batch(url, list(prompts), max_tokens)[0]


def assert_same(reference, got, prompts=PROMPTS, tol: float = 1e-5):
    for prompt, ref, out in zip(prompts, reference, got, strict=True):
        assert len(ref.token_ids) == len(out.token_ids) == MAX_TOKENS
        assert out.token_ids == ref.token_ids, prompt
        worst = max(abs(a - b) for a, b in zip(ref.logprobs, out.logprobs, strict=True))
        assert worst <= tol, (prompt, worst)


def await_health(server, status: int, within_s: float, every_s: float = 0.5) -> float:
    """Poll the server's /health until it answers `status`; the seconds that took (the
    test fails with the server's log past `within_s`)."""
    import time

    started = time.monotonic()
    while server.health_status() != status:
        assert time.monotonic() - started < within_s, server.log_tail(60)
        time.sleep(every_s)
    return time.monotonic() - started


def engine_core(server, dp_rank: int | None = None):
    """The server's engine-core process (psutil.Process): its only one, or data-parallel
    rank `dp_rank`'s (vLLM names it EngineCore_DP<rank>)."""
    import psutil

    name = "EngineCore" if dp_rank is None else f"EngineCore_DP{dp_rank}"
    (core,) = [
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if name in " ".join(p.cmdline())
    ]
    return core


def with_reference(arch: str, model: str, log_dir: Path, servers: list) -> list:
    """The servers, plus a colocated one of `arch` if no module of this session has run its
    prompts yet (COLOCATED_ALONE)."""
    from afd_plugin.deploy.servers import SHARED_CORES, Server, ServerSpec, free_port

    if arch in COLOCATED_ALONE:
        return servers
    spec = ServerSpec(
        f"{arch}-reference-colocated",
        model,
        free_port(),
        attention_backend={**BACKENDS, **BACKENDS_MORE}[arch],
        env=SHARED_CORES,
    )
    return [Server(spec, log_dir), *servers]


def reference(arch: str, servers: list) -> list:
    """The colocated results of `arch` for PROMPTS, one request at a time."""
    if arch not in COLOCATED_ALONE:
        colocated = next(s for s in servers if s.spec.name.endswith("reference-colocated"))
        COLOCATED_ALONE[arch] = run_prompts(colocated.url)
    return COLOCATED_ALONE[arch]

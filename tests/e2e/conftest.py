"""Shared fixtures and helpers for the end-to-end tests: one tiny checkpoint per
architecture per session, requests one at a time or as one batch, vLLM's dev endpoints."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

# attention backend each architecture needs in fp32 on CPU
BACKENDS = {"deepseek_v2": "CPU_MLA", "qwen3_moe": None}
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


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


def run_prompts(url: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS):
    """One prompt at a time."""
    from afd_plugin.launcher import complete

    return [complete(url, p, max_tokens) for p in prompts]


def post(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        text = r.read()
    return json.loads(text) if text else None


def rpc(url: str, method: str, *args: str) -> list:
    """Call a worker method through vLLM's dev endpoint (VLLM_SERVER_DEV_MODE=1)."""
    return post(url, "/collective_rpc", {"method": method, "args": list(args)})["results"]


def run_batch(url: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS):
    """All prompts as one batch, in this order: the scheduler is paused while they are
    added one after another, then resumed, so every step holds all of them (vLLM's CPU path
    is not batch-invariant: only equal batches compare exactly)."""
    from afd_plugin.launcher import complete

    post(url, "/pause?mode=keep")
    out: list = [None] * len(prompts)
    errors: list = []

    def one(i):
        try:
            out[i] = complete(url, prompts[i], max_tokens)
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = []
    try:
        for i in range(len(prompts)):
            t = threading.Thread(target=one, args=(i,))
            t.start()
            threads.append(t)
            time.sleep(0.3)  # arrival order = batch order
        time.sleep(0.5)
    finally:
        post(url, "/resume")
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return out


def assert_same(reference, got, prompts=PROMPTS, tol: float = 1e-5):
    for prompt, ref, out in zip(prompts, reference, got, strict=True):
        assert len(ref.token_ids) == len(out.token_ids) == MAX_TOKENS
        assert out.token_ids == ref.token_ids, prompt
        worst = max(abs(a - b) for a, b in zip(ref.logprobs, out.logprobs, strict=True))
        assert worst <= tol, (prompt, worst)

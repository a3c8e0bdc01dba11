"""Shared fixtures for the end-to-end tests: one tiny checkpoint per architecture per session."""

from __future__ import annotations

from pathlib import Path

import pytest

# attention backend each architecture needs in fp32 on CPU
BACKENDS = {"deepseek_v2": "CPU_MLA", "qwen3_moe": None}
PROMPTS = [
    "The quick brown fox",
    "Attention and the feed-forward network",
    "Hello world, this is",
    "Numbers 0 1 2 3",
]
MAX_TOKENS = 32


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


def run_prompts(url: str, max_tokens: int = MAX_TOKENS):
    """One prompt at a time. vLLM's CPU path is not batch-invariant (measured: the same
    prompt's first logprob moves by 0.04 between a lone and a 4-request batch on a colocated
    server), so only equal batches compare exactly."""
    from afd_plugin.launcher import complete

    return [complete(url, p, max_tokens) for p in PROMPTS]

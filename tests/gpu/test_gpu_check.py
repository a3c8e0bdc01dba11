"""tests/gpu/check.py: runs on a CUDA GPU (marked gpu, skipped without one); on any machine,
its imports must not need vLLM or pydantic (the device machine has PyTorch and NCCL only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("check.py")

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('vllm', 'pydantic'):
            raise ImportError('blocked: the device machine has no ' + name)
sys.meta_path.insert(0, Block())
sys.argv = ['check.py']
import runpy
mod = runpy.run_path(%r, run_name='check')
import afd_core.connectors.nccl, afd_core.connectors.device, afd_core.step.graphs
import afd_core.exchange, afd_core.runtime, afd_core.step.microbatch
op = afd_core.exchange.ffn_exchange_op()
print('ok', sorted(mod['CHECKS']))
"""


@pytest.mark.vllm  # needs torch
def test_check_script_imports_what_it_runs_without_vllm():
    out = subprocess.run(
        [sys.executable, "-c", BLOCKER % str(CHECK)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "ok ['exchange_op_graph', 'ffn_graph_cache', 'microbatch_threads_graph', "
        "'nccl_transport']" in out.stdout
    )


@pytest.mark.gpu
def test_gpu_check_passes(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = subprocess.run(
        [sys.executable, str(CHECK), "--out", str(tmp_path / "gpu.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]

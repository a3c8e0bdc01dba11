"""tests/gpu/check.py and tests/gpu/nccl_check.py: run on a CUDA GPU (marked gpu, skipped
without one). On any machine: check.py's imports must not need vLLM or pydantic (the device
machine has PyTorch and NCCL only; run.sh installs carried pydantic wheels for nccl_check),
and nccl_check's scenarios that need no CUDA graph pass over the CPU stand-ins, with vLLM
unimportable, as on the device machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("check.py")
NCCL_CHECK = Path(__file__).with_name("nccl_check.py")
NO_VLLM = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'vllm':
            raise ImportError('blocked: the device machine has no vllm')
sys.meta_path.insert(0, Block())
"""

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
import afd_core.connectors.transports.nccl, afd_core.connectors.transports.device, afd_core.step.graphs
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
@pytest.mark.parametrize("script", [CHECK, NCCL_CHECK], ids=["check", "nccl_check"])
def test_gpu_checks_pass(tmp_path, script):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    out = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path / "report.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]


@pytest.mark.vllm  # needs torch
def test_nccl_check_runs_its_scenarios_over_the_cpu_stand_ins(tmp_path):
    """Three real processes (FFN rank 0, attention ranks 0 and 1) over the NCCL stand-ins
    (issue-ordered channel, first operations blocking the host as NCCL's lazy connection
    does), vLLM blocked in every process: the first step, m = 2 with zero rows, a failure
    at layer 0 with rows (4, 3) (abort_step must walk layer-major), a device-wide
    synchronize inside the FFN's eager m = 1 steps (the stand-in's), the FFN process
    killed mid-run (both attention ranks end with a named error), and an attention server
    crashing mid-step whose restart rejoins while the other is served; one line each."""
    import json
    import os

    (tmp_path / "sitecustomize.py").write_text(NO_VLLM)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, str(NCCL_CHECK), "--cpu", "--out", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]
    passing = ("a_first_eager", "b_microbatches", "e_failure", "g_kill_ffn", "h_device_sync")
    for name in (*passing, "j_bucket_graphs", "k_peer_restart"):
        assert f"PASS {name}:" in out.stdout, out.stdout
    for name in ("c_capture_replay", "d_recapture", "f_dbo_capture", "i_capture_failure"):
        assert f"SKIP {name}: needs CUDA graphs" in out.stdout
    assert "7 passed, 0 failed, 4 skipped" in out.stdout
    r = json.loads(report.read_text())["scenarios"]
    assert "injected attention failure" in r["e_failure"]["attention0"]["step_failed"]
    assert r["e_failure"]["attention1"]["step_failed"] is None  # the other rank's step is fine
    for rank in (0, 1):
        assert "FFN rank 0" in r["g_kill_ffn"][f"attention{rank}"]["error"]
    assert r["h_device_sync"]["ffn_device_syncs"] >= 12  # 3 steps x 4 layers
    assert r["j_bucket_graphs"]["ffn_bucket_replays"] == 16  # 4 micro-batches x 4 layers
    k = r["k_peer_restart"]
    assert k["ffn"]["lost"] == [1] and k["ffn"]["rejoined"] == [1], k
    assert k["attention1"]["steps"] == 5 and k["attention0"]["steps"] >= 5, k

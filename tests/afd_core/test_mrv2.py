"""What AFD relies on in vLLM 0.32's model runner V2 (MRV2), pinned against the real vLLM.

The end-to-end tier is tests/e2e/test_mrv2.py; this pins the pieces: vLLM's Triton-CPU
check that the test-only backend entry satisfies, vLLM's choice of runner and AFD keeping
it, and the MRV2 functions AFD's V2 attention runner calls or wraps.
"""

from __future__ import annotations

import inspect
import json
import os

import pytest

from tests.conftest import mrv2_env, run_python

pytestmark = pytest.mark.vllm

CHOICES = """
import json, os, sys
import vllm.triton_utils.importing as triton_check
from vllm.engine.arg_utils import EngineArgs

def choice(**flags):
    cfg = EngineArgs(model=sys.argv[1], max_model_len=128, enforce_eager=True, **flags)
    return cfg.create_engine_config().use_v2_model_runner

out = {"has_triton": triton_check.HAS_TRITON, "plain": choice(), "dbo": choice(enable_dbo=True)}
import afd_plugin
afd_plugin.register_afd()
for name, flags in (("afd", {}), ("afd_dbo", {"enable_dbo": True})):
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    afd = {"afd": {"role": "attention", "port": 29999}}
    choice(additional_config=afd, **flags)
    out[name] = os.environ["VLLM_USE_V2_MODEL_RUNNER"]
print(json.dumps(out))
"""


def _choices(model: str, env: dict) -> dict:
    code = CHOICES.replace("sys.argv[1]", repr(model))
    env = {k: v for k, v in env.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    out = run_python(code, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_picks_v2_where_triton_has_a_cpu_backend_and_afd_keeps_its_choice(checkpoints):
    """vLLM's CPU build enables Triton only when Triton's backend table has an entry named
    "cpu" (vllm/triton_utils/importing.py), then picks MRV2 unless a feature it lacks is
    asked for. With the test-only entry and Triton's interpreter it picks V2 here; without
    them V1. DBO is one such feature (vLLM 0.32 runs DBO on V2 only when
    VLLM_USE_V2_MODEL_RUNNER=1 is set), but vLLM's CPU platform drops --enable-dbo, after
    which plain vLLM picks V2 on CPU. AFD's start-up check keeps vLLM's choice for the
    server's processes (it pins VLLM_USE_V2_MODEL_RUNNER), made on the flags as given,
    before the platform drops anything: an AFD attention server asked for --enable-dbo runs
    AFD's micro-batches on V1 (as vLLM does with DBO on CUDA), one without runs on V2, with
    AFD's micro-batches from afd.num_microbatches too."""
    import vllm.triton_utils.importing as triton_check

    assert 'if "cpu" in backends:' in inspect.getsource(triton_check)
    model = str(checkpoints("qwen3_moe"))
    with_entry = _choices(model, mrv2_env(dict(os.environ)))
    assert with_entry == {
        "has_triton": True,
        "plain": True,
        "dbo": True,
        "afd": "1",
        "afd_dbo": "0",
    }, with_entry
    without = _choices(model, {"TRITON_INTERPRET": "0"})
    assert without == {
        "has_triton": False,
        "plain": False,
        "dbo": False,
        "afd": "0",
        "afd_dbo": "0",
    }, without


@pytest.fixture
def cpu_runner_v2(monkeypatch):
    """vLLM's CPU model runner V2, imported in this process: its module replaces
    torch.cuda.set_stream with a no-op (vllm/v1/worker/cpu/shm.py), undone after the test."""
    import torch

    monkeypatch.setattr(torch.cuda, "set_stream", torch.cuda.set_stream)
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    return CPUModelRunner


def test_the_cpu_worker_makes_its_v2_runner_only_where_vllm_built_v2(cpu_runner_v2):
    """AFD's CPU attention worker imports vLLM's CPU V2 module only once vLLM built that
    runner (so a process on V1 keeps torch's set_stream); then it takes it."""
    code = """
import sys
import afd_core.workers.cpu_worker
print("vllm.v1.worker.cpu.model_runner" in sys.modules)
"""
    out = run_python(code)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "False", out.stderr
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from afd_core.workers.attention_runner import AFDAttentionRunnerMixin, AFDRunnerCommon
    from afd_core.workers.attention_runner_v2 import AFDAttentionRunnerV2Mixin
    from afd_core.workers.cpu_worker import AFDCPUAttentionWorker

    worker = AFDCPUAttentionWorker.__new__(AFDCPUAttentionWorker)
    v2 = worker.afd_runner_class(cpu_runner_v2)
    assert v2.__mro__[1:3] == (AFDAttentionRunnerV2Mixin, AFDRunnerCommon), v2.__mro__
    assert issubclass(v2, cpu_runner_v2) and worker.afd_runner_class(cpu_runner_v2) is v2
    v1 = worker.afd_runner_class(CPUModelRunner)
    assert v1.__mro__[1] is AFDAttentionRunnerMixin and issubclass(v1, CPUModelRunner)
    assert worker.afd_runner_class(object) is None


def test_the_mrv2_functions_afds_v2_runner_uses_are_vllms(cpu_runner_v2):
    from vllm.v1.worker.gpu import model_runner as mrv2
    from vllm.v1.worker.gpu.kv_connector import KVConnector
    from vllm.v1.worker.gpu.model_states.interface import ModelState
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner, _slice_input_batch

    runner = mrv2.GPUModelRunner
    assert issubclass(cpu_runner_v2, runner)
    # the one call of execute_model that builds a step's attention metadata, per
    # micro-batch on the i-th metadata builder; vLLM's UBatchRunner slices the same way
    prepare = inspect.signature(ModelState.prepare_attn).parameters
    assert list(prepare)[1:4] == ["input_batch", "cudagraph_mode", "block_tables"]
    assert {"ubatch_idx", "for_capture"} <= set(prepare)
    execute = inspect.getsource(runner.execute_model)
    assert "self.model_state.prepare_attn(" in execute
    assert "model_output = self.model(**model_inputs)" in execute
    assert "_slice_input_batch(" in inspect.getsource(UBatchRunner.prepare)
    params = list(inspect.signature(_slice_input_batch).parameters)
    assert params[:4] == ["input_batch", "ubatch_slice", "query_start_loc_buf", "seq_lens_buf"]
    # dummy and profiling forwards go through execute_model(dummy_run=True)
    assert "dummy_run" in inspect.signature(runner.execute_model).parameters
    assert "is_profile" in inspect.signature(runner._dummy_run).parameters
    # a failed step: execute_model returns the output, sample_tokens then has nothing
    assert "if self.execute_model_state is None:" in inspect.getsource(runner.sample_tokens)
    for name in ("finish_forward", "post_forward"):
        assert name in KVConnector.__dict__, name
    # the micro-batch runner AFD's patch keeps vLLM from building on attention servers
    assert "maybe_build_ubatch_runner(" in inspect.getsource(runner.initialize_kv_cache)
    assert callable(mrv2.maybe_build_ubatch_runner)


def test_the_ffn_worker_needs_only_what_both_runners_have(cpu_runner_v2):
    """The FFN side has no model runner of its own: its worker overrides every step,
    KV-cache and warm-up method of vLLM's worker and takes only `load_model` and
    `get_model` from whichever runner vLLM built (docs/architecture.md)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from afd_core.workers.role_workers import FFNWorkerMixin

    source = inspect.getsource(FFNWorkerMixin)
    uses = {part.split("(")[0] for part in source.split("self.model_runner.")[1:]}
    assert uses == {"get_model"}, uses  # load_model goes through vLLM's worker
    for name in (
        "get_kv_cache_spec",
        "initialize_from_config",
        "compile_or_warm_up_model",
        "execute_model",
        "sample_tokens",
    ):
        assert name in FFNWorkerMixin.__dict__, name
    for runner in (CPUModelRunner, cpu_runner_v2):
        for name in ("load_model", "get_model"):
            assert callable(getattr(runner, name)), (runner, name)

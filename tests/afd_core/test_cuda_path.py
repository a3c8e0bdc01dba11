"""The CUDA path's start-up on a CPU machine: the CUDA role workers subclass vLLM's real GPU
worker and V1 runner (they ship in the CPU build), `auto` picks them on the CUDA platform,
and the config patch rejects what the CUDA path does not run, each with its alternative.
A real vLLM config is built on CPU, then checked as the CUDA platform's hook would."""

from __future__ import annotations

import inspect
import os

import pytest

pytestmark = pytest.mark.vllm


class FakeCudaPlatform:
    """The CUDA platform's class as the patch sees it (vllm.platforms.cuda imports only
    where vLLM's CUDA kernels are built)."""

    device_type = "cuda"
    seen = []

    @classmethod
    def check_and_update_config(cls, vllm_config):
        pc = vllm_config.parallel_config
        if pc.worker_cls == "auto":  # what vLLM's CudaPlatformBase does
            pc.worker_cls = "vllm.v1.worker.gpu_worker.Worker"
        cls.seen.append(pc.worker_cls)


@pytest.fixture(scope="module")
def cuda_check(checkpoints):
    """Build a real config on CPU, then run the CUDA platform's (patched) hook on it."""
    import afd_plugin

    afd_plugin.register_afd()
    from afd_core.patches.config_validation import install_on
    from tests.conftest import platform_hook_check

    install_on(FakeCudaPlatform)
    return platform_hook_check(
        FakeCudaPlatform, str(checkpoints("qwen3_moe")), graph_mode="FULL_DECODE_ONLY"
    )


def test_auto_picks_the_cuda_role_workers_then_vllms_hook_runs(cuda_check):
    FakeCudaPlatform.seen.clear()
    att = cuda_check({"role": "attention"})
    ffn = cuda_check({"role": "ffn"})
    assert att.parallel_config.worker_cls == "afd_core.workers.cuda_worker.AFDCUDAAttentionWorker"
    assert ffn.parallel_config.worker_cls == "afd_core.workers.cuda_worker.AFDCUDAFFNWorker"
    assert FakeCudaPlatform.seen == [att.parallel_config.worker_cls, ffn.parallel_config.worker_cls]
    assert ffn.cache_config.enable_prefix_caching is False


def test_eager_and_full_decode_only_are_the_graph_modes(cuda_check):
    cuda_check({"role": "attention"}, graph_mode="NONE")
    cuda_check({"role": "attention"}, graph_mode="FULL_DECODE_ONLY")
    for mode in ("FULL_AND_PIECEWISE", "PIECEWISE", "FULL"):
        with pytest.raises(Exception, match=rf"cudagraph_mode={mode} is not supported") as err:
            cuda_check({"role": "attention"}, graph_mode=mode)
        assert "FULL_DECODE_ONLY" in str(err.value) and "--enforce-eager" in str(err.value)


def test_dbo_runs_eagerly_up_to_4_and_in_2_with_graphs(cuda_check):
    cfg = cuda_check({"role": "attention", "num_microbatches": 4}, graph_mode="NONE")
    assert cfg.additional_config["afd"]["num_microbatches"] == 4
    assert cfg.parallel_config.enable_dbo is False  # AFD's step engine splits
    # with graphs vLLM's UBatchWrapper splits; its DBO is turned on by the attention
    # worker, after vLLM's config checks (afd_core.step.vllm_ubatch)
    cfg = cuda_check({"role": "attention"}, enable_dbo=True)
    assert cfg.additional_config["afd"]["num_microbatches"] == 2
    assert cfg.parallel_config.enable_dbo is False
    with pytest.raises(Exception, match=r"3 micro-batches per step \(DBO\) with cudagraph_mode"):
        cuda_check({"role": "attention", "num_microbatches": 3})


def test_graphs_on_v2_model_runner_and_ffn_tensor_parallel_are_rejected(cuda_check, monkeypatch):
    """Model runner V2 runs AFD eagerly; its FULL graph replay would skip the control
    message, so graphs on V2 are refused naming both ways out. vLLM's choice of runner is
    kept for the server's processes (VLLM_USE_V2_MODEL_RUNNER pinned to it)."""
    from vllm.config import VllmConfig

    with pytest.raises(Exception, match="tensor-parallel-size=2 is not supported yet"):
        cuda_check({"role": "ffn"}, tensor_parallel_size=2)

    def v2():  # vLLM would pick its V2 runner for this config (once it is built)
        monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with pytest.raises(Exception, match="model runner V2 with cudagraph_mode=FULL_DECODE_ONLY"):
        cuda_check({"role": "attention"}, before=v2)
    monkeypatch.undo()
    cuda_check({"role": "attention"}, graph_mode="NONE", before=v2)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    monkeypatch.undo()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    cuda_check({"role": "attention"})
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_disabled_pynccl_and_dense_dbo_with_graphs_under_dp_are_rejected(cuda_check, monkeypatch):
    """VLLM_DISABLE_PYNCCL makes vLLM's communicator a silent no-op (send/recv return at
    once): rejected by name. A dense model's DBO with graphs under data parallel would
    trip vLLM's UBatchWrapper DP-metadata assert: rejected with the alternatives."""
    from afd_core.patches.config_validation import validate_cuda_microbatches

    monkeypatch.setenv("VLLM_DISABLE_PYNCCL", "1")
    with pytest.raises(Exception, match="VLLM_DISABLE_PYNCCL is set.*unset it"):
        cuda_check({"role": "attention"})
    monkeypatch.delenv("VLLM_DISABLE_PYNCCL")
    cfg = cuda_check({"role": "attention"})
    pc = cfg.parallel_config
    monkeypatch.setattr(pc, "data_parallel_size", 2)
    monkeypatch.setattr(pc, "is_moe_model", False)
    with pytest.raises(Exception, match="needs a MoE model.*--enforce-eager"):
        validate_cuda_microbatches(2, cfg)
    validate_cuda_microbatches(1, cfg)  # no DBO: fine
    monkeypatch.setattr(pc, "is_moe_model", True)
    validate_cuda_microbatches(2, cfg)
    # m chosen per step cannot work under graphs captured split in two
    with pytest.raises(
        Exception, match="'auto' with cudagraph_mode=FULL_DECODE_ONLY.*enforce-eager"
    ):
        validate_cuda_microbatches(4, cfg, adaptive=True)
    src = inspect.getsource(
        __import__("vllm.v1.worker.gpu_ubatch_wrapper", fromlist=["x"]).UBatchWrapper.__call__
    )
    assert "assert dp_metadata is not None" in src  # what the rejection stands for


def test_the_cpu_connector_is_rejected_on_cuda(cuda_check):
    with pytest.raises(Exception, match="connector='gloo' runs on cpu.*allowed here: 'nccl'"):
        cuda_check({"role": "attention", "connector": "gloo"})
    cfg = cuda_check({"role": "attention"})
    from afd_core.config import parse_afd_config

    assert parse_afd_config(cfg.additional_config["afd"], "cuda").connector == "nccl"


def test_the_cuda_workers_bind_the_shared_role_logic_to_vllms_gpu_classes():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from afd_core.workers import cuda_worker
    from afd_core.workers.attention_runner import AFDAttentionRunnerMixin
    from afd_core.workers.attention_runner_v2 import AFDAttentionRunnerV2Mixin
    from afd_core.workers.role_workers import AttentionWorkerMixin, FFNWorkerMixin
    from afd_core.workers.selection import worker_class_for

    assert worker_class_for("cuda", "attention").endswith("cuda_worker.AFDCUDAAttentionWorker")
    assert worker_class_for("cuda", "ffn").endswith("cuda_worker.AFDCUDAFFNWorker")
    att, ffn = cuda_worker.AFDCUDAAttentionWorker, cuda_worker.AFDCUDAFFNWorker
    assert att.__mro__[1:4] == (AttentionWorkerMixin, att.__mro__[2], Worker)
    assert ffn.__mro__[1] is FFNWorkerMixin and issubclass(ffn, Worker)
    runner = cuda_worker.AFDCUDAAttentionModelRunner
    assert runner.__mro__[1] is AFDAttentionRunnerMixin and issubclass(runner, GPUModelRunner)
    runner_v2 = cuda_worker.AFDCUDAAttentionModelRunnerV2
    assert runner_v2.__mro__[1] is AFDAttentionRunnerV2Mixin
    assert issubclass(runner_v2, GPUModelRunnerV2)
    assert att.afd_runner_classes == {GPUModelRunner: runner, GPUModelRunnerV2: runner_v2}
    # what the mixins override exists on vLLM's classes, with the arguments they pass on
    for name in (
        "_determine_batch_execution_and_padding",
        "_build_attention_metadata",
        "_dummy_run",
        "execute_model",
        "get_model",
    ):
        assert name in GPUModelRunner.__dict__, name
    params = inspect.signature(GPUModelRunner._determine_batch_execution_and_padding).parameters
    assert {"num_reqs", "num_scheduled_tokens_np", "allow_microbatching"} <= set(params)
    assert "is_profile" in inspect.signature(GPUModelRunner._dummy_run).parameters
    for name in (
        "init_device",
        "load_model",
        "get_kv_cache_spec",
        "initialize_from_config",
        "compile_or_warm_up_model",
        "execute_model",
        "sample_tokens",
        "shutdown",
    ):
        assert name in Worker.__dict__, name
    # vLLM's Worker builds its runner in _make_model_runner: V1 unless the V2 flag is on
    assert "use_v2_model_runner" in inspect.getsource(Worker._make_model_runner)


def test_the_ffn_thread_runs_on_its_device_and_captures_only_with_full_decode_only():
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from afd_core.workers.cuda_worker import ffn_graphs_enabled

    def cfg(mode):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))

    assert ffn_graphs_enabled(cfg(CUDAGraphMode.FULL_DECODE_ONLY))
    assert not ffn_graphs_enabled(cfg(CUDAGraphMode.NONE))
    assert not ffn_graphs_enabled(cfg(None))

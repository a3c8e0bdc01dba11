"""The Ascend config patch against the stand-in vllm_ascend (written from vllm-ascend
0.23.0.post1's source; see tests/afd_npu/standin/README.md): installed once, over the
aliases modules took by name, idempotent, touching only its two functions, reversible;
and the platform hook run on a real vLLM config built on CPU."""

from __future__ import annotations

import importlib
import sys

import pytest

pytestmark = pytest.mark.vllm

EXPECTED_PATCHED = {
    ("vllm_ascend.ascend_config", "init_ascend_config"),
    ("vllm_ascend.platform", "init_ascend_config"),
    ("vllm_ascend.worker.worker", "init_ascend_config"),
    ("vllm_ascend.platform.NPUPlatform", "check_and_update_config"),
}


def _owner_name(owner) -> str:
    return (
        owner.__name__
        if isinstance(owner, type(sys))
        else f"{owner.__module__}.{owner.__qualname__}"
    )


@pytest.fixture(scope="module")
def patched(ascend):
    """Apply the patch after some vllm_ascend modules bound init_ascend_config by name."""
    from afd_npu.patches import ascend_config as patch

    config_module = importlib.import_module("vllm_ascend.ascend_config")
    original = config_module.init_ascend_config
    importlib.import_module("vllm_ascend.platform")
    importlib.import_module("vllm_ascend.worker.worker")
    status, reason = patch.apply_afd_ascend_config_patch()
    assert (status.value, reason) == ("applied", "")
    return patch, original


def test_installed_once_over_every_alias_and_nothing_else(patched):
    patch, original = patched
    assert {(_owner_name(o), n) for o, n in patch._patched} == EXPECTED_PATCHED
    wrapper = sys.modules["vllm_ascend.ascend_config"].init_ascend_config
    assert wrapper is not original and wrapper.__afd_patch__ == "ascend_config"
    assert sys.modules["vllm_ascend.platform"].init_ascend_config is wrapper
    assert sys.modules["vllm_ascend.worker.worker"].init_ascend_config is wrapper
    # a module imported after the patch gets the wrapper by its own import
    from vllm_ascend.ascend_config import init_ascend_config

    assert init_ascend_config is wrapper
    hook = sys.modules["vllm_ascend.platform"].NPUPlatform.check_and_update_config
    # a second call (every vLLM process runs register_afd; doctor runs it again) changes nothing
    status, _ = patch.apply_afd_ascend_config_patch()
    assert status.value == "applied" and len(patch._patched) == len(EXPECTED_PATCHED)
    assert sys.modules["vllm_ascend.ascend_config"].init_ascend_config is wrapper
    assert sys.modules["vllm_ascend.platform"].NPUPlatform.check_and_update_config == hook


def test_ascend_config_never_sees_the_afd_key_and_it_survives(patched, monkeypatch):
    from types import SimpleNamespace

    ascend_config = sys.modules["vllm_ascend.ascend_config"]
    monkeypatch.setattr(ascend_config, "STRICT", True)  # a vllm-ascend that rejects unknown keys
    afd = {"role": "ffn", "port": 1234}
    cfg = SimpleNamespace(additional_config={"afd": afd, "eplb_config": {}})
    built = ascend_config.init_ascend_config(cfg)
    assert built.seen_keys == ["eplb_config"]
    assert cfg.additional_config["afd"] is afd and afd == {"role": "ffn", "port": 1234}
    # vllm-ascend's cache by config identity is kept
    assert ascend_config.init_ascend_config(cfg) is built
    # unpatched, the strict AscendConfig refuses the afd key (the patch is what accepts it)
    original = importlib.import_module("afd_core.patches.catalogue").original
    with pytest.raises(ValueError, match="unknown keys"):
        original(ascend_config, "init_ascend_config")(
            SimpleNamespace(additional_config={"afd": afd, "refresh": True})
        )


def test_restore_puts_every_original_back(ascend):
    from afd_npu.patches import ascend_config as patch

    config_module = importlib.import_module("vllm_ascend.ascend_config")
    platform = importlib.import_module("vllm_ascend.platform")
    patch.restore_afd_ascend_config_patch()
    original = config_module.init_ascend_config
    hook = platform.NPUPlatform.__dict__["check_and_update_config"]
    patch.apply_afd_ascend_config_patch()
    assert config_module.init_ascend_config is not original
    assert patch.restore_afd_ascend_config_patch() == len(EXPECTED_PATCHED)
    assert config_module.init_ascend_config is original
    assert platform.init_ascend_config is original
    assert platform.NPUPlatform.__dict__["check_and_update_config"] is hook
    assert not patch.is_applied()
    patch.apply_afd_ascend_config_patch()  # the tests below run patched


def test_api_drift_fails_the_step_and_refuses_afd_configs(ascend, monkeypatch):
    from types import SimpleNamespace

    from afd_npu import ascend_api
    from afd_npu.patches import ascend_config as patch

    def init_ascend_config(vllm_config, extra):  # a drifted signature
        return None

    class SomePlatform:  # the platform the failed patch guards (vLLM's current one on an NPU)
        device_type = "npu"

        @classmethod
        def check_and_update_config(cls, vllm_config):
            vllm_config.ran = True

    patch.restore_afd_ascend_config_patch()
    try:
        with monkeypatch.context() as m:
            m.setattr(
                sys.modules["vllm_ascend.ascend_config"], "init_ascend_config", init_ascend_config
            )
            problem = ascend_api.drift("vllm_ascend.ascend_config:init_ascend_config")
            assert "takes (vllm_config, extra)" in problem
            assert "AFD does not pass extra" in problem
            with pytest.raises(ascend_api.AscendAPIError, match="init_ascend_config"):
                ascend_api.check_ascend_api()
            status, reason = patch.apply_afd_ascend_config_patch(guard=SomePlatform)
        assert status.value == "failed" and "init_ascend_config" in reason
        assert not patch.is_applied()
        plain = SimpleNamespace(additional_config={})
        SomePlatform.check_and_update_config(plain)  # no afd key: the platform as it is
        assert plain.ran
        afd_config = SimpleNamespace(additional_config={"afd": {"role": "ffn"}})
        with pytest.raises(Exception, match="ascend_config patch was not applied.*init_ascend"):
            SomePlatform.check_and_update_config(afd_config)
    finally:
        patch.apply_afd_ascend_config_patch()


# -- the platform hook on a real vLLM config ------------------------------------------------


@pytest.fixture(scope="module")
def npu_check(patched, checkpoints):
    """Build a real config on CPU, then run the stand-in NPUPlatform's (patched) hook."""
    import afd_plugin

    afd_plugin.register_afd()
    from tests.conftest import platform_hook_check

    platform = sys.modules["vllm_ascend.platform"]
    check = platform_hook_check(platform.NPUPlatform, str(checkpoints("qwen3_moe")))
    check.calls = platform.calls
    return check


def test_auto_picks_the_npu_role_workers_after_ascends_defaults(npu_check):
    npu_check.calls.clear()
    att = npu_check({"role": "attention"})
    ffn = npu_check({"role": "ffn"})
    assert att.parallel_config.worker_cls == "afd_npu.workers.npu_worker.AFDNPUAttentionWorker"
    assert ffn.parallel_config.worker_cls == "afd_npu.workers.npu_worker.AFDNPUFFNWorker"
    # vLLM-Ascend's original ran with "auto" and applied its NPU defaults
    assert [c[0] for c in npu_check.calls] == ["auto", "auto"]
    assert att.parallel_config.all2all_backend == "flashinfer_all2allv"
    assert att.additional_config["enable_cpu_binding"] is True
    assert ffn.cache_config.enable_prefix_caching is False
    assert att.additional_config["afd"]["role"] == "attention"
    from afd_core.config import parse_afd_config

    assert parse_afd_config(att.additional_config["afd"], "npu").connector == "hccl"
    # the worker names the AFD worker explicitly: accepted, and Ascend's defaults still apply
    again = npu_check({"role": "ffn"}, worker_cls="afd_npu.workers.npu_worker.AFDNPUFFNWorker")
    assert again.parallel_config.worker_cls.endswith("AFDNPUFFNWorker")
    assert again.parallel_config.all2all_backend == "flashinfer_all2allv"


def test_what_the_npu_path_does_not_run_is_rejected_with_the_alternative(npu_check):
    with pytest.raises(
        Exception, match=r"cudagraph_mode=FULL_DECODE_ONLY \(ACL graphs\).*--enforce-eager"
    ):
        npu_check({"role": "attention"}, graph_mode="FULL_DECODE_ONLY")
    with pytest.raises(Exception, match=r"2 micro-batches per step \(DBO\) is not supported"):
        npu_check({"role": "attention"}, enable_dbo=True)
    with pytest.raises(Exception, match="tensor-parallel-size=2 is not supported yet"):
        npu_check({"role": "ffn"}, tensor_parallel_size=2)
    with pytest.raises(Exception, match="xlite"):
        npu_check({"role": "attention"}, additional={"xlite_graph_config": {"enabled": True}})
    with pytest.raises(
        Exception, match="--worker-cls 'vllm_ascend.worker.worker.NPUWorker' does not match"
    ):
        npu_check({"role": "attention"}, worker_cls="vllm_ascend.worker.worker.NPUWorker")
    with pytest.raises(Exception, match="connector='gloo' runs on cpu.*allowed here: 'hccl'"):
        npu_check({"role": "attention", "connector": "gloo"})


def test_a_config_without_afd_is_left_to_vllm_ascend(npu_check):
    platform = sys.modules["vllm_ascend.platform"]
    from types import SimpleNamespace

    pc = SimpleNamespace(worker_cls="auto", enable_dbo=True, ubatch_size=2, all2all_backend="x")
    plain = SimpleNamespace(
        additional_config={},
        parallel_config=pc,
        compilation_config=SimpleNamespace(pass_config=SimpleNamespace()),
    )
    platform.NPUPlatform.check_and_update_config(plain)
    assert pc.worker_cls == "vllm_ascend.worker.worker.NPUWorker" and pc.enable_dbo is False

"""register_afd follows the seed's contract: order, once per process, what is caught."""

import sys

import pytest

import afd_plugin
from afd_core import registration as reg
from tests.conftest import run_python


@pytest.fixture
def fresh(monkeypatch):
    """A process state in which register_afd has not run yet."""
    monkeypatch.setattr(afd_plugin, "_registered", False)
    saved = reg.records()
    reg.clear()
    yield
    reg.clear()
    for r in saved.values():
        reg.record(r.name, r.status, r.reason)


def test_early_return_without_vllm(fresh, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    afd_plugin.register_afd()
    assert afd_plugin._registered is True
    assert reg.records() == {}


vllm_only = pytest.mark.vllm


@vllm_only
def test_body_runs_once_per_process(fresh, monkeypatch):
    from vllm.model_executor.models import ModelRegistry

    calls = []
    orig = ModelRegistry.register_model
    monkeypatch.setattr(ModelRegistry, "register_model", lambda *a: (calls.append(a), orig(*a)))
    afd_plugin.register_afd()
    afd_plugin.register_afd()
    assert len(calls) == 8
    assert reg.records()[reg.STEP_MODELS].status is reg.StepStatus.APPLIED


@vllm_only
def test_version_check_failure_is_caught(fresh, monkeypatch):
    import afd_core.version_gate as vg

    monkeypatch.setattr(vg, "check_vllm_version", lambda strict: 1 / 0)
    afd_plugin.register_afd()
    rec = reg.records()[reg.STEP_VERSION_CHECK]
    assert rec.status is reg.StepStatus.FAILED and "ZeroDivisionError" in rec.reason
    assert afd_plugin._registered


@vllm_only
def test_patch_failures_are_caught_and_recorded_one_by_one(fresh, monkeypatch):
    import afd_core.patches.config_validation as cv

    def boom():
        raise RuntimeError("no such vLLM function")

    monkeypatch.setattr(cv, "apply", boom)
    monkeypatch.setitem(sys.modules, "afd_core.patches.async_dp_engine", None)  # import fails
    afd_plugin.register_afd()
    recs = reg.records()
    assert recs["patch:config_validation"].status is reg.StepStatus.FAILED
    assert "no such vLLM function" in recs["patch:config_validation"].reason
    assert recs["patch:async_dp_engine"].status is reg.StepStatus.FAILED
    # the other patches still ran
    assert recs["patch:engine_core"].status is not reg.StepStatus.FAILED
    assert recs["patch:async_dp_forward_context"].status is reg.StepStatus.APPLIED
    assert afd_plugin._registered


@vllm_only
def test_dbo_op_failure_is_caught(fresh, monkeypatch):
    import afd_core.dbo as dbo

    monkeypatch.setattr(dbo, "register_dbo_yield_custom_op", lambda: 1 / 0)
    afd_plugin.register_afd()
    assert reg.records()[reg.STEP_DBO_YIELD_OP].status is reg.StepStatus.FAILED
    assert afd_plugin._registered


@vllm_only
def test_routing_strategy_failure_propagates(fresh, monkeypatch):
    import afd_core.routing_simulator as rs

    def boom():
        raise RuntimeError("routing registry changed")

    monkeypatch.setattr(rs, "register_afd_balanced_routing_strategy", boom)
    with pytest.raises(RuntimeError, match="routing registry changed"):
        afd_plugin.register_afd()
    assert afd_plugin._registered is False


@vllm_only
def test_model_registration_failure_propagates(fresh, monkeypatch):
    from vllm.model_executor.models import ModelRegistry

    def boom(*a):
        raise ValueError("bad model")

    monkeypatch.setattr(ModelRegistry, "register_model", boom)
    with pytest.raises(ValueError, match="bad model"):
        afd_plugin.register_afd()
    assert afd_plugin._registered is False


@vllm_only
def test_ascend_patch_only_on_npu_and_not_wrapped(fresh, monkeypatch):
    from vllm.platforms import current_platform

    import afd_npu.patches.ascend_config as ac

    called = []
    monkeypatch.setattr(ac, "apply_afd_ascend_config_patch", lambda: called.append(1))
    afd_plugin.register_afd()
    assert called == []
    assert reg.records()[reg.STEP_ASCEND_CONFIG].status is reg.StepStatus.SKIPPED

    monkeypatch.setattr(afd_plugin, "_registered", False)
    monkeypatch.setattr(type(current_platform), "device_type", "npu", raising=False)

    def boom():
        raise RuntimeError("ascend config moved")

    monkeypatch.setattr(ac, "apply_afd_ascend_config_patch", boom)
    with pytest.raises(RuntimeError, match="ascend config moved"):
        afd_plugin.register_afd()


@vllm_only
def test_npu_without_afd_npu_is_recorded_not_fatal(fresh, monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "device_type", "npu", raising=False)
    for name in ("afd_npu", "afd_npu.patches", "afd_npu.patches.ascend_config"):
        monkeypatch.setitem(sys.modules, name, None)  # afd-plugin without its [npu] extra
    afd_plugin.register_afd()  # every vLLM process on that machine keeps running
    rec = reg.records()[reg.STEP_ASCEND_CONFIG]
    assert rec.status is reg.StepStatus.FAILED and "afd-plugin[npu]" in rec.reason
    # an AFD deployment stops at start-up with that reason
    from afd_core.config import parse_afd_config

    with pytest.raises(reg.AFDStartupError, match=r"patch:ascend_config.*afd-plugin\[npu\]"):
        reg.assert_steps_ok_for(parse_afd_config({"role": "ffn"}, device_type="cpu"))


def test_registration_table():
    from afd_plugin.model_table import MODEL_REGISTRATIONS

    assert len(MODEL_REGISTRATIONS) == 8
    assert set(MODEL_REGISTRATIONS) == {
        "DeepseekForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV4ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    }
    assert (
        MODEL_REGISTRATIONS["DeepseekV32ForCausalLM"]
        == MODEL_REGISTRATIONS["DeepseekV3ForCausalLM"]
    )
    for target in MODEL_REGISTRATIONS.values():
        module, cls = target.split(":")
        assert cls.startswith("AFD") and module.startswith(("afd_models.", "afd_npu."))
    with pytest.raises(TypeError):
        MODEL_REGISTRATIONS["X"] = "y"  # read-only


def test_deepseek_v4_picks_npu_class_when_torch_npu_importable(monkeypatch):
    import importlib.util

    from afd_plugin import model_table

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "torch_npu" else real(n, *a)
    )
    assert model_table.build_model_registrations()["DeepseekV4ForCausalLM"].startswith(
        "afd_npu.models.deepseek_v4:"
    )
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "torch_npu" else real(n, *a)
    )
    assert model_table.build_model_registrations()["DeepseekV4ForCausalLM"].startswith(
        "afd_models.deepseek_v4:"
    )


@vllm_only
def test_registered_names_resolve_to_the_table(fresh):
    from vllm.model_executor.models import ModelRegistry

    afd_plugin.register_afd()
    archs = set(ModelRegistry.get_supported_archs())
    assert {f"AFD{a}" for a in afd_plugin.model_table.MODEL_REGISTRATIONS} <= archs
    assert "DeepseekV2ForCausalLM" in archs  # native names untouched


SPAWN_PROBE = """
import multiprocessing as mp
import afd_plugin
before = mp.get_start_method(allow_none=True)
afd_plugin.register_afd()
print(before, mp.get_start_method(allow_none=True), type(mp.get_context("forkserver")).__name__)
"""


def test_spawn_override_on():
    r = run_python(SPAWN_PROBE, hide=("vllm",), env={"AFD_FORCE_SPAWN_MULTIPROCESSING": "1"})
    assert r.returncode == 0, r.stderr
    # applied at import time already, and forkserver is redirected to spawn
    assert r.stdout.split() == ["spawn", "spawn", "SpawnContext"]


def test_spawn_override_runs_when_a_worker_module_is_imported_directly():
    probe = (
        "import afd_core.workers.selection, multiprocessing as mp, sys\n"
        "print(mp.get_start_method(allow_none=True), type(mp.get_context('forkserver')).__name__,"
        " 'afd_plugin' in sys.modules)\n"
    )
    r = run_python(probe, env={"AFD_FORCE_SPAWN_MULTIPROCESSING": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["spawn", "SpawnContext", "False"]


@pytest.mark.parametrize("value", ["", "0", "true"])
def test_spawn_override_off(value):
    r = run_python(SPAWN_PROBE, hide=("vllm",), env={"AFD_FORCE_SPAWN_MULTIPROCESSING": value})
    assert r.returncode == 0, r.stderr
    before, after, fs = r.stdout.split()
    assert before == "None" and after == "None" and fs == "ForkServerContext"


def test_version_never_raises():
    assert isinstance(afd_plugin.__version__, str) and afd_plugin.__version__
    r = run_python(
        "import importlib.metadata as m\n"
        "def boom(n): raise m.PackageNotFoundError(n)\n"
        "m.version = boom\nimport afd_plugin; print(afd_plugin.__version__)"
    )
    assert r.returncode == 0 and r.stdout.strip() == "0.0.0+unknown", r.stderr


def test_lazy_attributes():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        afd_plugin.nope  # noqa: B018


@vllm_only
def test_lazy_worker_classes_and_stack_check():
    from vllm.v1.worker.cpu_worker import CPUWorker

    assert issubclass(afd_plugin.AFDAttentionWorker, CPUWorker)
    assert issubclass(afd_plugin.AFDFFNWorker, CPUWorker)
    assert callable(afd_plugin.assert_compatible_afd_stack)

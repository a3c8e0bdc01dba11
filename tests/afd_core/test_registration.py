import pytest

from afd_core import registration as reg
from afd_core.config import parse_afd_config


@pytest.fixture(autouse=True)
def clean():
    saved = reg.records()
    reg.clear()
    yield
    reg.clear()
    for r in saved.values():
        reg.record(r.name, r.status, r.reason)


def cfg(**kw):
    return parse_afd_config({"role": "attention", **kw}, device_type="cpu")


def test_nothing_recorded_means_nothing_blocks():
    reg.assert_steps_ok_for(cfg())


def test_failed_needed_step_stops_startup_with_name_and_reason():
    reg.record(reg.patch_step("engine_core"), reg.StepStatus.FAILED, "ImportError: boom")
    with pytest.raises(
        reg.AFDStartupError, match=r"patch:engine_core \(failed: ImportError: boom\)"
    ):
        reg.assert_steps_ok_for(cfg())


def test_not_implemented_needed_step_blocks():
    reg.record(reg.STEP_DBO_YIELD_OP, reg.StepStatus.NOT_IMPLEMENTED, "later")
    with pytest.raises(reg.AFDStartupError, match="custom_op:manual_dbo_yield"):
        reg.assert_steps_ok_for(cfg())


def test_unneeded_failures_do_not_block(monkeypatch):
    monkeypatch.delenv("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", raising=False)
    reg.record(reg.patch_step("async_dp_engine"), reg.StepStatus.NOT_IMPLEMENTED, "later")
    reg.record(reg.STEP_ROUTING_STRATEGY, reg.StepStatus.FAILED, "x")
    reg.record(reg.STEP_VERSION_CHECK, reg.StepStatus.FAILED, "old vllm")
    reg.record(reg.STEP_ASCEND_CONFIG, reg.StepStatus.SKIPPED, "not npu")
    reg.assert_steps_ok_for(cfg())


def test_routing_step_needed_when_requested(monkeypatch):
    monkeypatch.setenv("VLLM_MOE_ROUTING_SIMULATION_STRATEGY", "afd_balanced")
    reg.record(reg.STEP_ROUTING_STRATEGY, reg.StepStatus.FAILED, "x")
    with pytest.raises(reg.AFDStartupError, match="routing_strategy:afd_balanced"):
        reg.assert_steps_ok_for(cfg())


def test_async_dp_needs_its_patches():
    from afd_core.config import AFDConfig

    c = AFDConfig(role="attention", connector="gloo", async_dp=True)
    assert reg.patch_step("async_dp_engine") in reg.steps_needed_by(c)
    assert reg.patch_step("async_dp_engine") not in reg.steps_needed_by(cfg())

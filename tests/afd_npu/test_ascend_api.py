"""The vllm-ascend API afd-npu relies on (afd_npu.ascend_api.PINNED) and the stand-ins the
tests use for it agree: a pin changed without its stand-in (or the reverse) fails here."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def test_the_standins_match_every_pin(ascend):
    from afd_npu.ascend_api import PINNED, check_ascend_api, drift

    assert {t.split(":")[0] for t in PINNED} == {
        "vllm_ascend.ascend_config",
        "vllm_ascend.platform",
        "vllm_ascend.worker.worker",
        "vllm_ascend.worker.model_runner_v1",
        "vllm_ascend.ascend_forward_context",
    }
    assert [t for t in PINNED if drift(t)] == []
    check_ascend_api()


def test_a_missing_name_is_reported_by_name(ascend, monkeypatch):
    import sys

    from afd_npu.ascend_api import drift

    monkeypatch.delattr(sys.modules["vllm_ascend.worker.worker"].NPUWorker, "load_model")
    problem = drift("vllm_ascend.worker.worker:NPUWorker.load_model")
    # WorkerBase still has load_model, with another signature
    assert problem is None or "load_model" in problem
    monkeypatch.delattr(
        sys.modules["vllm_ascend.ascend_forward_context"], "set_ascend_forward_context"
    )
    problem = drift("vllm_ascend.ascend_forward_context:set_ascend_forward_context")
    assert problem.startswith(
        "vllm_ascend.ascend_forward_context:set_ascend_forward_context is missing"
    )


def test_a_keyword_afd_passes_must_exist(ascend, monkeypatch):
    import sys

    from afd_npu.ascend_api import drift

    def set_ascend_forward_context(
        attn_metadata, vllm_config, num_tokens=0, num_tokens_across_dp=None
    ):
        return None

    module = sys.modules["vllm_ascend.ascend_forward_context"]
    monkeypatch.setattr(module, "set_ascend_forward_context", set_ascend_forward_context)
    problem = drift("vllm_ascend.ascend_forward_context:set_ascend_forward_context")
    assert "AFD passes input_ids by name" in problem


def test_the_patch_checks_its_modules_and_the_workers_the_rest(ascend, monkeypatch):
    """register_afd (every process) checks only what the config patch touches; the worker
    pins are checked where AFD's NPU workers are imported (worker processes)."""
    import sys

    from afd_npu.ascend_api import AscendAPIError, check_ascend_api

    def load_model(self, extra):  # a drifted worker API
        return None

    monkeypatch.setattr(
        sys.modules["vllm_ascend.worker.worker"].NPUWorker, "load_model", load_model
    )
    check_ascend_api("patch")
    with pytest.raises(AscendAPIError, match="NPUWorker.load_model takes \\(self, extra\\)"):
        check_ascend_api("worker")
    with pytest.raises(ValueError, match="scope='everything'"):
        check_ascend_api("everything")

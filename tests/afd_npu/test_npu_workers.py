"""The NPU role workers bind the shared role logic to vLLM-Ascend's worker and runner
(stand-ins pinned to vllm-ascend 0.23's API); `auto` maps to them on the npu platform."""

from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.vllm


def test_the_worker_table_names_the_npu_workers():
    from afd_core.workers.selection import resolve_worker_cls, worker_class_for

    assert (
        worker_class_for("npu", "attention") == "afd_npu.workers.npu_worker.AFDNPUAttentionWorker"
    )
    assert worker_class_for("npu", "ffn") == "afd_npu.workers.npu_worker.AFDNPUFFNWorker"
    assert resolve_worker_cls("auto", "npu", "ffn").endswith("AFDNPUFFNWorker")


def test_the_npu_workers_extend_vllm_ascends_classes(ascend):
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
    from vllm_ascend.worker.worker import NPUWorker

    from afd_core.workers.attention_runner import AFDAttentionRunnerMixin, AFDRunnerCommon
    from afd_core.workers.role_workers import AttentionWorkerMixin, FFNWorkerMixin
    from afd_npu.workers import npu_worker

    att, ffn = npu_worker.AFDNPUAttentionWorker, npu_worker.AFDNPUFFNWorker
    assert att.__mro__[1] is AttentionWorkerMixin and issubclass(att, NPUWorker)
    assert ffn.__mro__[1] is FFNWorkerMixin and issubclass(ffn, NPUWorker)
    runner = npu_worker.AFDNPUAttentionModelRunner
    assert runner.__mro__[1:4] == (AFDAttentionRunnerMixin, AFDRunnerCommon, NPUModelRunner)
    assert att.afd_runner_classes == {NPUModelRunner: runner}
    # every runner method AFD's mixin overrides is one NPUModelRunner has: its own (the
    # mixin then sits above vLLM-Ascend's version) or, for vLLM's KV-connector context,
    # the one it inherits from vLLM's runner
    inherited = {"maybe_get_kv_connector_output"}
    overrides = {**vars(AFDRunnerCommon), **vars(AFDAttentionRunnerMixin)}
    for name, member in overrides.items():
        if inspect.isfunction(member) and not name.startswith(("_afd", "afd_")):
            assert name in NPUModelRunner.__dict__ or (
                name in inherited and hasattr(NPUModelRunner, name)
            ), name
    # the second positional parameter of Ascend's _dummy_run is with_prefill (vLLM's:
    # cudagraph_runtime_mode): the mixin passes positionals through untouched
    params = list(inspect.signature(NPUModelRunner._dummy_run).parameters)
    assert params[:3] == ["self", "num_tokens", "with_prefill"]
    assert "num_tokens" in inspect.signature(AFDAttentionRunnerMixin._dummy_run).parameters


def test_the_attention_worker_turns_ascends_runner_into_afds(ascend, monkeypatch):
    from afd_npu.workers import npu_worker

    worker = object.__new__(npu_worker.AFDNPUAttentionWorker)
    worker.vllm_config = _Cfg({"afd": {"role": "attention"}})
    worker.parallel_config = worker.vllm_config.parallel_config
    monkeypatch.setattr(
        "afd_core.workers.role_workers.assert_compatible_afd_stack", lambda c, w: None
    )
    worker.init_device()
    assert type(worker.model_runner) is npu_worker.AFDNPUAttentionModelRunner
    assert worker.max_microbatches == 1


def test_every_ffn_call_runs_in_ascends_forward_context_for_its_rows(ascend):
    import torch
    from vllm.forward_context import get_forward_context
    from vllm_ascend import ascend_forward_context

    from afd_npu.workers import npu_worker

    worker = object.__new__(npu_worker.AFDNPUFFNWorker)
    from vllm.config import VllmConfig

    worker.vllm_config = VllmConfig()
    ids = torch.tensor([7, 8, 9])
    ascend_forward_context.entered.clear()
    with worker.afd_layer_context(3, ids):
        assert get_forward_context().input_ids is ids
    assert ascend_forward_context.entered == [(3, ids)]


def test_ffn_role_wraps_each_layer_call_in_the_layer_context():
    """FFNRole._compute runs the model's FFN inside the worker's per-call context."""
    import contextlib

    import torch

    from afd_core.workers.roles import FFNRole

    seen = []

    @contextlib.contextmanager
    def layer_context(rows, token_ids):
        seen.append(("enter", rows, None if token_ids is None else token_ids.tolist()))
        yield
        seen.append(("exit",))

    class Model:
        def compute_ffn_output(self, layer, hidden, logits, ids):
            seen.append(("ffn", layer))
            return hidden

    role = object.__new__(FFNRole)
    role._fail_next = None
    role.tp_leader = None
    role.model = Model()
    role.layer_context = layer_context
    out = role._compute(2, torch.ones(4, 3), None, torch.arange(4))
    assert out.shape == (4, 3)
    assert seen == [("enter", 4, [0, 1, 2, 3]), ("ffn", 2), ("exit",)]


class _Cfg:
    """The parts of a VllmConfig the attention worker's init_device reads."""

    def __init__(self, additional):
        from types import SimpleNamespace

        self.additional_config = additional
        self.parallel_config = SimpleNamespace(ubatch_size=0)

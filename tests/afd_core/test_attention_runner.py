"""The AFD attention runner's overrides over a stand-in for vLLM's runner, and the scheduler
patch that turns a failed step into failed requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm


class FakeBuilder:
    supports_update_block_table = True


class BaseRunner:
    def __init__(self):
        self.calls = {}
        self.attn_groups = [[SimpleNamespace(metadata_builders=[FakeBuilder(), FakeBuilder()])]]
        self.raise_in_execute = None

    def _determine_batch_execution_and_padding(self, **kw):
        self.calls["determine"] = kw
        return ("mode", "desc", False, None, None)

    def _build_attention_metadata(self, **kw):
        builders = self.attn_groups[0][0].metadata_builders
        self.calls["build"] = (kw, [b.supports_update_block_table for b in builders])
        return ({}, None)

    def _dummy_run(self, num_tokens, **kw):
        self.calls["dummy_kind"] = self.afd_engine.kind
        if self.raise_in_execute:
            raise self.raise_in_execute
        return ("hidden", "logits")

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        raise self.raise_in_execute

    def get_model(self):
        return self.model


@pytest.fixture
def runner():
    from afd_core.step.split import SplitPolicy
    from afd_core.step.wrapper import AttentionStepEngine, StepKind
    from afd_core.workers.attention_runner import AFDAttentionRunnerMixin

    class Runner(AFDAttentionRunnerMixin, BaseRunner):
        pass

    r = Runner()

    class Engine(SimpleNamespace):
        plan_step = AttentionStepEngine.plan_step  # the engine's own planning

    r.afd_engine = Engine(
        plan=None,
        kind=StepKind.REAL,
        policy=SplitPolicy(2, 2, 4),
        vllm_ubatching=False,
        tuner=None,
        choice=None,
    )
    return r


def determine(runner, tokens, allow=True):
    import numpy as np

    return runner._determine_batch_execution_and_padding(
        num_tokens=sum(tokens),
        num_reqs=len(tokens),
        num_scheduled_tokens_np=np.array(tokens + [0, 0], dtype=np.int32),
        max_num_scheduled_tokens=max(tokens),
        allow_microbatching=allow,
    )


def test_afd_plans_the_split_and_vllm_micro_batching_stays_off(runner):
    assert determine(runner, [1, 1, 1, 1]) == ("mode", "desc", False, None, None)
    assert runner.calls["determine"]["allow_microbatching"] is False
    assert [(s.req_start, s.req_stop) for s in runner.afd_engine.plan] == [(0, 2), (2, 4)]
    determine(runner, [1, 1, 1, 1], allow=False)  # vLLM's prefix-cache veto
    assert runner.afd_engine.plan is None
    determine(runner, [1])  # one request
    assert runner.afd_engine.plan is None


def test_attention_metadata_is_built_per_microbatch_with_full_rebuilds(runner):
    determine(runner, [3, 1, 2])
    runner._build_attention_metadata(num_tokens=6, ubatch_slices=None)
    kw, update_flags = runner.calls["build"]
    slices = kw["ubatch_slices"]
    assert [(s.request_slice, s.token_slice) for s in slices] == [
        (slice(0, 1), slice(0, 3)),
        (slice(1, 3), slice(3, 6)),
    ]
    assert update_flags == [False, False]  # no block-table-only rebuild across micro-batches
    builders = runner.attn_groups[0][0].metadata_builders
    assert all(b.supports_update_block_table for b in builders)  # restored
    runner.afd_engine.plan = None
    runner._build_attention_metadata(num_tokens=6, ubatch_slices=None)
    assert runner.calls["build"][0]["ubatch_slices"] is None


def test_dummy_and_profile_runs_are_flagged_and_only_a_failed_dp_dummy_is_skipped(runner):
    """Only an idle data-parallel rank's dummy batch (vLLM's execute_dummy_batch) may fail
    quietly: a failed profiling run, compile warm-up or graph capture stops the start-up
    with its cause (vLLM would go on without the graph and announce the size as a capture
    again at run time)."""
    from afd_core.connectors.base import AFDStepError
    from afd_core.step.wrapper import StepKind

    assert runner._dummy_run(1) == ("hidden", "logits")
    assert runner.calls["dummy_kind"] is StepKind.DUMMY
    runner._dummy_run(64, is_profile=True)
    assert runner.calls["dummy_kind"] is StepKind.PROFILE
    assert runner.afd_engine.kind is StepKind.REAL
    runner.raise_in_execute = AFDStepError("FFN rank 0 failed step 3")
    runner.afd_dp_dummy_batch = True  # as AttentionWorkerMixin.execute_dummy_batch sets it
    hidden, logits = runner._dummy_run(1)  # an idle rank's dummy batch: logged, not fatal
    assert hidden.numel() == 0 and logits.numel() == 0
    runner.afd_dp_dummy_batch = False
    with pytest.raises(AFDStepError):
        runner._dummy_run(64, is_profile=True)  # a failed profile run stops start-up
    with pytest.raises(AFDStepError):
        runner._dummy_run(8)  # compile warm-up
    with pytest.raises(AFDStepError):
        runner._dummy_run(8, is_graph_capturing=True)  # a graph capture


def test_a_failed_step_returns_a_marked_output_for_its_requests(runner):
    from afd_core.connectors.base import AFDPeerError, AFDStepError
    from afd_core.step.attention import STEP_FAILURE_ATTR

    runner.raise_in_execute = AFDStepError("FFN rank 0 failed layer 1, step 9")
    out = runner.execute_model(SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 1}))
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [[], []]
    assert getattr(out, STEP_FAILURE_ATTR) == "FFN rank 0 failed layer 1, step 9"
    runner.raise_in_execute = AFDPeerError("FFN rank 0 closed the connection")
    with pytest.raises(AFDPeerError):  # the deployment cannot go on: vLLM stops the engine
        runner.execute_model(SimpleNamespace(num_scheduled_tokens={"a": 1}))


def test_a_step_that_loads_kv_synchronously_runs_unsplit(runner, monkeypatch):
    """vLLM's connectors read the step's forward context in start_load_kv (before the
    forward): a split step's holds one attention metadata per micro-batch, which vLLM's
    ExampleConnector skips without loading."""
    plans = []

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        determine(self, [3, 5])
        plans.append(self.afd_engine.plan)
        return "output"

    monkeypatch.setattr(BaseRunner, "execute_model", execute_model)
    runner.execute_model(SimpleNamespace(has_sync_kv_loads=True))
    assert plans == [None] and runner.calls["determine"]["allow_microbatching"] is False
    runner.execute_model(SimpleNamespace(has_sync_kv_loads=False))  # async loads, or none
    assert plans[1] is not None and len(plans[1]) == 2
    assert runner._afd_sync_kv_loads is False  # for the dummy runs in between


def test_a_failed_step_carries_its_kv_connector_report(monkeypatch):
    """vLLM's connector context (kv_connector_model_runner_mixin.py) cleans up also when
    the forward raises (wait_for_save, get_finished, clear_connector_metadata); what it
    reported for the step reaches the scheduler in the failed step's output, so a request
    whose KV finished arriving is not left waiting for ever."""
    import inspect

    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.worker import gpu_model_runner, kv_connector_model_runner_mixin
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    from afd_core.connectors.base import AFDStepError
    from afd_core.step.attention import STEP_FAILURE_ATTR
    from afd_core.workers.attention_runner import AFDAttentionRunnerMixin
    from tests.afd_core.step_fakes import recording_kv_connector

    # vLLM's runner enters the context through the runner, where AFD's override is
    source = inspect.getsource(gpu_model_runner.GPUModelRunner.execute_model)
    assert "self.maybe_get_kv_connector_output(" in source

    calls = []
    connector = recording_kv_connector(calls, finished=({"sent"}, {"received"}))
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    monkeypatch.setattr(kv_connector_model_runner_mixin, "get_forward_context", lambda: "ctx")

    class VLLMRunner(KVConnectorModelRunnerMixin):
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            with self.maybe_get_kv_connector_output(scheduler_output):
                assert connector.has_connector_metadata()
                raise AFDStepError("FFN rank 0 failed layer 1, step 9")

    class Runner(AFDAttentionRunnerMixin, VLLMRunner):
        pass

    sched_out = SimpleNamespace(
        num_scheduled_tokens={"a": 3},
        kv_connector_metadata=KVConnectorMetadata(),
        has_sync_kv_loads=True,
        finished_req_ids={"done"},
    )
    out = Runner().execute_model(sched_out)
    assert getattr(out, STEP_FAILURE_ATTR) == "FFN rank 0 failed layer 1, step 9"
    kv = out.kv_connector_output
    assert (kv.finished_sending, kv.finished_recving) == ({"sent"}, {"received"})
    assert [c[0] for c in calls] == [
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "clear_connector_metadata",
    ]
    assert calls[2] == ("get_finished", {"done"}) and not connector.has_connector_metadata()


def test_get_model_unwraps_the_step_wrapper(runner):
    from afd_core.step.wrapper import AFDStepWrapper

    model = object()
    runner.model = AFDStepWrapper(model, None)
    assert runner.get_model() is model


def test_scheduler_patch_fails_the_requests_of_a_marked_step():
    from vllm.v1.engine import EngineCoreOutputs, FinishReason
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    from afd_core.patches import step_failure
    from afd_core.step.attention import STEP_FAILURE_ATTR

    class Request:
        def __init__(self, rid, client):
            self.request_id, self.client_index = rid, client
            self.status = None

        def get_finished_reason(self):
            return FinishReason.ERROR if self.status == RequestStatus.FINISHED_ERROR else None

    class Scheduler:
        def __init__(self):
            self.requests = {"a": Request("a", 0), "b": Request("b", 1)}
            self.original_calls = 0

        def finish_requests(self, ids, status):
            done = [self.requests.pop(i) for i in ids]
            for r in done:
                r.status = status
            return done

        def update_from_output(self, scheduler_output, model_runner_output):
            self.original_calls += 1
            return {0: EngineCoreOutputs()}

    step_failure._patch(SimpleNamespace(Scheduler=Scheduler))
    sched = Scheduler()
    sched_out = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1})
    plain = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})
    untouched = sched.update_from_output(sched_out, plain)
    assert list(untouched) == [0] and untouched[0].outputs == []
    failed = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1})
    setattr(failed, STEP_FAILURE_ATTR, "FFN rank 0 failed layer 1")
    outputs = sched.update_from_output(sched_out, failed)
    assert sched.original_calls == 2 and sched.requests == {}  # vLLM's bookkeeping still ran
    errors = {o.request_id: o.finish_reason for eco in outputs.values() for o in eco.outputs}
    assert errors == {"a": FinishReason.ERROR, "b": FinishReason.ERROR}
    assert set(outputs) == {0, 1}  # each request's client hears about it

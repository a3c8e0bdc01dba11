"""The step wrapper inside a real vLLM forward context, with an in-memory connector: one
control message per forward, per-micro-batch inputs and forward contexts, the baton at the
yield op, outputs in order, flags, and the clean-up of a failed step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.afd_core.step_fakes import FakeConnector

pytestmark = pytest.mark.vllm


@pytest.fixture
def setup():
    import torch
    from vllm.forward_context import create_forward_context

    from afd_core.dbo import current_microbatch_id, dbo_yield
    from afd_core.step.split import SplitPolicy
    from afd_core.step.wrapper import AFDStepWrapper, AttentionStepEngine

    vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            fast_moe_cold_start=False,
            # the attention layers, as vLLM's KV connector hooks look them up
            static_forward_context={
                f"layer.{i}": SimpleNamespace(kv_cache=f"kv{i}") for i in (0, 1)
            },
            static_all_moe_layers=[],
        )
    )
    conn = FakeConnector()
    seen = []

    class Toy:
        fail_in = None
        attention = None  # called with each layer's name (vLLM's attention op)

        def __call__(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
            from vllm.forward_context import get_forward_context

            ctx = get_forward_context()
            mb = current_microbatch_id()
            seen.append((mb, ctx.attn_metadata, ctx.slot_mapping["layer.0"].tolist()))
            h = input_ids.float().unsqueeze(1)
            for layer in range(2):
                h = h + 1
                if self.attention is not None:
                    self.attention(f"layer.{layer}")
                if self.fail_in == (mb, layer):
                    raise ValueError("attention kernel failed")
                ex = conn.start_exchange(h, layer, mb)
                dbo_yield(h)
                h = ex.wait()
            return h

        def compute_logits(self, h):
            return h

    engine = AttentionStepEngine(conn, vllm_config, SplitPolicy(2, 2, 2), max_microbatches=4)
    assert engine.starting_up  # until the worker's compile/warm-up ends
    engine.starting_up = False  # a serving engine (start-up steps: their own test)
    model = Toy()
    wrapper = AFDStepWrapper(model, engine)

    def forward(attn_metadata, n=8, **context):
        ctx = create_forward_context(
            attn_metadata,
            vllm_config,
            slot_mapping={"layer.0": torch.arange(100, 100 + n)},
            **context,
        )
        from vllm.forward_context import override_forward_context

        with override_forward_context(ctx), torch.inference_mode():
            ids = torch.arange(n)
            out = wrapper(input_ids=ids, positions=ids, intermediate_tensors=None)
            from vllm.forward_context import get_forward_context

            assert get_forward_context() is ctx  # the caller's context is back
            return out

    return SimpleNamespace(
        engine=engine, conn=conn, seen=seen, forward=forward, model=model, wrapper=wrapper
    )


def expected(n):
    import torch

    h = torch.arange(n).float().unsqueeze(1)
    for _ in range(2):
        h = (h + 1) * 2
    return h


def test_unsplit_forward_is_one_step_of_one_microbatch(setup):
    import torch

    out = setup.forward({"layer.0": "meta"})
    assert torch.equal(out, expected(8))
    assert setup.conn.steps == [((8,), 0)] and setup.conn.ended == 1
    assert setup.seen == [(0, {"layer.0": "meta"}, list(range(100, 108)))]
    assert setup.wrapper.compute_logits(3) == 3  # attributes reach the model


def test_planned_forward_runs_microbatches_with_their_own_contexts(setup):
    import torch

    from afd_core.step.split import MicrobatchSlice

    setup.engine.plan = [MicrobatchSlice(0, 2, 0, 3), MicrobatchSlice(2, 4, 3, 8)]
    out = setup.forward([{"layer.0": "mb0"}, {"layer.0": "mb1"}])
    assert torch.equal(out, expected(8))  # concatenated in order
    assert setup.conn.steps == [((3, 5), 0)]
    assert sorted(setup.seen, key=lambda s: s[0]) == [
        (0, {"layer.0": "mb0"}, [100, 101, 102]),
        (1, {"layer.0": "mb1"}, [103, 104, 105, 106, 107]),
    ]
    # the baton moved at each yield: layer-major, micro-batch-minor, like the FFN side
    assert setup.conn.exchanges == [(0, 0, 3), (0, 1, 5), (1, 0, 3), (1, 1, 5)]
    assert setup.engine.plan is None  # consumed
    stats = setup.engine.stats.as_dict()
    assert stats["by_microbatches"] == {"2": 1} and stats["last_split_rows"] == [3, 5]


def test_dummy_forward_carries_its_flag(setup):
    from afd_core.connectors.protocol.control import ControlFlag
    from afd_core.step.wrapper import StepKind

    setup.engine.kind = StepKind.DUMMY
    setup.forward({"layer.0": None}, n=1)
    assert setup.conn.steps == [((1,), int(ControlFlag.DUMMY))]
    assert setup.engine.stats.as_dict()["by_kind"] == {"dummy": 1}


def test_start_up_steps_carry_their_flag_until_the_worker_has_warmed_up(setup):
    """Profiling, compile warm-up and captures run before the worker's
    compile_or_warm_up_model returns: their steps carry STARTUP (bounded by
    startup_timeout_s on both sides); the worker clears it, and real steps go without."""
    from afd_core.connectors.protocol.control import ControlFlag
    from afd_core.step.wrapper import StepKind
    from afd_core.workers.role_workers import AttentionWorkerMixin

    setup.engine.starting_up = True
    setup.engine.kind = StepKind.PROFILE
    setup.forward({"layer.0": None}, n=4)
    setup.engine.kind = StepKind.REAL

    class Base:
        def compile_or_warm_up_model(self):
            setup.forward({"layer.0": None}, n=2)  # a warm-up forward
            return "times"

    class Worker(AttentionWorkerMixin, Base):
        afd = type("Role", (), {"engine": setup.engine})()

    assert Worker().compile_or_warm_up_model() == "times"
    setup.forward({"layer.0": None}, n=3)
    assert setup.conn.steps == [
        ((4,), int(ControlFlag.PROFILE | ControlFlag.STARTUP)),
        ((2,), int(ControlFlag.STARTUP)),
        ((3,), 0),
    ]


def test_metadata_split_without_a_plan_is_refused(setup):
    with pytest.raises(RuntimeError, match="attention metadata was split but the step was not"):
        setup.forward([{"layer.0": "mb0"}, {"layer.0": "mb1"}])


def test_failing_microbatch_is_cleaned_up_and_reported(setup):
    from afd_core.connectors.base import AFDStepError
    from afd_core.step.split import MicrobatchSlice

    setup.model.fail_in = (1, 1)
    setup.engine.plan = [MicrobatchSlice(0, 2, 0, 3), MicrobatchSlice(2, 4, 3, 8)]
    with pytest.raises(AFDStepError, match="failed on this rank .*attention kernel failed"):
        setup.forward([{"layer.0": "mb0"}, {"layer.0": "mb1"}])
    assert setup.conn.aborted == 1 and setup.engine.stats.failed == 1
    # the next step runs normally on the same threads
    setup.model.fail_in = None
    setup.engine.plan = [MicrobatchSlice(0, 2, 0, 3), MicrobatchSlice(2, 4, 3, 8)]
    setup.forward([{"layer.0": "mb0"}, {"layer.0": "mb1"}])
    assert setup.conn.ended == 1


def test_with_tensor_parallel_a_local_failure_stops_the_server(setup):
    """Issue 36 (review M7): one TP rank's failure would leave its siblings in the step's
    collectives; it is finished in protocol with the FFN rank, then raised as fatal."""
    from afd_core.connectors.base import AFDPeerError, AFDStepError
    from afd_core.step.split import MicrobatchSlice

    setup.conn.local_failure_fatal = True
    setup.model.fail_in = (1, 1)
    setup.engine.plan = [MicrobatchSlice(0, 2, 0, 3), MicrobatchSlice(2, 4, 3, 8)]
    with pytest.raises(AFDPeerError, match="other tensor-parallel ranks") as err:
        setup.forward([{"layer.0": "mb0"}, {"layer.0": "mb1"}])
    assert not isinstance(err.value, AFDStepError)
    assert setup.conn.aborted == 1  # the FFN rank was left in step first


def test_injected_failure_hits_the_next_real_step_only(setup):
    from afd_core.connectors.base import AFDStepError

    setup.engine.inject_failure("drill")
    with pytest.raises(AFDStepError, match=r"injected attention step failure \(drill\)"):
        setup.forward({"layer.0": None})
    setup.forward({"layer.0": None})
    assert setup.conn.ended == 1 and setup.conn.aborted == 1


def test_set_policy_is_bounded_by_what_the_server_built(setup):
    from afd_core.step.split import SplitPolicy

    setup.engine.max_microbatches = 1
    with pytest.raises(ValueError, match="started for at most 1; start it with --enable-dbo"):
        setup.engine.set_policy(SplitPolicy(2))


def test_graph_capture_is_announced_and_a_replay_counts_as_exchanged(setup):
    """Under vLLM's CUDAGraphWrapper (FULL_DECODE_ONLY): the forward that captures carries
    the CAPTURE flag, so the FFN rank captures the same key; after a replay (no exchange
    Python ran inside the graph) the connector is told the layers were exchanged."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from afd_core.connectors.protocol.control import ControlFlag

    wrapper = SimpleNamespace(runtime_mode=CUDAGraphMode.FULL, concrete_cudagraph_entries={})
    setup.engine.graph_wrapper = wrapper
    desc = BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True)
    full = {"cudagraph_runtime_mode": CUDAGraphMode.FULL, "batch_descriptor": desc}
    setup.forward({"layer.0": "capture"}, **full)
    wrapper.concrete_cudagraph_entries[desc] = SimpleNamespace(cudagraph=object())  # captured
    setup.forward({"layer.0": "replay"}, **full)
    setup.forward({"layer.0": "eager"})  # a prefill step: no graph
    assert setup.conn.steps == [((8,), int(ControlFlag.CAPTURE)), ((8,), 0), ((8,), 0)]
    assert setup.conn.replayed == 1 and setup.conn.ended == 3
    assert setup.engine.stats.as_dict()["by_graph"] == {"capture": 1, "replay": 1, "eager": 1}


def test_a_split_step_under_a_graph_is_refused(setup):
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from afd_core.step.split import MicrobatchSlice

    setup.engine.graph_wrapper = SimpleNamespace(
        runtime_mode=CUDAGraphMode.FULL, concrete_cudagraph_entries={}
    )
    setup.engine.plan = [MicrobatchSlice(0, 2, 0, 3), MicrobatchSlice(2, 4, 3, 8)]
    with pytest.raises(RuntimeError, match="a step split by AFD ran under a device graph"):
        setup.forward(
            [{"layer.0": "mb0"}, {"layer.0": "mb1"}],
            cudagraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=BatchDescriptor(num_tokens=8),
        )
    assert setup.conn.steps == []


def test_the_wrapper_passes_attributes_through_even_model():
    """`runner.model.model` is the model's decoder stack through AFD's wrapper, as through
    vLLM's own wrappers (vLLM-Ascend's layer-index check reads `model.model.start_layer`)."""
    from afd_core.step.wrapper import AFDStepWrapper

    inner = SimpleNamespace(model=SimpleNamespace(start_layer=0), compute_logits="logits")
    wrapper = AFDStepWrapper(inner, engine=None)
    assert wrapper.model is inner.model and wrapper.model.start_layer == 0
    assert wrapper.compute_logits == "logits" and wrapper.unwrap() is inner


def test_auto_microbatches_choose_m_per_step_and_record_each_steps_time(setup):
    """num_microbatches "auto": the engine asks the tuner for each step's m (at request
    boundaries, at most one per request), runs it and records the forward's time; every m
    computes what the unsplit step computes."""
    import torch

    from afd_core.step.split import SplitPolicy

    engine = setup.engine
    engine.set_policy(SplitPolicy(4, 2, 2), adaptive=True)
    ms = []
    for _ in range((engine.tuner.warmup + engine.tuner.window) * 2):
        engine.plan_step([2, 2, 2, 2])
        m = len(engine.plan) if engine.plan else 1
        ms.append(m)
        meta = [{"layer.0": f"mb{i}"} for i in range(m)] if m > 1 else {"layer.0": "one"}
        assert torch.equal(setup.forward(meta), expected(8))
    assert ms == [1] * 6 + [2] * 6  # m = 1, then 2 measured (then 3 only if 2 paid)
    arms = engine.tuner.as_dict()["mixed~8"]["by_microbatches"]
    assert {int(m): n for m, (n, _) in arms.items() if n} == {m: ms.count(m) for m in set(ms)}
    assert all(us > 0 for n, us in arms.values() if n)
    engine.plan_step([5])  # one request: never split, nothing to choose or measure
    assert engine.plan is None and engine.choice is None
    engine.set_policy(SplitPolicy(2, 2, 2))  # a fixed m again
    assert engine.tuner is None
    engine.set_policy(SplitPolicy(4, 2, 2), adaptive=True)  # back to auto: kept
    assert engine.tuner.as_dict()["mixed~8"]["steps"] == 12
    engine.set_policy(SplitPolicy(2, 2, 2), adaptive=True)  # auto up to 2: measured anew
    assert engine.tuner.as_dict() == {}


@pytest.fixture
def kv_hooks(setup, monkeypatch):
    """A recording KV connector installed as vLLM's, with this step's metadata bound, and
    the toy model's attention layers wrapped in vLLM's own KV-transfer hooks."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

    from afd_core.dbo import current_microbatch_id
    from tests.afd_core.step_fakes import recording_kv_connector

    calls = []
    connector = recording_kv_connector(calls)
    connector.bind_connector_metadata(KVConnectorMetadata())
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)

    @maybe_transfer_kv_layer
    def attention(layer_name):
        calls.append(("attention", current_microbatch_id(), layer_name))

    setup.model.attention = attention
    return calls


def test_kv_connector_hooks_run_per_layer_in_each_microbatch_with_its_context(setup, kv_hooks):
    """vLLM's per-layer KV-connector hooks (wait_for_layer_load before a layer's attention,
    save_kv_layer after it) run inside AFD's micro-batch threads, each with its own
    micro-batch's attention metadata; the baton order (layer-major) makes the last save of
    a layer come after every micro-batch wrote it."""
    from afd_core.step.split import MicrobatchSlice

    setup.engine.plan = [MicrobatchSlice(0, 2, 0, 3), MicrobatchSlice(2, 4, 3, 8)]
    meta = [{f"layer.{i}": f"mb{m}" for i in (0, 1)} for m in (0, 1)]
    setup.forward(meta)
    assert kv_hooks == [
        call
        for layer in ("layer.0", "layer.1")
        for mb in (0, 1)
        for call in (
            ("wait_for_layer_load", mb, layer),
            ("attention", mb, layer),
            ("save_kv_layer", mb, layer, f"mb{mb}"),
        )
    ]


def test_kv_connector_hooks_of_an_unsplit_step_see_the_whole_step(setup, kv_hooks):
    setup.forward({"layer.0": "step", "layer.1": "step"})
    assert [c for c in kv_hooks if c[0] == "save_kv_layer"] == [
        ("save_kv_layer", 0, "layer.0", "step"),
        ("save_kv_layer", 0, "layer.1", "step"),
    ]

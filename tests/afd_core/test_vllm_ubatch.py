"""DBO with graphs through vLLM's UBatchWrapper (afd_core.step.vllm_ubatch), on CPU.

vLLM's real micro-batch threads and hand-over (UBatchWrapper._run_ubatches, UBatchContext,
dbo_yield) run here with CUDA's streams stood in (vLLM keeps the current stream per thread;
only the call into CUDA is replaced): AFD's step wrapper announces vLLM's slices, AFD's
exchange op yields to vLLM's other micro-batch, and the outputs come back in order. The
decision at data parallel 1, the graph phase, the runner and worker wiring and the pins on
the vLLM 0.32 code this relies on are tested against the real classes."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from tests.afd_core.step_fakes import FakeConnector

pytestmark = pytest.mark.vllm


class Toy:
    """Two layers, each exchanged through AFD's exchange op (which yields at DBO)."""

    def __init__(self):
        self.seen = []
        self.fail_in = None  # (micro-batch, layer): the attention compute raises there

    def __call__(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        from vllm.forward_context import get_forward_context

        from afd_core.dbo import current_microbatch_id
        from afd_core.exchange import exchange

        ctx = get_forward_context()
        self.seen.append((current_microbatch_id(), ctx.attn_metadata, ctx.dp_metadata))
        h = input_ids.float().unsqueeze(1)
        for layer in range(2):
            if self.fail_in == (current_microbatch_id(), layer):
                raise ValueError("attention kernel failed")
            h = exchange(h + 1, layer)
        return h


def expected(n):
    import torch

    h = torch.arange(n).float().unsqueeze(1)
    for _ in range(2):
        h = (h + 1) * 2
    return h


@pytest.fixture
def cpu_streams(monkeypatch):
    """CUDA's stream calls stood in: vLLM tracks the current stream per thread itself
    (vllm.utils.torch_utils), so its hand-over checks run as on a GPU."""
    import torch
    import vllm.utils.torch_utils as tu
    import vllm.v1.worker.gpu_ubatch_wrapper as gw

    class Stream:
        def __init__(self, device=None):
            pass

    compute = Stream()
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: compute)
    monkeypatch.setattr(tu, "prev_set_stream", lambda stream: None)
    # vLLM's SM control asserts a CUDA platform; AFD replaces it by a no-op (adopt)
    monkeypatch.setattr(gw, "create_sm_control_context", lambda pc: "vLLM's SM control")
    return compute


@pytest.fixture
def setup(cpu_streams):
    import torch
    from vllm.config import CUDAGraphMode

    from afd_core.runtime import install_connector
    from afd_core.step.graphs import find_graph_wrapper
    from afd_core.step.split import SplitPolicy
    from afd_core.step.vllm_ubatch import AFDUBatchWrapper, adopt
    from afd_core.step.wrapper import AFDStepWrapper, AttentionStepEngine

    vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            fast_moe_cold_start=False, static_forward_context={}, static_all_moe_layers=[]
        ),
        parallel_config=SimpleNamespace(num_ubatches=2, data_parallel_size=1),
    )
    from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper

    model = Toy()
    built = UBatchWrapper(model, vllm_config, CUDAGraphMode.NONE, "cpu")  # what vLLM builds
    assert built.sm_control == "vLLM's SM control"
    ubw = adopt(built)
    assert ubw is built and type(ubw) is AFDUBatchWrapper
    conn = FakeConnector()
    install_connector(conn)
    engine = AttentionStepEngine(conn, vllm_config, SplitPolicy(2, 2, 2), max_microbatches=2)
    engine.starting_up = False  # a serving engine
    engine.vllm_ubatching = True
    engine.graph_wrapper = find_graph_wrapper(ubw)
    assert engine.graph_wrapper is ubw
    wrapper = AFDStepWrapper(ubw, engine)

    def forward(n=8, cut=3, mode=CUDAGraphMode.NONE, split=True):
        from vllm.forward_context import (
            BatchDescriptor,
            create_forward_context,
            get_forward_context,
            override_forward_context,
        )
        from vllm.v1.worker.ubatch_utils import UBatchSlice

        slices = [UBatchSlice(slice(0, 2), slice(0, cut)), UBatchSlice(slice(2, 4), slice(cut, n))]
        ctx = create_forward_context(
            ["meta0", "meta1"] if split else "meta",
            vllm_config,
            cudagraph_runtime_mode=mode,
            batch_descriptor=BatchDescriptor(num_tokens=n),
            ubatch_slices=slices if split else None,
        )
        with override_forward_context(ctx), torch.inference_mode():
            ids = torch.arange(n)
            out = wrapper(
                input_ids=ids, positions=ids, intermediate_tensors=None, inputs_embeds=None
            )
            assert get_forward_context() is ctx  # the caller's context is back
        return out

    yield SimpleNamespace(engine=engine, conn=conn, model=model, ubw=ubw, forward=forward)
    install_connector(None)


def test_vllms_micro_batch_threads_run_afds_exchanges_in_protocol_order(setup):
    import torch

    out = setup.forward(n=8, cut=3)
    assert torch.equal(out, expected(8))  # vLLM concatenates the micro-batches in order
    assert setup.conn.steps == [((3, 5), 0)] and setup.conn.ended == 1  # one control message
    # vLLM's threads handed over at AFD's yield: layer-major, micro-batch-minor, as the FFN
    # rank walks them, each micro-batch with its own forward context and no DP metadata
    assert setup.conn.exchanges == [(0, 0, 3), (0, 1, 5), (1, 0, 3), (1, 1, 5)]
    assert sorted(setup.model.seen) == [(0, "meta0", None), (1, "meta1", None)]
    stats = setup.engine.stats.as_dict()
    assert stats["by_microbatches"] == {"2": 1} and stats["last_split_rows"] == [3, 5]
    assert stats["by_graph"] == {"eager": 1}
    setup.forward(n=4, cut=2)  # the next step, new threads (vLLM starts them per step)
    assert setup.conn.steps[-1] == ((2, 2), 0) and setup.conn.ended == 2


def test_an_unsplit_step_runs_the_model_once(setup):
    import torch

    assert torch.equal(setup.forward(n=5, split=False), expected(5))
    assert setup.conn.steps == [((5,), 0)]
    assert setup.conn.exchanges == [(0, 0, 5), (1, 0, 5)]


def test_a_failure_inside_vllms_micro_batches_fails_the_step_in_protocol(setup):
    from afd_core.connectors.base import AFDStepError

    setup.engine.inject_failure("drill")
    with pytest.raises(AFDStepError, match=r"injected attention step failure \(drill\)"):
        setup.forward()
    assert setup.conn.aborted == 1 and setup.engine.stats.failed == 1
    setup.forward()
    assert setup.conn.ended == 1


@pytest.mark.parametrize("where", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_a_micro_batch_failing_inside_vllms_threads_fails_the_step_without_a_hang(setup, where):
    """vLLM's threads alone would leave the other micro-batch yielding to an ended thread
    forever and swallow the error; AFD's wrapper stops the other at its next yield and
    raises the first error, so the step is finished in protocol and the next one runs."""
    import threading

    from afd_core.connectors.base import AFDStepError

    setup.model.fail_in = where
    outcome = []

    def step():
        try:
            setup.forward()
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the split step hung"
    assert isinstance(outcome[0], AFDStepError), outcome
    assert "ValueError: attention kernel failed" in str(outcome[0])  # the real error
    assert setup.conn.aborted == 1 and setup.engine.stats.failed == 1
    setup.model.fail_in = None
    assert setup.forward().shape == (8, 1)  # the next step runs on new threads
    assert setup.conn.ended == 1


def test_capture_is_announced_and_a_replay_runs_no_python(setup, monkeypatch):
    """FULL graphs: a split size seen first is captured (the CAPTURE flag goes out, the
    FFN rank captures the same key), then replayed: the connector marks it exchanged."""
    import torch
    from vllm.config import CUDAGraphMode

    from afd_core.connectors.protocol.control import ControlFlag

    ubw = setup.ubw
    captured = []

    def capture(metadata, model):  # torch.cuda.graph needs a GPU: record, then run
        captured.append([m.num_tokens for m in metadata])
        out = ubw._run_ubatches(metadata, model)
        ubw.cudagraphs[sum(captured[-1])] = SimpleNamespace(
            cudagraph=SimpleNamespace(replay=lambda: captured.append("replayed")), outputs=out
        )
        return out

    monkeypatch.setattr(ubw, "_capture_ubatches", capture)
    full = CUDAGraphMode.FULL
    assert torch.equal(setup.forward(mode=full), expected(8))
    assert torch.equal(setup.forward(mode=full), expected(8))  # the captured outputs
    assert captured == [[3, 5], "replayed"]
    assert setup.conn.steps == [((3, 5), int(ControlFlag.CAPTURE)), ((3, 5), 0)]
    assert setup.conn.replayed == 1 and len(setup.conn.exchanges) == 4  # none at replay
    assert setup.engine.stats.as_dict()["by_graph"] == {"capture": 1, "replay": 1}


def test_graph_phase_is_the_wrappers_decision(setup):
    from vllm.config import CUDAGraphMode as M
    from vllm.forward_context import BatchDescriptor
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    from afd_core.step.graphs import GraphPhase, graph_phase

    ubw = setup.ubw
    split = [UBatchSlice(slice(0, 1), slice(0, 4)), UBatchSlice(slice(1, 2), slice(4, 8))]

    def ctx(mode, slices=None, n=8):
        return SimpleNamespace(
            cudagraph_runtime_mode=mode,
            batch_descriptor=BatchDescriptor(num_tokens=n),
            ubatch_slices=slices,
        )

    assert graph_phase(ctx(M.FULL, split), ubw) is GraphPhase.CAPTURE
    assert graph_phase(ctx(M.NONE, split), ubw) is GraphPhase.EAGER
    ubw.cudagraphs[8] = "split graph"
    assert graph_phase(ctx(M.FULL, split), ubw) is GraphPhase.REPLAY
    # unsplit: a size captured split runs eagerly, else vLLM's CUDAGraphWrapper decides
    assert graph_phase(ctx(M.FULL), ubw) is GraphPhase.EAGER
    ubw.cudagraph_wrapper = SimpleNamespace(runtime_mode=M.FULL, concrete_cudagraph_entries={})
    assert graph_phase(ctx(M.FULL, n=4), ubw) is GraphPhase.CAPTURE
    assert graph_phase(ctx(M.NONE, n=4), ubw) is GraphPhase.EAGER


def test_vllm_splits_only_where_afd_handed_it_the_split(setup):
    setup.engine.vllm_ubatching = False  # AFD's executor splits on this server
    with pytest.raises(RuntimeError, match="vLLM split this step into micro-batches"):
        setup.forward()
    assert setup.conn.steps == []


def test_run_time_micro_batching_changes_stay_within_what_was_captured(setup):
    from afd_core.step.split import SplitPolicy

    setup.engine.set_policy(SplitPolicy(1, 2, 2))  # off
    setup.engine.set_policy(SplitPolicy(2, 2, 2))  # on again
    for bad in (SplitPolicy(3, 2, 2), SplitPolicy(2, 64, 2)):
        with pytest.raises(ValueError, match="split by vLLM's UBatchWrapper.*restart"):
            setup.engine.set_policy(bad)


# -- the decision at data parallel 1 and the runner --------------------------------------


def dbo_config(**kw):
    from vllm.config import ParallelConfig

    pc = ParallelConfig(**kw)
    pc.enable_dbo = True  # what the attention worker sets after the config checks
    return pc


def test_the_decision_at_dp1_is_vllms_rules():
    from afd_core.step.vllm_ubatch import should_ubatch_single_rank

    pc = dbo_config(dbo_decode_token_threshold=8, dbo_prefill_token_threshold=64)
    assert should_ubatch_single_rank(pc, 8, 8, uniform_decode=True)
    assert not should_ubatch_single_rank(pc, 7, 8, uniform_decode=True)  # below threshold
    assert not should_ubatch_single_rank(pc, 8, 8, uniform_decode=False)  # prefill threshold
    assert should_ubatch_single_rank(pc, 64, 64, uniform_decode=False)
    assert not should_ubatch_single_rank(pc, 9, 24, uniform_decode=True)  # last one empty


class BaseRunner:
    """The part of vLLM's GPUModelRunner the decision calls (its real _is_uniform_decode)."""

    uniform_decode_query_len = 1

    def __init__(self, dp):
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        self._is_uniform_decode = GPUModelRunner._is_uniform_decode
        self.parallel_config = dbo_config(data_parallel_size=dp, dbo_decode_token_threshold=4)
        self.calls = []

    def _determine_batch_execution_and_padding(self, **kw):
        self.calls.append(kw["allow_microbatching"])
        return ("mode", SimpleNamespace(num_tokens=kw["num_tokens"]), "vllm's", None, None)


@pytest.fixture
def runner():
    from afd_core.step.split import SplitPolicy
    from afd_core.workers.attention_runner import AFDAttentionRunnerMixin

    def make(dp):
        class Runner(AFDAttentionRunnerMixin, BaseRunner):
            pass

        r = Runner(dp)
        r.afd_engine = SimpleNamespace(vllm_ubatching=True, policy=SplitPolicy(2, 4, 512))
        return r

    return make


def determine(r, tokens, allow=True):
    import numpy as np

    return r._determine_batch_execution_and_padding(
        num_tokens=sum(tokens),
        num_reqs=len(tokens),
        num_scheduled_tokens_np=np.array(tokens, dtype=np.int32),
        max_num_scheduled_tokens=max(tokens),
        allow_microbatching=allow,
    )


def test_the_runner_decides_at_dp1_and_leaves_data_parallel_to_vllm(runner):
    from afd_core.step.split import SplitPolicy

    r = runner(1)
    assert determine(r, [1] * 4)[2] is True  # a decode batch at the threshold
    assert determine(r, [1] * 3)[2] is False
    assert determine(r, [2, 2])[2] is False  # not a decode batch: the prefill threshold
    assert determine(r, [1] * 4, allow=False)[2] is False  # vLLM's prefix-cache veto
    assert r.calls == [False] * 4  # vLLM's own decision never splits at DP 1
    r.afd_engine.policy = SplitPolicy(1)  # turned off at run time
    assert determine(r, [1] * 4)[2] is False
    dp = runner(2)
    assert determine(dp, [1] * 4)[2] == "vllm's" and dp.calls == [True]
    dp.afd_engine.policy = SplitPolicy(1)
    determine(dp, [1] * 4)
    assert dp.calls == [True, False]


def test_vllms_split_builds_every_micro_batch_in_full():
    """vLLM 0.32 reuses one micro-batch's attention metadata for the next when a builder
    can swap block tables (the cache key has no micro-batch); AFD turns that off while
    vLLM's split is built too."""
    from afd_core.workers.attention_runner import AFDAttentionRunnerMixin

    class Builder:
        supports_update_block_table = True

    class Base:
        attn_groups = [[SimpleNamespace(metadata_builders=[Builder(), Builder()])]]

        def _build_attention_metadata(self, **kw):
            return [b.supports_update_block_table for b in self.attn_groups[0][0].metadata_builders]

    class Runner(AFDAttentionRunnerMixin, Base):
        pass

    r = Runner()
    r.afd_engine = SimpleNamespace(plan=None)
    assert r._build_attention_metadata(ubatch_slices=["two", "slices"]) == [False, False]
    assert r._build_attention_metadata(ubatch_slices=None) == [True, True]
    assert r._build_attention_metadata(ubatch_slices=["a"], for_cudagraph_capture=True) == [
        True,
        True,
    ]


def test_get_model_unwraps_vllms_ubatch_wrapper_inside_afds():
    from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper

    from afd_core.step.wrapper import AFDStepWrapper
    from afd_core.workers.attention_runner import AFDAttentionRunnerMixin

    class Base:
        def get_model(self):
            return self.model

    class Runner(AFDAttentionRunnerMixin, Base):
        pass

    model = SimpleNamespace()
    ubw = object.__new__(UBatchWrapper)
    ubw.runnable = model
    r = Runner()
    r.model = AFDStepWrapper(ubw, None)
    assert r.get_model() is model


def test_the_cuda_attention_worker_turns_vllms_dbo_on_for_graphs_only(monkeypatch):
    """With graphs the worker turns on vLLM's DBO before vLLM's worker builds the runner
    (its wrapper, 2 metadata builders and workspaces); eagerly it sizes vLLM's builders
    for AFD's executor and vLLM's DBO stays off."""
    from vllm.config import CUDAGraphMode, ParallelConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from afd_core.workers.cuda_worker import AFDCUDAAttentionModelRunner, AFDCUDAAttentionWorker

    seen = []

    def init_device(self):  # vLLM's: builds the runner from the parallel config
        pc = self.parallel_config
        seen.append((pc.enable_dbo, pc.num_ubatches if pc.use_ubatching else 1))
        self.model_runner = object.__new__(GPUModelRunner)

    monkeypatch.setattr(Worker, "init_device", init_device)
    monkeypatch.setattr(
        "afd_core.workers.role_workers.assert_compatible_afd_stack", lambda c, w: None
    )

    def start(mode, m):
        w = object.__new__(AFDCUDAAttentionWorker)
        w.vllm_config = SimpleNamespace(
            additional_config={"afd": {"role": "attention", "num_microbatches": m}},
            compilation_config=SimpleNamespace(cudagraph_mode=getattr(CUDAGraphMode, mode)),
            parallel_config=ParallelConfig(),
        )
        w.parallel_config = w.vllm_config.parallel_config
        w.init_device()
        assert type(w.model_runner) is AFDCUDAAttentionModelRunner
        return w.vllm_ubatching, w.max_microbatches

    assert start("FULL_DECODE_ONLY", 2) == (True, 2)
    assert start("NONE", 2) == (False, 4)  # AFD's executor: up to 4, changeable
    assert start("FULL_DECODE_ONLY", 1) == (False, 1)
    assert seen == [(True, 2), (False, 4), (False, 1)]


# -- what AFD relies on in vLLM 0.32 --------------------------------------------------------


def test_pinned_vllm_micro_batching_code():
    """If one of these fails, vLLM changed the code AFD's DP-1 micro-batching mirrors or
    works around: re-read it (afd_core.step.vllm_ubatch) before moving the pin."""
    from vllm.forward_context import DPMetadata
    from vllm.v1.worker import dp_utils, gpu_model_runner
    from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper

    from afd_core.step.vllm_ubatch import AFDUBatchWrapper

    call = inspect.getsource(UBatchWrapper.__call__)
    for needle in (
        "assert dp_metadata is not None",  # why AFD's __call__ exists
        "DPMetadata.make(",
        "num_tokens not in self.cudagraphs",
        "cudagraph_runtime_mode is CUDAGraphMode.FULL",
        "batch_descriptor.num_tokens in self.cudagraphs",
        "with self.sm_control:",
        "self._capture_ubatches(ubatch_metadata, self.runnable)",
        "self._run_ubatches(ubatch_metadata, self.runnable)",
        "cudagraph_metadata.cudagraph.replay()",
        "compute_stream = torch.cuda.current_stream()",
    ):
        assert needle in call, needle
    assert "data_parallel_size > 1" in inspect.getsource(DPMetadata.make)
    made = inspect.signature(UBatchWrapper._make_ubatch_metadata).parameters
    passed = inspect.getsource(AFDUBatchWrapper.__call__)
    assert all(f"{p}=" in passed for p in made if p != "self")
    for method in ("_capture_ubatches", "_run_ubatches"):
        assert list(inspect.signature(getattr(UBatchWrapper, method)).parameters) == [
            "self",
            "ubatch_metadata",
            "model",
        ]
    init = inspect.getsource(UBatchWrapper.__init__)
    for attr in ("self.cudagraphs", "self.cudagraph_wrapper", "self.sm_control"):
        assert attr in init, attr
    # vLLM never splits at data parallel 1: the reason for AFD's decision
    assert "data_parallel_size == 1" in inspect.getsource(dp_utils.coordinate_batch_across_dp)
    determine = inspect.getsource(
        gpu_model_runner.GPUModelRunner._determine_batch_execution_and_padding
    )
    assert "if self.vllm_config.parallel_config.data_parallel_size > 1:" in determine
    assert "self.uniform_decode_query_len =" in inspect.getsource(
        gpu_model_runner.GPUModelRunner.__init__
    )
    assert list(
        inspect.signature(gpu_model_runner.GPUModelRunner._is_uniform_decode).parameters
    ) == [
        "max_num_scheduled_tokens",
        "uniform_decode_query_len",
        "num_tokens",
        "num_reqs",
        "force_uniform_decode",
    ]

"""The FFN side's graph cache (capture on a peer's CAPTURE flag, replay a known key, eager
otherwise) and the attention side's reading of vLLM's graph wrapper, with a stand-in
graph backend; the CUDA graphs themselves are in tests/gpu/check.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from afd_core.connectors.base import StepPlan
from afd_core.connectors.protocol.control import ControlFlag
from afd_core.step.graphs import FFNGraphCache, GraphPhase, graph_phase


class RecordingBackend:
    """'Captures' by running the function once (as capture runs the Python), 'replays'
    by recording the call."""

    def __init__(self):
        self.events = []

    def capture(self, fn):
        self.events.append("capture")
        fn()
        return f"graph{len(self.events)}"

    def replay(self, graph):
        self.events.append(("replay", graph))


def plan(rows, flags=ControlFlag.NONE):
    return StepPlan(0, (), rows, flags)


def run(cache, p, group_rows=None, eager_only=False, result=None):
    calls = []

    def layers(capturing=False):
        calls.append("layers")
        return result

    out = cache.run(p, layers, lambda: calls.append("settle"), group_rows, eager_only)
    return out, calls


def test_capture_on_the_flag_then_replay_the_key_and_run_unknown_keys_eagerly():
    backend = RecordingBackend()
    cache = FFNGraphCache(backend)
    decode = ((4, 4),)  # one micro-batch, two peers with 4 rows each
    assert run(cache, plan(decode)) == (None, ["layers"])  # before any capture: eager
    # the capture runs the layers and joins the sends inside the captured region
    assert run(cache, plan(decode, ControlFlag.CAPTURE | ControlFlag.DUMMY)) == (
        None,
        ["layers", "settle"],
    )
    assert run(cache, plan(decode)) == (None, [])  # replayed: no Python
    assert run(cache, plan(((5, 3),))) == (None, ["layers"])  # another key: eager
    assert backend.events == ["capture", ("replay", "graph1")]
    assert cache.stats.as_dict() == {"captured": 1, "replayed": 1, "eager": 2}


def test_the_key_holds_the_expert_group_rows_and_a_drill_runs_eagerly():
    cache = FFNGraphCache(RecordingBackend())
    rows = ((2,),)
    run(cache, plan(rows, ControlFlag.CAPTURE), group_rows=((2, 0),))
    assert run(cache, plan(rows), group_rows=((2, 0),))[1] == []  # replay
    assert run(cache, plan(rows), group_rows=((2, 3),))[1] == ["layers"]  # other sizes
    assert run(cache, plan(rows), group_rows=((2, 0),), eager_only=True)[1] == ["layers"]


def test_a_failure_while_capturing_is_not_kept_and_the_cache_is_bounded():
    from afd_core.connectors.protocol.status import StatusCode, StepStatus

    cache = FFNGraphCache(RecordingBackend(), max_graphs=1)
    failed = StepStatus(0, StatusCode.STEP_FAILED, 1, 0, 0, "boom")
    out, _ = run(cache, plan(((1,),), ControlFlag.CAPTURE), result=failed)
    assert out is failed and len(cache) == 0
    assert run(cache, plan(((1,),)))[1] == ["layers"]  # not kept: eager until captured again
    run(cache, plan(((1,),), ControlFlag.CAPTURE))
    # past the bound a capture still captures (the peers record, nothing would move for an
    # eager run): the least recently used key goes
    assert run(cache, plan(((2,),), ControlFlag.CAPTURE))[1] == ["layers", "settle"]
    assert len(cache) == 1 and cache.stats.captured == 3
    assert run(cache, plan(((1,),)))[1] == ["layers"]
    assert run(cache, plan(((2,),)))[1] == []


def test_a_capture_step_always_captures_and_a_second_capture_replaces_the_graph():
    """vLLM captures its largest sizes twice at start-up (the memory profile's captures are
    dropped, then capture_model captures again): the FFN side captures each time, never
    replaying or running eagerly on a CAPTURE step, and replays the newest graph after.
    A drill (eager_only) does not turn a capture into an eager run either."""
    backend = RecordingBackend()
    cache = FFNGraphCache(backend)
    key = ((4, 4),)
    assert run(cache, plan(key, ControlFlag.CAPTURE))[1] == ["layers", "settle"]
    assert run(cache, plan(key, ControlFlag.CAPTURE))[1] == ["layers", "settle"]
    assert run(cache, plan(key, ControlFlag.CAPTURE), eager_only=True)[1] == ["layers", "settle"]
    assert run(cache, plan(key))[1] == []
    assert backend.events == ["capture", "capture", "capture", ("replay", "graph3")]
    assert len(cache) == 1
    assert cache.stats.as_dict() == {"captured": 3, "replayed": 1, "eager": 0}


@pytest.mark.vllm
def test_graph_phase_reads_vllms_graph_wrapper_like_its_call_does():
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    desc = BatchDescriptor(num_tokens=16)
    wrapper = SimpleNamespace(runtime_mode=CUDAGraphMode.FULL, concrete_cudagraph_entries={})
    full = SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode.FULL, batch_descriptor=desc)
    none = SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=desc)
    piecewise = SimpleNamespace(
        cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE, batch_descriptor=desc
    )
    assert graph_phase(full, None) is GraphPhase.EAGER
    assert graph_phase(none, wrapper) is GraphPhase.EAGER
    assert graph_phase(piecewise, wrapper) is GraphPhase.EAGER
    assert graph_phase(full, wrapper) is GraphPhase.CAPTURE
    wrapper.concrete_cudagraph_entries[desc] = SimpleNamespace(cudagraph=None)  # not yet
    assert graph_phase(full, wrapper) is GraphPhase.CAPTURE
    wrapper.concrete_cudagraph_entries[desc] = SimpleNamespace(cudagraph=object())
    assert graph_phase(full, wrapper) is GraphPhase.REPLAY


@pytest.mark.vllm
def test_vllms_graph_wrapper_has_what_graph_phase_reads():
    """Pinned against vLLM 0.32: the attributes and the decision graph_phase mirrors."""
    import inspect

    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    from afd_core.step.graphs import find_graph_wrapper

    src = inspect.getsource(CUDAGraphWrapper.__call__)
    for needle in (
        "cudagraph_runtime_mode != self.runtime_mode",
        "self.concrete_cudagraph_entries",
        "entry.cudagraph is None",
    ):
        assert needle in src, needle
    assert "concrete_cudagraph_entries" in inspect.getsource(CUDAGraphWrapper.__init__)
    assert find_graph_wrapper(SimpleNamespace(concrete_cudagraph_entries={})) is not None
    assert find_graph_wrapper(object()) is None

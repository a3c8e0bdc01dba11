"""Device graphs (CUDA FULL_DECODE_ONLY) on both sides of a step.

Attention side: vLLM's `CUDAGraphWrapper` captures the model forward once per batch
descriptor and replays it after; AFD's step wrapper sits outside it, so the control
message (with the padded row count the graph was captured for) goes out before every
forward, captured or not. `graph_phase` tells, before the forward, what the wrapper is
about to do: a capture is announced with the CAPTURE flag (the FFN rank captures the same
key), and after a replay, where none of the exchange's Python ran, the connector is told
the step's layers were exchanged (`mark_exchanged`).

FFN side: `FFNGraphCache` captures the step's layers x micro-batches loop (receives,
compute, sends) whenever a peer announces a capture (a key captured again replaces its
graph), keyed by the rows per peer per micro-batch (and an expert group's rows per
member), replays a known key, and runs an unknown key eagerly. The receive buffers are allocated once (fixed addresses), and the
sends are joined into the captured stream before the capture ends.

`GraphBackend` is the seam the tests swap (CUDA: `CudaGraphBackend`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from afd_core.capabilities import PLATFORMS
from afd_core.connectors.base import StepPlan
from afd_core.connectors.protocol.control import ControlFlag
from afd_core.log import get_logger

logger = get_logger(__name__)

# the graph modes AFD runs on CUDA (vLLM's CUDAGraphMode names)
SUPPORTED_GRAPH_MODES = PLATFORMS["cuda"].graph_modes
MAX_FFN_GRAPHS = 256  # keys per FFN rank; a capture past it drops the least recently used


class GraphPhase(enum.Enum):
    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


def graph_mode_name(vllm_config) -> str:
    """vLLM's CUDAGraphMode of the config by name; "NONE" when it has none."""
    return getattr(vllm_config.compilation_config.cudagraph_mode, "name", "NONE")


def find_graph_wrapper(model) -> Any | None:
    """vLLM's graph wrapper around the attention model, if the runner made one: its
    CUDAGraphWrapper, or AFD's UBatchWrapper (step/vllm_ubatch.py) for DBO with graphs."""
    if hasattr(type(model), "afd_graph_phase"):
        return model
    # not hasattr(model, ...): vLLM's wrappers forward unknown attributes to the model
    return model if "concrete_cudagraph_entries" in getattr(model, "__dict__", {}) else None


def graph_phase(forward_context, wrapper) -> GraphPhase:
    """What `wrapper` (vLLM's CUDAGraphWrapper, or AFD's UBatchWrapper) does on the forward
    about to run: the same decision its __call__ makes, read before it runs."""
    if wrapper is None:
        return GraphPhase.EAGER
    if hasattr(type(wrapper), "afd_graph_phase"):
        return wrapper.afd_graph_phase(forward_context)
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    if mode is None or not mode or mode != wrapper.runtime_mode:
        return GraphPhase.EAGER
    entry = wrapper.concrete_cudagraph_entries.get(forward_context.batch_descriptor)
    if entry is not None and entry.cudagraph is not None:
        return GraphPhase.REPLAY
    return GraphPhase.CAPTURE


class GraphBackend:
    """Capture a function into a replayable graph, and replay it."""

    def capture(self, fn: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def replay(self, graph: Any) -> None:
        raise NotImplementedError


class CudaGraphBackend(GraphBackend):
    """torch.cuda graphs sharing one memory pool, captured on the calling thread's
    current stream (the FFN serving thread's own)."""

    def __init__(self):
        import torch

        self._torch = torch
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, fn):
        torch = self._torch
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():  # cannot be captured (the start-up thread)
            side = torch.cuda.Stream()
            side.wait_stream(stream)
            stream = side
        # thread-local: the FFN process's other threads (control listeners, the transport's
        # watchdog) go on while this thread captures
        with torch.cuda.graph(
            graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"
        ):
            fn()
        return graph

    def replay(self, graph) -> None:
        graph.replay()


@dataclass
class GraphStats:
    captured: int = 0
    replayed: int = 0
    eager: int = 0

    def as_dict(self) -> dict:
        return {"captured": self.captured, "replayed": self.replayed, "eager": self.eager}

    def replayed_fraction(self) -> float:
        steps = self.replayed + self.eager
        return self.replayed / steps if steps else 0.0


def graph_key(plan: StepPlan, group_rows: tuple | None = None) -> tuple:
    """What a captured FFN step depends on: rows per peer per micro-batch, and over an
    expert group the rows of every member per micro-batch (its collectives' sizes)."""
    return (plan.rows, group_rows)


class FFNGraphCache:
    """FFN side: capture on a peer's CAPTURE flag (always), replay a known key, else eager."""

    def __init__(self, backend: GraphBackend, max_graphs: int = MAX_FFN_GRAPHS):
        self.backend = backend
        self.max_graphs = max_graphs
        self._graphs: dict[tuple, Any] = {}
        self.stats = GraphStats()
        # per-layer compute graphs at padded row counts, for steps run layer by layer
        # (afd_core.step.ffn_buckets); None until the FFN rank captured them
        self.buckets = None

    def drop_step_graphs(self) -> None:
        """Forget every whole-step graph (their keys run layer by layer until captured
        again); the layer graphs stay."""
        self._graphs.clear()

    def counts(self) -> dict:
        """What the metrics count of this cache, now (see counts_since)."""
        out = {"ffn_graph_replays": self.stats.replayed, "ffn_eager_steps": self.stats.eager}
        if self.buckets is not None:
            out["ffn_bucket_replays"] = self.buckets.stats.replayed
            out["ffn_eager_layers"] = self.buckets.stats.eager
        return out

    def counts_since(self, before: dict) -> dict:
        return {k: v - before.get(k, 0) for k, v in self.counts().items()}

    def __len__(self) -> int:
        return len(self._graphs)

    def run(
        self,
        plan: StepPlan,
        run_layers: Callable[[], Any],
        settle: Callable[[], None],
        group_rows: tuple | None = None,
        eager_only: bool = False,
        watch: Callable[[], None] = lambda: None,
    ) -> Any:
        """Run the step's layers (`run_layers`, which returns the step's failure or None)
        as the key allows; `settle` joins the step's sends (called inside a capture);
        `watch` bounds a replay just launched (its operations ran no Python).
        `run_layers(capturing)`: True inside a capture, whose operations are launched
        together at replay, so it may prefetch (step/ffn.py says why eager steps must not)."""
        key = graph_key(plan, group_rows)
        if plan.flags & ControlFlag.CAPTURE:
            # The peers capture: their operations are recorded, not run, so this side must
            # record too, whatever it holds: replaying or running eagerly would move data
            # nobody sends. vLLM captures a size more than once (its memory profile
            # captures the largest sizes and drops them, then capture_model captures them
            # again): the new graph replaces the old.
            return self._capture(key, run_layers, settle)
        graph = None if eager_only else self._graphs.get(key)
        if graph is not None:
            self._graphs[key] = self._graphs.pop(key)  # most recently used last
            self.backend.replay(graph)
            watch()
            self.stats.replayed += 1
            return None
        self.stats.eager += 1
        return run_layers()

    def _capture(self, key, run_layers, settle):
        self._graphs.pop(key, None)
        while len(self._graphs) >= self.max_graphs:  # the least recently used goes
            self._graphs.pop(next(iter(self._graphs)))
        result: list = []

        def body():
            result.append(run_layers(capturing=True))
            settle()

        graph = self.backend.capture(body)
        self.stats.captured += 1
        failure = result[0] if result else None
        if failure is None:
            self._graphs[key] = graph
        # else a compute error while capturing: the graph would replay it; the key runs
        # eagerly until it is captured again
        return failure

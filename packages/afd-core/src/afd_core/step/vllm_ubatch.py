"""DBO with CUDA graphs: two micro-batches through vLLM's own micro-batching (UBatchWrapper).

AFD's micro-batch executor (step/microbatch.py) runs DBO eagerly, for up to 4 micro-batches.
A step captured in a CUDA graph needs vLLM's `UBatchWrapper` instead: it runs the two
micro-batches on threads that hand over at vLLM's yield (AFD's exchange op calls it, see
afd_core.dbo) and captures both into one graph, replayed after like any other. AFD uses it
on an attention server on CUDA with FULL_DECODE_ONLY graphs and 2 micro-batches; the pieces:

* the attention worker turns vLLM's DBO on (`enable_dbo`) after the config was checked, so
  vLLM builds the wrapper, two metadata builders and two workspaces. vLLM's start-up
  assert that DBO needs a DeepEP/NIXL all2all backend is about the MoE's all2all; an AFD
  attention server holds no MoE layer, and the FFN server runs no DBO: no patch needed;
* at data parallel 1, where vLLM 0.32 never splits (`coordinate_batch_across_dp` returns
  early), the runner decides with vLLM's own rules (`should_ubatch_single_rank`); with
  data parallelism vLLM coordinates the decision across the ranks as it does for itself;
* vLLM's `UBatchWrapper.__call__` asserts data-parallel metadata and builds it for each
  micro-batch (`DPMetadata.make` asserts DP > 1): `AFDUBatchWrapper` makes the same
  decision (capture, replay or run) at DP 1 with no data-parallel metadata, as an unsplit
  step at DP 1 has none, through vLLM's own helpers; with DP > 1 it is vLLM's call;
* no SM partitioning: vLLM's SM control reserves SMs for DeepEP's kernels and caps
  DeepGEMM's while micro-batches overlap; an attention server has no all2all, so the
  wrapper's SM control is a no-op;
* a failure: vLLM's micro-batch threads neither report an exception nor stop the other
  micro-batch, which then yields to a thread that has ended and waits forever. AFD's
  wrapper runs each micro-batch under `_SplitStep`, which keeps the first error and makes
  the others stop at their next yield (afd_core.dbo), then raises it, so the step fails in
  protocol like one split by AFD's executor.

The step wrapper (step/wrapper.py) sends the control message with the micro-batches' rows
from the forward context's `ubatch_slices` and runs the wrapper as one job; `afd_graph_phase`
tells it beforehand whether the wrapper captures, replays or runs eagerly.
"""

from __future__ import annotations

import contextlib
import threading

from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context
from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper
from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds, is_last_ubatch_empty

from afd_core import dbo
from afd_core.capabilities import MICROBATCHES_WITH_GRAPHS
from afd_core.step.graphs import GraphPhase, graph_phase
from afd_core.step.microbatch import MicrobatchAborted

# vLLM's UBatchWrapper runs two micro-batches (ParallelConfig.num_ubatches with enable_dbo)
VLLM_UBATCHES = MICROBATCHES_WITH_GRAPHS


def uses_vllm_ubatching(num_microbatches: int, cudagraph_mode_name: str) -> bool:
    """An attention server on CUDA splits through vLLM's UBatchWrapper when it captures
    graphs and runs DBO; eager DBO stays on AFD's executor (up to 4, changeable at run time)."""
    return num_microbatches > 1 and cudagraph_mode_name == "FULL_DECODE_ONLY"


def should_ubatch_single_rank(
    parallel_config, num_tokens: int, num_tokens_padded: int, uniform_decode: bool
) -> bool:
    """vLLM's micro-batching decision for one data-parallel rank: its thresholds (the same
    check decides which graph sizes are captured split) and no empty last micro-batch."""
    return check_ubatch_thresholds(
        parallel_config, num_tokens, uniform_decode
    ) and not is_last_ubatch_empty(num_tokens, num_tokens_padded, VLLM_UBATCHES)


class AFDUBatchWrapper(UBatchWrapper):
    """vLLM's UBatchWrapper, also at data parallel 1. Not built: `adopt` turns the one
    vLLM's runner built into it."""

    def afd_graph_phase(self, ctx) -> GraphPhase:
        """What __call__ does on the forward about to run (the decision of vLLM's)."""
        mode = ctx.cudagraph_runtime_mode
        slices = ctx.ubatch_slices
        if slices is None:
            if mode is CUDAGraphMode.FULL and ctx.batch_descriptor.num_tokens in self.cudagraphs:
                return GraphPhase.EAGER  # a split graph of this size exists: run it whole
            if mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
                return GraphPhase.EAGER
            return graph_phase(ctx, self.cudagraph_wrapper)
        if mode is not CUDAGraphMode.FULL:
            return GraphPhase.EAGER
        num_tokens = sum(s.num_tokens for s in slices)
        return GraphPhase.REPLAY if num_tokens in self.cudagraphs else GraphPhase.CAPTURE

    def __call__(self, *args, **kwargs):
        ctx = get_forward_context()
        if ctx.ubatch_slices is None or self.vllm_config.parallel_config.data_parallel_size > 1:
            return super().__call__(*args, **kwargs)
        import torch

        phase = self.afd_graph_phase(ctx)
        if phase is GraphPhase.REPLAY:
            from vllm.model_executor.offloader.base import get_offloader

            entry = self.cudagraphs[sum(s.num_tokens for s in ctx.ubatch_slices)]
            get_offloader().sync_prev_onload()
            entry.cudagraph.replay()
            return entry.outputs
        metadata = self._make_ubatch_metadata(
            ubatch_slices=ctx.ubatch_slices,
            attn_metadata=ctx.attn_metadata,
            slot_mapping=ctx.slot_mapping,
            input_ids=kwargs["input_ids"],
            positions=kwargs["positions"],
            intermediate_tensors=kwargs["intermediate_tensors"],
            inputs_embeds=kwargs["inputs_embeds"],
            compute_stream=torch.cuda.current_stream(),
            dp_metadata=[None] * len(ctx.ubatch_slices),
            batch_descriptor=ctx.batch_descriptor,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            is_padding=ctx.is_padding,
        )
        with self.sm_control:
            if phase is GraphPhase.CAPTURE:
                return self._capture_ubatches(metadata, self.runnable)
            return self._run_ubatches(metadata, self.runnable)

    def _run_ubatches(self, ubatch_metadata, model):
        return _SplitStep(model).run(super()._run_ubatches, ubatch_metadata)

    def _capture_ubatches(self, ubatch_metadata, model):
        return _SplitStep(model).run(super()._capture_ubatches, ubatch_metadata)


class _SplitStep:
    """The model as each of one step's micro-batch threads calls it: the first error is
    kept (a released micro-batch's MicrobatchAborted only until a real one comes) and the
    other micro-batches stop at their next yield; `run` raises it after vLLM's threads end."""

    def __init__(self, model):
        self.model = model
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def __call__(self, **inputs):
        try:
            return self.model(**inputs)
        except BaseException as exc:  # noqa: BLE001 - raised by run() in the caller's thread
            with self._lock:
                if self.error is None or (
                    isinstance(self.error, MicrobatchAborted)
                    and not isinstance(exc, MicrobatchAborted)
                ):
                    self.error = exc
            dbo.fail_vllm_split()
            return None

    def run(self, vllm_run, ubatch_metadata):
        dbo.fail_vllm_split(False)
        try:
            out = vllm_run(ubatch_metadata, self)
        except BaseException:
            if self.error is None:
                raise
        finally:
            dbo.fail_vllm_split(False)
        if self.error is not None:
            raise self.error
        return out


def adopt(model):
    """Make the UBatchWrapper vLLM's runner built an AFDUBatchWrapper, without SM control;
    any other model is returned as it is."""
    if isinstance(model, UBatchWrapper) and not isinstance(model, AFDUBatchWrapper):
        model.__class__ = AFDUBatchWrapper
        model.sm_control = contextlib.nullcontext()
    return model

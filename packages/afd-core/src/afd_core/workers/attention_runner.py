"""The AFD attention model runner: vLLM's runner, plus four narrow overrides.

Mixed into the platform's runner class (CPU and CUDA; Ascend later). vLLM 0.32's own
micro-batching is CUDA-only and decides to split only under data parallelism; AFD decides
per step and per rank instead:

* `_determine_batch_execution_and_padding`: vLLM's decision with its micro-batching off
  (no data-parallel padding for it either), then AFD's plan from the scheduled requests
  (whole requests, thresholds, m); `allow_microbatching` is vLLM's veto when a request reads
  a prefix another request of the same step is still writing;
* `_build_attention_metadata`: vLLM builds one attention metadata per planned micro-batch
  with its own slicing helpers (`split_attn_metadata`);
* `_dummy_run`: marks dummy and profiling forwards, which run unsplit, for the control
  message's flags; a dummy step the FFN rank failed is logged, not fatal;
* `execute_model`: a step that failed but left the protocol in step (AFDStepError) returns
  an output that fails exactly that step's requests (see patches/step_failure.py); the
  engine goes on.
"""

from __future__ import annotations

import contextlib

from afd_core.connectors.base import AFDStepError
from afd_core.log import get_logger
from afd_core.step.attention import STEP_FAILURE_ATTR
from afd_core.step.graphs import find_graph_wrapper
from afd_core.step.wrapper import AFDStepWrapper, AttentionStepEngine, StepKind

logger = get_logger(__name__)


class AFDAttentionRunnerMixin:
    afd_engine: AttentionStepEngine | None = None

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        allow = kwargs.pop("allow_microbatching", True)
        result = super()._determine_batch_execution_and_padding(
            *args, allow_microbatching=False, **kwargs
        )
        engine = self.afd_engine
        if engine is not None:
            engine.plan = None
            if allow and engine.kind is StepKind.REAL and engine.policy.enabled:
                num_reqs = kwargs["num_reqs"]
                tokens = kwargs["num_scheduled_tokens_np"][:num_reqs].tolist()
                engine.plan = engine.policy.plan(tokens)
        return result

    def _build_attention_metadata(self, *args, **kwargs):
        engine = self.afd_engine
        plan = engine.plan if engine is not None else None
        if (
            plan is not None
            and kwargs.get("ubatch_slices") is None
            and not kwargs.get("for_cudagraph_capture")
        ):
            from vllm.v1.worker.ubatch_utils import UBatchSlice

            kwargs["ubatch_slices"] = [
                UBatchSlice(slice(s.req_start, s.req_stop), slice(s.token_start, s.token_stop))
                for s in plan
            ]
            with _no_block_table_only_rebuilds(self.attn_groups):
                return super()._build_attention_metadata(*args, **kwargs)
        return super()._build_attention_metadata(*args, **kwargs)

    def _dummy_run(self, num_tokens: int, *args, **kwargs):
        engine = self.afd_engine
        if engine is None:
            return super()._dummy_run(num_tokens, *args, **kwargs)
        engine.kind = StepKind.PROFILE if kwargs.get("is_profile") else StepKind.DUMMY
        try:
            return super()._dummy_run(num_tokens, *args, **kwargs)
        except AFDStepError as exc:
            if engine.kind is StepKind.PROFILE:
                raise
            # an idle data-parallel rank's dummy batch: nothing depends on its output
            logger.error("AFD: a dummy step failed and was skipped: %s", exc)
            import torch

            return torch.empty(0), torch.empty(0)
        finally:
            engine.kind = StepKind.REAL

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        except AFDStepError as exc:
            return self._afd_failed_step_output(scheduler_output, exc)

    def _afd_failed_step_output(self, scheduler_output, exc: AFDStepError):
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(scheduler_output.num_scheduled_tokens)
        logger.error(
            "AFD: the step of %d request(s) failed and they finish with an error; the "
            "deployment goes on: %s",
            len(req_ids),
            exc,
        )
        self.execute_model_state = None
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[] for _ in req_ids],
        )
        setattr(output, STEP_FAILURE_ATTR, str(exc))
        return output

    def get_model(self):
        model = super().get_model()
        if isinstance(model, AFDStepWrapper):
            model = model.unwrap()
            # vLLM's graph wrapper sits inside AFD's, where vLLM's get_model cannot see it
            if find_graph_wrapper(model) is not None:
                model = model.unwrap()
        return model


@contextlib.contextmanager
def _no_block_table_only_rebuilds(attn_groups):
    """vLLM 0.32's `_build_attention_metadata` caches one build per (KV spec, builder type)
    and, for builders that support it, serves later builds of the same call by swapping
    only the block table. The key has no micro-batch, so micro-batch 1 would get micro-batch
    0's metadata (sequence lengths, query starts) with its own block table. No CPU builder
    supports the swap (CPU_ATTN, CPU_MLA), FlashAttention on CUDA does: while AFD builds
    per-micro-batch metadata, every builder builds in full."""
    builders = [b for groups in attn_groups for g in groups for b in g.metadata_builders]
    for b in builders:
        b.supports_update_block_table = False  # shadows the class attribute
    try:
        yield
    finally:
        for b in builders:
            b.__dict__.pop("supports_update_block_table", None)

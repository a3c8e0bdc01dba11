"""The AFD attention model runner: vLLM's runner, plus four narrow overrides.

Mixed into the platform's V1 runner class (CPU, CUDA and Ascend); on vLLM's model runner
V2 see attention_runner_v2.py (AFDRunnerCommon below is shared by both). vLLM 0.32's own
micro-batching is CUDA-only and decides to split only under data parallelism; AFD decides
per step and per rank instead:

* `_determine_batch_execution_and_padding`: vLLM's decision with its micro-batching off
  (no data-parallel padding for it either), then AFD's plan from the scheduled requests
  (whole requests, thresholds, m); `allow_microbatching` is vLLM's veto when a request reads
  a prefix another request of the same step is still writing;
  With DBO and CUDA graphs vLLM's UBatchWrapper splits instead (step/vllm_ubatch.py): vLLM
  decides under data parallelism, AFD with vLLM's rules at data parallel 1;
* `_build_attention_metadata`: vLLM builds one attention metadata per planned micro-batch
  with its own slicing helpers (`split_attn_metadata`), never reusing one micro-batch's;
* `_dummy_run`: marks dummy and profiling forwards, which run unsplit, for the control
  message's flags; a failed data-parallel dummy batch (an idle rank's step) is logged,
  any other failed dummy forward (profiling, warm-up, graph capture) is raised;
* `execute_model`: a step that failed but left the protocol in step (AFDStepError) returns
  an output that fails exactly that step's requests (see patches/step_failure.py); the
  engine goes on. With a KV connector (prefill/decode, docs/pd.md) that output carries
  what vLLM's connector context reported for the step (`maybe_get_kv_connector_output`:
  finished sends and receives, load errors, stats): vLLM's context always runs its
  clean-up, also when the forward raises, but its report went with the exception, and a
  finished receive it held would leave its request waiting for its KV for ever;
* a step in which the connector loads KV synchronously (`has_sync_kv_loads`: vLLM's
  ExampleConnector) runs unsplit: the connector reads the step's forward context in
  `start_load_kv`, before the forward, and a split step's context holds one attention
  metadata per micro-batch (a list), which ExampleConnector skips without loading.
"""

from __future__ import annotations

import contextlib

from afd_core.connectors.base import AFDStepError
from afd_core.log import get_logger
from afd_core.step.attention import STEP_FAILURE_ATTR
from afd_core.step.graphs import find_graph_wrapper
from afd_core.step.wrapper import AFDStepWrapper, AttentionStepEngine, StepKind

logger = get_logger(__name__)


class AFDRunnerCommon:
    """What AFD's attention runner overrides alike on vLLM's V1 runner and on MRV2
    (attention_runner_v2.py): dummy and profiling forwards, the failed step's output, and
    the model behind AFD's step wrapper."""

    afd_engine: AttentionStepEngine | None = None

    def afd_attached(self) -> None:
        """Called once AFD's step wrapper is on `self.model` (role_workers)."""

    # set by the worker around vLLM's execute_dummy_batch: an idle data-parallel rank's
    # step, the only dummy forward whose failure nothing depends on
    afd_dp_dummy_batch = False

    def _dummy_run(self, num_tokens: int, *args, **kwargs):
        engine = self.afd_engine
        if engine is None:
            return super()._dummy_run(num_tokens, *args, **kwargs)
        engine.kind = StepKind.PROFILE if kwargs.get("is_profile") else StepKind.DUMMY
        try:
            return super()._dummy_run(num_tokens, *args, **kwargs)
        except AFDStepError as exc:
            # profiling, compile warm-up and graph capture: vLLM goes on with what they
            # built (a size with no graph would be announced as a capture again at run
            # time), so their failure stops the start-up with its cause
            if not self.afd_dp_dummy_batch or kwargs.get("is_graph_capturing"):
                raise
            logger.error("AFD: a data-parallel dummy step failed and was skipped: %s", exc)
            import torch

            return torch.empty(0), torch.empty(0)
        finally:
            engine.kind = StepKind.REAL

    # this step: the KV connector loads synchronously (no split)
    _afd_sync_kv_loads = False

    def _afd_failed_step_output(self, scheduler_output, exc: AFDStepError, kv_output=None):
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
        # the step's KV transfers went on: the scheduler must hear of them like any step's
        output.kv_connector_output = kv_output
        setattr(output, STEP_FAILURE_ATTR, str(exc))
        return output

    def get_model(self):
        model = super().get_model()
        if isinstance(model, AFDStepWrapper):
            model = model.unwrap()
            # vLLM's wrapper (graphs, micro-batches) sits inside AFD's, where vLLM's
            # get_model cannot see it
            if find_graph_wrapper(model) is not None or _is_ubatch_wrapper(model):
                model = model.unwrap()
        return model


class AFDAttentionRunnerMixin(AFDRunnerCommon):
    """On vLLM's V1 runner (`v1/worker/gpu_model_runner.py` and the platforms' subclasses)."""

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        engine = self.afd_engine
        if engine is not None and engine.vllm_ubatching:
            return self._afd_vllm_ubatching_decision(args, kwargs)
        allow = kwargs.pop("allow_microbatching", True) and not self._afd_sync_kv_loads
        result = super()._determine_batch_execution_and_padding(
            *args, allow_microbatching=False, **kwargs
        )
        engine = self.afd_engine
        if engine is not None:
            engine.plan = None
            if allow and engine.kind is StepKind.REAL and engine.policy.enabled:
                num_reqs = kwargs["num_reqs"]
                tokens = kwargs["num_scheduled_tokens_np"][:num_reqs].tolist()
                engine.plan_step(tokens)
        return result

    def _afd_vllm_ubatching_decision(self, args, kwargs):
        """vLLM's UBatchWrapper splits (DBO with graphs): under data parallelism vLLM
        coordinates the decision across the ranks; at data parallel 1, where vLLM 0.32
        never splits, AFD applies vLLM's rules (the ones its graph capture used)."""
        from afd_core.step.vllm_ubatch import should_ubatch_single_rank

        allow = kwargs.pop("allow_microbatching", True) and self.afd_engine.policy.enabled
        allow = allow and not self._afd_sync_kv_loads
        determine = super()._determine_batch_execution_and_padding
        if self.parallel_config.data_parallel_size > 1:
            return determine(*args, allow_microbatching=allow, **kwargs)
        mode, desc, _, across, stats = determine(*args, allow_microbatching=False, **kwargs)
        uniform_decode = self._is_uniform_decode(
            max_num_scheduled_tokens=kwargs["max_num_scheduled_tokens"],
            uniform_decode_query_len=self.uniform_decode_query_len,
            num_tokens=kwargs["num_tokens"],
            num_reqs=kwargs["num_reqs"],
            force_uniform_decode=kwargs.get("force_uniform_decode"),
        )
        split = allow and should_ubatch_single_rank(
            self.parallel_config, kwargs["num_tokens"], desc.num_tokens, uniform_decode
        )
        return mode, desc, split, across, stats

    def _build_attention_metadata(self, *args, **kwargs):
        engine = self.afd_engine
        plan = engine.plan if engine is not None else None
        if kwargs.get("for_cudagraph_capture"):
            return super()._build_attention_metadata(*args, **kwargs)
        if plan is not None and kwargs.get("ubatch_slices") is None:
            from vllm.v1.worker.ubatch_utils import UBatchSlice

            kwargs["ubatch_slices"] = [
                UBatchSlice(slice(s.req_start, s.req_stop), slice(s.token_start, s.token_stop))
                for s in plan
            ]
        if kwargs.get("ubatch_slices") is not None:  # AFD's plan or vLLM's own split
            with _no_block_table_only_rebuilds(self.attn_groups):
                return super()._build_attention_metadata(*args, **kwargs)
        return super()._build_attention_metadata(*args, **kwargs)

    # what vLLM's connector context reported for this step (None without a connector, or
    # before the forward)
    _afd_kv_output = None

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._afd_sync_kv_loads = bool(getattr(scheduler_output, "has_sync_kv_loads", False))
        self._afd_kv_output = None
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        except AFDStepError as exc:
            kv_output, self._afd_kv_output = self._afd_kv_output, None
            return self._afd_failed_step_output(scheduler_output, exc, kv_output)
        finally:
            self._afd_sync_kv_loads = False

    @contextlib.contextmanager
    def maybe_get_kv_connector_output(self, scheduler_output, *args, **kwargs):
        """vLLM's connector context around the forward (a static method there, called on
        the runner), keeping its report: its clean-up fills it in also when the forward
        raises, and a failed step's output must carry it."""
        with super().maybe_get_kv_connector_output(scheduler_output, *args, **kwargs) as out:
            self._afd_kv_output = out
            yield out


def _is_ubatch_wrapper(model) -> bool:
    """vLLM wraps the model in its UBatchWrapper whenever it builds for micro-batches (AFD
    sets `ubatch_size` for its own split), graphs or not."""
    from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper

    return isinstance(model, UBatchWrapper)


@contextlib.contextmanager
def _no_block_table_only_rebuilds(attn_groups):
    """vLLM 0.32's `_build_attention_metadata` caches one build per (KV spec, builder type)
    and, for builders that support it, serves later builds of the same call by swapping
    only the block table. The key has no micro-batch, so micro-batch 1 would get micro-batch
    0's metadata (sequence lengths, query starts) with its own block table; vLLM's own
    micro-batching (UBatchWrapper) goes through the same cache. No CPU builder supports the
    swap (CPU_ATTN, CPU_MLA), FlashAttention on CUDA does: while a step's metadata is built
    per micro-batch, every builder builds in full."""
    builders = [b for groups in attn_groups for g in groups for b in g.metadata_builders]
    for b in builders:
        b.supports_update_block_table = False  # shadows the class attribute
    try:
        yield
    finally:
        for b in builders:
            b.__dict__.pop("supports_update_block_table", None)

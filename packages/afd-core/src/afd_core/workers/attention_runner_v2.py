"""The AFD attention model runner on vLLM's model runner V2 (MRV2, `v1/worker/gpu/`).

vLLM 0.32 runs MRV2 by default wherever Triton runs (`VllmConfig.use_v2_model_runner`), and
its CPU build subclasses it (`v1/worker/cpu/model_runner.py`). The AFD step itself needs
nothing of the runner: `runner.model` is AFD's step wrapper on both runners, so every
forward (real step, data-parallel dummy batch, profiling run) is one AFD step. What
differs from V1 (attention_runner.py) is where a step is planned and how it fails:

* micro-batches: MRV2 micro-batches only through its `UBatchRunner` (vLLM's DBO: CUDA
  streams, data parallel > 1, split at the token midpoint decided across the DP ranks);
  AFD never lets vLLM build it for an attention server (patches/mrv2_ubatch_runner.py:
  its threads would call AFD's step wrapper once per micro-batch). AFD plans each step
  from the scheduled requests, as on V1, and has vLLM build one attention metadata per
  micro-batch with MRV2's own helpers: `_slice_input_batch` (the sub-batch vLLM's
  UBatchRunner builds) and the model state's `prepare_attn(..., ubatch_idx=i)` on the
  i-th metadata builder. The hook is the model state's `prepare_attn`, the one call of
  MRV2's `execute_model` that builds a step's metadata: AFD wraps it on this runner's
  model state (an instance attribute, `_hook_model_state`); the step wrapper then finds a
  list of metadata in the forward context and splits, as on V1;
* dummy and profiling runs: MRV2's `_dummy_run` calls `execute_model(dummy_run=True)`;
  AFD's `_dummy_run` (shared with V1) marks the step's kind;
* a failed step: MRV2's `execute_model` returns nothing and `sample_tokens` makes the
  output; a step that raised AFDStepError returns the failed step's output from
  `execute_model` (the engine core takes it when `sample_tokens` has nothing, as on V1),
  after finishing what the KV connector started for the step (`finish_forward`,
  `post_forward`: MRV2 has no context that does it when the forward raises).
"""

from __future__ import annotations

import numpy as np

from afd_core.connectors.base import AFDStepError
from afd_core.step.wrapper import StepKind
from afd_core.workers.attention_runner import AFDRunnerCommon


class AFDAttentionRunnerV2Mixin(AFDRunnerCommon):
    _afd_ubatch_buffers: list | None = None

    def afd_attached(self) -> None:
        self._hook_model_state()

    def _hook_model_state(self) -> None:
        state = self.model_state
        plain = state.prepare_attn

        def prepare_attn(input_batch, cudagraph_mode, block_tables, slot_mappings, *args, **kw):
            plan = self._afd_plan(input_batch, cudagraph_mode, block_tables, kw)
            if plan is None:
                return plain(input_batch, cudagraph_mode, block_tables, slot_mappings, *args, **kw)
            return self._afd_split_metadata(
                plain, plan, input_batch, cudagraph_mode, block_tables, slot_mappings, args, kw
            )

        state.prepare_attn = prepare_attn

    def _afd_plan(self, input_batch, cudagraph_mode, block_tables, kw):
        from vllm.config import CUDAGraphMode

        engine = self.afd_engine
        if engine is None:
            return None
        engine.plan = None
        if (
            engine.kind is not StepKind.REAL
            or kw.get("for_capture")
            or kw.get("ubatch_idx", 0)
            or not engine.policy.enabled
            or self._afd_sync_kv_loads
            or cudagraph_mode != CUDAGraphMode.NONE
        ):
            return None
        num_reqs = input_batch.num_reqs
        tokens = input_batch.num_scheduled_tokens[:num_reqs]
        if not self._afd_may_split(input_batch, tokens, block_tables):
            return None
        engine.plan_step(tokens.tolist())
        return engine.plan

    def _afd_may_split(self, input_batch, query_lens, block_tables) -> bool:
        """vLLM's V1 veto (`GPUModelRunner._allow_microbatching`) on MRV2's batch: a request
        admitted on a prefix another request of the step is only writing now must run in
        the same micro-batch as its writer (split, the reader could attend over blocks the
        writer has not filled in yet)."""
        num_reqs = len(query_lens)
        if num_reqs < 2:
            return True
        computed = input_batch.num_computed_tokens_np[:num_reqs]
        readers = np.flatnonzero((query_lens > 1) & (computed > 0))
        if readers.size == 0:
            return True
        kv_groups = self.kv_cache_config.kv_cache_groups
        for table, group in zip(block_tables, kv_groups, strict=False):
            block_size = group.kv_cache_spec.block_size
            rows = table[:num_reqs].cpu().numpy()
            start = computed // block_size
            stop = (computed + query_lens + block_size - 1) // block_size
            written = np.unique(
                np.concatenate(
                    [rows[r, start[r] : min(stop[r], rows.shape[1])] for r in range(num_reqs)]
                )
            )
            for reader in readers:
                whole = computed[reader] // block_size
                if np.isin(rows[reader, :whole], written).any():
                    return False
        return True

    def _afd_split_metadata(
        self, plain, plan, input_batch, cudagraph_mode, block_tables, slot_mappings, args, kw
    ) -> list:
        """One attention metadata per planned micro-batch, built as vLLM's MRV2 UBatchRunner
        builds them (vllm/v1/worker/gpu/ubatch_utils.py: UBatchRunner.prepare)."""
        from vllm.v1.worker.gpu.ubatch_utils import _slice_input_batch
        from vllm.v1.worker.ubatch_utils import UBatchSlice

        buffers = self._afd_buffers(len(plan))
        metadata = []
        for i, s in enumerate(plan):
            ubatch_slice = UBatchSlice(
                slice(s.req_start, s.req_stop), slice(s.token_start, s.token_stop)
            )
            qsl, seq_lens = buffers[i]
            ubatch = _slice_input_batch(input_batch, ubatch_slice, qsl, seq_lens)
            metadata.append(
                plain(
                    ubatch,
                    cudagraph_mode,
                    tuple(t[ubatch_slice.request_slice] for t in block_tables),
                    slot_mappings[:, ubatch_slice.token_slice],
                    *args,
                    **{**kw, "ubatch_idx": i},
                )
            )
        return metadata

    def _afd_buffers(self, n: int) -> list:
        """Per micro-batch: its rebased query starts and sequence lengths (vLLM's helper
        writes into buffers its caller owns; kept for the runner's life)."""
        import torch

        have = self._afd_ubatch_buffers or []
        while len(have) < n:
            have.append(
                (
                    torch.zeros(self.max_num_reqs + 1, dtype=torch.int32, device=self.device),
                    torch.zeros(self.max_num_reqs, dtype=torch.int32, device=self.device),
                )
            )
        self._afd_ubatch_buffers = have
        return have

    def execute_model(self, scheduler_output, intermediate_tensors=None, *args, **kwargs):
        if kwargs.get("dummy_run"):  # MRV2's _dummy_run: its failure goes to _dummy_run
            return super().execute_model(scheduler_output, intermediate_tensors, *args, **kwargs)
        self._afd_sync_kv_loads = bool(getattr(scheduler_output, "has_sync_kv_loads", False))
        try:
            return super().execute_model(scheduler_output, intermediate_tensors, *args, **kwargs)
        except AFDStepError as exc:
            return self._afd_failed_step_output(
                scheduler_output, exc, self._afd_finish_kv_connector(scheduler_output)
            )
        finally:
            self._afd_sync_kv_loads = False
            if self.afd_engine is not None:
                self.afd_engine.plan = None

    def _afd_finish_kv_connector(self, scheduler_output):
        """What MRV2's execute_model/sample_tokens do with the connector after a forward,
        for a forward that raised: the step's loads and saves end, and the scheduler hears
        of the transfers that finished (else their requests wait for their KV for ever)."""
        self.kv_connector.finish_forward()
        return self.kv_connector.post_forward(scheduler_output.finished_req_ids)

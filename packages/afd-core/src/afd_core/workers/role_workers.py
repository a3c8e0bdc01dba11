"""What every platform's AFD worker adds to that platform's vLLM worker, as mixins.

A platform module (cpu_worker, cuda_worker) binds them to its vLLM worker and model runner:
`class AFDCPUAttentionWorker(AttentionWorkerMixin, CPUWorker)`. The platform sets
`afd_runner_classes`: for each model runner vLLM may build there (its V1 runner, its model
runner V2), the same runner with AFD's attention-runner overrides (or overrides
`afd_runner_class` to make one when it is needed); and may override the FFN thread's set-up
and the FFN graph cache.
"""

from __future__ import annotations

import contextlib

from vllm.distributed import get_tensor_model_parallel_rank
from vllm.forward_context import set_forward_context
from vllm.v1.worker.worker_base import CompilationTimes

from afd_core.config import AUTO, coerce_microbatches, require_afd_config
from afd_core.connectors.protocol.control import MAX_MICROBATCHES
from afd_core.step.split import SplitPolicy
from afd_core.workers.roles import (
    AttentionRole,
    FFNRole,
    afd_architecture,
    terminate_this_process,
)
from afd_core.workers.selection import assert_compatible_afd_stack


class _RoleWorkerMixin:
    afd = None  # the AttentionRole / FFNRole, set in load_model

    def init_device(self):
        assert_compatible_afd_stack(self.vllm_config, self)
        super().init_device()

    def shutdown(self) -> None:
        if self.afd is not None:
            self.afd.close()
        super().shutdown()


class AttentionWorkerMixin(_RoleWorkerMixin):
    """A normal worker whose model sends every layer's MLP/MoE to the FFN ranks."""

    # vLLM's model runner class -> that runner with AFD's overrides (AFDAttentionRunnerMixin
    # on V1, AFDAttentionRunnerV2Mixin on model runner V2)
    afd_runner_classes: dict[type, type]

    def afd_runner_class(self, built: type) -> type | None:
        """AFD's runner for the runner vLLM built, or None if AFD has none for it."""
        return self.afd_runner_classes.get(built)

    def afd_vllm_ubatching(self, num_microbatches: int) -> bool:
        """Whether vLLM's UBatchWrapper splits the steps (a platform with graphs: CUDA)
        rather than AFD's micro-batch executor."""
        return False

    def init_device(self):
        afd = require_afd_config(self.vllm_config)
        m = afd.max_microbatches
        self.vllm_ubatching = self.afd_vllm_ubatching(m)
        if self.vllm_ubatching:
            # vLLM's DBO: its UBatchWrapper, 2 metadata builders and workspaces (set after
            # the config checks: their all2all-backend assert is for MoE layers, and this
            # server has none; see afd_core.step.vllm_ubatch)
            from afd_core.step.vllm_ubatch import VLLM_UBATCHES

            self.max_microbatches = VLLM_UBATCHES
            self.parallel_config.enable_dbo = True
        else:
            # vLLM builds one attention-metadata builder per micro-batch it may run; with
            # DBO on, build them for up to 4 so the count can also change at run time.
            # vLLM's own micro-batching stays off, AFD's runner does the splitting.
            self.max_microbatches = MAX_MICROBATCHES if m > 1 else 1
            if self.max_microbatches > 1:
                self.parallel_config.ubatch_size = self.max_microbatches
        super().init_device()
        built = type(self.model_runner)
        afd_runner = self.afd_runner_class(built)
        if afd_runner is None:
            raise RuntimeError(
                f"AFD attention worker: vLLM built {built.__module__}.{built.__name__}, a "
                "model runner AFD has no attention runner for (AFD runs on vLLM's V1 and V2 "
                "runners of the CPU and CUDA platforms and vLLM-Ascend's)"
            )
        # AFD's runner only overrides methods: make vLLM's runner one, in place
        self.model_runner.__class__ = afd_runner

    def load_model(self, *args, **kwargs) -> None:
        with afd_architecture(self.model_config):
            super().load_model(*args, **kwargs)
        self.afd = AttentionRole(self.vllm_config, get_tensor_model_parallel_rank())
        self.afd.attach(self.model_runner, self.max_microbatches, self.vllm_ubatching)
        self.model_runner.afd_attached()

    def compile_or_warm_up_model(self):
        try:
            return super().compile_or_warm_up_model()
        finally:
            # from here on the server serves: steps are bounded by timeout_s again
            if self.afd is not None and self.afd.engine is not None:
                self.afd.engine.starting_up = False

    def execute_dummy_batch(self) -> None:
        # an idle data-parallel rank's step: its failure may be skipped (attention_runner)
        self.model_runner.afd_dp_dummy_batch = True
        try:
            super().execute_dummy_batch()
        finally:
            self.model_runner.afd_dp_dummy_batch = False

    # -- reachable through vLLM's /collective_rpc (VLLM_SERVER_DEV_MODE=1) -----------------
    def afd_step_stats(self) -> dict:
        """What this attention rank ran: steps by kind and by number of micro-batches."""
        engine = self.afd.engine
        tuner = {"tuner": engine.tuner.as_dict()} if engine.tuner is not None else {}
        return {
            "rank": self.afd.rank,
            "policy": str(engine.policy),
            **engine.stats.as_dict(),
            **tuner,
        }

    def afd_set_microbatching(
        self,
        num_microbatches: str,
        decode_token_threshold: str = "",
        prefill_token_threshold: str = "",
    ) -> dict:
        """Change m (1..4, up to what the server was started for, or "auto": chosen per
        step) and the thresholds."""
        engine = self.afd.engine
        old = engine.policy
        try:  # the config's rule: 1..4 or "auto", any case
            m = coerce_microbatches(num_microbatches)
        except ValueError as exc:
            raise ValueError(f"num_microbatches={num_microbatches!r}: {exc}") from None
        adaptive = m == AUTO
        engine.set_policy(
            SplitPolicy(
                num_microbatches=engine.max_microbatches if adaptive else m,
                decode_token_threshold=int(decode_token_threshold or old.decode_token_threshold),
                prefill_token_threshold=int(prefill_token_threshold or old.prefill_token_threshold),
            ),
            adaptive=adaptive,
        )
        return self.afd_step_stats()

    def afd_inject_step_failure(self, reason: str = "drill") -> str:
        """Make the next real step fail on this rank (drills and tests): its requests get
        an error and the deployment goes on."""
        self.afd.engine.inject_failure(reason)
        return f"attention rank {self.afd.rank}: the next step fails ({reason})"

    # -- called by the API server's POST /fault_tolerance/apply (afd_core/fault_tolerance.py)
    def afd_retry_ffn(self) -> dict:
        """Without its FFN rank: try to be served again now rather than at the next retry
        (connectors/admission/ffn_return.py); `retried` False while an FFN rank serves this rank."""
        retry = getattr(self.afd.connector, "retry_ffn_now", None)
        return {"rank": self.afd.rank, "retried": bool(retry is not None and retry())}


class FFNWorkerMixin(_RoleWorkerMixin):
    """Holds only MLP/MoE weights and no KV cache; a thread serves the attention ranks."""

    def afd_thread_context(self) -> contextlib.AbstractContextManager:
        """Entered by the FFN serving thread before it serves (a device worker: its device
        and its own stream)."""
        return contextlib.nullcontext()

    def afd_graph_cache(self):
        """The FFN side's device-graph cache, or None (eager)."""
        return None

    # (rows, token_ids) -> the context every FFN call runs in, or None for none (Ascend:
    # its MoE reads the call's token count and token ids from its forward context)
    afd_layer_context = None

    def load_model(self, *args, **kwargs) -> None:
        with afd_architecture(self.model_config):
            super().load_model(*args, **kwargs)
        self.afd = FFNRole(self.vllm_config, get_tensor_model_parallel_rank())
        self.afd.attach(
            self.model_runner.get_model(),  # the model itself, inside any graph wrapper
            lambda: set_forward_context(None, self.vllm_config),
            self.afd_graph_cache(),
            self.afd_layer_context,
        )
        self.afd.start(on_fatal=terminate_this_process, thread_context=self.afd_thread_context)

    def get_kv_cache_spec(self):
        return {}  # an attention-free engine: vLLM then allocates and schedules nothing

    def initialize_from_config(self, kv_cache_config) -> None:
        return None

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def execute_model(self, *args, **kwargs):
        raise RuntimeError(
            "AFD FFN worker: this server computes the FFN half for its attention servers and "
            "runs no requests of its own; send requests to an attention server"
        )

    sample_tokens = execute_model

    # -- reachable through vLLM's /collective_rpc (VLLM_SERVER_DEV_MODE=1) -----------------
    def afd_step_stats(self) -> dict:
        return self.afd.stats()

    def afd_inject_step_failure(self, layer: str = "0", reason: str = "drill") -> str:
        """Make the next step's FFN compute fail at `layer` (drills and tests; with tensor
        parallelism TP rank 0 decides for its group)."""
        self.afd.inject_failure(int(layer), reason)
        return f"FFN rank {self.afd.rank}: the next step fails at layer {layer} ({reason})"

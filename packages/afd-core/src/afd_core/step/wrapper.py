"""The step wrapper around the attention model: every forward is one AFD step.

vLLM's model runner calls `runner.model(...)` for real steps, data-parallel dummy batches
and profiling runs alike; AFD replaces `runner.model` by `AFDStepWrapper`, so each of those
forwards sends exactly one control message, from outside the model (a forward hook inside
it would not run under CUDA-graph replay or in micro-batch threads). When the runner planned
micro-batches for the step (`AttentionStepEngine.plan`, set from the scheduled requests by
the AFD runner, which also had vLLM build one attention metadata per micro-batch), the
wrapper slices the inputs, gives each micro-batch its own forward context, and runs them on
the micro-batch executor; the outputs are concatenated in order, so vLLM's logits indices
stay valid. With DBO and CUDA graphs vLLM splits instead (step/vllm_ubatch.py): the forward
context carries vLLM's `ubatch_slices`, the wrapper announces their rows and calls vLLM's
UBatchWrapper once, which runs (or captures, or replays) both micro-batches.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from afd_core.connectors.base import AFDConnector
from afd_core.connectors.protocol.control import ControlFlag
from afd_core.log import get_logger
from afd_core.step.attention import AttentionStepDriver
from afd_core.step.graphs import GraphPhase, graph_phase
from afd_core.step.microbatch import MicrobatchExecutor
from afd_core.step.sequence_split import SequenceSplit
from afd_core.step.split import MicrobatchSlice, SplitPolicy, split_requests
from afd_core.step.tuner import Choice, MicrobatchTuner

logger = get_logger(__name__)


class StepKind(enum.Enum):
    """What the runner is about to run; travels as the control message's flags."""

    REAL = ControlFlag.NONE
    DUMMY = ControlFlag.DUMMY  # data-parallel dummy batch of an idle rank
    PROFILE = ControlFlag.PROFILE  # vLLM's memory-profiling run


@dataclass
class StepStats:
    """What this attention rank ran, for `afd_step_stats` and the logs."""

    steps: int = 0
    failed: int = 0
    by_kind: Counter = field(default_factory=Counter)
    # real steps by number of micro-batches; rows of the last split step
    by_microbatches: Counter = field(default_factory=Counter)
    last_split_rows: tuple[int, ...] = ()
    # real steps: tokens forwarded, and rows this rank exchanged per layer (its share of
    # them over attention tensor parallel)
    tokens: int = 0
    rows: int = 0
    by_graph: Counter = field(default_factory=Counter)  # steps by GraphPhase

    def as_dict(self) -> dict:
        return {
            "by_graph": {p.value: n for p, n in self.by_graph.items()},
            "steps": self.steps,
            "tokens": self.tokens,
            "rows": self.rows,
            "failed": self.failed,
            "by_kind": {k.name.lower(): n for k, n in self.by_kind.items()},
            "by_microbatches": {str(m): n for m, n in sorted(self.by_microbatches.items())},
            "last_split_rows": list(self.last_split_rows),
        }


class AttentionStepEngine:
    """Per attention worker: the connector's step driver, the split policy, the plan of the
    next forward and what ran."""

    def __init__(
        self,
        connector: AFDConnector,
        vllm_config,
        policy: SplitPolicy,
        max_microbatches: int = 1,
        sequence_split: SequenceSplit | None = None,
    ):
        self.vllm_config = vllm_config
        # over attention tensor parallel: this TP rank announces (and sends) its share
        self.sequence_split = sequence_split
        self.policy = policy
        # vLLM built this many attention-metadata builders per attention group
        self.max_microbatches = max_microbatches
        self.plan: list[MicrobatchSlice] | None = None
        # num_microbatches "auto": m chosen per step from measured steps, and the choice
        # for the next forward (to record its time)
        self.tuner: MicrobatchTuner | None = None
        self._measured: MicrobatchTuner | None = None  # kept while m is fixed for a while
        self.choice: Choice | None = None
        self._planned_at = 0.0
        self.kind = StepKind.REAL
        # until the worker's compile/warm-up is done: steps carry STARTUP (their first
        # forward may compile for minutes; both sides bound them by startup_timeout_s)
        self.starting_up = True
        self.stats = StepStats()
        self._contexts: list[Any] = []
        self._fail_next: str | None = None  # a drill: fail the next real step (see inject)
        self.driver = AttentionStepDriver(connector, MicrobatchExecutor(on_resume=self._resume))
        self._lock = threading.Lock()
        # vLLM's graph wrapper around the model (FULL_DECODE_ONLY on CUDA), else None
        self.graph_wrapper = None
        # vLLM's UBatchWrapper splits the steps (DBO with graphs), not AFD's plan
        self.vllm_ubatching = False

    def set_policy(self, policy: SplitPolicy, adaptive: bool = False) -> None:
        """Micro-batching from now on: `policy`, with m chosen per step up to its m when
        `adaptive` (going back to it keeps what was measured before, for the same most m)."""
        if adaptive and self.vllm_ubatching:
            raise ValueError(
                "num_microbatches 'auto': this attention server's steps are split by vLLM's "
                "UBatchWrapper (graphs), which splits every captured step alike; allowed: a "
                f"fixed num_microbatches 1 or {self.max_microbatches}"
            )
        if self.vllm_ubatching and (
            policy.num_microbatches not in (1, self.max_microbatches)
            or policy.decode_token_threshold != self.policy.decode_token_threshold
            or policy.prefill_token_threshold != self.policy.prefill_token_threshold
        ):
            raise ValueError(
                f"{policy}: this attention server captured its graphs split by vLLM's "
                f"UBatchWrapper for {self.max_microbatches} micro-batches at its start-up "
                "thresholds; allowed at run time: num_microbatches 1 (off) or "
                f"{self.max_microbatches}, thresholds unchanged (restart to change them)"
            )
        if policy.num_microbatches > self.max_microbatches:
            raise ValueError(
                f"num_microbatches={policy.num_microbatches}, but this attention server was "
                f"started for at most {self.max_microbatches}; start it with --enable-dbo to "
                "change the number of micro-batches at run time (up to 4)"
            )
        self.policy = policy
        kept = self._measured
        if adaptive and (kept is None or kept.max_microbatches != policy.num_microbatches):
            self._measured = kept = MicrobatchTuner(policy.num_microbatches)
        self.tuner = kept if adaptive else None
        self.plan, self.choice = None, None
        logger.info(
            "AFD attention rank %d: micro-batching %s%s",
            self.rank,
            policy,
            " (m chosen per step)" if adaptive else "",
        )

    def plan_step(self, tokens_per_request: list[int]) -> None:
        """Plan the next forward's micro-batches from its scheduled tokens per request."""
        self.choice = None
        if self.tuner is None:
            self.plan = self.policy.plan(tokens_per_request)
            return
        if not self.policy.splittable(tokens_per_request):
            self.plan = None
            return
        self.choice = self.tuner.choose(tokens_per_request)
        # timed from here to the forward's end: the per-micro-batch attention metadata
        # vLLM builds in between costs too
        self._planned_at = time.perf_counter()
        m = self.choice.microbatches
        self.plan = split_requests(tokens_per_request, m) if m > 1 else None

    @property
    def rank(self) -> int:
        return self.driver.connector.role_rank

    def inject_failure(self, reason: str) -> None:
        """Make the next real step fail on this rank (drills and tests)."""
        self._fail_next = reason

    def _resume(self, index: int) -> None:
        from vllm import forward_context

        forward_context._forward_context = self._contexts[index]

    def forward(self, model, args: tuple, kwargs: dict):
        import torch
        from vllm import forward_context

        ctx = forward_context.get_forward_context()
        plan, self.plan = self.plan, None
        choice, self.choice = self.choice, None
        kind = self.kind
        num_tokens = _num_tokens(args, kwargs)
        vllm_slices = getattr(ctx, "ubatch_slices", None)
        if vllm_slices is not None and not self.vllm_ubatching:
            raise RuntimeError(
                "AFD step wrapper: vLLM split this step into micro-batches, but on this "
                "attention server AFD's step engine splits them"
            )
        split = plan is not None  # split by AFD's plan, on its executor
        planned = split or vllm_slices is not None
        metadata_split = isinstance(ctx.attn_metadata, list)
        if metadata_split != planned:
            raise RuntimeError(
                "AFD step wrapper: the attention metadata was "
                + ("split" if metadata_split else "not split")
                + " but the step was "
                + ("planned" if planned else "not planned")
                + " into micro-batches"
            )
        fail, self._fail_next = (self._fail_next, None) if kind is StepKind.REAL else (None, None)
        phase = graph_phase(ctx, self.graph_wrapper)
        if split and phase is not GraphPhase.EAGER:
            raise RuntimeError(
                "AFD step wrapper: a step split by AFD ran under a device graph "
                f"({phase.value}); with graphs, vLLM's UBatchWrapper splits steps"
            )
        flags = kind.value | (ControlFlag.CAPTURE if phase is GraphPhase.CAPTURE else 0)
        if self.starting_up:
            flags |= ControlFlag.STARTUP
        whole = False  # one job runs every announced micro-batch (vLLM's UBatchWrapper)
        if vllm_slices is not None:
            rows = tuple(self._rows(s.num_tokens) for s in vllm_slices)
            jobs = [_Job(model, (args, kwargs), None, fail)]
            whole = True
        elif split:
            slices = _cover(plan, num_tokens)
            rows = tuple(self._rows(s.num_tokens) for s in slices)
            self._contexts = [
                _microbatch_context(ctx, self.vllm_config, i, s) for i, s in enumerate(slices)
            ]
            inference = torch.is_inference_mode_enabled()
            last = len(slices) - 1  # an injected failure hits the last micro-batch, after
            jobs = [  # the others started exchanging: the clean-up has work in flight
                _Job(model, _slice_inputs(args, kwargs, s), inference, fail if i == last else None)
                for i, s in enumerate(slices)
            ]
        else:
            rows = (self._rows(num_tokens),)
            jobs = [_Job(model, (args, kwargs), None, fail)]
        try:
            results = self.driver.run(
                rows, jobs, flags=flags, replayed=phase is GraphPhase.REPLAY, whole=whole
            )
        except BaseException:
            with self._lock:
                self.stats.failed += 1
            raise
        finally:
            if split:
                forward_context._forward_context = ctx
                self._contexts = []
        if choice is not None and kind is StepKind.REAL:
            self.tuner.observe(choice, time.perf_counter() - self._planned_at)
        with self._lock:
            self.stats.steps += 1
            self.stats.by_kind[kind] += 1
            self.stats.by_graph[phase] += 1
            if kind is StepKind.REAL:
                self.stats.by_microbatches[len(rows)] += 1
                self.stats.tokens += num_tokens
                self.stats.rows += sum(rows)
                if len(rows) > 1:
                    self.stats.last_split_rows = rows
        if not split:
            return results[0]
        return _concat(results)

    def _rows(self, num_tokens: int) -> int:
        split = self.sequence_split
        return num_tokens if split is None else split.rows(num_tokens)

    def close(self) -> None:
        self.driver.close()


class _Job:
    """One micro-batch's forward, in whatever thread runs it."""

    def __init__(self, model, inputs, inference_mode: bool | None, fail: str | None):
        self.model = model
        self.args, self.kwargs = inputs
        self.inference_mode = inference_mode  # None: run in the caller's thread as it is
        self.fail = fail

    def __call__(self):
        if self.fail:
            raise RuntimeError(f"injected attention step failure ({self.fail})")
        if self.inference_mode is None:
            return self.model(*self.args, **self.kwargs)
        import torch

        with torch.inference_mode(self.inference_mode):
            return self.model(*self.args, **self.kwargs)


def _num_tokens(args: tuple, kwargs: dict) -> int:
    positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
    if positions is not None:
        return int(positions.shape[-1])
    for key in ("input_ids", "inputs_embeds"):
        if kwargs.get(key) is not None:
            return int(kwargs[key].shape[0])
    raise RuntimeError("AFD step wrapper: cannot tell the number of tokens of this forward")


def _cover(plan: list[MicrobatchSlice], num_tokens: int) -> list[MicrobatchSlice]:
    """The plan, its last micro-batch extended over padding rows (vLLM pads at the end)."""
    last = plan[-1]
    if num_tokens < last.token_stop:
        raise RuntimeError(
            f"AFD step wrapper: the forward has {num_tokens} tokens, the micro-batch plan "
            f"covers {last.token_stop}"
        )
    return plan[:-1] + [
        MicrobatchSlice(last.req_start, last.req_stop, last.token_start, num_tokens)
    ]


def _slice_inputs(args: tuple, kwargs: dict, s: MicrobatchSlice) -> tuple[tuple, dict]:
    if args:
        raise RuntimeError("AFD step wrapper: micro-batching needs keyword model inputs")
    tokens = slice(s.token_start, s.token_stop)
    sliced = dict(kwargs)
    for key in ("input_ids", "inputs_embeds"):
        if sliced.get(key) is not None:
            sliced[key] = sliced[key][tokens]
    positions = sliced.get("positions")
    if positions is not None:  # M-RoPE positions are [3, tokens]
        sliced["positions"] = positions[..., tokens]
    if sliced.get("intermediate_tensors") is not None:
        raise RuntimeError("AFD micro-batching does not support pipeline parallelism")
    return (), sliced


def _microbatch_context(ctx, vllm_config, index: int, s: MicrobatchSlice):
    """A forward context like vLLM's UBatchWrapper makes for one micro-batch."""
    from vllm.forward_context import create_forward_context

    tokens = slice(s.token_start, s.token_stop)
    slot_mapping = ctx.slot_mapping
    if isinstance(slot_mapping, dict):
        slot_mapping = {name: sm[tokens] for name, sm in slot_mapping.items()}
    elif isinstance(slot_mapping, list):
        slot_mapping = slot_mapping[index]
    return create_forward_context(
        ctx.attn_metadata[index],
        vllm_config,
        # the attention model holds no MoE layer: nothing reads data-parallel metadata
        dp_metadata=None,
        cudagraph_runtime_mode=ctx.cudagraph_runtime_mode,
        batch_descriptor=ctx.batch_descriptor,
        slot_mapping=slot_mapping,
        additional_kwargs=ctx.additional_kwargs,
        skip_compiled=ctx.skip_compiled,
        is_padding=None if ctx.is_padding is None else ctx.is_padding[tokens],
    )


def _concat(results: list):
    import torch

    if isinstance(results[0], tuple):  # e.g. (hidden_states, aux_hidden_states)
        return tuple(torch.cat(parts, dim=0) for parts in zip(*results, strict=True))
    return torch.cat(results, dim=0)


class AFDStepWrapper:
    """Stands in for the attention model in vLLM's runner (like vLLM's own CUDAGraphWrapper
    and UBatchWrapper): calls go through the AFD step engine, attributes to the model."""

    def __init__(self, model, engine: AttentionStepEngine):
        # not `self.model`: that name must reach the model's own `.model` (its decoder
        # stack), as through vLLM's wrappers; vLLM-Ascend reads `runner.model.model`
        self._afd_model = model
        self.engine = engine

    def __call__(self, *args, **kwargs):
        return self.engine.forward(self._afd_model, args, kwargs)

    def __getattr__(self, name: str):
        # only reached for attributes the wrapper itself does not have
        return getattr(self.__dict__["_afd_model"], name)

    def unwrap(self):
        return self._afd_model

"""Role logic shared by every platform's AFD workers.

`AttentionRole`: builds the connector, installs it for the model's FFN proxies, and puts
the step wrapper (afd_core.step.wrapper) in place of the runner's model, so every forward
(real steps, DP dummy batches, profiling runs) is one AFD step, micro-batched when the
runner planned it.
`FFNRole`: builds the connector and serves steps in a thread (afd_core.step.ffn); the
FFN ranks of one server with data parallelism form an expert group
(afd_core.step.expert_group).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

from afd_core import envs
from afd_core.config import require_afd_config
from afd_core.connectors.base import AFDConnector, AFDPeerError, WireSpec
from afd_core.connectors.factory import build_connector
from afd_core.connectors.transports.transport import TransportError
from afd_core.log import get_logger
from afd_core.registration import assert_steps_ok_for
from afd_core.runtime import install_connector, install_sequence_split
from afd_core.step.expert_group import ExpertGroup, expert_group_name
from afd_core.step.ffn import FFNStepServer
from afd_core.step.ffn_tp import TensorParallelFollower, TensorParallelLeader, tp_group_name
from afd_core.step.graphs import FFNGraphCache, find_graph_wrapper
from afd_core.step.sequence_split import SequenceSplit
from afd_core.step.served_together import for_attention_server
from afd_core.step.split import SplitPolicy
from afd_core.step.wrapper import AFDStepWrapper, AttentionStepEngine

# entered around one FFN call: (rows, token ids or None) -> a context manager
LayerContext = Callable[[int, object], contextlib.AbstractContextManager]

logger = get_logger(__name__)


def role_rank(vllm_config, afd, tp_rank: int) -> int:
    """This worker's rank in its role. Attention: every worker is one, numbered from the
    server's start_rank by (DP index) * TP size + TP rank. FFN: each DP rank of the server
    is one FFN rank (start_rank + DP index); its tensor-parallel workers shard it."""
    pc = vllm_config.parallel_config
    if afd.is_ffn:
        return afd.start_rank + pc.data_parallel_index
    return afd.start_rank + pc.data_parallel_index * pc.tensor_parallel_size + tp_rank


def steps_with(vllm_config, afd, rank: int) -> int:
    """The first of the ranks that step together with this one: an attention server's
    ranks run every forward together (vLLM's DP lockstep), with async_dp only one DP
    rank's tensor-parallel ranks do. The FFN side's rank is its own."""
    if afd.is_ffn:
        return afd.start_rank
    if afd.async_dp:
        tp = vllm_config.parallel_config.tensor_parallel_size
        return rank - (rank - afd.start_rank) % tp
    return afd.start_rank


def torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def afd_architecture(model_config) -> Iterator[None]:
    """While loading, resolve the checkpoint's architecture to its AFD wrapper ("AFD"+arch).

    Only this worker's copy of the config changes, and only for the duration of the load;
    vLLM's registry then builds the wrapper registered by register_afd.
    """
    hf = model_config.hf_config
    original = list(getattr(hf, "architectures", None) or [])
    from afd_core.registration import STEP_MODELS, records

    if not original:
        raise RuntimeError("AFD: the checkpoint's config.json names no architecture")
    hf.architectures = [a if a.startswith("AFD") else "AFD" + a for a in original]
    try:
        yield
    except Exception as exc:
        # only vLLM's registry refusing the name: an error inside the model (a kernel this
        # platform lacks) is the model's own and passes unchanged
        if "are not supported for now" in str(exc) or "failed to be inspected" in str(exc):
            rec = records().get(STEP_MODELS)
            from afd_core.patches.config_validation import runnable_architectures

            raise RuntimeError(
                f"AFD: no AFD wrapper for architecture {original[0]!r} ({exc}); AFD runs: "
                + (runnable_architectures() or "nothing (register_afd did not run)")
                + (f"; model registration: {rec.status.value}" if rec else "")
            ) from exc
        raise
    finally:
        hf.architectures = original


def make_wire_spec(vllm_config, model) -> WireSpec:
    mc = vllm_config.model_config
    return WireSpec(
        hidden_size=mc.hf_text_config.hidden_size,
        dtype=torch_dtype_name(mc.dtype),
        num_exchange_layers=len(model.ffn_layer_indices()),
        max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        router_width=model.router_width(),
        token_ids=model.routes_by_token_id(),
    )


def warm_up_sizes(max_rows: int, capture_sizes=(), peers: int = 1) -> list[int]:
    """The FFN's warm-up row counts: powers of two up to `max_rows` (a kernel's tuning
    buckets) and `max_rows` itself, and each graph capture size for one peer and for all
    of them (a captured step's rows), as far as they fit."""
    sizes = {max_rows}
    n = 1
    while n < max_rows:
        sizes.add(n)
        n *= 2
    for size in capture_sizes:
        sizes.update(s for s in (size, size * peers) if s <= max_rows)
    return sorted(sizes)


class _Role:
    """This worker's AFD config, rank and connector."""

    def __init__(self, vllm_config, tp_rank: int):
        self.vllm_config = vllm_config
        self.config = require_afd_config(vllm_config)
        assert_steps_ok_for(self.config)
        self.rank = role_rank(vllm_config, self.config, tp_rank)
        self.tp_rank = tp_rank
        self.connector: AFDConnector | None = None

    def _connect(self, model) -> None:
        wire = make_wire_spec(self.vllm_config, model)
        self.connector = build_connector(self.config, self.rank, wire)
        self.connector.steps_with = steps_with(self.vllm_config, self.config, self.rank)
        self.connector.init()
        self._share_metrics()

    def _share_metrics(self) -> None:
        """On a server spanning hosts: its head host's /metrics and /health see this rank
        (`AFDConnector.share_metrics`)."""
        if (ranks := envs.server_ranks()) is not None:
            self.connector.share_metrics(ranks)


def split_policy(vllm_config, afd) -> SplitPolicy:
    """This attention server's micro-batching: m (resolved at start-up into the afd config)
    and vLLM's DBO thresholds."""
    pc = vllm_config.parallel_config
    return SplitPolicy(
        num_microbatches=afd.max_microbatches,
        decode_token_threshold=pc.dbo_decode_token_threshold,
        prefill_token_threshold=pc.dbo_prefill_token_threshold,
    )


class AttentionRole(_Role):
    engine: AttentionStepEngine | None = None

    def attach(self, runner, max_microbatches: int, vllm_ubatching: bool = False) -> None:
        """Connect to the FFN rank and make every forward of the runner's model one step
        (`vllm_ubatching`: vLLM's UBatchWrapper splits the steps, step/vllm_ubatch.py)."""
        model = runner.model
        if vllm_ubatching:
            from afd_core.step.vllm_ubatch import adopt

            model = runner.model = adopt(model)
        self._connect(model)
        # over tensor parallelism the ranks of a step would not all fail it at one point
        # (one could wait in vLLM's all-gather for another): a lost FFN rank stops the server
        tensor_parallel = self.vllm_config.parallel_config.tensor_parallel_size > 1
        self.connector.ffn_loss_fatal = tensor_parallel
        # and a failure on one TP rank alone cannot be finished in step with its siblings
        # (step/attention.py)
        self.connector.local_failure_fatal = tensor_parallel
        install_connector(self.connector)
        split = self._sequence_split()
        install_sequence_split(split)
        self.engine = AttentionStepEngine(
            self.connector,
            self.vllm_config,
            split_policy(self.vllm_config, self.config),
            max_microbatches=max_microbatches,
            sequence_split=split,
        )
        self.engine.vllm_ubatching = vllm_ubatching
        if self.config.adaptive_microbatches:
            self.engine.set_policy(self.engine.policy, adaptive=True)
        # outside vLLM's graph wrapper: the control message goes out before every replay
        self.engine.graph_wrapper = find_graph_wrapper(model)
        if self.engine.graph_wrapper is not None:
            # vLLM's graphs, captured once at start-up, hold this link's communicators: a
            # new FFN rank's link could not be replayed, so a lost FFN rank stops the server
            self.connector.ffn_loss_fatal = True
        # where the DP ranks' FFN ranks are one expert group: served again together
        self.engine.driver.served_together = for_attention_server(
            self.vllm_config, self.config, self.connector
        )
        runner.model = AFDStepWrapper(model, self.engine)
        runner.afd_engine = self.engine

    def _sequence_split(self) -> SequenceSplit | None:
        """Over tensor parallel: this TP rank's share of every step's rows, and the TP
        group's all-gather that brings the outputs back (afd_core.step.sequence_split)."""
        size = self.vllm_config.parallel_config.tensor_parallel_size
        if size == 1:
            return None
        from vllm.distributed import tensor_model_parallel_all_gather

        return SequenceSplit(
            self.tp_rank, size, lambda t: tensor_model_parallel_all_gather(t, dim=0)
        )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        install_sequence_split(None)
        if self.connector is not None:
            install_connector(None)
            self.connector.close()


class FFNRole(_Role):
    """Serves the FFN half of every layer for this rank's attention peers. On an FFN server
    with tensor parallelism, TP rank 0 serves and the others follow (afd_core.step.ffn_tp);
    with data parallelism, each DP rank is an FFN rank and they run the MoE layers as one
    expert group (afd_core.step.expert_group)."""

    @staticmethod
    def layer_context(rows: int, token_ids) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __init__(self, vllm_config, tp_rank: int):
        super().__init__(vllm_config, tp_rank)
        pc = vllm_config.parallel_config
        self.tp_size = pc.tensor_parallel_size
        self.dp_size = pc.data_parallel_size
        self.dp_rank = pc.data_parallel_index
        self.group: ExpertGroup | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.server: FFNStepServer | None = None
        self.tp_leader: TensorParallelLeader | None = None
        self.tp_follower: TensorParallelFollower | None = None
        self._fail_next: tuple[int, str] | None = None  # a drill: (layer, reason)

    @property
    def steps(self) -> int:
        return self.server.steps if self.server else 0

    def attach(
        self,
        model,
        forward_context: Callable[[], contextlib.AbstractContextManager],
        graphs: FFNGraphCache | None = None,
        layer_context: LayerContext | None = None,
    ):
        """Connect, join the TP / expert group, and build the step server (`graphs`: the
        device-graph cache of whole steps, CUDA FULL_DECODE_ONLY; `layer_context`: entered
        around every FFN call with its rows and token ids, for a platform whose MoE reads
        per-call state from the forward context, Ascend's)."""
        self.model = model
        self.forward_context = forward_context
        if layer_context is not None:
            self.layer_context = layer_context
        wire = make_wire_spec(self.vllm_config, model)
        self.connector = build_connector(self.config, self.rank, wire)
        self.connector.expert_group_size = self.dp_size  # told to its peers at the handshake
        self.warm_up(wire)
        if graphs is not None and self.tp_size == 1 and self.dp_size == 1:
            # a TP leader shares each computation with its followers, an expert group's
            # members meet in collectives sized by the step: both stay eager per layer
            self.capture_buckets(wire, graphs)
        if self.tp_rank > 0:
            self._join_as_follower(wire)
            return
        self.connector.init()
        self._share_metrics()
        if self.tp_size > 1:
            self.tp_leader = TensorParallelLeader(self._tp_transport(), self.tp_size, self.rank)
        if self.dp_size > 1:
            self.group = self._join_expert_group()
            self.group.watch_members(self.connector.stop_serving)
            self.connector.serve_group_steps(self.group)
        self.server = FFNStepServer(
            self.connector,
            model.ffn_layer_indices(),
            self._compute,
            forward_context,
            self.group,
            graphs,
        )
        # an armed failure drill must run in Python: a replayed graph cannot raise
        self.server.eager_only = lambda: self._fail_next is not None

    def warm_up(self, wire) -> list[int]:
        """Run every layer once at each row count of `warm_up_sizes` before serving, on
        rows of zeros: the FFN's kernels load (CUDA loads them lazily, on first use,
        which may wait for the whole device), Triton compiles its MoE kernels per size
        bucket, and the caching allocator grows to the largest step, all before the first
        step, where a wait for the device could stall a peer (step/ffn.py). Every TP rank
        and every expert-group member runs the same sizes in the same order, so the
        collectives inside the layers line up. Returns the sizes."""
        import torch

        sizes = warm_up_sizes(
            len(self.connector.peers) * wire.max_tokens,
            getattr(self.vllm_config.compilation_config, "cudagraph_capture_sizes", None) or (),
            len(self.connector.peers),
        )
        t0 = time.monotonic()
        with torch.inference_mode(), self.forward_context():
            for rows in sizes:
                # what one micro-batch carries on the wire, as the receive buffers hold it
                hidden, logits, ids = self.connector._wire_tensors(rows, torch.zeros)
                if self.dp_size > 1:
                    self._set_group_rows(rows, (rows,) * self.dp_size)
                for layer in self.model.ffn_layer_indices():
                    with self.layer_context(rows, ids):
                        self.model.compute_ffn_output(layer, hidden, logits, ids)
        logger.info(
            "AFD FFN rank %d: warmed up %d layers at %d row counts (1..%d) in %.1fs",
            self.rank,
            len(self.model.ffn_layer_indices()),
            len(sizes),
            sizes[-1],
            time.monotonic() - t0,
        )
        return sizes

    def capture_buckets(self, wire, graphs: FFNGraphCache) -> int:
        """Capture every layer's compute at the bucket ladder up to the most rows the
        peers' graphs can bring together (afd_core.step.ffn_buckets): a step no
        whole-step graph matches (several attention servers' rows combined) replays them
        layer by layer instead of running eagerly. Returns the number of graphs."""
        import torch

        from afd_core.step.ffn_buckets import FFNBucketGraphs, bucket_ladder

        cc = self.vllm_config.compilation_config
        per_peer = getattr(cc, "max_cudagraph_capture_size", None) or max(
            getattr(cc, "cudagraph_capture_sizes", None) or [0]
        )
        ladder = bucket_ladder(
            min(per_peer * len(self.connector.peers), wire.max_tokens * len(self.connector.peers))
        )
        if not ladder:
            return 0
        top = ladder[-1]
        inputs = self.connector._wire_tensors(top, torch.zeros)  # static, as on the wire
        buckets = FFNBucketGraphs(graphs.backend, ladder)
        t0 = time.monotonic()

        def compute(layer, hidden, logits, ids):
            with self.layer_context(hidden.shape[0], ids):
                return self.model.compute_ffn_output(layer, hidden, logits, ids)

        with torch.inference_mode():
            n = buckets.capture(
                self.model.ffn_layer_indices(), compute, inputs, context=self.forward_context
            )
        graphs.buckets = buckets
        logger.info(
            "AFD FFN rank %d: captured %d layer graphs at %d row counts (1..%d) in %.1fs",
            self.rank,
            n,
            len(ladder),
            top,
            time.monotonic() - t0,
        )
        return n

    def _side_transport(self, name: str, rank: int, size: int, what: str):
        # a member may wait for another, whose start-up waits for its attention peers
        transport = self.connector.make_side_transport(name, rank, size, connect_scale=2.0)
        try:
            transport.connect()
        except TransportError as exc:
            raise AFDPeerError(f"FFN rank {self.rank}: {what}: {exc}") from None
        return transport

    def _tp_transport(self):
        return self._side_transport(
            tp_group_name(self.rank),
            self.tp_rank,
            self.tp_size,
            f"TP rank {self.tp_rank}: tensor-parallel group",
        )

    def _join_expert_group(self) -> ExpertGroup:
        first = self.rank - self.dp_rank
        group = ExpertGroup(
            self._side_transport(
                expert_group_name(first), self.dp_rank, self.dp_size, "expert group"
            ),
            self.dp_rank,
            self.dp_size,
            first,
        )
        try:
            group.check_peers(self.connector.peer_servers())
        except AFDPeerError as exc:
            self.connector.abort(str(exc))  # the attention peers stop with the reason too
            group.close()
            raise
        return group

    def _join_as_follower(self, wire) -> None:
        import torch

        self.tp_follower = TensorParallelFollower(
            self._tp_transport(),
            self.rank,
            self.tp_rank,
            wire.hidden_size,
            getattr(torch, wire.dtype),
            wire.router_width,
            wire.token_ids,
        )

    def _compute(self, layer: int, hidden_states, router_logits, token_ids=None, group_rows=None):
        if self._fail_next is not None and self._fail_next[0] == layer:
            _, reason = self._fail_next
            self._fail_next = None
            raise RuntimeError(f"injected FFN step failure ({reason})")
        if group_rows is not None:
            self._set_group_rows(hidden_states.shape[0], group_rows)
        if self.tp_leader is None:
            with self.layer_context(hidden_states.shape[0], token_ids):
                return self.model.compute_ffn_output(layer, hidden_states, router_logits, token_ids)
        self.tp_leader.share(layer, hidden_states, router_logits, token_ids)
        try:
            with self.layer_context(hidden_states.shape[0], token_ids):
                return self.model.compute_ffn_output(layer, hidden_states, router_logits, token_ids)
        except Exception as exc:
            # the followers may be inside the layer's collectives: no later step could
            # line up with them
            raise AFDPeerError(
                f"FFN rank {self.rank}: layer {layer} failed on TP rank 0 after its "
                f"tensor-parallel group started it ({type(exc).__name__}: {exc}); the group "
                "cannot stay in step, the FFN server stops"
            ) from exc

    def _set_group_rows(self, rows: int, group_rows) -> None:
        """vLLM's DP metadata for this layer/micro-batch: the rows of every member, which
        its MoE layers gather and scatter back."""
        import torch
        from vllm.forward_context import DPMetadata, get_forward_context

        across = torch.tensor(group_rows, dtype=torch.int32)
        get_forward_context().dp_metadata = DPMetadata.make(
            self.vllm_config.parallel_config, rows, across
        )

    def _follow(self, layer: int, hidden_states, router_logits, token_ids) -> None:
        with self.forward_context(), self.layer_context(hidden_states.shape[0], token_ids):
            self.model.compute_ffn_output(layer, hidden_states, router_logits, token_ids)

    def inject_failure(self, layer: int, reason: str) -> None:
        """Make the next step's compute fail at `layer` (drills and tests; TP rank 0
        decides for its group)."""
        self._fail_next = (layer, reason)

    def serve_step(self) -> bool:
        return self.server.serve_step()

    def stats(self) -> dict:
        """What this worker served: steps (TP rank 0) and layer computations shared with or
        followed in its tensor-parallel group."""
        out = {"rank": self.rank, "tp_rank": self.tp_rank}
        if self.server is not None:
            out |= {
                "steps": self.server.steps,
                "failed": self.server.failed_steps,
                "rows": self.server.rows,
            }
        if self.tp_leader is not None:
            out["tp_computations"] = self.tp_leader.shared
        if self.tp_follower is not None:
            out["tp_computations"] = self.tp_follower.computed
        if self.server is not None and self.server.graphs is not None:
            out["graphs"] = self.server.graphs.stats.as_dict()
        if self.group is not None:
            out["group_steps"] = self.group.steps
            out["group_zero_row_microbatches"] = self.group.zero_row_microbatches
        return out

    def start(
        self,
        on_fatal: Callable[[BaseException | None], None],
        thread_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        """Serve in a thread of its own; `thread_context` is entered in that thread first
        (a device worker: the thread's device and its own stream)."""
        name = f"FFN rank {self.rank}" + (f" TP rank {self.tp_rank}" if self.tp_size > 1 else "")

        def loop():
            try:
                with thread_context():
                    serve()
            except BaseException as exc:  # noqa: BLE001 - the thread's device set-up failed
                logger.error("AFD %s could not start serving: %s", name, exc, exc_info=True)
                on_fatal(exc)

        def serve():
            try:
                if self.tp_follower is not None:
                    self.tp_follower.serve(self._follow, self._stop)
                else:
                    self.server.serve(self._stop)
                    if self.tp_leader is not None:
                        self.tp_leader.stop()
                if not self._stop.is_set():
                    if self.tp_follower is not None:
                        logger.warning(
                            "AFD %s: TP rank 0 stopped the group after %d layer computations",
                            name,
                            self.tp_follower.computed,
                        )
                    else:
                        logger.warning(
                            "AFD %s: every attention peer left the deployment after %d steps; "
                            "this FFN server stops (restart the deployment to serve again)",
                            name,
                            self.steps,
                        )
                    on_fatal(None)
            except BaseException as exc:  # noqa: BLE001 - reported, then the process stops
                if self._stop.is_set():
                    return
                if self.tp_leader is not None:
                    self.tp_leader.stop()
                logger.error(
                    "AFD %s stopped: %s", name, exc, exc_info=not isinstance(exc, AFDPeerError)
                )
                on_fatal(exc)

        self._thread = threading.Thread(target=loop, name=f"afd-ffn-{self.rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self.connector is not None:
            self.connector.close()
        for side in (self.tp_leader, self.tp_follower, self.group):
            if side is not None:
                side.close()


def terminate_this_process(exc: BaseException | None) -> None:
    """Stop the worker process so vLLM's executor monitor takes the engine (and the API
    server) down with a clear log line: a dead FFN rank must not look like an idle one."""
    time.sleep(0.1)  # let the log line flush
    os.kill(os.getpid(), signal.SIGTERM)

"""The FFN side of a step: receive, compute and send every layer and micro-batch, pipelined.

Per step: the control messages of all peers (the most micro-batches any peer announced;
a peer with fewer sends no rows in the rest), then for each layer, for each micro-batch in
order: wait for the rows of every peer (their receives were posted together), compute,
send each peer its slice without waiting, and only then post the receives of the next
layer/micro-batch.

Why the receive comes after the send: with one micro-batch the next receive's rows are the
next layer of the same rows, which the peers send only once they have this layer's output.
Posted before this send, that receive would sit on the device waiting for work this host
has not enqueued yet, and any host call that waits for the whole device (a kernel loaded
lazily on first use, the caching allocator's cudaMalloc/cudaFree, a synchronize in vLLM's
code) would wait for it forever. Rule: never hold a posted receive whose data depends on
work not yet enqueued. A captured step may prefetch (its graph is launched whole, nothing
waits on the host between its operations), so `FFNGraphCache` asks for it.

A micro-batch with no rows stays in the protocol (it is walked, nothing moves).
A compute failure fails the step, not the deployment: the rest of the step is answered with
zeros and the status message tells every peer which layer failed (unless compute raises
AFDPeerError: then the rank cannot go on, e.g. its tensor-parallel group broke). A transport or protocol
failure stops the FFN rank after telling its peers why.

In an expert group (afd_core.step.expert_group) the group agrees on each step's
micro-batches first, and every member computes every (layer, micro-batch) that has rows on
any member, with zero rows of its own if need be: the MoE's collectives need all of them.
A compute failure there stops the rank (the others may be inside a collective).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from afd_core.connectors.base import AFDConnector, AFDPeerError, FFNBatch
from afd_core.connectors.protocol.status import StatusCode, StepStatus
from afd_core.log import get_logger
from afd_core.step.expert_group import ExpertGroup, GroupStep
from afd_core.step.graphs import FFNGraphCache
from afd_core.trace import now, trace_for

logger = get_logger(__name__)

# compute(layer, hidden_states, router_logits, token_ids[, group_rows]) -> output rows;
# group_rows (an expert group's rows per member) only when the server has a group
Compute = Callable[..., object]


class FFNStepServer:
    def __init__(
        self,
        connector: AFDConnector,
        layers: list[int],
        compute: Compute,
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        group: ExpertGroup | None = None,
        graphs: FFNGraphCache | None = None,
    ):
        self.connector = connector
        self.group = group
        self.graphs = graphs  # device graphs of whole steps (CUDA FULL_DECODE_ONLY), or None
        self.eager_only = lambda: False  # e.g. while a failure drill is armed
        self.layers = list(layers)
        self.compute = compute
        self.forward_context = forward_context
        self.steps = 0  # steps served
        self.rows = 0  # rows received per layer, over all steps and peers
        self.failed_steps = 0
        self._rejoins_seen = 0
        self.trace = trace_for("ffn", connector.role_rank)

    def serve_step(self) -> bool:
        """One step for all peers; False when every peer has left."""

        conn = self.connector
        plan = conn.recv_control()
        if conn.all_peers_left:
            return False
        rejoined = len(getattr(conn, "peers_rejoined", ()))
        if self.graphs is not None and rejoined != self._rejoins_seen:
            # a rejoined peer has a fresh link: whole-step graphs hold the old one's
            # communicators (layer graphs hold none); its server's captures come again
            self._rejoins_seen = rejoined
            self.graphs.drop_step_graphs()
        t_step = now()
        agreed = self.group.agree(plan) if self.group is not None else None

        eager_only = self.eager_only()

        def run_layers(capturing: bool = False):
            buckets = None
            if self.graphs is not None and not capturing and not eager_only:
                buckets = self.graphs.buckets
            return self._run_layers(plan, agreed, prefetch=capturing, buckets=buckets)

        if self.graphs is None:
            failure = run_layers()
        else:
            counts = self.graphs.counts()
            failure = self.graphs.run(
                plan,
                run_layers,
                conn.settle_sends,
                group_rows=agreed.rows if agreed is not None else None,
                eager_only=eager_only,
                watch=lambda: conn.watch_replay(f"the replay of step {plan.step}"),
            )
            for name, n in self.graphs.counts_since(counts).items():
                conn.metrics.add(name, n)
        conn.finish_step(failure)
        self.rows += sum(sum(rows) for rows in plan.rows)
        self.trace.add("step", t_step, now())
        self.steps += 1
        self.failed_steps += failure is not None
        return True

    def _run_layers(
        self, plan, agreed: GroupStep | None, prefetch: bool = False, buckets=None
    ) -> StepStatus | None:
        """Every layer and micro-batch of the step: receive, compute, send; returns the
        step's failure, if its compute raised. `prefetch`: post the next receive before
        this compute (only where no host wait can come between them: a capture).
        `buckets`: FFNBucketGraphs whose graphs replay a layer's compute where one fits."""
        import torch

        conn = self.connector
        n_mb = agreed.num_microbatches if agreed is not None else plan.num_microbatches
        # the receives this rank posts: a member of a group may compute micro-batches its
        # own peers did not announce (zero rows, nothing moves)
        posted = [(layer, mb) for layer in self.layers for mb in range(plan.num_microbatches)]
        failure: StepStatus | None = None
        with torch.inference_mode(), self.forward_context():
            pending = conn.post_attn_output(*posted[0]) if posted else None
            k = 0
            for layer in self.layers:
                for mb in range(n_mb):
                    if mb >= plan.num_microbatches:
                        self._compute_in_group(agreed, layer, mb, self._no_rows())
                        continue
                    batch = pending.wait()
                    k += 1
                    if prefetch and k < len(posted):  # lands in the other ring buffer
                        pending = conn.post_attn_output(*posted[k])
                    if agreed is not None:
                        out = self._compute_in_group(agreed, layer, mb, batch)
                    else:
                        out, failure = self._compute(plan.step, layer, mb, batch, failure, buckets)
                    conn.send_ffn_output(out, layer, mb)
                    if not prefetch and k < len(posted):  # after the send: see the docstring
                        pending = conn.post_attn_output(*posted[k])
        return failure

    def _compute(self, step: int, layer: int, mb: int, batch: FFNBatch, failure, buckets=None):
        """One layer/micro-batch of this rank alone: (output rows, the step's failure)."""
        import torch

        rows = batch.hidden_states
        if rows.shape[0] == 0:
            return rows, failure
        if failure is not None:
            return torch.zeros_like(rows), failure
        try:
            t0 = now()
            out = None
            if buckets is not None:
                out = buckets.run(layer, rows, batch.router_logits, batch.token_ids)
            if out is None:
                out = self.compute(layer, rows, batch.router_logits, batch.token_ids)
            self.trace.add("compute", t0, now())
            return out, None
        except AFDPeerError:
            raise  # the rank cannot stay in step (e.g. its TP group broke)
        except Exception as exc:  # noqa: BLE001 - reported to every peer
            failure = StepStatus(
                step,
                StatusCode.STEP_FAILED,
                layer,
                mb,
                self.connector.role_rank,
                f"{type(exc).__name__}: {exc}",
            )
            logger.error(
                "AFD FFN rank %d: %s failed; the step is answered with zeros and "
                "its requests fail on the attention side",
                self.connector.role_rank,
                failure.where(),
                exc_info=True,
            )
            return torch.zeros_like(rows), failure

    def _compute_in_group(self, agreed: GroupStep, layer: int, mb: int, batch: FFNBatch):
        """One layer/micro-batch with the expert group: computed whenever any member has
        rows, so every member enters the MoE's collectives."""
        rows = batch.hidden_states
        if agreed.total(mb) == 0:
            return rows
        try:
            t0 = now()
            out = self.compute(
                layer, rows, batch.router_logits, batch.token_ids, group_rows=agreed.rows[mb]
            )
            self.trace.add("compute", t0, now())
            return out
        except AFDPeerError:
            raise
        except Exception as exc:
            raise AFDPeerError(
                f"FFN rank {self.connector.role_rank}: layer {layer} micro-batch {mb} failed "
                f"({type(exc).__name__}: {exc}); its expert group (FFN ranks "
                f"{self.group.first_ffn_rank}..{self.group.first_ffn_rank + self.group.size - 1}"
                ") cannot stay in step, the FFN server stops"
            ) from exc

    def _no_rows(self) -> FFNBatch:
        import torch

        wire, dev = self.connector.wire, self.connector.device
        return FFNBatch(
            torch.empty(0, wire.hidden_size, dtype=getattr(torch, wire.dtype), device=dev),
            torch.empty(0, wire.router_width, dtype=getattr(torch, wire.router_dtype), device=dev)
            if wire.router_width
            else None,
            (),
            torch.empty(0, dtype=torch.int64, device=dev) if wire.token_ids else None,
        )

    def serve(self, stop: threading.Event) -> None:
        """Serve until every peer left or `stop` is set. On a transport or protocol error,
        tell the peers why (so they stop at once with the reason) and raise it."""
        try:
            while not stop.is_set():
                if not self.serve_step():
                    return
        except BaseException as exc:
            if not stop.is_set():
                reason = (
                    str(exc) if isinstance(exc, AFDPeerError) else f"{type(exc).__name__}: {exc}"
                )
                self.connector.abort(reason)
            raise

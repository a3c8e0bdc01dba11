"""The FFN side of a step: receive, compute and send every layer and micro-batch, pipelined.

Per step: the control messages of all peers (the most micro-batches any peer announced;
a peer with fewer sends no rows in the rest), then for each layer, for each micro-batch in
order: wait for the rows of every peer (their receives were posted together), post the
receives of the next layer/micro-batch, compute, and send each peer its slice without
waiting. A micro-batch with no rows stays in the protocol (it is walked, nothing moves).
A compute failure fails the step, not the deployment: the rest of the step is answered with
zeros and the status message tells every peer which layer failed (unless compute raises
AFDPeerError: then the rank cannot go on, e.g. its tensor-parallel group broke). A transport or protocol
failure stops the FFN rank after telling its peers why.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from afd_core.connectors.base import AFDConnector, AFDPeerError
from afd_core.connectors.status import StatusCode, StepStatus
from afd_core.log import get_logger
from afd_core.trace import now, trace_for

logger = get_logger(__name__)

# compute(layer, hidden_states, router_logits, token_ids) -> output rows
Compute = Callable[..., object]


class FFNStepServer:
    def __init__(
        self,
        connector: AFDConnector,
        layers: list[int],
        compute: Compute,
        forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.connector = connector
        self.layers = list(layers)
        self.compute = compute
        self.forward_context = forward_context
        self.steps = 0  # steps served
        self.failed_steps = 0
        self.trace = trace_for("ffn", connector.role_rank)

    def serve_step(self) -> bool:
        """One step for all peers; False when every peer has left."""
        import torch

        conn = self.connector
        plan = conn.recv_control()
        if conn.all_peers_left:
            return False
        t_step = now()
        order = [(layer, mb) for layer in self.layers for mb in range(plan.num_microbatches)]
        failure: StepStatus | None = None
        with torch.inference_mode(), self.forward_context():
            pending = conn.post_attn_output(*order[0]) if order else None
            for k, (layer, mb) in enumerate(order):
                batch = pending.wait()
                if k + 1 < len(order):  # lands in the other buffer while this one computes
                    pending = conn.post_attn_output(*order[k + 1])
                rows = batch.hidden_states
                if rows.shape[0] == 0:
                    out = rows
                elif failure is not None:
                    out = torch.zeros_like(rows)
                else:
                    try:
                        t0 = now()
                        out = self.compute(layer, rows, batch.router_logits, batch.token_ids)
                        self.trace.add("compute", t0, now())
                    except AFDPeerError:
                        raise  # the rank cannot stay in step (e.g. its TP group broke)
                    except Exception as exc:  # noqa: BLE001 - reported to every peer
                        failure = StepStatus(
                            plan.step,
                            StatusCode.STEP_FAILED,
                            layer,
                            mb,
                            conn.role_rank,
                            f"{type(exc).__name__}: {exc}",
                        )
                        logger.error(
                            "AFD FFN rank %d: %s failed; the step is answered with zeros and "
                            "its requests fail on the attention side",
                            conn.role_rank,
                            failure.where(),
                            exc_info=True,
                        )
                        out = torch.zeros_like(rows)
                conn.send_ffn_output(out, layer, mb)
        conn.finish_step(failure)
        self.trace.add("step", t_step, now())
        self.steps += 1
        self.failed_steps += failure is not None
        return True

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

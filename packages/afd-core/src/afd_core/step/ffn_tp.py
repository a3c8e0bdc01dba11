"""An FFN rank sharded over tensor parallel: TP rank 0 exchanges, the group computes.

An FFN server with `--tensor-parallel-size T` is one FFN rank whose MLP/MoE weights vLLM
shards over its T workers; the layer's own reduction (the MoE's / row-parallel all-reduce
in vLLM's TP group) leaves the full output on every worker. TP rank 0, the leader, runs the
AFD protocol with the attention peers as an unsharded FFN rank does; before it computes a
layer/micro-batch it hands the rows (and, when the wire carries them, their router logits
and token ids) to the followers (TP ranks 1..T-1), which compute the same layer with it, so every collective inside the layer has all T members. Nothing else
crosses the group: zero-row micro-batches and failed steps compute nothing anywhere.

Why the leader and not every TP rank receives from the attention peers: the attention side
then sends each row once (not T times), the peers' protocol is unchanged, and one place
decides what is computed, so the followers can never disagree on a step. The rows cross the
TP group once more (measured in benchmarks/ffn_tensor_parallel.py).

The leader talks to its followers through the deployment's own transport, in a group of
its own: commands on the control channel (a follower may wait for days while the
deployment is idle), rows on the data channel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from afd_core.connectors.base import AFDPeerError
from afd_core.connectors.transports.transport import Transport, TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)

CMD_STOP, CMD_COMPUTE = 0, 1
HEADER_LEN = 3  # command, layer, rows
ROWS_TAG, LOGITS_TAG, TOKENS_TAG = 0, 1, 2
STOP_DELIVERY_S = 1.0


def tp_group_name(ffn_rank: int) -> str:
    return f"ffn{ffn_rank}-tp"


class TensorParallelLeader:
    """TP rank 0 of an FFN rank: shares every computed layer/micro-batch with the group."""

    def __init__(self, transport: Transport, size: int, ffn_rank: int):
        self.transport = transport
        self.size = size
        self.ffn_rank = ffn_rank
        self.shared = 0  # layer/micro-batches handed to the group

    def _to_followers(
        self,
        header: list[int],
        rows=None,
        logits=None,
        token_ids=None,
        timeout_s: float | None = None,
    ):
        import torch

        head = torch.tensor(header, dtype=torch.int64)
        handles = []
        try:
            for follower in range(1, self.size):
                handles.append(self.transport.isend_control(head, follower))
                if rows is not None:
                    handles.append(self.transport.isend(rows, follower, ROWS_TAG))
                if logits is not None:
                    handles.append(self.transport.isend(logits, follower, LOGITS_TAG))
                if token_ids is not None:
                    handles.append(self.transport.isend(token_ids, follower, TOKENS_TAG))
            for h in handles:  # the rows' buffer is reused by the next receive
                h.wait(timeout_s)
        except TransportError as exc:
            raise AFDPeerError(
                f"FFN rank {self.ffn_rank}: its tensor-parallel group lost a member: {exc}"
            ) from None

    def share(self, layer: int, rows, router_logits=None, token_ids=None) -> None:
        """Before computing `layer` on `rows`: the followers compute it with this rank."""
        logits = router_logits.contiguous() if router_logits is not None else None
        ids = token_ids.contiguous() if token_ids is not None else None
        header = [CMD_COMPUTE, layer, rows.shape[0]]
        self._to_followers(header, rows.contiguous(), logits, ids)
        self.shared += 1

    def stop(self) -> None:
        """Best effort, bounded: a follower stuck in a collective never takes it (the
        server stops anyway)."""
        try:
            self._to_followers([CMD_STOP, 0, 0], timeout_s=STOP_DELIVERY_S)
        except AFDPeerError:
            logger.debug("AFD FFN rank %d: TP followers already gone", self.ffn_rank)

    def close(self) -> None:
        self.transport.close()


class TensorParallelFollower:
    """TP rank 1..T-1 of an FFN rank: computes what the leader computes, returns nothing."""

    def __init__(
        self,
        transport: Transport,
        ffn_rank: int,
        tp_rank: int,
        hidden: int,
        dtype,
        router_width: int = 0,
        token_ids: bool = False,
    ):
        self.transport = transport
        self.ffn_rank = ffn_rank
        self.tp_rank = tp_rank
        self.hidden = hidden
        self.dtype = dtype
        self.router_width = router_width  # > 0: the gate runs on attention, logits follow
        self.token_ids = token_ids  # each row's token id follows (hash-routed MoE)
        self.computed = 0  # layer/micro-batches computed

    def serve(
        self, compute: Callable[[int, object, object, object], object], stop: threading.Event
    ) -> None:
        """Until the leader says stop (or `stop` is set); compute errors propagate (the
        group cannot stay in step after one, so the server stops)."""
        import torch

        head = torch.zeros(HEADER_LEN, dtype=torch.int64)
        buf = torch.empty(0, self.hidden, dtype=self.dtype)
        logits_buf = torch.empty(0, self.router_width, dtype=torch.float32)
        ids_buf = torch.empty(0, dtype=torch.int64)
        while not stop.is_set():
            try:
                self.transport.recv_control(head, 0)
                cmd, layer, n = (int(x) for x in head.tolist())
                if cmd == CMD_STOP:
                    return
                if buf.shape[0] < n:
                    size = max(n, 2 * buf.shape[0])
                    buf = torch.empty(size, self.hidden, dtype=self.dtype)
                    logits_buf = torch.empty(size, self.router_width, dtype=torch.float32)
                    ids_buf = torch.empty(size, dtype=torch.int64)
                rows = buf[:n]
                self.transport.recv(rows, 0, ROWS_TAG)
                logits = None
                if self.router_width:
                    logits = logits_buf[:n]
                    self.transport.recv(logits, 0, LOGITS_TAG)
                ids = None
                if self.token_ids:
                    ids = ids_buf[:n]
                    self.transport.recv(ids, 0, TOKENS_TAG)
            except TransportError as exc:
                if stop.is_set():
                    return
                raise AFDPeerError(
                    f"FFN rank {self.ffn_rank} TP rank {self.tp_rank}: lost TP rank 0: {exc}"
                ) from None
            with torch.inference_mode():
                compute(layer, rows, logits, ids)
            self.computed += 1

    def close(self) -> None:
        self.transport.close()

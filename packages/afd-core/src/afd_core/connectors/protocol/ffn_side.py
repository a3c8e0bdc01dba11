"""The FFN side's data path of a point-to-point step: the receives of every peer's rows into
a ring of two buffer sets, the sends of each peer's slice of the output, the step's end
with a status per peer, a lost peer dropped (where the transport allows it), and the abort
that tells the peers why this rank stops.
"""

from __future__ import annotations

import dataclasses
import time

from afd_core.connectors.base import (
    AFDPeerError,
    FFNBatch,
)
from afd_core.connectors.protocol.control import ControlFlag
from afd_core.connectors.protocol.data_tags import KIND_HIDDEN, KIND_LOGITS, KIND_TOKENS, data_tag
from afd_core.connectors.protocol.status import (
    StatusCode,
    StepStatus,
)
from afd_core.connectors.transports.transport import TransportError
from afd_core.log import get_logger
from afd_core.trace import now

logger = get_logger(__name__)

ABORT_DELIVERY_S = 1.0  # how long a stopping FFN rank waits for its peers to take the reason
# how long dropping a peer waits for its reason to leave (its status receive is posted while
# it is in a step; a dead or silent peer's send fails or stays queued: not waited for)
DROP_NOTICE_S = 0.2


def status_payload(status: StepStatus):
    """A status message as the uint8 tensor the control channel sends."""
    import torch

    return torch.frombuffer(bytearray(status.encode()), dtype=torch.uint8)


class PendingBatch:
    """FFN side: one layer/micro-batch whose receives from every peer are posted."""

    def __init__(self, connector, layer: int, microbatch: int, batch: FFNBatch, handles):
        self._connector = connector
        self.layer = layer
        self.microbatch = microbatch
        self._batch = batch
        self._handles = handles  # (peer index, handle, the rows it fills)
        self.done = False

    def wait(self) -> FFNBatch:
        if not self.done:
            self._connector._complete_batch(self)
        return self._batch


def _peer_rows(rows):
    """(peer index, its slice of the micro-batch's rows) of every peer with rows: the peers'
    rows are concatenated in peer order."""
    off = 0
    for i, n in enumerate(rows):
        if n:
            yield i, slice(off, off + n)
            off += n


def _peer_views(rows, hidden, logits, ids):
    """(peer index, [(its slice of each receive buffer, kind)]) of every peer with rows."""
    kinds = ((hidden, KIND_HIDDEN), (logits, KIND_LOGITS), (ids, KIND_TOKENS))
    for i, part in _peer_rows(rows):
        yield i, [(b[part], kind) for b, kind in kinds if b is not None]


class FFNDataPath:
    """PointToPointConnector's FFN data path (a mixin: the connector's state is its own)."""

    def post_attn_output(self, layer: int, microbatch: int = 0) -> PendingBatch:
        """Post the receives of every peer's rows of one layer/micro-batch."""

        t = self._require("ffn")
        plan = self._require_plan()
        self._recv_order.issue(layer, microbatch, f"{self._me()} in step {self._step}")
        rows = plan.rows[microbatch]
        hidden, logits, ids = self._receive_buffers(sum(rows))
        handles = []
        try:
            with t.grouped_ops():  # every peer's receives: one launch
                for i, views in _peer_views(rows, hidden, logits, ids):
                    self._post_receives(t, i, views, layer, microbatch, handles)
        except TransportError as exc:  # the launch of a device transport (no peer loss there)
            raise self._launch_error("receiving", layer, microbatch, exc) from None
        batch = FFNBatch(hidden, logits, rows, ids)
        return PendingBatch(self, layer, microbatch, batch, handles)

    def _post_receives(self, t, i: int, views, layer: int, microbatch: int, handles) -> None:
        """Post peer i's receives straight into the concatenated buffers (a peer's rows are
        a contiguous slice); a lost peer's rows are zeros."""
        if self._active_peers[i]:
            try:
                for view, kind in views:
                    handle = t.irecv(view, i + 1, data_tag(layer, microbatch, kind))
                    handles.append((i, handle, view))
                return
            except TransportError as exc:
                self._lose_peer_or_raise(i, self._batch_error(i, layer, microbatch, exc))
        for view, _ in views:
            view.zero_()

    def _complete_batch(self, pending: PendingBatch) -> None:
        t0 = now()
        try:
            for i, handle, view in pending._handles:
                try:
                    if self._active_peers[i]:
                        handle.wait()
                        continue
                except TransportError as exc:
                    error = self._batch_error(i, pending.layer, pending.microbatch, exc)
                    self._lose_peer_or_raise(i, error)
                view.zero_()  # a lost peer's rows: zeros, computed and never sent back
        finally:
            pending.done = True
            self.metrics.exchange_wait.observe(now() - t0)

    def _lose_peer_or_raise(self, i: int, error: AFDPeerError) -> None:
        """A peer's channel failed: drop the peer and go on serving the others where the
        transport allows it (its channels fail alone), else raise `error`. Its server's
        other ranks are dropped as their own channels fail."""
        if not self.survives_peer_loss:
            raise error
        if self._active_peers[i]:
            self._active_peers[i] = False
            self._peer_served(i)  # its listener, if it waits for that, stops
            self.peers_lost.append(self.peers[i])
            self._tell_dropped(i, error)
            self._transport.drop_member(i + 1)
            self._release_claim(i)
            self.metrics.set_peers([self.peers[i]], False)
            self.metrics.add("peers_lost")
            self.metrics.publish(now=True)
            logger.warning(
                "AFD %s: attention rank %d is lost and dropped; the other attention ranks "
                "are served on (%s)",
                self._me(),
                self.peers[i],
                error,
            )

    def _tell_dropped(self, i: int, error: AFDPeerError) -> None:
        """Best effort: send peer i the reason it is dropped (a DROPPED status) before its
        link closes, so a live peer names it instead of a closed connection."""
        status = StepStatus(
            self._peer_step[i] - 1, StatusCode.DROPPED, ffn_rank=self.role_rank, reason=str(error)
        )
        try:
            self._transport.isend_status(status_payload(status), i + 1).wait(DROP_NOTICE_S)
        except Exception:  # noqa: BLE001 - the peer may be gone, or its link broken
            logger.debug("AFD %s: the drop's reason not delivered", self._me(), exc_info=True)

    def _peer_served(self, i: int) -> None:
        if self._inbox is not None:
            self._inbox.served(i)

    def _batch_error(self, i, layer, microbatch, exc) -> AFDPeerError:
        return AFDPeerError(
            f"{self._me()} waiting for layer {layer} (micro-batch {microbatch}) of step "
            f"{self._peer_step[i] - 1} from attention rank {self.peers[i]}: {exc}"
        )

    def _launch_error(self, doing: str, layer, microbatch, exc) -> AFDPeerError:
        up = zip(self.peers, self._active_peers, strict=True)
        ranks = ", ".join(str(rank) for rank, active in up if active)
        return AFDPeerError(
            f"{self._me()} {doing} layer {layer} (micro-batch {microbatch}) of step "
            f"{self._step}, attention ranks {ranks}: {exc}"
        )

    def recv_attn_output(self, layer: int, microbatch: int = 0) -> FFNBatch:
        """Blocking form: the peers' rows; valid until the second receive after it."""
        return self.post_attn_output(layer, microbatch).wait()

    def _receive_buffers(self, rows: int) -> tuple:
        """Rows [0, rows) of the next set of receive buffers of the ring: (hidden states,
        router logits or None, token ids or None)."""
        slot = self._ring_next
        self._ring_next ^= 1
        bufs = self._ring[slot]
        if bufs is None or bufs[0].shape[0] < rows:
            if bufs is not None and self.fixed_receive_buffers:
                raise AFDPeerError(
                    f"{self._me()}: {rows} rows in one micro-batch, more than the "
                    f"{bufs[0].shape[0]} its receive buffers were allocated for (the peers' "
                    "max-num-batched-tokens)"
                )
            if self.fixed_receive_buffers:
                capacity = max(rows, self.max_receive_rows())
            else:
                capacity = max(rows, 1 if bufs is None else 2 * bufs[0].shape[0])
            bufs = self._allocate_receive_buffers(capacity)
            self._ring[slot] = bufs
        return tuple(None if b is None else b[:rows] for b in bufs)

    def max_receive_rows(self) -> int:
        """FFN side: the most rows one micro-batch can bring, from every peer together."""
        return sum(n or self.wire.max_tokens for n in self._peer_max_tokens)

    def _allocate_receive_buffers(self, capacity: int) -> tuple:
        import torch

        return self._wire_tensors(capacity, torch.empty)

    def _wire_tensors(self, rows: int, make) -> tuple:
        """`make` (torch.empty, torch.zeros) of what one micro-batch carries on the wire:
        (hidden states, router logits or None, token ids or None)."""
        import torch

        w, dev = self.wire, self.device
        return (
            make(rows, w.hidden_size, dtype=getattr(torch, w.dtype), device=dev),
            make(rows, w.router_width, dtype=getattr(torch, w.router_dtype), device=dev)
            if w.router_width
            else None,
            make(rows, dtype=torch.int64, device=dev) if w.token_ids else None,
        )

    def send_ffn_output(self, output, layer: int, microbatch: int = 0) -> None:
        """Send each peer its rows of the output; returns at once (see finish_step)."""
        import torch

        t = self._require("ffn")
        self.check_tensor(output)
        rows = self._require_plan().rows[microbatch]
        self._send_order.issue(layer, microbatch, f"{self._me()} in step {self._step}")
        if output.shape[0] != sum(rows):
            raise AFDPeerError(
                f"{self._me()}: layer {layer} output has {output.shape[0]} rows, peers sent "
                f"{sum(rows)}"
            )
        plan = self._require_plan()
        if plan.num_microbatches > 1 or any(
            b is not None and _shares_memory(output, b[0]) for b in self._ring
        ):
            # The send is in flight while the next micro-batch computes, and compute may
            # return memory its next call reuses (vLLM's modular fused MoE writes into a
            # buffer of its workspace manager) or a receive buffer of the ring: the send
            # gets its own copy.
            output = output.clone(memory_format=torch.contiguous_format)
        else:
            output = output.contiguous()
        try:
            with t.grouped_ops():  # every peer's slice: one launch
                for i, part in _peer_rows(rows):
                    if self._active_peers[i]:
                        self._post_return(t, i, output, part, layer, microbatch)
        except TransportError as exc:  # the launch of a device transport (no peer loss there)
            raise self._launch_error("returning", layer, microbatch, exc) from None

    def _post_return(self, t, i: int, output, part: slice, layer: int, microbatch: int) -> None:
        """Post the send of peer i's rows of the output."""
        try:
            handle = t.isend(output[part], i + 1, data_tag(layer, microbatch, KIND_HIDDEN))
        except TransportError as exc:
            self._lose_peer_or_raise(i, self._return_error(i, layer, microbatch, exc))
            return
        # the output stays referenced until settle_sends joins the send (see Exchange)
        self._pending_sends.append((i, layer, microbatch, handle, output))

    def _return_error(self, i, layer, microbatch, exc) -> AFDPeerError:
        return AFDPeerError(
            f"{self._me()} returning layer {layer} (micro-batch {microbatch}) of step "
            f"{self._peer_step[i] - 1} to attention rank {self.peers[i]}: {exc}"
        )

    def settle_sends(self) -> None:
        self._require("ffn")
        try:
            for i, layer, mb, handle, _sent in self._pending_sends:
                try:
                    handle.wait()
                except TransportError as exc:
                    self._lose_peer_or_raise(i, self._return_error(i, layer, mb, exc))
        finally:
            self._pending_sends.clear()

    def finish_step(self, failure: StepStatus | None = None) -> None:
        """End the step: every output delivered, and each live peer told how it went."""

        t = self._require("ffn")
        plan = self._require_plan()
        status = failure or StepStatus(self._step, ffn_rank=self.role_rank)
        step_of = {m.sender_rank: m.step for m in plan.live}  # each peer counts its own steps
        handles = []
        try:
            self.settle_sends()
            for i, peer in enumerate(self.peers):
                if peer not in step_of or not self._active_peers[i]:
                    continue
                payload = status_payload(dataclasses.replace(status, step=step_of[peer]))
                try:
                    handles.append((i, t.isend_status(payload, i + 1)))
                except TransportError as exc:
                    self._lose_peer_or_raise(i, self._end_error(i, step_of, exc))
            for i, handle in handles:
                try:
                    handle.wait()
                except TransportError as exc:
                    self._lose_peer_or_raise(i, self._end_error(i, step_of, exc))
        finally:
            for i, peer in enumerate(self.peers):
                if peer in step_of:
                    self._peer_served(i)  # its silence counts again (inbox.py)
            self._pending_sends.clear()
            self._plan = None
            self._step += 1
            busy = now() - self._busy_since
            self.metrics.count_step(failure is not None, busy)
            self.metrics.add("ffn_busy_seconds", busy)
            if not plan.flags & ControlFlag.CAPTURE:
                self._count_bytes(plan)
            self.metrics.publish()

    def _count_bytes(self, plan) -> None:
        """The step's payload per peer still served (a peer lost during the step: none)."""
        inward, out = self.row_bytes()
        layers = self.wire.num_exchange_layers
        for i, peer in enumerate(self.peers):
            if self._active_peers[i]:
                rows = sum(mb[i] for mb in plan.rows) * layers
                if rows:
                    self.metrics.add_bytes(peer, rows * out, rows * inward)

    def _end_error(self, i: int, step_of: dict, exc) -> AFDPeerError:
        return AFDPeerError(
            f"{self._me()} ending step {step_of[self.peers[i]]} with attention rank "
            f"{self.peers[i]}: {exc}"
        )

    def abort(self, reason: str) -> None:
        """Tell every live peer this FFN rank stops (best effort), so they stop at once
        with this reason instead of seeing a closed connection only."""

        t = self._transport
        if t is None or self._closed:
            return
        status = StepStatus(self._step, StatusCode.ABORT, ffn_rank=self.role_rank, reason=reason)
        payload = status_payload(status)
        handles = []
        for i, _ in enumerate(self.peers):
            if not self._active_peers[i]:
                continue
            try:
                handles.append(t.isend_status(payload, i + 1))
            except Exception:  # noqa: BLE001 - the peer may be gone already
                logger.debug("AFD %s: abort not delivered", self._me(), exc_info=True)
        # A peer inside a step has the status receive posted and takes it at once; an idle
        # peer never will, so wait only briefly before this rank goes down.
        deadline = time.monotonic() + ABORT_DELIVERY_S
        for handle in handles:
            try:
                handle.wait(max(deadline - time.monotonic(), 0.01))
            except TransportError:
                pass


def _shares_memory(a, b) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:
        return False

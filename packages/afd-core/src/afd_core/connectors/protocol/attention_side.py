"""The attention side of a point-to-point step: announce it, exchange every layer of every
micro-batch in the order the FFN rank expects, end it with the FFN rank's status, or
finish a failed step in protocol with rows of zeros (`abort_step`). A failed channel with
the FFN rank goes to `_ffn_failure` (admission/ffn_return.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_core.connectors.base import (
    AFDPeerError,
    AFDStepError,
)
from afd_core.connectors.protocol.control import (
    ControlFlag,
    ControlMessage,
)
from afd_core.connectors.protocol.data_tags import KIND_HIDDEN, KIND_LOGITS, KIND_TOKENS, data_tag
from afd_core.connectors.protocol.order import AttentionOrder
from afd_core.connectors.protocol.status import (
    STATUS_LEN,
    StatusCode,
    StatusError,
    StepStatus,
    decode_status,
)
from afd_core.connectors.transports.transport import Handle, TransportError
from afd_core.log import get_logger
from afd_core.trace import now

logger = get_logger(__name__)

# what the FFN rank did, by the status code that says so
_TOLD = {StatusCode.ABORT: "stopped the deployment", StatusCode.DROPPED: "dropped this rank"}
STATUS_GRACE_S = 0.5  # how long a failed exchange waits for the FFN rank's reason


class Exchange:
    """One layer/micro-batch in flight on the attention side: the FFN output's receive is
    posted, the rows are sent. `wait()` returns the FFN output."""

    def __init__(self, connector, layer: int, microbatch: int, out, handles: list[Handle], sent=()):
        self._connector = connector
        self.layer = layer
        self.microbatch = microbatch
        self.out = out
        self._handles = handles  # receive first, then the sends
        # the tensors being sent, alive until the sends are joined: while a graph is
        # captured no allocator stream use is recorded, and a temporary freed earlier would
        # go back to the graph's pool for the next micro-batch's kernels to overwrite
        self._sent = sent
        self.done = False

    def wait(self):
        if not self.done:
            self._connector._complete_exchange(self)
        return self.out


@dataclass
class _AttentionStep:
    """What the attention side tracks of the step in flight."""

    number: int
    rows: tuple[int, ...]
    control: Handle
    status_buf: object
    status: Handle
    next_layer: list[int]
    inflight: dict[int, Exchange]
    order: AttentionOrder  # the exchanges in the order the FFN rank expects them
    flags: ControlFlag = ControlFlag.NONE  # as announced (CAPTURE: nothing really moves)
    started: float = 0.0  # when its control message was posted (trace.now)


class AttentionSide:
    """PointToPointConnector's attention side (a mixin: the connector's state is its own)."""

    # the next step's `senders` word (protocol/control.py), set by step/served_together.py
    # just before the step begins; 0: not told
    step_senders = 0

    # -- attention side ---------------------------------------------------------------------
    def _send_words(self, words: list[int]) -> Handle:
        import torch

        return self._transport.isend_control(torch.tensor(words, dtype=torch.int64), 0)

    def begin_step(self, tokens: tuple[int, ...], flags: int = 0) -> ControlMessage:
        # a heartbeat (heartbeat.py) in flight finishes first: their messages never interleave
        with self.control_lock:
            return self._begin_step(tokens, flags)

    def _begin_step(self, tokens: tuple[int, ...], flags: int) -> ControlMessage:
        import torch

        senders, self.step_senders = self.step_senders, 0  # for this step only
        if self._fatal is not None:  # a heartbeat found the FFN rank gone, where that is fatal
            raise self._fatal
        if self._ffn_lost is not None:  # fails at once while no FFN rank serves this one
            self._count_step(failed=True)
            raise self._ffn_lost_error()
        t = self._require("attention")
        if self._current is not None:
            raise AFDPeerError(
                f"{self._me()}: step {self._current.number} was neither ended nor aborted "
                "before the next one began"
            )
        msg = ControlMessage(
            self.role_rank,
            self._step,
            tuple(tokens),
            self.wire.hidden_size,
            self.wire.dtype,
            ControlFlag(flags),
            senders,
        )
        words = msg.encode()  # validates before anything is sent
        self._bound_step(msg.flags)
        started = now()
        status_buf = torch.empty(STATUS_LEN, dtype=torch.uint8)
        try:
            # the status receive first: the FFN rank may answer before the control send
            # is reported complete here
            status = t.irecv_status(status_buf, 0)
            control = self._send_words(words)
        except TransportError as exc:
            raise self._ffn_failure(
                f"{self._me()} could not start step {self._step} with {self._peer_name(0)}: {exc}"
            ) from None
        for rows in msg.tokens:
            self.metrics.rows.observe(rows)
        self._current = _AttentionStep(
            number=self._step,
            rows=msg.tokens,
            control=control,
            status_buf=status_buf,
            status=status,
            next_layer=[0] * len(msg.tokens),
            inflight={},
            order=AttentionOrder(self.wire.num_exchange_layers, msg.tokens),
            flags=msg.flags,
            started=started,
        )
        self._step += 1
        return msg

    def _step_or_raise(self) -> _AttentionStep:
        if self._current is None:
            raise AFDPeerError(f"{self._me()}: no step is in flight (begin_step first)")
        return self._current

    def start_exchange(
        self,
        hidden_states,
        layer: int,
        microbatch: int = 0,
        router_logits=None,
        out=None,
        token_ids=None,
    ) -> Exchange:
        import torch

        t = self._require("attention")
        step = self._step_or_raise()
        self.check_tensor(hidden_states)
        if not 0 <= microbatch < len(step.rows):
            raise AFDPeerError(
                f"{self._me()}: micro-batch {microbatch} of step {step.number}, which announced "
                f"{len(step.rows)} micro-batch(es)"
            )
        rows = hidden_states.shape[0]
        if step.rows[microbatch] != rows:
            raise AFDPeerError(
                f"{self._me()}: layer {layer} micro-batch {microbatch} has {rows} rows but the "
                f"control message of step {step.number} announced {step.rows[microbatch]}"
            )
        if layer != step.next_layer[microbatch] or microbatch in step.inflight:
            raise AFDPeerError(
                f"{self._me()}: micro-batch {microbatch} of step {step.number} exchanged layer "
                f"{layer}, but layer {step.next_layer[microbatch]} is next (exchanges run in "
                "layer order, one at a time per micro-batch)"
            )
        if self.wire.router_width and router_logits is None:
            raise AFDPeerError(
                f"{self._me()}: layer {layer} has no router logits, but the gate runs on "
                "attention (compute_gate_on_attention)"
            )
        if self.wire.token_ids and token_ids is None:
            raise AFDPeerError(
                f"{self._me()}: layer {layer} has no token ids, but the model routes by token "
                "id (the wire carries them)"
            )
        if rows:
            step.order.issue(layer, microbatch, f"{self._me()} in step {step.number}")
        if len(step.rows) > 1:
            # other micro-batches compute while this send is in flight: it gets its own copy
            # of the rows, whatever memory the model reuses for them
            hidden_states = hidden_states.clone(memory_format=torch.contiguous_format)
        else:
            hidden_states = hidden_states.contiguous()
        if out is None:
            out = torch.empty_like(hidden_states)
        handles: list[Handle] = []
        sent = [hidden_states]
        if rows:
            try:
                handles.append(t.irecv(out, 0, data_tag(layer, microbatch, KIND_HIDDEN)))
                with t.grouped_ops():  # the rows, logits and token ids: one launch
                    handles.append(
                        t.isend(hidden_states, 0, data_tag(layer, microbatch, KIND_HIDDEN))
                    )
                    if self.wire.router_width:
                        sent.append(router_logits.contiguous())
                        handles.append(
                            t.isend(sent[-1], 0, data_tag(layer, microbatch, KIND_LOGITS))
                        )
                    if self.wire.token_ids:
                        sent.append(token_ids.to(torch.int64).contiguous())
                        handles.append(
                            t.isend(sent[-1], 0, data_tag(layer, microbatch, KIND_TOKENS))
                        )
            except TransportError as exc:
                raise self._exchange_error(step, layer, microbatch, exc) from None
        ex = Exchange(self, layer, microbatch, out, handles, tuple(sent))
        step.inflight[microbatch] = ex
        return ex

    def _complete_exchange(self, ex: Exchange) -> None:
        step = self._step_or_raise()
        t0 = now()
        try:
            for h in ex._handles:
                h.wait()
            t1 = now()
            self._trace.add("wait", t0, t1)
            self.metrics.exchange_wait.observe(t1 - t0)
        except TransportError as exc:
            raise self._exchange_error(step, ex.layer, ex.microbatch, exc) from None
        finally:
            ex.done = True
            ex._sent = ()  # joined into the caller's stream: later work is ordered after
            step.inflight.pop(ex.microbatch, None)
        step.next_layer[ex.microbatch] = ex.layer + 1

    def exchange(self, hidden_states, layer: int, microbatch: int = 0, router_logits=None):
        """Blocking form: send the rows of one layer/micro-batch, return the FFN output."""
        return self.start_exchange(hidden_states, layer, microbatch, router_logits).wait()

    def _ffn_status_now(self, step: _AttentionStep) -> StepStatus | None:
        """After a failed exchange: the FFN rank's status for this step if it arrived (its
        reason for stopping), else None. Only called once the connection already failed,
        so the short wait cannot hurt a healthy step."""
        try:
            step.status.wait(STATUS_GRACE_S)
            return decode_status(bytes(step.status_buf.numpy()), self.group)
        except (TransportError, StatusError):
            return None

    def _told(self, status: StepStatus, when: str) -> Exception | None:
        """The failure to raise where the FFN rank said it stops (ABORT) or dropped this
        rank (DROPPED), with its reason; None for another status."""
        what = _TOLD.get(status.code)
        if what is None:
            return None
        return self._ffn_failure(
            f"{self._me()}: {self._peer_name(0)} {what} {when}: {status.reason}"
        )

    def _exchange_error(self, step, layer, microbatch, exc) -> Exception:
        where = f"layer {layer} (micro-batch {microbatch}) of step {step.number}"
        status = self._ffn_status_now(step)
        if status is not None and (told := self._told(status, f"during {where}")):
            return told
        return self._ffn_failure(
            f"{self._me()} exchanging {where} with {self._peer_name(0)}: {exc}"
        )

    def end_step(self) -> None:
        """Finish the step in flight: every micro-batch exchanged every layer, and the FFN
        rank computed them all. AFDStepError if the FFN rank reported the step failed."""
        step = self._step_or_raise()
        missing = [
            f"micro-batch {mb} stopped at layer {n}"
            for mb, n in enumerate(step.next_layer)
            if step.rows[mb] and n != self.wire.num_exchange_layers
        ]
        if missing or step.inflight:
            raise AFDPeerError(
                f"{self._me()}: step {step.number} ended before all "
                f"{self.wire.num_exchange_layers} layers were exchanged: "
                + "; ".join(missing or [f"micro-batch(es) {sorted(step.inflight)} in flight"])
            )
        status = self._finish(step)
        self._count_step(failed=status.code == StatusCode.STEP_FAILED, step=step)
        if status.code == StatusCode.STEP_FAILED:
            raise AFDStepError(
                f"{self._peer_name(0)} failed {status.where()} for {self._me()}: {status.reason}"
            )

    def _count_step(self, failed: bool, step: _AttentionStep | None = None) -> None:
        """A step ended (`step`: one that ran, with the FFN rank's status taken): counted,
        timed, and its payload's bytes added (none moved in a capture)."""
        if step is None:
            self.metrics.count_step(failed)
        else:
            self.metrics.count_step(failed, now() - step.started)
            if not step.flags & ControlFlag.CAPTURE:
                rows = sum(step.rows) * self.wire.num_exchange_layers
                out, back = self.row_bytes()
                self.metrics.add_bytes(self.group, rows * out, rows * back)
        self.metrics.publish()

    def _ffn_gone(self) -> None:
        """This rank is not served by its FFN rank: its /metrics says so at once."""
        self.metrics.set_peers([self.group], False)
        self.metrics.publish(now=True)

    def _finish(self, step: _AttentionStep) -> StepStatus:
        self._current = None
        where = f"step {step.number}"
        try:
            step.control.wait()
            step.status.wait()
            status = decode_status(bytes(step.status_buf.numpy()), self.group)
        except TransportError as exc:
            raise self._ffn_failure(
                f"{self._me()} waiting for {self._peer_name(0)} to end {where}: {exc}"
            ) from None
        except StatusError as exc:
            raise AFDPeerError(f"{self._me()}: {exc}") from None
        if told := self._told(status, f"at {where}"):
            raise told
        if status.step != step.number:
            raise AFDPeerError(
                f"{self._me()}: {self._peer_name(0)} ended step {status.step}, but this rank "
                f"is at step {step.number}"
            )
        return status

    def mark_exchanged(self) -> None:
        step = self._step_or_raise()
        if step.inflight:
            raise AFDPeerError(
                f"{self._me()}: step {step.number} was replayed from a graph, but "
                f"micro-batch(es) {sorted(step.inflight)} exchanged in Python"
            )
        step.next_layer = [self.wire.num_exchange_layers] * len(step.rows)
        step.order.issue_all()
        self.watch_replay(f"the replayed exchanges of step {step.number} with {self._peer_name(0)}")

    def watch_replay(self, what: str) -> None:
        try:
            self._transport.watch_device_work(what)
        except TransportError as exc:
            raise AFDPeerError(f"{self._me()}: {exc}") from None

    def abort_step(self) -> str:
        """Finish the step in flight after a local failure: complete what is in flight,
        exchange rows of zeros for every layer not yet exchanged, and take the status, so
        the FFN rank stays in step and the next step can run. Returns where each
        micro-batch had stopped; AFDPeerError if the transport cannot (then the deployment
        cannot go on).

        A step announced as a graph capture moved nothing on either side: the FFN rank
        recorded its whole step and already sent its status, and this rank's operations
        were recorded into a capture that failed and will never run. Zeros would pair with
        the next step's operations, so only the status is taken."""
        step = self._current
        if step is None:
            return ""
        stopped = ", ".join(
            f"micro-batch {mb} at layer {n}"
            for mb, n in enumerate(step.next_layer)
            if step.rows[mb]
        )
        if step.flags & ControlFlag.CAPTURE:
            step.inflight.clear()  # recorded, never launched: nothing to wait for
            self._finish(step)
            self._count_step(failed=True, step=step)
            return f"a graph capture, nothing moved; {stopped}"
        for mb in sorted(step.inflight):
            step.inflight[mb].wait()
        zeros = {mb: self._zero_rows(rows) for mb, rows in enumerate(step.rows) if rows}
        # in the order the FFN rank walks the step (layer-major, micro-batch-minor): every
        # micro-batch that still owes a layer posts it, then the layer's are waited for
        by_layer: dict[int, list[int]] = {}
        for layer, mb in step.order.remaining():
            by_layer.setdefault(layer, []).append(mb)
        for layer, mbs in by_layer.items():
            posted = [
                self.start_exchange(zeros[mb][0], layer, mb, zeros[mb][1], token_ids=zeros[mb][2])
                for mb in mbs
            ]
            for ex in posted:
                ex.wait()
        self._finish(step)
        self._count_step(failed=True, step=step)
        return stopped

    def _zero_rows(self, rows: int) -> tuple:
        """Rows of zeros as an aborted step sends them: (hidden, router logits, token ids)."""
        import torch

        return self._wire_tensors(rows, torch.zeros)

"""How an FFN rank assembles a step from its peers' control messages.

The first message to come starts a step, however long the servers are idle; then every
rank of its attention server is waited for (they step together; bounded by the step
timeout, naming who is missing) and whatever else already arrived joins. A capture is
served alone; goodbyes alone are no step. Where the transport's links fail alone, a peer
whose control channel fails, whose message is malformed or out of step, or that comes
later than its server's other ranks by the step timeout is dropped, and the others are
served on; elsewhere any of these stops the FFN rank.

A member of an expert group also serves the group's steps that none of its active peers
send (their attention server's `senders` word, step/served_together.py), with no rows:
its peer may be held, lost or rejoining while its siblings step on.
"""

from __future__ import annotations

from afd_core.connectors.base import (
    AFDPeerError,
    StepPlan,
)
from afd_core.connectors.protocol.control import (
    ControlError,
    ControlFlag,
    ControlMessage,
    Expectation,
    decode,
)
from afd_core.connectors.protocol.ffn_side import status_payload
from afd_core.connectors.protocol.inbox import (
    ControlInbox,
    GroupStepBegun,
    RejoinReady,
    StopServing,
)
from afd_core.connectors.protocol.order import FFNOrder
from afd_core.connectors.protocol.status import StepStatus
from afd_core.connectors.transports.transport import TransportError
from afd_core.log import get_logger
from afd_core.trace import now

logger = get_logger(__name__)


class FFNStepAssembly:
    """PointToPointConnector's step assembly (a mixin: the connector's state is its own)."""

    # -- FFN side ------------------------------------------------------------------------------
    def recv_control(self) -> StepPlan:
        """The next step's control messages: blocks until some peer announces a step, then
        takes every peer of the same attention server(s) (they step together) and whatever
        other peers already announced; the rest join a later step (their servers step on
        their own)."""
        self._require("ffn")
        waiting_since = now()
        if self._inbox is None:
            # where links fail alone, a silent idle peer is lost within liveness_timeout_s
            live = self.survives_peer_loss
            self._inbox = ControlInbox(
                self._transport,
                len(self.peers),
                self._me(),
                liveness_s=self.config.extra().liveness_timeout_s if live else None,
                on_heartbeat=self._answer_heartbeat if live else None,
                # a peer waits this long for its step to be served, then gives up on us
                answer_bound_s=lambda flags: self.step_bound_s(flags, "attention"),
            )
            self._inbox.start()
            if self.survives_peer_loss:
                self._start_rejoin_watch()  # admission/rejoin.py
            if self._stop_reason is not None:  # stop_serving came before the first step
                self._inbox.put(0, StopServing(self._stop_reason))
        while True:
            if self._owes_group_step():
                arrived = {}  # the expert group's step, with no rows of this rank's peers
                break
            arrived = self._gather_control()
            # only goodbyes (or a departed peer's last socket error): no step to serve
            if any(not m.is_shutdown for m in arrived.values()) or self.all_peers_left:
                break
        messages = [arrived[i] for i in sorted(arrived)]
        by_peer = {m.sender_rank: m for m in messages if not m.is_shutdown}
        # peers may split into different numbers of micro-batches: the FFN rank serves the
        # most any peer announced, and a peer with fewer (or none this step) sends no rows
        n_mb = max((m.num_microbatches for m in by_peer.values()), default=0)
        rows = tuple(
            tuple(
                by_peer[p].tokens[mb] if p in by_peer and mb < by_peer[p].num_microbatches else 0
                for p in self.peers
            )
            for mb in range(n_mb)
        )
        flags = ControlFlag.NONE
        for m in by_peer.values():
            flags |= m.flags
        self._plan = StepPlan(self._step, tuple(messages), rows, flags)
        self._bound_step(flags)
        self._ring_next = 0  # every step uses the buffers in the same order (graph replay)
        self._recv_order = FFNOrder(n_mb, "receive")
        self._send_order = FFNOrder(n_mb, "send")
        self._busy_since = now()
        self.metrics.add("ffn_idle_seconds", self._busy_since - waiting_since)
        self.metrics.begin_step(self._transport.timeout_s)  # as _bound_step set it
        for mb_rows in rows:
            self.metrics.rows.observe(sum(mb_rows))
        return self._plan

    def _gather_control(self) -> dict[int, ControlMessage]:
        """One step's control messages by peer index: the first to come (however long the
        servers are idle), then every rank of its server (bounded by the step timeout: a
        server's ranks step together) and whatever else already arrived."""
        held, self._held_control = self._held_control, []
        timeout_s = self._transport.timeout_s

        def next_item(block: bool, timeout: float | None = None):
            item = held.pop(0) if held else self._inbox.get(block, timeout)
            if item is ControlInbox.CLOSED:
                raise AFDPeerError(f"{self._me()}: closed while waiting for the next step")
            return item

        arrived: dict[int, ControlMessage] = {}
        self._take_control(next_item(True), arrived)
        while True:
            servers = {self._peer_server[i] for i in arrived}
            missing = [
                j
                for j in range(len(self.peers))
                if self._active_peers[j] and j not in arrived and self._peer_server[j] in servers
            ]
            item = next_item(bool(missing), timeout_s if missing else None)
            if item is None:
                if missing:
                    ranks = ", ".join(str(self.peers[j]) for j in missing)
                    late = AFDPeerError(
                        f"{self._me()}: attention rank(s) {ranks} did not announce their next "
                        f"step within {timeout_s:.0f}s of the other ranks of their server "
                        "(the ranks of one attention server step together)"
                    )
                    # where links fail alone, the late ranks are lost, not the FFN rank
                    for j in missing:
                        self._lose_peer_or_raise(j, late)
                return arrived
            self._take_control(item, arrived)

    def serve_group_steps(self, group) -> None:
        """This FFN rank is a member of `group` (step/expert_group.py): it takes part in
        every group step whose senders (the control messages' word) include none of its
        active peers, with no rows: a member whose peer is held, lost, or rejoining does
        not stop the others' steps."""
        self._group_senders = group.pending_senders
        group.on_vector = self._wake_for_group_step

    def _wake_for_group_step(self) -> None:
        """A receive thread got another member's vector: wake the serving thread only if
        it owes the group this step (on most steps its own peers send, and it is woken by
        their control messages). No wake is lost: while the serving thread waits, only
        this vector can change the answer; whatever it does itself (a peer dropped or
        admitted) it checks again before it waits (recv_control)."""
        if self._inbox is not None and self._owes_group_step():
            self._inbox.put(0, GroupStepBegun())

    def _owes_group_step(self) -> bool:
        """Another member began a group step that none of this rank's active peers send."""
        senders = self._group_senders() if self._group_senders is not None else 0
        if not senders:
            return False
        return not any(
            self._active_peers[j] and senders >> (peer - self._peer_server[j]) & 1
            for j, peer in enumerate(self.peers)
        )

    def stop_serving(self, reason: str) -> None:
        """Any thread: this FFN rank stops, raising AFDPeerError(reason) where its serving
        thread next waits for a step (at once when idle; a step in flight ends first)."""
        self._stop_reason = reason
        if self._inbox is not None:
            self._inbox.put(0, StopServing(reason))

    def _take_control(self, item, arrived: dict[int, ControlMessage]) -> None:
        """Check one peer's control message and add it to the step, or hold it back for the
        next step: a capture is served alone (its peers record their operations, nothing
        moves), never in the same step as another server's real one."""
        i, payload = item
        if isinstance(payload, GroupStepBegun):
            return  # recv_control looks whether this rank owes the group the step
        if isinstance(payload, RejoinReady):
            self._admit(i, payload)
            return
        if isinstance(payload, StopServing):  # admission/group_epoch.py: this rank must stop
            raise AFDPeerError(payload.reason)
        if not self._active_peers[i]:
            return  # a peer that left: its listener's last receive failed
        peer = self.peers[i]
        if isinstance(payload, TransportError):
            self._lose_peer_or_raise(i, self._control_error(i, payload))
            return
        if i in arrived:  # cannot happen: a peer sends its next step after this one ends
            raise AFDPeerError(
                f"{self._me()}: attention rank {peer} announced a second step before its "
                f"step {arrived[i].step} was served"
            )
        expect = Expectation(peer, self.wire.hidden_size, self.wire.dtype, self._peer_max_tokens[i])
        try:
            msg = decode(payload, expect)
        except ControlError as exc:
            # a malformed message costs its sender (where links fail alone), not the others
            self._lose_peer_or_raise(i, AFDPeerError(f"{self._me()}: {exc}"))
            return
        if msg.is_heartbeat:
            return  # answered by its listener (a transport whose links fail alone)
        if msg.step != self._peer_step[i]:
            self._lose_peer_or_raise(
                i,
                AFDPeerError(
                    f"{self._me()}: attention rank {peer} announced step {msg.step}, but step "
                    f"{self._peer_step[i]} is next for it (a control message was lost or sent "
                    "twice; the two sides are out of step)"
                ),
            )
            return
        if not msg.is_shutdown and self._peer_server[i] not in {
            self._peer_server[j] for j in arrived
        }:
            live = [m for m in arrived.values() if not m.is_shutdown]
            if live and bool(live[0].flags & ControlFlag.CAPTURE) != bool(
                msg.flags & ControlFlag.CAPTURE
            ):
                self._held_control.append(item)
                return
        if msg.is_shutdown:
            self._active_peers[i] = False
            self._peer_left[i] = True
            self._release_claim(i)
            self.metrics.set_peers([peer], False)
            self.metrics.publish(now=True)
            logger.info("AFD %s: attention rank %d left the deployment", self._me(), peer)
        else:
            self._peer_step[i] += 1
        arrived[i] = msg

    def _answer_heartbeat(self, i: int, words: list[int]) -> None:
        """Listener thread: peer i is idle and alive; answer at once (heartbeat.py).
        TransportError for a heartbeat that cannot be accepted: the peer is dropped."""

        expect = Expectation(
            self.peers[i], self.wire.hidden_size, self.wire.dtype, self._peer_max_tokens[i]
        )
        try:
            msg = decode(words, expect)
        except ControlError as exc:
            raise TransportError(f"a heartbeat this rank cannot accept: {exc}") from None
        answer = StepStatus(msg.step, ffn_rank=self.role_rank)
        self._transport.isend_status(status_payload(answer), i + 1).wait()

    def _control_error(self, i: int, exc) -> AFDPeerError:
        return AFDPeerError(
            f"{self._me()} waiting for the next step from attention rank {self.peers[i]}: {exc}"
        )

    def peer_servers(self) -> list[int]:
        """FFN side, after init: the attention server (its first rank) of each peer."""
        self._require("ffn")
        return list(self._peer_server)

    @property
    def all_peers_left(self) -> bool:
        """Every peer said goodbye: the deployment stops. While a lost peer may still
        come back (admission/rejoin.py), the FFN rank waits for it."""
        if self.survives_peer_loss:
            return all(self._peer_left)
        return not any(self._active_peers)

    def rows_per_peer(self, microbatch: int) -> tuple[int, ...]:
        return self._require_plan().rows[microbatch]

    def _require_plan(self) -> StepPlan:
        if self._plan is None:
            raise AFDPeerError(f"{self._me()}: no step in flight (recv_control first)")
        return self._plan

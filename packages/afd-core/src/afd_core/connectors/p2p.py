"""Point-to-point AFD protocol logic, independent of the transport.

Each FFN rank k forms a group with its attention peers (topology.peers_of(k)): the FFN rank
is group rank 0, peer i is group rank i + 1. Start-up: every member publishes a hello in the
rendezvous store; the FFN rank checks that all peers agree with it (ranks, shape, dtype,
layers) and publishes a verdict that every peer waits for, so a mismatch fails both sides
with the same message.

One step (docs/protocol.md): the attention rank sends a control message (rows per
micro-batch, step number, flags) and posts the receive of the step's status; then per
layer and micro-batch it posts the receive of the FFN output and sends its rows; the FFN
rank posts the receives of all its peers at once, computes, sends each peer its slice, and
ends the step with a status message per peer (on the control channel). Every operation is
asynchronous; on gloo, tags encode (layer, micro-batch, kind), so an ordering bug is an
error that names the layer, never mixed-up data; both sides issue the data operations in
the same order, so a channel that matches in issue order (NCCL) needs no tags. A step that
failed on either side is finished in protocol (rows of zeros) so the next step starts in
step; only a transport failure ends the deployment.

The connector is one class over six modules, one job each: start-up membership
(`admission/membership.py`), a restarted attention server's return (`admission/rejoin.py`),
the attention side of a step (`protocol/attention_side.py`) and its wait for a lost FFN rank
(`admission/ffn_return.py`), how the FFN rank assembles a step (`protocol/ffn_assembly.py`)
and its data path (`protocol/ffn_side.py`); the order both sides check is
`protocol/order.py`, the tags `protocol/data_tags.py`.
"""

from __future__ import annotations

import threading
from abc import abstractmethod

from afd_core.connectors.admission.ffn_return import AwaitingFFN, FFNReturnWatch
from afd_core.connectors.admission.group_epoch import GroupEpochs
from afd_core.connectors.admission.membership import FAILED_KEY, StartupMembership
from afd_core.connectors.admission.rejoin import Rejoining, RejoinWatch
from afd_core.connectors.base import (
    ATTENTION_WAIT_FACTOR,
    AFDConnector,
    AFDPeerError,
    StepPlan,
    WireSpec,
)
from afd_core.connectors.protocol.attention_side import AttentionSide, Exchange, _AttentionStep
from afd_core.connectors.protocol.control import (
    ControlFlag,
    ControlMessage,
)
from afd_core.connectors.protocol.data_tags import data_tag
from afd_core.connectors.protocol.ffn_assembly import FFNStepAssembly
from afd_core.connectors.protocol.ffn_side import FFNDataPath, PendingBatch
from afd_core.connectors.protocol.heartbeat import Heartbeat
from afd_core.connectors.protocol.inbox import ControlInbox
from afd_core.connectors.protocol.order import FFNOrder
from afd_core.connectors.transports.rendezvous import _listening
from afd_core.connectors.transports.transport import Transport, TransportError
from afd_core.log import get_logger
from afd_core.metrics import RoleMetrics, SnapshotShare
from afd_core.topology import Topology
from afd_core.trace import trace_for

logger = get_logger(__name__)

__all__ = ["Exchange", "PendingBatch", "PointToPointConnector", "data_tag"]


class PointToPointConnector(
    StartupMembership,
    Rejoining,
    GroupEpochs,
    AttentionSide,
    AwaitingFFN,
    FFNStepAssembly,
    FFNDataPath,
    AFDConnector,
):
    def __init__(self, config, role_rank: int, wire: WireSpec):
        super().__init__(config, role_rank, wire)
        self.topology = Topology(config.num_attention_ranks, config.num_ffn_ranks)
        if config.is_ffn:
            self.group = role_rank
            self.peers = self.topology.peers_of(role_rank)  # validates the rank
            self.group_rank = 0
        else:
            self.group = self.topology.ffn_rank_of(role_rank)  # validates the rank
            self.peers = self.topology.peers_of(self.group)
            self.group_rank = 1 + self.peers.index(role_rank)
        self.group_size = 1 + len(self.peers)
        self._transport: Transport | None = None
        self._lock = threading.Lock()
        # attention: a step's control message and a heartbeat go one at a time
        self.control_lock = threading.Lock()
        self._heartbeat: Heartbeat | None = None
        self._fatal: AFDPeerError | None = None  # attention: raised by the next step
        self._closed = False
        self._step = 0  # attention: the next step's number; FFN: steps served
        self._current: _AttentionStep | None = None  # attention: the step in flight
        self._formed = False  # init() connected this rank (a loss after it may be waited out)
        self._ffn_lost: str | None = None  # attention: why no FFN rank serves this one now
        self._ffn_lost_at = 0.0
        self._ffn_watch: FFNReturnWatch | None = None
        # FFN side
        self._plan: StepPlan | None = None
        self._active_peers: list[bool] = [True] * len(self.peers)
        self.peers_lost: list[int] = []  # attention ranks dropped after their channel failed
        self.peers_rejoined: list[int] = []  # attention ranks whose restart was taken back
        self._peer_left = [False] * len(self.peers)  # gone with a goodbye (not lost)
        self._peer_server: list[int] = [0] * len(self.peers)  # peers of one server step together
        self._inbox: ControlInbox | None = None
        self._stop_reason: str | None = None  # FFN side: stop_serving's, for the inbox
        # FFN side, in an expert group: its pending_senders (serve_group_steps)
        self._group_senders = None
        self._rejoin_watch: RejoinWatch | None = None
        self._peer_max_tokens: list[int | None] = [None] * len(self.peers)
        self._peer_step: list[int] = [0] * len(self.peers)  # the step each peer must send next
        self._held_control: list = []  # control messages held back to the next step
        # the order of the step's receives and sends (set per step by recv_control)
        self._recv_order, self._send_order = FFNOrder(1, "receive"), FFNOrder(1, "send")
        self._pending_sends: list[tuple] = []  # peer, layer, mb, handle, the tensor sent
        # FFN side: two sets of receive buffers (rows, router logits, token ids) used in
        # turn, so the receive of the next layer/micro-batch lands in one while the other is
        # computed; each grows as needed (a fresh large tensor per layer costs an mmap and
        # page faults each time), or is allocated once (`fixed_receive_buffers`)
        self._ring: list[tuple | None] = [None, None]
        self._ring_next = 0
        self._trace = trace_for(config.role, role_rank)
        self.metrics = RoleMetrics(config.role, role_rank)  # on the server's /metrics
        self.metrics.info.update(connector=config.connector, server=str(config.start_rank))
        self._row_bytes: tuple[int, int] | None = None  # see row_bytes()
        self._share: SnapshotShare | None = None  # a server spanning hosts: share_metrics
        self._busy_since = 0.0  # FFN side: when the step in flight was assembled

    # -- hooks for a transport ----------------------------------------------------------
    @abstractmethod
    def new_transport(self, *args, **kwargs) -> Transport:
        """This connector's transport, built with StoreTransport's arguments."""

    def make_transport(self, group: int, group_rank: int, group_size: int) -> Transport:
        """The transport of this rank's AFD group (FFN rank 0 hosts the store)."""
        store_master = self.config.is_ffn and self.role_rank == 0
        return self._build_transport(group, group_rank, group_size, store_master, 1.0)

    def make_side_transport(
        self, name: str, group_rank: int, group_size: int, connect_scale: float
    ) -> Transport:
        """A transport for a group of this deployment outside the AFD protocol (the
        tensor-parallel workers of one FFN rank), on the same rendezvous store; its
        members wait up to connect_scale times the connect timeout for each other."""
        transport = self._build_transport(name, group_rank, group_size, False, connect_scale)
        transport.fresh_launch = group_size > 1  # the store may outlive the group's members
        transport.fail_key = FAILED_KEY  # a member whose deployment failed stops at once
        return transport

    def _build_transport(self, group, group_rank, group_size, store_master, connect_scale):
        extra = self.config.extra()
        transport = self.new_transport(
            self.config.host,
            self.config.port,
            group,
            group_rank,
            group_size,
            is_store_master=store_master,
            timeout_s=extra.timeout_s,
            connect_timeout_s=extra.connect_timeout_s * connect_scale,
        )
        # FFN rank 0 opens the rendezvous only after loading its weights: waiting for it is
        # start-up's bound (a side group's members start together: connect's)
        if connect_scale == 1.0:
            transport.formation_timeout_s = max(extra.startup_timeout_s, extra.connect_timeout_s)
        return transport

    def share_metrics(self, ranks: list[int]) -> None:
        if self._share is not None or self._closed:
            return
        self._share = SnapshotShare(self.metrics, self.config.start_rank, ranks, self._store_client)
        self.metrics.share = self._share
        self._share.start()

    def _store_client(self) -> Transport:
        """A rendezvous store client of its own, for a thread outside the protocol: the
        connector's client serves the serving path (the store serializes a client's round
        trips) and goes with the link when the FFN rank is lost (admission/ffn_return.py)."""
        if not _listening(self.config.host, self.config.port):  # FFN rank 0 gone: try later
            raise TransportError(f"nothing listens at {self.config.host}:{self.config.port}")
        transport = self.make_side_transport("metrics", 0, 1, connect_scale=1.0)
        transport.formation_timeout_s = None  # connect_timeout_s: the store is up already
        transport.open_store()
        return transport

    def row_bytes(self) -> tuple[int, int]:
        """(bytes one row carries from attention to FFN: hidden state, router logits, token
        id as the wire has them; bytes it carries back: the hidden state) per layer."""
        if self._row_bytes is None:
            import torch

            w = self.wire
            hidden = w.hidden_size * getattr(torch, w.dtype).itemsize
            logits = w.router_width * getattr(torch, w.router_dtype).itemsize
            self._row_bytes = (hidden + logits + 8 * w.token_ids, hidden)
        return self._row_bytes

    def _bound_step(self, flags) -> None:
        """Bound this step's waits (the transport takes the bound at each post, so it
        holds for every operation of the step): `step_bound_s`."""
        self._transport.timeout_s = self.step_bound_s(flags, self.config.role)

    def step_bound_s(self, flags, role: str) -> float:
        """How long `role`'s waits in a step with these flags last: a start-up step
        (STARTUP: the attention server's profiling run, compile warm-up and captures, whose
        first forward compiles) startup_timeout_s where it is longer, any other timeout_s
        on the FFN side and ATTENTION_WAIT_FACTOR x timeout_s on the attention side."""
        extra = self.config.extra()
        bound = extra.timeout_s
        if role == "attention":
            # the FFN rank waits up to timeout_s for a silent peer of the same step before
            # it drops it and answers the others: with one bound on both sides, every
            # other attention rank would give up on the FFN rank at that same moment (the
            # nemesis tier's partition of one attention host lost all of them)
            bound *= ATTENTION_WAIT_FACTOR
        return max(extra.startup_timeout_s, bound) if flags & ControlFlag.STARTUP else bound

    def check_tensor(self, tensor) -> None:
        return None

    # where this connector's own tensors live (receive buffers, zeros of an aborted step)
    device = "cpu"
    # receive buffers allocated once, for the most rows the peers may send, instead of
    # growing: their addresses never change (a captured device graph reads them)
    fixed_receive_buffers = False
    # FFN side: a lost attention peer is dropped and the others are served on (its
    # channels fail alone: transports/member_links.py); False for a transport without such links
    survives_peer_loss = False

    # -- naming, for error messages --------------------------------------------------------
    def _me(self) -> str:
        return f"{self.config.role} rank {self.role_rank}"

    def _peer_name(self, group_rank: int) -> str:
        if group_rank == 0:
            return f"FFN rank {self.group} ({self.config.host}:{self.config.port})"
        return f"attention rank {self.peers[group_rank - 1]}"

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def is_initialized(self) -> bool:
        return self._transport is not None and not self._closed

    def close(self) -> None:
        if self._ffn_watch is not None:
            self._ffn_watch.close()
        if self._heartbeat is not None:
            self._heartbeat.close()
        with self._lock:
            if self._closed or self._transport is None:
                self._closed = True
                if self._share is not None:
                    self._share.close()
                self.metrics.close()
                return
            self._closed = True
            transport = self._transport
        if self._inbox is not None:
            self._inbox.close()
        if self._rejoin_watch is not None:
            self._rejoin_watch.close()
        self.metrics.set_peers(self._metric_peers(), False)
        self.metrics.publish(now=True)
        if self._share is not None:
            self._share.close()  # after one last write: this rank's peers are gone
        self.metrics.close()
        if self.config.is_attention and self._current is None:
            try:  # tell the FFN rank we leave, so it stops instead of timing out
                with self.control_lock:
                    goodbye = self._send_words(
                        ControlMessage(
                            self.role_rank,
                            self._step,
                            (),
                            self.wire.hidden_size,
                            self.wire.dtype,
                            ControlFlag.SHUTDOWN,
                        ).encode()
                    )
                goodbye.wait()
            except Exception:
                logger.debug("AFD %s: goodbye not delivered", self._me(), exc_info=True)
        transport.close()

    def _metric_peers(self) -> list[int]:
        """The ranks `afd_peer_up` shows: the attention peers, or the FFN rank."""
        return list(self.peers) if self.config.is_ffn else [self.group]

    def _require(self, role: str) -> Transport:
        if self._ffn_lost is not None and not self._closed and role == "attention":
            raise self._ffn_lost_error()
        if self._transport is None or self._closed:
            raise AFDPeerError(f"{self._me()}: connector is not initialized or already closed")
        if self.config.role != role:
            raise RuntimeError(f"{self._me()}: this call belongs to the {role} side")
        return self._transport

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
the same order, so a channel that matches in issue order (NCCL) needs no tags. A step that failed on either side is finished in protocol (rows of zeros)
so the next step starts in step; only a transport failure ends the deployment.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass

from afd_core.connectors.base import (
    AFDConnector,
    AFDPeerError,
    AFDStepError,
    FFNBatch,
    StepPlan,
    WireSpec,
)
from afd_core.connectors.control import (
    MAX_MICROBATCHES,
    ControlError,
    ControlFlag,
    ControlMessage,
    Expectation,
    decode,
)
from afd_core.connectors.inbox import ControlInbox
from afd_core.connectors.order import AttentionOrder, FFNOrder
from afd_core.connectors.status import (
    STATUS_LEN,
    StatusCode,
    StatusError,
    StepStatus,
    decode_status,
)
from afd_core.connectors.transport import Handle, Transport, TransportError
from afd_core.log import get_logger
from afd_core.topology import Topology
from afd_core.trace import now, trace_for

logger = get_logger(__name__)

KIND_HIDDEN, KIND_LOGITS, KIND_TOKENS = 0, 1, 2
NUM_KINDS = 3
ABORT_DELIVERY_S = 1.0  # how long a stopping FFN rank waits for its peers to take the reason
STATUS_GRACE_S = 0.5  # how long a failed exchange waits for the FFN rank's reason
FAILED_KEY = "afd/failed"  # the store key holding why start-up failed, for every rank
FAILED_SEEN_KEY = "afd/failed/seen"  # ranks that left a failed start-up
TIMED_OUT_KEY = "afd/failed/timed-out"  # set when start-up failed because ranks never came
CLAIMS_KEY = "afd/claims"  # ranks that claimed a place (duplicates included)
ROLL_CALL_KEY = "afd/roll-call"  # ranks whose claim and deployment shape were accepted
FAILED_GRACE_S = 10.0  # at most this long the rank holding the store waits for them


def data_tag(layer: int, microbatch: int, kind: int) -> int:
    return ((layer * MAX_MICROBATCHES) + microbatch) * NUM_KINDS + kind


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


class PointToPointConnector(AFDConnector):
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
        self._closed = False
        self._step = 0  # attention: the next step's number; FFN: steps served
        self._current: _AttentionStep | None = None  # attention: the step in flight
        # FFN side
        self._plan: StepPlan | None = None
        self._active_peers: list[bool] = [True] * len(self.peers)
        self.peers_lost: list[int] = []  # attention ranks dropped after their channel failed
        self._peer_server: list[int] = [0] * len(self.peers)  # peers of one server step together
        self._inbox: ControlInbox | None = None
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
        return self._build_transport(name, group_rank, group_size, False, connect_scale)

    def _build_transport(self, group, group_rank, group_size, store_master, connect_scale):
        extra = self.config.extra()
        return self.new_transport(
            self.config.host,
            self.config.port,
            group,
            group_rank,
            group_size,
            is_store_master=store_master,
            timeout_s=extra.timeout_s,
            connect_timeout_s=extra.connect_timeout_s * connect_scale,
        )

    def check_tensor(self, tensor) -> None:
        return None

    # where this connector's own tensors live (receive buffers, zeros of an aborted step)
    device = "cpu"
    # receive buffers allocated once, for the most rows the peers may send, instead of
    # growing: their addresses never change (a captured device graph reads them)
    fixed_receive_buffers = False
    # FFN side: a lost attention peer is dropped and the others are served on (its
    # channels fail alone); False where one communicator spans the group (NCCL, HCCL)
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

    def init(self) -> None:
        if self._transport is not None:
            return
        transport = self.make_transport(self.group, self.group_rank, self.group_size)
        try:
            self._connect(transport)
        except AFDPeerError:
            self._leave_failed_start_up(transport)
            raise
        if self.config.is_ffn and self.fixed_receive_buffers:
            self._ring = [self._allocate_receive_buffers(self.max_receive_rows()) for _ in (0, 1)]

    def _leave_failed_start_up(self, transport: Transport) -> None:
        """The store lives in FFN rank 0's process: it stays until every rank of the
        deployment that has come (or comes within FAILED_GRACE_S) read why start-up failed,
        so no rank sees only a lost store."""
        try:
            transport.store_add(FAILED_SEEN_KEY, 1)
            if not transport.hosts_store:
                return
            deadline = time.monotonic() + FAILED_GRACE_S
            while time.monotonic() < deadline:
                # after a connect timeout the missing ranks will not come; after an early
                # failure every rank may still be on its way
                expected = self.topology.world_size
                if transport.store_try_get(TIMED_OUT_KEY) is not None:
                    expected -= len(self.missing_ranks(transport))
                if transport.store_add(FAILED_SEEN_KEY, 0) >= max(
                    expected, transport.store_add(CLAIMS_KEY, 0)
                ):
                    return
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store may be gone already
            logger.debug("AFD %s: start-up failure not acknowledged", self._me())

    def _connect(self, transport: Transport) -> None:
        extra = self.config.extra()
        deadline = time.monotonic() + extra.connect_timeout_s
        try:
            transport.open_store()
        except TransportError as exc:
            raise AFDPeerError(f"{self._me()}: {exc}") from None
        self._roll_call(transport, extra.connect_timeout_s)
        try:
            # No group connects before every rank of the deployment has claimed its place
            # and checked its shape: a rank inside gloo's connect cannot see a failure
            # recorded meanwhile, and would only find the store gone when FFN rank 0 stops.
            transport.barrier(
                ROLL_CALL_KEY,
                self.topology.world_size,
                deadline - time.monotonic(),
                fail_key=FAILED_KEY,
            )
            transport.join_group(fail_key=FAILED_KEY)
        except TransportError as exc:
            raise self._start_up_error(transport, exc) from None
        self._transport = transport
        self._handshake(extra.connect_timeout_s)
        # The rendezvous store lives in FFN rank 0's process: nobody may leave start-up
        # (and FFN rank 0 may not stop) before every group of the deployment is connected.
        try:
            transport.barrier(
                "afd/ready",
                self.topology.world_size,
                deadline - time.monotonic(),
                fail_key=FAILED_KEY,
            )
        except TransportError as exc:
            self._transport = None
            raise self._start_up_error(transport, exc) from None
        logger.info(
            "AFD %s connected: group %d, peers %s, %s",
            self._me(),
            self.group,
            self.peers,
            self.wire,
        )

    # -- start-up checks over the whole deployment -------------------------------------------
    def _deployment_shape(self) -> dict:
        """What every rank of the deployment, in every group, must agree on."""
        return {
            "connector": self.config.connector,
            "num_attention_ranks": self.config.num_attention_ranks,
            "num_ffn_ranks": self.config.num_ffn_ranks,
            "compute_gate_on_attention": self.config.compute_gate_on_attention,
            "hidden_size": self.wire.hidden_size,
            "dtype": self.wire.dtype,
            "num_exchange_layers": self.wire.num_exchange_layers,
            "router_width": self.wire.router_width,
            "router_dtype": self.wire.router_dtype if self.wire.router_width else None,
            "token_ids": self.wire.token_ids,
        }

    def _fail_deployment(self, transport: Transport, reason: str) -> AFDPeerError:
        """Record why start-up failed, so every other rank stops at once with the reason."""
        try:
            transport.store_set(FAILED_KEY, reason.encode())
        except Exception:  # noqa: BLE001 - the reason is still raised here
            logger.debug("AFD %s: could not record the start-up failure", self._me())
        return AFDPeerError(reason)

    def _roll_call(self, transport: Transport, timeout_s: float) -> None:
        """Claim this rank (a rank claimed twice is an error naming it) and check this
        rank's view of the deployment against the first rank's."""
        role = self.config.role
        transport.store_add(CLAIMS_KEY, 1)
        if transport.store_add(f"afd/rank/{role}/{self.role_rank}", 1) > 1:
            raise self._fail_deployment(
                transport,
                f"AFD start-up failed: two servers claim {self._me()}: each rank belongs to "
                "exactly one server "
                "(check afd.start_rank and --data-parallel-size of every server of this role)",
            )
        mine = self._deployment_shape()
        if transport.store_add("afd/deployment/first", 1) == 1:
            transport.store_set("afd/deployment", json.dumps({"by": self._me(), **mine}).encode())
            return
        try:
            theirs = json.loads(transport.store_get("afd/deployment", timeout_s))
        except TransportError as exc:
            raise AFDPeerError(f"{self._me()}: {exc}") from None
        diffs = [
            f"{self._me()} has {k}={v!r}, {theirs['by']} has {theirs.get(k)!r}"
            for k, v in mine.items()
            if theirs.get(k) != v
        ]
        if diffs:
            raise self._fail_deployment(
                transport,
                "AFD handshake failed: "
                + "; ".join(diffs)
                + " (every server of a deployment needs the same afd shape and model)",
            )

    def missing_ranks(self, transport: Transport) -> list[str]:
        """The ranks of the deployment that have not claimed their place yet."""
        missing = [
            f"FFN rank {k}"
            for k in range(self.config.num_ffn_ranks)
            if transport.store_add(f"afd/rank/ffn/{k}", 0) == 0
        ]
        missing += [
            f"attention rank {j}"
            for j in range(self.config.num_attention_ranks)
            if transport.store_add(f"afd/rank/attention/{j}", 0) == 0
        ]
        return missing

    def _start_up_error(self, transport: Transport, exc: TransportError) -> AFDPeerError:
        try:
            reason = transport.store_try_get(FAILED_KEY)
            missing = self.missing_ranks(transport)
        except Exception:  # noqa: BLE001 - the store may be gone with FFN rank 0
            reason, missing = None, []
        if reason is not None:
            return AFDPeerError(f"{reason.decode()} (seen by {self._me()})")
        if missing:
            transport.store_set(TIMED_OUT_KEY, b"1")
            return self._fail_deployment(
                transport,
                f"AFD start-up failed: {', '.join(missing)} of the deployment never joined "
                f"({exc}): start the "
                "server(s) holding them (afd.start_rank says which ranks a server holds)",
            )
        return AFDPeerError(f"{self._me()}: {exc}")

    def _hello(self) -> dict:
        return {
            "role": self.config.role,
            "role_rank": self.role_rank,
            **self._deployment_shape(),
            # each side's own --max-num-batched-tokens: not compared, it bounds what the
            # FFN rank accepts from that peer in one micro-batch
            "max_tokens": self.wire.max_tokens,
            # which attention server this rank belongs to (its first rank): the ranks of one
            # server step together, two servers on their own
            "server": self.config.start_rank,
        }

    def _handshake(self, timeout_s: float) -> None:
        t = self._transport
        key = f"afd/g{self.group}/hello/{self.group_rank}"
        mine = self._hello()
        t.store_set(key, json.dumps(mine).encode())
        verdict_key = f"afd/g{self.group}/verdict"
        if self.config.is_ffn:
            problems = []
            for i, peer in enumerate(self.peers, start=1):
                try:
                    theirs = json.loads(t.store_get(f"afd/g{self.group}/hello/{i}", timeout_s))
                except TransportError:
                    problems.append(f"attention rank {peer} did not join within {timeout_s:.0f}s")
                    continue
                self._peer_max_tokens[i - 1] = int(theirs.get("max_tokens") or 0) or None
                self._peer_server[i - 1] = int(theirs.get("server") or 0)
                for field in mine:
                    if field in ("role", "role_rank", "max_tokens", "server"):
                        continue
                    # the FFN side may hold the router weights or not; only the width matters
                    if theirs.get(field) != mine[field]:
                        problems.append(
                            f"attention rank {peer} has {field}={theirs.get(field)!r}, "
                            f"FFN rank {self.role_rank} has {mine[field]!r}"
                        )
                if theirs.get("role") != "attention" or theirs.get("role_rank") != peer:
                    problems.append(
                        f"group rank {i} should be attention rank {peer}, got "
                        f"{theirs.get('role')} rank {theirs.get('role_rank')}"
                    )
            verdict = "ok" if not problems else "; ".join(problems)
            t.store_set(verdict_key, verdict.encode())
        else:
            try:
                verdict = t.store_get(verdict_key, timeout_s).decode()
            except TransportError:
                verdict = f"FFN rank {self.group} gave no verdict within {timeout_s:.0f}s"
        if verdict != "ok":
            self._transport = None
            if self.config.is_ffn:  # every other group stops at once, too
                self._fail_deployment(t, f"handshake of FFN rank {self.group}'s group: {verdict}")
            raise AFDPeerError(f"AFD handshake failed for {self._me()}: {verdict}")

    def close(self) -> None:
        with self._lock:
            if self._closed or self._transport is None:
                self._closed = True
                return
            self._closed = True
            transport = self._transport
        if self._inbox is not None:
            self._inbox.close()
        if self.config.is_attention and self._current is None:
            try:  # tell the FFN rank we leave, so it stops instead of timing out
                self._send_words(
                    ControlMessage(
                        self.role_rank,
                        self._step,
                        (),
                        self.wire.hidden_size,
                        self.wire.dtype,
                        ControlFlag.SHUTDOWN,
                    ).encode()
                ).wait()
            except Exception:
                logger.debug("AFD %s: goodbye not delivered", self._me(), exc_info=True)
        transport.close()

    def _require(self, role: str) -> Transport:
        if self._transport is None or self._closed:
            raise AFDPeerError(f"{self._me()}: connector is not initialized or already closed")
        if self.config.role != role:
            raise RuntimeError(f"{self._me()}: this call belongs to the {role} side")
        return self._transport

    # -- attention side ---------------------------------------------------------------------
    def _send_words(self, words: list[int]) -> Handle:
        import torch

        return self._transport.isend_control(torch.tensor(words, dtype=torch.int64), 0)

    def begin_step(self, tokens: tuple[int, ...], flags: int = 0) -> ControlMessage:
        import torch

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
        )
        words = msg.encode()  # validates before anything is sent
        status_buf = torch.empty(STATUS_LEN, dtype=torch.uint8)
        try:
            # the status receive first: the FFN rank may answer before the control send
            # is reported complete here
            status = t.irecv_status(status_buf, 0)
            control = self._send_words(words)
        except TransportError as exc:
            raise AFDPeerError(
                f"{self._me()} could not start step {self._step} with {self._peer_name(0)}: {exc}"
            ) from None
        self._current = _AttentionStep(
            number=self._step,
            rows=msg.tokens,
            control=control,
            status_buf=status_buf,
            status=status,
            next_layer=[0] * len(msg.tokens),
            inflight={},
            order=AttentionOrder(self.wire.num_exchange_layers, msg.tokens),
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
                handles.append(t.isend(hidden_states, 0, data_tag(layer, microbatch, KIND_HIDDEN)))
                if self.wire.router_width:
                    sent.append(router_logits.contiguous())
                    handles.append(t.isend(sent[-1], 0, data_tag(layer, microbatch, KIND_LOGITS)))
                if self.wire.token_ids:
                    sent.append(token_ids.to(torch.int64).contiguous())
                    handles.append(t.isend(sent[-1], 0, data_tag(layer, microbatch, KIND_TOKENS)))
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
            self._trace.add("wait", t0, now())
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

    def _exchange_error(self, step, layer, microbatch, exc) -> AFDPeerError:
        where = f"layer {layer} (micro-batch {microbatch}) of step {step.number}"
        status = self._ffn_status_now(step)
        if status is not None and status.code == StatusCode.ABORT:
            return AFDPeerError(
                f"{self._me()}: {self._peer_name(0)} stopped the deployment during {where}: "
                f"{status.reason}"
            )
        return AFDPeerError(f"{self._me()} exchanging {where} with {self._peer_name(0)}: {exc}")

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
        if status.code == StatusCode.STEP_FAILED:
            raise AFDStepError(
                f"{self._peer_name(0)} failed {status.where()} for {self._me()}: {status.reason}"
            )

    def _finish(self, step: _AttentionStep) -> StepStatus:
        self._current = None
        where = f"step {step.number}"
        try:
            step.control.wait()
            step.status.wait()
            status = decode_status(bytes(step.status_buf.numpy()), self.group)
        except TransportError as exc:
            raise AFDPeerError(
                f"{self._me()} waiting for {self._peer_name(0)} to end {where}: {exc}"
            ) from None
        except StatusError as exc:
            raise AFDPeerError(f"{self._me()}: {exc}") from None
        if status.code == StatusCode.ABORT:
            raise AFDPeerError(
                f"{self._me()}: {self._peer_name(0)} stopped the deployment at {where}: "
                f"{status.reason}"
            )
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
        cannot go on)."""
        step = self._current
        if step is None:
            return ""
        stopped = ", ".join(
            f"micro-batch {mb} at layer {n}"
            for mb, n in enumerate(step.next_layer)
            if step.rows[mb]
        )
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
        return stopped

    def _zero_rows(self, rows: int) -> tuple:
        """Rows of zeros as an aborted step sends them: (hidden, router logits, token ids)."""
        import torch

        return self._wire_tensors(rows, torch.zeros)

    # -- FFN side ------------------------------------------------------------------------------
    def recv_control(self) -> StepPlan:
        """The next step's control messages: blocks until some peer announces a step, then
        takes every peer of the same attention server(s) (they step together) and whatever
        other peers already announced; the rest join a later step (their servers step on
        their own)."""
        self._require("ffn")
        if self._inbox is None:
            self._inbox = ControlInbox(self._transport, len(self.peers), self._me())
            self._inbox.start()
        while True:
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
        self._ring_next = 0  # every step uses the buffers in the same order (graph replay)
        self._recv_order = FFNOrder(n_mb, "receive")
        self._send_order = FFNOrder(n_mb, "send")
        return self._plan

    def _gather_control(self) -> dict[int, ControlMessage]:
        """One step's control messages by peer index: the first to come (however long the
        servers are idle), then every rank of its server (bounded by the step timeout: a
        server's ranks step together) and whatever else already arrived."""
        held, self._held_control = self._held_control, []
        timeout_s = self._transport.timeout_s

        def next_item(block: bool):
            item = held.pop(0) if held else self._inbox.get(block, timeout_s if block else None)
            if item is ControlInbox.CLOSED:
                raise AFDPeerError(f"{self._me()}: closed while waiting for the next step")
            return item

        arrived: dict[int, ControlMessage] = {}
        first = held.pop(0) if held else self._inbox.get()
        if first is ControlInbox.CLOSED:
            raise AFDPeerError(f"{self._me()}: closed while waiting for the next step")
        self._take_control(first, arrived)
        while True:
            servers = {self._peer_server[i] for i in arrived}
            missing = [
                j
                for j in range(len(self.peers))
                if self._active_peers[j] and j not in arrived and self._peer_server[j] in servers
            ]
            item = next_item(bool(missing))
            if item is None:
                if missing:
                    ranks = ", ".join(str(self.peers[j]) for j in missing)
                    raise AFDPeerError(
                        f"{self._me()}: attention rank(s) {ranks} did not announce their next "
                        f"step within {timeout_s:.0f}s of the other ranks of their server "
                        "(the ranks of one attention server step together)"
                    )
                return arrived
            self._take_control(item, arrived)

    def _take_control(self, item, arrived: dict[int, ControlMessage]) -> None:
        """Check one peer's control message and add it to the step, or hold it back for the
        next step: a capture is served alone (its peers record their operations, nothing
        moves), never in the same step as another server's real one."""
        i, payload = item
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
            raise AFDPeerError(f"{self._me()}: {exc}") from None
        if msg.step != self._peer_step[i]:
            raise AFDPeerError(
                f"{self._me()}: attention rank {peer} announced step {msg.step}, but step "
                f"{self._peer_step[i]} is next for it (a control message was lost or sent "
                "twice; the two sides are out of step)"
            )
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
            logger.info("AFD %s: attention rank %d left the deployment", self._me(), peer)
        else:
            self._peer_step[i] += 1
        arrived[i] = msg

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
        return not any(self._active_peers)

    def rows_per_peer(self, microbatch: int) -> tuple[int, ...]:
        return self._require_plan().rows[microbatch]

    def _require_plan(self) -> StepPlan:
        if self._plan is None:
            raise AFDPeerError(f"{self._me()}: no step in flight (recv_control first)")
        return self._plan

    def post_attn_output(self, layer: int, microbatch: int = 0) -> PendingBatch:
        """Post the receives of every peer's rows of one layer/micro-batch."""

        t = self._require("ffn")
        plan = self._require_plan()
        self._recv_order.issue(layer, microbatch, f"{self._me()} in step {self._step}")
        rows = plan.rows[microbatch]
        hidden, logits, ids = self._receive_buffers(sum(rows))
        handles = []
        off = 0
        for i, n in enumerate(rows):
            if n == 0:
                continue
            views = [
                (b[off : off + n], kind)
                for b, kind in ((hidden, KIND_HIDDEN), (logits, KIND_LOGITS), (ids, KIND_TOKENS))
                if b is not None
            ]
            off += n
            if not self._active_peers[i]:  # lost during this step: its rows are zeros
                for view, _ in views:
                    view.zero_()
                continue
            try:  # straight into the concatenated buffer: row slices are contiguous
                for view, kind in views:
                    handles.append(
                        (i, t.irecv(view, i + 1, data_tag(layer, microbatch, kind)), view)
                    )
            except TransportError as exc:
                self._lose_peer_or_raise(i, self._batch_error(i, layer, microbatch, exc))
                for view, _ in views:
                    view.zero_()
        batch = FFNBatch(hidden, logits, rows, ids)
        return PendingBatch(self, layer, microbatch, batch, handles)

    def _complete_batch(self, pending: PendingBatch) -> None:
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

    def _lose_peer_or_raise(self, i: int, error: AFDPeerError) -> None:
        """A peer's channel failed: drop the peer and go on serving the others where the
        transport allows it (its channels fail alone), else raise `error`. Its server's
        other ranks are dropped as their own channels fail."""
        if not self.survives_peer_loss:
            raise error
        if self._active_peers[i]:
            self._active_peers[i] = False
            self.peers_lost.append(self.peers[i])
            logger.warning(
                "AFD %s: attention rank %d is lost and dropped; the other attention ranks "
                "are served on (%s)",
                self._me(),
                self.peers[i],
                error,
            )

    def _batch_error(self, i, layer, microbatch, exc) -> AFDPeerError:
        return AFDPeerError(
            f"{self._me()} waiting for layer {layer} (micro-batch {microbatch}) of step "
            f"{self._peer_step[i] - 1} from attention rank {self.peers[i]}: {exc}"
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
        off = 0
        for i, n in enumerate(rows):
            off += n
            if n == 0 or not self._active_peers[i]:
                continue
            try:
                tag = data_tag(layer, microbatch, KIND_HIDDEN)
                handle = t.isend(output[off - n : off], i + 1, tag)
            except TransportError as exc:
                self._lose_peer_or_raise(i, self._return_error(i, layer, microbatch, exc))
                continue
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
        import torch

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
                mine = dataclasses.replace(status, step=step_of[peer])
                payload = torch.frombuffer(bytearray(mine.encode()), dtype=torch.uint8)
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
            self._pending_sends.clear()
            self._plan = None
            self._step += 1

    def _end_error(self, i: int, step_of: dict, exc) -> AFDPeerError:
        return AFDPeerError(
            f"{self._me()} ending step {step_of[self.peers[i]]} with attention rank "
            f"{self.peers[i]}: {exc}"
        )

    def abort(self, reason: str) -> None:
        """Tell every live peer this FFN rank stops (best effort), so they stop at once
        with this reason instead of seeing a closed connection only."""
        import torch

        t = self._transport
        if t is None or self._closed:
            return
        status = StepStatus(self._step, StatusCode.ABORT, ffn_rank=self.role_rank, reason=reason)
        payload = torch.frombuffer(bytearray(status.encode()), dtype=torch.uint8)
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

"""Point-to-point AFD protocol logic, independent of the transport.

Each FFN rank k forms a group with its attention peers (topology.peers_of(k)): the FFN rank
is group rank 0, peer i is group rank i + 1. Start-up: every member publishes a hello in the
rendezvous store; the FFN rank checks that all peers agree with it (ranks, shape, dtype,
layers) and publishes a verdict that every peer waits for, so a mismatch fails both sides
with the same message. Per step: control message, then per layer and micro-batch the rows.
Tags encode (layer, micro-batch, kind), so an ordering bug is a timeout that names the
layer instead of silently mixed-up data.
"""

from __future__ import annotations

import json
import threading
from abc import abstractmethod

from afd_core.connectors.base import AFDConnector, AFDPeerError, FFNBatch, WireSpec
from afd_core.connectors.control import (
    MAX_MICROBATCHES,
    MESSAGE_LEN,
    ControlError,
    ControlFlag,
    ControlMessage,
    Expectation,
    decode,
)
from afd_core.connectors.transport import Transport, TransportError
from afd_core.log import get_logger
from afd_core.topology import Topology

logger = get_logger(__name__)

KIND_HIDDEN, KIND_LOGITS = 0, 1


def data_tag(layer: int, microbatch: int, kind: int) -> int:
    return ((layer * MAX_MICROBATCHES) + microbatch) * 2 + kind


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
        self._step = 0
        # FFN side: rows per peer of the current step, per micro-batch
        self._rows: list[tuple[int, ...]] = []
        self._active_peers: list[bool] = [True] * len(self.peers)
        self._peer_max_tokens: list[int | None] = [None] * len(self.peers)
        self._pending: dict[int, tuple[int, ...]] = {}  # micro-batch -> rows of the last recv
        # FFN side: one receive buffer per micro-batch, reused layer after layer (a fresh
        # large tensor per layer costs an mmap and page faults each time)
        self._recv_buffers: dict[int, object] = {}

    # -- hooks for a transport ----------------------------------------------------------
    @abstractmethod
    def make_transport(self, group: int, group_rank: int, group_size: int) -> Transport: ...

    def check_tensor(self, tensor) -> None:
        return None

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
        extra = self.config.extra()
        transport = self.make_transport(self.group, self.group_rank, self.group_size)
        try:
            transport.connect()
        except TransportError as exc:
            raise AFDPeerError(f"{self._me()}: {exc}") from None
        self._transport = transport
        self._handshake(extra.connect_timeout_s)
        # The rendezvous store lives in FFN rank 0's process: nobody may leave start-up
        # (and FFN rank 0 may not stop) before every group of the deployment is connected.
        try:
            transport.barrier("afd/ready", self.topology.world_size, extra.connect_timeout_s)
        except TransportError as exc:
            self._transport = None
            raise AFDPeerError(f"{self._me()}: {exc}") from None
        logger.info(
            "AFD %s connected: group %d, peers %s, %s",
            self._me(),
            self.group,
            self.peers,
            self.wire,
        )

    def _hello(self) -> dict:
        return {
            "role": self.config.role,
            "role_rank": self.role_rank,
            "num_attention_ranks": self.config.num_attention_ranks,
            "num_ffn_ranks": self.config.num_ffn_ranks,
            "compute_gate_on_attention": self.config.compute_gate_on_attention,
            "hidden_size": self.wire.hidden_size,
            "dtype": self.wire.dtype,
            "num_exchange_layers": self.wire.num_exchange_layers,
            "router_width": self.wire.router_width,
            # each side's own --max-num-batched-tokens: not compared, it bounds what the
            # FFN rank accepts from that peer in one micro-batch
            "max_tokens": self.wire.max_tokens,
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
                for field in mine:
                    if field in ("role", "role_rank", "max_tokens"):
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
            raise AFDPeerError(f"AFD handshake failed for {self._me()}: {verdict}")

    def close(self) -> None:
        with self._lock:
            if self._closed or self._transport is None:
                self._closed = True
                return
            self._closed = True
            transport = self._transport
        if self.config.is_attention:
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
                )
            except Exception:
                logger.debug("AFD %s: goodbye not delivered", self._me(), exc_info=True)
        transport.close()

    # -- attention side ---------------------------------------------------------------------
    def _require(self, role: str) -> Transport:
        if self._transport is None or self._closed:
            raise AFDPeerError(f"{self._me()}: connector is not initialized or already closed")
        if self.config.role != role:
            raise RuntimeError(f"{self._me()}: this call belongs to the {role} side")
        return self._transport

    def _send_words(self, words: list[int]) -> None:
        import torch

        self._transport.send_control(torch.tensor(words, dtype=torch.int64), 0)

    def send_control(self, tokens: tuple[int, ...], flags: int = 0) -> ControlMessage:
        self._require("attention")
        msg = ControlMessage(
            self.role_rank,
            self._step,
            tuple(tokens),
            self.wire.hidden_size,
            self.wire.dtype,
            ControlFlag(flags),
        )
        try:
            self._send_words(msg.encode())
        except TransportError as exc:
            raise AFDPeerError(
                f"{self._me()} could not start step {self._step} with {self._peer_name(0)}: {exc}"
            ) from None
        self._step += 1
        self._pending = dict(enumerate(msg.tokens))
        return msg

    def send_attn_output(self, hidden_states, layer, microbatch=0, router_logits=None) -> None:
        t = self._require("attention")
        self.check_tensor(hidden_states)
        rows = hidden_states.shape[0]
        if self._pending.get(microbatch) != rows:
            raise AFDPeerError(
                f"{self._me()}: layer {layer} micro-batch {microbatch} has {rows} rows but the "
                f"control message announced {self._pending.get(microbatch)}"
            )
        if rows == 0:
            return
        try:
            t.send(hidden_states.contiguous(), 0, data_tag(layer, microbatch, KIND_HIDDEN))
            if self.wire.router_width:
                if router_logits is None:
                    raise AFDPeerError(
                        f"{self._me()}: layer {layer} has no router logits, but the gate runs on "
                        "attention (compute_gate_on_attention)"
                    )
                t.send(router_logits.contiguous(), 0, data_tag(layer, microbatch, KIND_LOGITS))
        except TransportError as exc:
            raise AFDPeerError(
                f"{self._me()} sending layer {layer} (micro-batch {microbatch}) of step "
                f"{self._step - 1} to {self._peer_name(0)}: {exc}"
            ) from None

    def recv_ffn_output(self, hidden_states, layer, microbatch=0):
        t = self._require("attention")
        if hidden_states.shape[0] == 0:
            return hidden_states
        if not hidden_states.is_contiguous():
            raise ValueError("recv_ffn_output needs the contiguous buffer that was sent")
        try:
            t.recv(hidden_states, 0, data_tag(layer, microbatch, KIND_HIDDEN))
        except TransportError as exc:
            raise AFDPeerError(
                f"{self._me()} waiting for {self._peer_name(0)} to return layer {layer} "
                f"(micro-batch {microbatch}) of step {self._step - 1}: {exc}"
            ) from None
        return hidden_states

    # -- FFN side ------------------------------------------------------------------------------
    def recv_control(self) -> list[ControlMessage]:
        import torch

        t = self._require("ffn")
        messages: list[ControlMessage] = []
        buf = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
        for i, peer in enumerate(self.peers):
            if not self._active_peers[i]:
                continue
            try:
                t.recv_control(buf, i + 1)
            except TransportError as exc:
                raise AFDPeerError(
                    f"{self._me()} waiting for the next step from attention rank {peer}: {exc}"
                ) from None
            expect = Expectation(
                peer, self.wire.hidden_size, self.wire.dtype, self._peer_max_tokens[i]
            )
            try:
                msg = decode(buf.tolist(), expect)
            except ControlError as exc:
                raise AFDPeerError(f"{self._me()}: {exc}") from None
            if msg.is_shutdown:
                self._active_peers[i] = False
                logger.info("AFD %s: attention rank %d left the deployment", self._me(), peer)
            messages.append(msg)
        live = [m for m in messages if not m.is_shutdown]
        if live and len({m.num_microbatches for m in live}) != 1:
            raise AFDPeerError(
                f"{self._me()}: peers disagree on the number of micro-batches: "
                + ", ".join(f"attention rank {m.sender_rank}: {m.num_microbatches}" for m in live)
            )
        # rows of a peer that left count as 0: it sends nothing more
        n_mb = live[0].num_microbatches if live else 0
        by_peer = {m.sender_rank: m for m in live}
        self._rows = [
            tuple(by_peer[p].tokens[mb] if p in by_peer else 0 for p in self.peers)
            for mb in range(n_mb)
        ]
        self._step += 1
        return messages

    @property
    def all_peers_left(self) -> bool:
        return not any(self._active_peers)

    def rows_per_peer(self, microbatch: int) -> tuple[int, ...]:
        return self._rows[microbatch]

    def recv_attn_output(self, layer, microbatch=0) -> FFNBatch:
        import torch

        t = self._require("ffn")
        rows = self._rows[microbatch]
        total = sum(rows)
        hidden = self._recv_buffer(microbatch, total)
        logits = (
            torch.empty(total, self.wire.router_width, dtype=torch.float32)
            if self.wire.router_width
            else None
        )
        off = 0
        for i, n in enumerate(rows):
            if n == 0:
                continue
            try:  # straight into the concatenated buffer: row slices are contiguous
                t.recv(hidden[off : off + n], i + 1, data_tag(layer, microbatch, KIND_HIDDEN))
                if logits is not None:
                    t.recv(logits[off : off + n], i + 1, data_tag(layer, microbatch, KIND_LOGITS))
            except TransportError as exc:
                raise AFDPeerError(
                    f"{self._me()} waiting for layer {layer} (micro-batch {microbatch}) of step "
                    f"{self._step - 1} from attention rank {self.peers[i]}: {exc}"
                ) from None
            off += n
        return FFNBatch(hidden, logits, rows)

    def _recv_buffer(self, microbatch: int, rows: int):
        """Rows [0, rows) of this micro-batch's buffer; valid until its next receive."""
        import torch

        buf = self._recv_buffers.get(microbatch)
        if buf is None or buf.shape[0] < rows:
            capacity = max(rows, 1 if buf is None else 2 * buf.shape[0])
            buf = torch.empty(
                capacity, self.wire.hidden_size, dtype=getattr(torch, self.wire.dtype)
            )
            self._recv_buffers[microbatch] = buf
        return buf[:rows]

    def send_ffn_output(self, output, layer, microbatch=0) -> None:
        t = self._require("ffn")
        self.check_tensor(output)
        rows = self._rows[microbatch]
        if output.shape[0] != sum(rows):
            raise AFDPeerError(
                f"{self._me()}: layer {layer} output has {output.shape[0]} rows, peers sent "
                f"{sum(rows)}"
            )
        output = output.contiguous()
        off = 0
        for i, n in enumerate(rows):
            if n == 0:
                continue
            try:
                t.send(output[off : off + n], i + 1, data_tag(layer, microbatch, KIND_HIDDEN))
            except TransportError as exc:
                raise AFDPeerError(
                    f"{self._me()} returning layer {layer} (micro-batch {microbatch}) to "
                    f"attention rank {self.peers[i]}: {exc}"
                ) from None
            off += n

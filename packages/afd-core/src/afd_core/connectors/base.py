"""The connector interface: how attention and FFN ranks exchange one layer's tensors.

Attention side, per step: `begin_step` (the control message: rows per micro-batch, step
number, flags), then per layer and micro-batch `start_exchange` (post the receive of the FFN
output, send the rows) and, after the DBO yield, the exchange's `wait()`; finally
`end_step` (the FFN rank's status for the step), or `abort_step` after a local failure.
FFN side, per step: `recv_control` (one message per attention peer), then per layer and
micro-batch `post_attn_output` (receives of every peer's rows, concatenated in peer order)
and `send_ffn_output` (each peer gets its slice back), and `finish_step`. Both sides walk
layer-major, micro-batch-minor: the order is the protocol.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

# The interface names the protocol's messages in annotations only: every room of connectors/
# imports this module, and it imports none of them (tests/afd_core/test_connector_layers.py).
if TYPE_CHECKING:
    import torch

    from afd_core.config import AFDConfig
    from afd_core.connectors.protocol.control import ControlFlag, ControlMessage
    from afd_core.connectors.protocol.status import StepStatus


# An attention rank's waits in a step, in units of timeout_s, the FFN rank's own bound on a
# silent peer: the FFN rank may wait that long for a silent peer of a step before it drops
# it and answers the others (PointToPointConnector._bound_step, step/attention.py)
ATTENTION_WAIT_FACTOR = 2


class AFDPeerError(RuntimeError):
    """A peer that is dead, late, or disagrees with this rank; names the peer and the wait.
    The deployment cannot go on: both sides stop."""


class AFDStepError(RuntimeError):
    """One step failed (on this rank or its peer) but the protocol is still in step: that
    step's requests fail, the deployment goes on with the next step."""


class AFDFFNLostError(AFDStepError):
    """Attention side: this rank's FFN rank is gone (admission/ffn_return.py). The step's requests
    fail, and so does every step until an FFN rank serves this rank again; the server
    stays up meanwhile."""


@dataclass(frozen=True)
class WireSpec:
    """What both sides must agree on; checked in the start-up handshake."""

    hidden_size: int
    dtype: str  # torch dtype name without "torch."
    num_exchange_layers: int  # layers whose FFN part runs remotely, per step
    max_tokens: int  # rows per micro-batch this rank sends at most (max_num_batched_tokens)
    router_width: int = 0  # experts, when the gate runs on attention; else 0
    # each row's token id travels with it (models that route by token id: DeepSeek-V4's
    # hash-routed MoE layers)
    token_ids: bool = False
    router_dtype: str = "float32"  # the router logits' dtype on the wire


@dataclass(frozen=True)
class StepPlan:
    """FFN side: what the peers announced for one step."""

    step: int
    messages: tuple[ControlMessage, ...]  # one per peer still in the deployment
    rows: tuple[tuple[int, ...], ...]  # [micro-batch][peer]: rows each peer sends
    flags: ControlFlag  # union of the live peers' flags

    @property
    def num_microbatches(self) -> int:
        return len(self.rows)

    @property
    def live(self) -> tuple[ControlMessage, ...]:
        return tuple(m for m in self.messages if not m.is_shutdown)


@dataclass
class FFNBatch:
    """One layer/micro-batch on the FFN side: the peers' rows, concatenated."""

    hidden_states: torch.Tensor
    router_logits: torch.Tensor | None
    rows_per_peer: tuple[int, ...]
    token_ids: torch.Tensor | None = None  # int64, one per row, when the wire carries them


class AFDConnector(ABC):
    def __init__(self, config: AFDConfig, role_rank: int, wire: WireSpec):
        self.config = config
        self.role_rank = role_rank
        self.wire = wire
        # attention: the first of the attention ranks that step together with this one (its
        # server's ranks in lockstep; with async_dp its DP rank's TP ranks, set by the
        # role); its FFN rank waits for all of them once one announces a step
        self.steps_with = config.start_rank
        # FFN: how many FFN ranks of its server run every step together (its data-parallel
        # size: an expert group, set by the role); attention: its FFN rank's, told at the
        # handshake
        self.expert_group_size = 1
        self.ffn_expert_group = 1

    @property
    @abstractmethod
    def is_initialized(self) -> bool: ...

    @abstractmethod
    def init(self) -> None:
        """Rendezvous and handshake; raises AFDPeerError within the connect timeout."""

    @abstractmethod
    def close(self) -> None:
        """Idempotent; the attention side tells its FFN rank it leaves."""

    # attention side
    @abstractmethod
    def begin_step(self, tokens: tuple[int, ...], flags: int = 0) -> ControlMessage:
        """Announce the next step: rows per micro-batch (1..4 entries) and flags."""

    @abstractmethod
    def start_exchange(
        self,
        hidden_states: torch.Tensor,
        layer: int,
        microbatch: int = 0,
        router_logits: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ):
        """Post the receive of the FFN output (into `out`, or a new tensor) and send the
        rows (with their router logits / token ids when the wire carries them); returns an
        exchange whose `wait()` returns the FFN output. The rows must not be modified until
        then."""

    @abstractmethod
    def end_step(self) -> None:
        """The FFN rank's verdict on the step: AFDStepError if it failed there."""

    @abstractmethod
    def mark_exchanged(self) -> None:
        """The step's forward was a replayed device graph: every layer of every micro-batch
        was exchanged by the captured operations, with no Python of this connector."""

    @abstractmethod
    def abort_step(self) -> str:
        """After a local failure mid-step: finish the step in protocol (zeros); returns
        where each micro-batch had stopped, for the error message."""

    def exchange(self, hidden_states, layer: int, microbatch: int = 0, router_logits=None):
        """Blocking form of start_exchange(...).wait()."""
        return self.start_exchange(hidden_states, layer, microbatch, router_logits).wait()

    # FFN side
    @abstractmethod
    def recv_control(self) -> StepPlan:
        """Block until every attention peer announced its next step (or left)."""

    @abstractmethod
    def peer_servers(self) -> list[int]:
        """After init: the attention server of each peer (peers of one server step
        together)."""

    @abstractmethod
    def post_attn_output(self, layer: int, microbatch: int = 0):
        """Post the receives of one layer/micro-batch; returns a pending batch whose
        `wait()` returns the FFNBatch."""

    def recv_attn_output(self, layer: int, microbatch: int = 0) -> FFNBatch:
        """Blocking form of post_attn_output(...).wait()."""
        return self.post_attn_output(layer, microbatch).wait()

    @abstractmethod
    def send_ffn_output(self, output: torch.Tensor, layer: int, microbatch: int = 0) -> None:
        """Send each peer its rows; does not wait (finish_step does)."""

    @abstractmethod
    def settle_sends(self) -> None:
        """Complete the step's sends so far (on a device: order the current stream after
        them, which joins them into a graph being captured)."""

    @abstractmethod
    def finish_step(self, failure: StepStatus | None = None) -> None:
        """Deliver the step's outputs and tell every live peer how the step went."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Tell the peers this rank stops the deployment, with the reason (best effort)."""

    def share_metrics(self, ranks: list[int]) -> None:
        """On a server spanning hosts (`ranks`: all of its ranks of this role): share this
        rank's metrics snapshots through the rendezvous store, so that its head host's
        /metrics and /health see every rank (afd_core.metrics.SnapshotShare). A connector
        without a rendezvous store shares nothing."""
        return None

    def watch_replay(self, what: str) -> None:
        """A device graph holding this rank's exchanges was just replayed: bound it as the
        transport bounds a posted operation (no-op where operations block the host)."""
        return None

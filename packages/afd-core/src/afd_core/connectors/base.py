"""The connector interface: how attention and FFN ranks exchange one layer's tensors.

Attention side, per step: `send_control` once, then per layer and micro-batch
`send_attn_output` followed by `recv_ffn_output` into the very buffer it sent.
FFN side, per step: `recv_control` (one message per attention peer), then per layer and
micro-batch `recv_attn_output` (the peers' rows concatenated in peer order) and
`send_ffn_output` (each peer gets its slice back). Both sides walk layer-major,
micro-batch-minor, exactly one exchange each: the order is the protocol.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from afd_core.connectors.control import ControlMessage

if TYPE_CHECKING:
    import torch

    from afd_core.config import AFDConfig


class AFDPeerError(RuntimeError):
    """A peer that is dead, late, or disagrees with this rank; names the peer and the wait."""


@dataclass(frozen=True)
class WireSpec:
    """What both sides must agree on; checked in the start-up handshake."""

    hidden_size: int
    dtype: str  # torch dtype name without "torch."
    num_exchange_layers: int  # layers whose FFN part runs remotely, per step
    max_tokens: int  # rows per micro-batch this rank sends at most (max_num_batched_tokens)
    router_width: int = 0  # experts, when the gate runs on attention; else 0


@dataclass
class FFNBatch:
    """One layer/micro-batch on the FFN side: the peers' rows, concatenated."""

    hidden_states: torch.Tensor
    router_logits: torch.Tensor | None
    rows_per_peer: tuple[int, ...]


class AFDConnector(ABC):
    def __init__(self, config: AFDConfig, role_rank: int, wire: WireSpec):
        self.config = config
        self.role_rank = role_rank
        self.wire = wire

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
    def send_control(self, tokens: tuple[int, ...], flags: int = 0) -> ControlMessage: ...

    @abstractmethod
    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        layer: int,
        microbatch: int = 0,
        router_logits: torch.Tensor | None = None,
    ) -> None: ...

    @abstractmethod
    def recv_ffn_output(
        self, hidden_states: torch.Tensor, layer: int, microbatch: int = 0
    ) -> torch.Tensor:
        """Receive the FFN output into `hidden_states` (the buffer that was sent)."""

    # FFN side
    @abstractmethod
    def recv_control(self) -> list[ControlMessage]:
        """Block until every attention peer announced its next step (or left)."""

    @abstractmethod
    def recv_attn_output(self, layer: int, microbatch: int = 0) -> FFNBatch:
        """The peers' rows; the tensor is reused by this micro-batch's next receive."""

    @abstractmethod
    def send_ffn_output(self, output: torch.Tensor, layer: int, microbatch: int = 0) -> None: ...

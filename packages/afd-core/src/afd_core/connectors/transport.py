"""Point-to-point transport under a connector: tensors to and from one peer, with timeouts.

A transport knows nothing of layers, control messages or topology: the connector logic
(`p2p.py`) does. CPU gloo is one transport; accelerator transports (NCCL, HCCL) plug in here.
Group-local ranks: the FFN rank is 0, its attention peers are 1..n.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class TransportError(RuntimeError):
    """A send or receive that failed: the peer closed the connection or did not answer."""


class Transport(ABC):
    @abstractmethod
    def connect(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def store_set(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def store_get(self, key: str, timeout_s: float) -> bytes: ...

    @abstractmethod
    def barrier(self, key: str, count: int, timeout_s: float) -> None:
        """Wait until `count` ranks of the deployment reached `key` in the rendezvous store."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None: ...

    @abstractmethod
    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Receive in place, waiting at most the transport's step timeout."""

    @abstractmethod
    def send_control(self, tensor: torch.Tensor, peer: int) -> None: ...

    @abstractmethod
    def recv_control(self, tensor: torch.Tensor, peer: int) -> None:
        """Receive a control message; may wait as long as the peer stays idle."""

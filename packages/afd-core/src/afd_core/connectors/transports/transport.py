"""Point-to-point transport under a connector: tensors to and from one peer, with timeouts.

A transport knows nothing of layers, control messages or topology: the connector logic
(`p2p.py` and the modules it is made of) does. CPU gloo is one transport; accelerator transports (NCCL, HCCL) plug in here.
Group-local ranks: the FFN rank is 0, its attention peers are 1..n.

Every operation is non-blocking: it is posted at once and returns a `Handle` whose `wait()`
completes it (raising TransportError naming the cause). The tensor of an operation must not
be touched by the caller until its handle completed. The blocking calls are thin wrappers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


PROGRESS_EVERY_S = 30.0  # a start-up wait says whom it waits for this often


class TransportError(RuntimeError):
    """A send or receive that failed: the peer closed the connection or did not answer."""


class Handle(ABC):
    """One posted send or receive."""

    @abstractmethod
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the operation completed, at most timeout_s (default: the transport's
        own bound); TransportError if it failed or did not complete in time."""


class Completed(Handle):
    """An operation with nothing to move (zero rows)."""

    def wait(self, timeout_s: float | None = None) -> None:
        return None


class Transport(ABC):
    hosts_store = False  # True on the rank whose process holds the rendezvous store
    # how long open_store waits for the rendezvous (FFN rank 0 may still be loading its
    # weights): the connector's startup_timeout_s; None: connect_timeout_s
    formation_timeout_s: float | None = None
    # the store key whose value (why the deployment's start-up failed) stops `connect`'s
    # waits at once; None: only the group's own bounds stop them
    fail_key: str | None = None

    def connect(self) -> None:
        self.open_store()
        self.join_group(fail_key=self.fail_key)

    @abstractmethod
    def open_store(self) -> None:
        """Reach the deployment's rendezvous store (FFN rank 0 hosts it)."""

    @abstractmethod
    def join_group(self, fail_key: str | None = None) -> None:
        """Wait for every member of this group (stopping if another rank sets `fail_key`
        in the store), then connect to them."""

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def store_set(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def store_get(self, key: str, timeout_s: float) -> bytes: ...

    @abstractmethod
    def store_add(self, key: str, amount: int) -> int:
        """Add to a counter of the store (created at 0) and return its new value."""

    @abstractmethod
    def store_try_get(self, key: str) -> bytes | None:
        """The value of `key`, or None if it is not set; never waits."""

    def store_delete(self, key: str) -> None:
        """Remove `key` from the store if it is there (a rejoin's keys once it is done: a
        long-running deployment's store must not grow with every restart); never raises."""
        return None

    @abstractmethod
    def barrier(
        self,
        key: str,
        count: int,
        timeout_s: float,
        fail_key: str | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        """Wait until `count` ranks of the deployment reached `key` in the rendezvous store;
        TransportError at once, with its value, if another rank sets `fail_key`.
        `progress(seconds waited)` runs every PROGRESS_EVERY_S while it waits."""

    @abstractmethod
    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle: ...

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Handle:
        """Receive in place; the handle's wait is bounded by the transport's step timeout."""

    @abstractmethod
    def isend_control(self, tensor: torch.Tensor, peer: int) -> Handle: ...

    @abstractmethod
    def irecv_control(
        self, tensor: torch.Tensor, peer: int, bound_s: float | None = None
    ) -> Handle:
        """Receive a control message; without `bound_s` it may wait as long as the peer
        stays idle (an FFN rank's next step, a TP follower's next command)."""

    # The step's status (and an abort) travel on the control channel, not the data channel:
    # a device data channel (NCCL, HCCL) matches operations in issue order, and the status
    # receive is posted when a step begins, before that step's data.
    @abstractmethod
    def isend_status(self, tensor: torch.Tensor, peer: int) -> Handle: ...

    @abstractmethod
    def irecv_status(self, tensor: torch.Tensor, peer: int) -> Handle:
        """Receive a step's status (CPU uint8); the handle's wait is bounded by the
        transport's step timeout."""

    def grouped_ops(self) -> AbstractContextManager[None]:
        """A block whose data operations (`isend`/`irecv`) may go out together when it ends:
        one launch per communicator on a device transport (NCCL's group calls). Their
        handles must not be waited for inside the block. Host transports post each
        operation at once: nothing to group."""
        return nullcontext()

    def drop_member(self, member: int) -> None:
        """The connector lost group rank `member`: release whatever of its link still
        waits (a device link's pending kernels would hold the others' operations queued
        behind them on a stream). Host transports fail a lost peer's operations at once:
        nothing to do."""
        return None

    def watch_device_work(self, what: str) -> None:
        """Bound the device work enqueued so far on the caller's current stream (a replayed
        graph's exchanges, which no Python posted) like a posted operation: past the step
        timeout the data channel is aborted and the next call raises. Host transports
        block on every operation already: nothing to do."""
        return None

    # blocking forms
    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.isend(tensor, peer, tag).wait()

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.irecv(tensor, peer, tag).wait()

    def send_control(self, tensor: torch.Tensor, peer: int) -> None:
        self.isend_control(tensor, peer).wait()

    def recv_control(self, tensor: torch.Tensor, peer: int) -> None:
        self.irecv_control(tensor, peer).wait()

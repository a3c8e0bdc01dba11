"""FFN side: the attention peers' control messages, as they come.

An FFN rank may serve attention ranks of several attention servers. The data-parallel ranks
of one server step together (vLLM runs them in lockstep: an idle rank runs a dummy step),
but two servers step independently: waiting for every peer before each step would stall one
server until the other gets a request. One listener thread per peer receives that peer's
next control message as soon as it is sent; the FFN rank then serves the peers that are
ready (and every peer of their servers), and picks up the others in a later step.

Where links fail alone, a listener also watches its peer's liveness: it answers the
peer's heartbeats itself (`on_heartbeat`), and a peer that sends neither a step nor a
heartbeat within `liveness_s` is reported as failed, so it is dropped and its restart is
admitted (admission/rejoin.py). Silence counts only while the peer owes a message: after
it announced a step, it sends nothing until that step is served (its status sent, `served`),
which may take the FFN rank a while when it waits out another server's stalled peer. So
the listener posts its next bounded receive once the step was served (or, at the latest,
after `answer_bound_s`, the longest the peer itself waits for it); before, a peer waiting
for its step behind another server's stall was dropped as silent.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from afd_core.connectors.protocol.control import MESSAGE_LEN, awaits_status, is_heartbeat
from afd_core.connectors.transports.transport import Transport, TransportError


# What the admission threads (admission/rejoin.py, group_epoch.py) hand the FFN serving
# thread through the inbox (`put`), in turn with the peers' control messages.
@dataclass(frozen=True)
class RejoinReady:
    """Peer i's restarted process was admitted: its hello, and its link connected off the
    serving thread (None: the serving thread connects it, relink)."""

    incarnation: int
    hello: dict
    link: object | None


@dataclass(frozen=True)
class StopServing:
    """For the FFN serving thread (through the inbox): this rank must stop, and why."""

    reason: str


@dataclass(frozen=True)
class GroupStepBegun:
    """For the FFN serving thread: another member of its expert group began a step
    (step/expert_group.py); it may owe the group that step without peers of its own."""


class ControlInbox:
    CLOSED = (-1, None)  # what `get` returns once the inbox is closed

    def __init__(
        self,
        transport: Transport,
        num_peers: int,
        name: str,
        liveness_s: float | None = None,
        on_heartbeat: Callable[[int, list[int]], None] | None = None,
        answer_bound_s: Callable[[int], float] | None = None,
    ):
        self._transport = transport
        self._name = name
        self._liveness_s = liveness_s  # None: an idle peer is waited for without bound
        # the longest a peer waits for a step of these flags to be served (then it stops
        # waiting on us)
        self._answer_bound_s = answer_bound_s
        # set while peer i owes nothing: no step of it waits to be served
        self._served = [threading.Event() for _ in range(num_peers)]
        for event in self._served:
            event.set()
        # answers peer i's heartbeat; raises TransportError when it cannot
        self._on_heartbeat = on_heartbeat
        self._queue: queue.Queue = queue.Queue()
        # each peer's listener generation: a restarted peer gets a new listener on its new
        # link, and whatever the old one still reports is dropped
        self._generation = [0] * num_peers
        self._closed = False

    def start(self) -> None:
        for i in range(len(self._generation)):
            self._start_listener(i)

    def listen(self, i: int) -> None:
        """A fresh listener for peer i (it rejoined on a new link)."""
        self._generation[i] += 1
        self._served[i].set()  # the old listener, if it waits, wakes and stops
        self._start_listener(i)

    def served(self, i: int) -> None:
        """Peer i's step was served (its status sent) or the peer dropped: from now on its
        silence counts again."""
        self._served[i].set()

    def put(self, i: int, item) -> None:
        """Something for the serving thread about peer i, in turn with its messages."""
        self._queue.put((i, None, item))

    def _start_listener(self, i: int) -> None:
        threading.Thread(
            target=self._listen,
            args=(i, self._generation[i]),
            name=f"{self._name}-control-{i}",
            daemon=True,
        ).start()

    def _listen(self, i: int, generation: int) -> None:
        """Peer i (group rank i + 1): one control message after another, until it fails."""
        import torch

        while not self._closed:
            buf = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
            posted = time.monotonic()
            try:
                self._transport.irecv_control(buf, i + 1, bound_s=self._liveness_s).wait()
                words = buf.tolist()
                if self._on_heartbeat is not None and is_heartbeat(words):
                    if not self._closed and generation == self._generation[i]:
                        self._on_heartbeat(i, words)
                    continue
            except TransportError as exc:
                silent = time.monotonic() - posted >= 0.9 * (self._liveness_s or float("inf"))
                if silent:
                    exc = TransportError(
                        f"{exc} (it sent no step and no heartbeat within "
                        f"{self._liveness_s:.0f}s, liveness_timeout_s: silent, cut off or "
                        "stopped)"
                    )
                self._queue.put((i, generation, exc))
                return
            except BaseException as exc:  # noqa: BLE001 - a listener must not die silently
                error = TransportError(f"control listener failed: {exc!r}")
                self._queue.put((i, generation, error))
                return
            if self._closed:
                return
            waits = self._liveness_s is not None and awaits_status(words)
            if waits:
                self._served[i].clear()
            self._queue.put((i, generation, words))
            if waits:  # it sends nothing more until its step is served
                bound = self._answer_bound_s(words[4]) if self._answer_bound_s else None
                self._served[i].wait(bound)
                if self._closed or generation != self._generation[i]:
                    return

    def get(self, block: bool = True, timeout_s: float | None = None):
        """(peer index, words), (peer index, TransportError) or (peer index, what `put`
        gave); None when nothing came (not blocking, or within timeout_s); CLOSED once
        closed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._closed:
                return self.CLOSED
            try:
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                i, generation, item = self._queue.get(block, left)
            except queue.Empty:
                return None
            if i < 0:
                return self.CLOSED
            if generation is None or generation == self._generation[i]:
                return i, item

    def close(self) -> None:
        """Wake a `get` waiting for the next step. The listeners stop at their next
        message, or when the transport closes under their receive."""
        self._closed = True
        for event in self._served:
            event.set()
        self._queue.put((-1, None, None))

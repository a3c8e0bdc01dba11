"""FFN side: the attention peers' control messages, as they come.

An FFN rank may serve attention ranks of several attention servers. The data-parallel ranks
of one server step together (vLLM runs them in lockstep: an idle rank runs a dummy step),
but two servers step independently: waiting for every peer before each step would stall one
server until the other gets a request. One listener thread per peer receives that peer's
next control message as soon as it is sent; the FFN rank then serves the peers that are
ready (and every peer of their servers), and picks up the others in a later step.
"""

from __future__ import annotations

import queue
import threading

from afd_core.connectors.control import MESSAGE_LEN
from afd_core.connectors.transport import Transport, TransportError


class ControlInbox:
    CLOSED = (-1, None)  # what `get` returns once the inbox is closed

    def __init__(self, transport: Transport, num_peers: int, name: str):
        self._transport = transport
        self._queue: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(
                target=self._listen, args=(i,), name=f"{name}-control-{i}", daemon=True
            )
            for i in range(num_peers)
        ]
        self._closed = False

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _listen(self, i: int) -> None:
        """Peer i (group rank i + 1): one control message after another, until it fails."""
        import torch

        while not self._closed:
            buf = torch.zeros(MESSAGE_LEN, dtype=torch.int64)
            try:
                self._transport.irecv_control(buf, i + 1).wait()
            except TransportError as exc:
                self._queue.put((i, exc))
                return
            except BaseException as exc:  # noqa: BLE001 - a listener must not die silently
                self._queue.put((i, TransportError(f"control listener failed: {exc!r}")))
                return
            if self._closed:
                return
            self._queue.put((i, buf.tolist()))

    def get(self, block: bool = True, timeout_s: float | None = None):
        """(peer index, words) or (peer index, TransportError); None when nothing came
        (not blocking, or within timeout_s); CLOSED once closed."""
        if self._closed:
            return self.CLOSED
        try:
            return self._queue.get(block, timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Wake a `get` waiting for the next step. The listeners stop at their next
        message, or when the transport closes under their receive."""
        self._closed = True
        self._queue.put(self.CLOSED)

"""Liveness of idle links: an idle attention rank's heartbeat, answered by its FFN rank.

Between steps nothing moves on a link, and a peer that is powered off, cut off by a
partition or stopped (SIGSTOP) sends no FIN: without traffic neither side would learn it,
the FFN rank would keep the silent rank's claim and refuse its restart. So where links fail
alone (`survives_peer_loss`), an attention rank that has not begun a step for
liveness_timeout_s / 3 sends a HEARTBEAT control message (control.py) and waits up to
liveness_timeout_s for the answer, which its FFN rank's listener for that peer sends at
once (inbox.py), busy serving other peers or not:

- the FFN rank's listener gives up on a peer that sent neither a step nor a heartbeat for
  liveness_timeout_s: the peer is dropped, its claim released, its restart admitted;
- the attention rank that gets no answer within liveness_timeout_s loses its FFN rank
  (admission/ffn_return.py): its steps fail at once, /health says 503, and it waits for an FFN rank.

A heartbeat and a step's control message never interleave: both take `control_lock`, and
a heartbeat goes only while no step is in flight (the FFN rank's status of the previous
step was taken), so each status the attention rank receives answers what it sent.
"""

from __future__ import annotations

import threading
import time

from afd_core.connectors.base import AFDPeerError
from afd_core.connectors.protocol.control import ControlFlag, ControlMessage
from afd_core.connectors.protocol.status import STATUS_LEN, StatusCode, StatusError, decode_status
from afd_core.connectors.transports.transport import TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)


def heartbeat_interval(liveness_s: float) -> float:
    """How long an attention rank stays idle before it sends a heartbeat: three of them
    fit in one liveness bound, so one late answer is not yet a loss."""
    return liveness_s / 3


class Heartbeat:
    """The attention side's heartbeat thread of one connector (a PointToPointConnector)."""

    def __init__(self, connector, liveness_s: float):
        self.connector = connector
        self.liveness_s = liveness_s
        self.interval_s = heartbeat_interval(liveness_s)
        self.sent = 0  # heartbeats answered, for tests and logs
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"{connector._me()}-heartbeat", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        c = self.connector
        seen_step, idle_since = c._step, time.monotonic()
        while not self._stop.wait(min(1.0, self.interval_s / 2)):
            if c._closed:
                return
            if c._step != seen_step or c._current is not None or c._ffn_lost is not None:
                seen_step, idle_since = c._step, time.monotonic()
                continue
            if time.monotonic() - idle_since < self.interval_s:
                continue
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - a heartbeat must not kill its thread
                logger.exception("AFD %s: heartbeat failed", c._me())
            seen_step, idle_since = c._step, time.monotonic()

    def beat(self) -> bool:
        """One heartbeat if this rank is idle and served; True if it was answered."""
        import torch

        c = self.connector
        with c.control_lock:
            t = c._transport
            if t is None or c._closed or c._current is not None or c._ffn_lost is not None:
                return False
            msg = ControlMessage(
                c.role_rank, c._step, (), c.wire.hidden_size, c.wire.dtype, ControlFlag.HEARTBEAT
            )
            buf = torch.empty(STATUS_LEN, dtype=torch.uint8)
            try:
                answer = t.irecv_status(buf, 0)
                t.isend_control(torch.tensor(msg.encode(), dtype=torch.int64), 0).wait()
                answer.wait(self.liveness_s)
                status = decode_status(bytes(buf.numpy()), c.group)
            except TransportError as exc:
                self._lost(
                    f"{c._me()}: {c._peer_name(0)} did not answer a heartbeat within "
                    f"{self.liveness_s:.0f}s (liveness_timeout_s: silent, cut off or stopped; "
                    f"{exc})"
                )
                return False
            except StatusError as exc:
                self._lost(f"{c._me()}: a malformed answer to a heartbeat: {exc}")
                return False
        if status.code == StatusCode.ABORT:
            self._lost(f"{c._me()}: {c._peer_name(0)} stopped the deployment: {status.reason}")
            return False
        if status.step != msg.step:
            self._lost(
                f"{c._me()}: {c._peer_name(0)} answered a heartbeat at step {msg.step} with "
                f"step {status.step}; the two sides are out of step"
            )
            return False
        self.sent += 1
        return True

    def _lost(self, message: str) -> None:
        error = self.connector._ffn_failure(message)
        if isinstance(error, AFDPeerError) and not self.connector._ffn_lost:
            # where a lost FFN rank is fatal, the next step raises it
            self.connector._fatal = error
        logger.error("%s", message)

"""An attention rank outlives its FFN rank.

When the FFN rank of a formed deployment is lost (its process died, hung past the step
timeout, or stopped the deployment), an attention rank whose links fail alone
(`survives_peer_loss`) does not stop its server. The step in flight and every later step
fail at once with AFDFFNLostError, an AFDStepError: the engine fails their requests and
goes on. `afd_peer_up` drops to 0 on /metrics, so /health answers 503 (patches/health.py).
A thread (`FFNReturnWatch`) waits meanwhile for an FFN rank to serve this rank again:

* a restarted FFN server holding FFN rank 0 opens a fresh store at the same host:port. The
  rank joins that deployment's start-up (membership.py), as every surviving attention
  server does, and says it returns: the FFN server's roll call then waits at most
  recovery_grace_s for the ranks not back yet and forms without them (formation.py);
  they join later as restarted ranks;
* the same FFN process still runs (it dropped this rank after a hang or a network fault):
  the store says the deployment formed, and the rank rejoins as a restarted attention rank
  does (rejoin.py).

Either way the rank's steps count from 0 again on a fresh link. `retry_ffn_now` (vLLM's
`POST /fault_tolerance/apply` with `retry`, afd_core/fault_tolerance.py) cuts the wait
before the next attempt short. A restarted FFN rank k > 0, while FFN rank 0 runs, forms
its group again under a new epoch (group_epoch.py): the rank sees the epoch change and
joins that.

The loss stays fatal (AFDPeerError, the server stops) before the deployment formed, and
where the attention role sets `ffn_loss_fatal`: on an attention server with tensor
parallelism (its ranks would not all fail a step at the same point, and one could wait in
vLLM's all-gather for a rank that left the step), and on one with device graphs (vLLM
captured them once, with the lost link's communicators in them).
"""

from __future__ import annotations

import threading
import time
from typing import NoReturn

from afd_core.connectors.admission.formation import REFORMING_KEY
from afd_core.connectors.admission.membership import FORMED_KEY
from afd_core.connectors.base import AFDFFNLostError, AFDPeerError
from afd_core.connectors.transports.rendezvous import _listening
from afd_core.connectors.transports.transport import TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)

RETRY_S = 1.0  # how often a rank without FFN rank looks for it


class AwaitingFFN:
    """PointToPointConnector's attention side without its FFN rank (a mixin: the
    connector's state is its own)."""

    # set by the attention role where a lost FFN rank must stop the server (see above)
    ffn_loss_fatal = False

    def _ffn_failure(self, message: str) -> Exception:
        """The error for a failure of the channel with the FFN rank: AFDFFNLostError once
        this rank waits for the FFN rank to come back, else AFDPeerError (fatal)."""
        self._ffn_gone()
        if self.ffn_loss_fatal or not self.survives_peer_loss or not self._formed:
            return AFDPeerError(message)
        with self._lock:
            first = self._ffn_lost is None and not self._closed
            if first:
                self._ffn_lost = message
                self._ffn_lost_at = time.monotonic()
                old, self._transport = self._transport, None
                in_flight, self._current = self._current, None
        if first:
            if in_flight is not None:
                self._count_step(failed=True)
            self.metrics.add("peers_lost")
            self.metrics.publish(now=True)
            logger.error(
                "AFD %s: lost %s (%s); this server stays up, fails every step until an FFN "
                "rank serves it again, and waits for one",
                self._me(),
                self._peer_name(0),
                message,
            )
            self._ffn_watch = FFNReturnWatch(self, old)
            self._ffn_watch.start()
        return self._ffn_lost_error() if self._ffn_lost is not None else AFDPeerError(message)

    def retry_ffn_now(self) -> bool:
        """Start the next attempt to be served again now instead of after RETRY_S (one
        already under way is followed by another at once). False while an FFN rank serves
        this rank (nothing to retry)."""
        with self._lock:
            watch = self._ffn_watch if self._ffn_lost is not None and not self._closed else None
        if watch is None:
            return False
        watch.wake()
        return True

    def link_steps(self) -> int | None:
        """None while no FFN rank serves this rank; else the steps begun on its link (0: a
        fresh link, on which no step went yet)."""
        with self._lock:
            if self._ffn_lost is not None or self._transport is None or self._closed:
                return None
            return self._step

    def hold_step(self, waiting_for: str) -> NoReturn:
        """Fail this step at once without sending anything (step/served_together.py): a
        rank it steps together with is `waiting_for` its FFN rank. A rank served on a new
        link keeps it idle (its heartbeat keeps it alive): its step 0 goes later, at the
        same step as its siblings' (their FFN ranks' group waits for all of them)."""
        if self._fatal is not None:
            raise self._fatal
        self._count_step(failed=True)
        with self._lock:
            lost = self._ffn_lost is not None
        if lost:
            raise self._ffn_lost_error()
        raise AFDFFNLostError(
            f"{self._me()}: step held: {waiting_for}; the ranks of this server step together "
            "and their FFN ranks are one expert group, so they are served again together, "
            "from the first step every one of them begins served"
        )

    def _ffn_lost_error(self) -> AFDFFNLostError:
        since = time.monotonic() - self._ffn_lost_at
        return AFDFFNLostError(
            f"{self._me()}: {self._peer_name(0)} is gone ({since:.0f} s ago: {self._ffn_lost}); "
            "the requests of every step fail until an FFN rank serves this rank again"
        )

    def _ffn_back(self, transport) -> bool:
        """Watch thread: the FFN side serves this rank again on `transport`."""
        with self._lock:
            if self._closed:
                return False
            self._transport = transport
            self._step = 0  # the FFN rank counts this rank's steps from 0 on a fresh link
            self._current = None
            away = time.monotonic() - self._ffn_lost_at
            self._ffn_lost = None
        self.metrics.set_peers([self.group], True)
        self.metrics.add("peers_rejoined")
        self.metrics.publish(now=True)
        logger.info(
            "AFD %s: %s serves this rank again after %.1f s", self._me(), self._peer_name(0), away
        )
        return True

    def _try_return(self) -> bool:
        """One attempt to be served again; True once it is."""
        if not _listening(self.config.host, self.config.port):
            return False
        transport = self.make_transport(self.group, self.group_rank, self.group_size)
        extra = self.config.extra()
        deadline = time.monotonic() + extra.connect_timeout_s
        try:
            transport.open_store()
            if transport.store_try_get(FORMED_KEY) is not None:
                epoch = self._store_epoch(transport)
                if epoch != self._group_epoch:  # a restarted FFN rank k > 0 forms its group
                    self._join_group_epoch(transport, epoch, deadline + extra.recovery_grace_s)
                else:
                    self._rejoin(transport, deadline)  # the same deployment still runs
            else:
                # a restarted FFN rank 0's: it forms with the ranks present after
                # recovery_grace_s from now (formation.py), so this rank waits that too
                transport.store_set(REFORMING_KEY, b"1")
                try:
                    self._connect(transport, deadline + extra.recovery_grace_s)
                except AFDPeerError:
                    self._leave_failed_start_up(transport)
                    raise
        except (AFDPeerError, TransportError) as exc:
            with self._lock:
                self._transport = None  # _connect or _rejoin may have set it
            transport.close()
            self._ffn_watch.note_failure(str(exc))
            return False
        if not self._ffn_back(transport):
            transport.close()
        return True


class FFNReturnWatch:
    """Attention rank without its FFN rank: a thread that tries, every RETRY_S (at once
    when woken), to be served again, until it is or the connector closes."""

    def __init__(self, connector, old_transport):
        self._connector = connector
        self._old_transport = old_transport  # closed by the thread: closing may wait
        self._stop = threading.Event()
        self._now = threading.Event()  # woken: the next attempt starts without waiting
        self.attempts = 0
        self._last_failure = ""
        self._thread = threading.Thread(
            target=self._watch, name=f"afd-attention-{connector.role_rank}-ffn-return", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._now.set()

    def wake(self) -> None:
        self._now.set()

    def _wait(self) -> bool:
        """Wait RETRY_S or until woken; True once the watch must stop."""
        self._now.wait(RETRY_S)
        self._now.clear()
        return self._stop.is_set()

    def note_failure(self, why: str) -> None:
        if why != self._last_failure:  # one line per new reason, not one per attempt
            logger.warning("AFD %s: not served again yet: %s", self._connector._me(), why)
            self._last_failure = why

    def _watch(self) -> None:
        c = self._connector
        if self._old_transport is not None:
            try:  # also fails the other exchanges of the step in flight at once
                self._old_transport.close()
            except Exception:  # noqa: BLE001 - its peer is gone: nothing left to close
                logger.debug("AFD %s: old transport not closed cleanly", c._me(), exc_info=True)
            self._old_transport = None
        while not self._wait() and not c._closed:
            self.attempts += 1
            try:
                if c._try_return():
                    return
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the wait
                logger.exception("AFD %s: FFN return attempt failed", c._me())
                self.note_failure(f"{type(exc).__name__}: {exc}")

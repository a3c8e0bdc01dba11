"""An FFN rank's group forms again in a running deployment: group epochs, and survivors of
a lost store.

Two things outlive one FFN server in a deployment of several (F > 1):

* **A restarted FFN rank k > 0** (the store, in FFN rank 0's process, still runs) forms its
  group again under a new epoch: it adds one to `afd/g<k>/epoch`, and every key of the
  group (arrival, hellos, verdicts, links, rejoin requests) lives under
  `afd/g<k>/e<epoch>` from then on (`group_prefix`). Its attention peers that wait for it
  (ffn_return.py) see the epoch change and join (`_join_group_epoch`); it waits at most
  recovery_grace_s for them and forms with those present; an absent peer rejoins later
  (rejoin.py) at the new epoch. The new process owns its group's claims: a peer absent from
  its formation has no FFN rank serving it, so its claim is freed. A previous process of
  the FFN rank that still runs (it hung, or was cut off) sees the newer epoch from its
  rejoin thread and stops with that reason instead of serving on beside the new one.
* **FFN rank 0 restarted** opens a fresh store: the other FFN ranks and their attention
  peers serve on over their own links, and their rejoin thread finds the store gone. It
  waits for a store at afd.host:afd.port again and registers there (`_reattach_store`): the
  ranks it serves keep their seats (the restarted FFN rank 0 does not wait for them,
  formation.py) and their claims, and its epoch; from then on its peers' restarts rejoin
  through it and a later loss of it is recovered as above. A store that holds another
  deployment (another shape) stops it with that reason.
"""

from __future__ import annotations

import json
import time

from afd_core.connectors.admission.formation import SEAT_CLOSED, keep_seat
from afd_core.connectors.admission.membership import claim_key
from afd_core.connectors.base import AFDPeerError
from afd_core.connectors.protocol.inbox import StopServing
from afd_core.connectors.transports.rendezvous import _listening
from afd_core.connectors.transports.transport import Transport, TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)

REATTACH_EVERY_S = 1.0  # how often a survivor of a lost store looks for a new one


def epoch_key(group: int) -> str:
    return f"afd/g{group}/epoch"


def group_prefix(group: int, epoch: int) -> str:
    """Where group `group`'s keys live at `epoch` (0: as formed at start-up)."""
    return f"afd/g{group}" if epoch == 0 else f"afd/g{group}/e{epoch}"


class GroupEpochs:
    """PointToPointConnector's group epochs (a mixin: the connector's state is its own)."""

    _group_epoch = 0  # the epoch of this rank's group it formed or joined

    def _group_prefix(self) -> str:
        return group_prefix(self.group, self._group_epoch)

    def _take_epoch(self, transport: Transport, epoch: int) -> None:
        self._group_epoch = epoch
        transport.group_prefix = self._group_prefix()

    def _store_epoch(self, transport: Transport) -> int:
        return transport.store_add(epoch_key(self.group), 0)

    # -- a restarted FFN rank ------------------------------------------------------------
    def _reform_group(self, transport: Transport) -> None:
        """A restarted FFN rank k > 0 in a running deployment: its group forms again, with
        the peers that come within recovery_grace_s."""
        extra = self.config.extra()
        me = self._me()
        if not self.survives_peer_loss:
            raise AFDPeerError(
                f"{me}: the deployment at {self.config.host}:{self.config.port} is running "
                f"and connector {self.config.connector!r} cannot form one group again (its "
                "channels span the group): restart the deployment (every server)"
            )
        if problem := self._shape_problem(transport, extra.connect_timeout_s):
            raise AFDPeerError(problem)
        self._take_epoch(transport, transport.store_add(epoch_key(self.group), 1))
        gp = self._group_prefix()
        logger.warning(
            "AFD %s: the deployment runs; this FFN rank forms its group again (epoch %d) and "
            "waits at most %.0f s (recovery_grace_s) for attention ranks %s",
            me,
            self._group_epoch,
            extra.recovery_grace_s,
            self.peers,
        )
        members = range(1, self.group_size)
        deadline = time.monotonic() + extra.recovery_grace_s
        while time.monotonic() < deadline:
            if all(transport.store_add(f"{gp}/seat/{m}", 0) for m in members):
                break
            time.sleep(0.05)
        present = [
            m
            for m in members
            if transport.store_add(f"{gp}/seat/{m}", SEAT_CLOSED) == SEAT_CLOSED + 1
        ]
        # this process owns its group's claims now: a peer it forms without is served by
        # no one and may rejoin
        for m in members:
            transport.store_set(
                claim_key("attention", self.peers[m - 1]), b"1" if m in present else b"0"
            )
        transport.store_set(claim_key("ffn", self.role_rank), b"1")
        transport.store_set(f"{gp}/members", json.dumps([0, *present]).encode())
        if len(present) < len(members):
            absent = [self.peers[m - 1] for m in members if m not in present]
            logger.warning(
                "AFD %s: forms its group without attention ranks %s (not back within "
                "recovery_grace_s); each joins when its server comes back",
                me,
                absent,
            )
        transport.group_members = [0, *present]
        for i in range(len(self.peers)):
            self._active_peers[i] = i + 1 in present
        try:
            transport.join_group()
        except TransportError as exc:
            raise AFDPeerError(f"{me}: forming its group again failed: {exc}") from None
        self._transport = transport
        self._handshake(extra.connect_timeout_s)
        logger.info("AFD %s formed its group again: epoch %d", me, self._group_epoch)

    # -- an attention rank whose FFN rank formed its group again ---------------------------
    def _join_group_epoch(self, transport: Transport, epoch: int, deadline: float) -> None:
        """The FFN rank of this attention rank formed its group again (a restarted
        process): join that formation, or rejoin the group if it went without this rank."""
        self._take_epoch(transport, epoch)
        if problem := self._shape_problem(transport, max(deadline - time.monotonic(), 1.0)):
            raise AFDPeerError(problem)
        gp = self._group_prefix()
        members = None
        if transport.store_add(f"{gp}/seat/{self.group_rank}", 1) == 1:
            while (raw := transport.store_try_get(f"{gp}/members")) is None:
                if time.monotonic() > deadline:
                    raise AFDPeerError(
                        f"{self._me()}: {self._peer_name(0)} began forming its group again "
                        "(epoch {epoch}) and did not finish in time"
                    )
                time.sleep(0.05)
            members = json.loads(raw)
        if members is None or self.group_rank not in members:
            self._rejoin(transport, deadline)
            return
        transport.group_members = members
        try:
            transport.join_group()
        except TransportError as exc:
            raise AFDPeerError(
                f"{self._me()}: joining its FFN rank's group failed: {exc}"
            ) from None
        self._transport = transport
        self._handshake(self.config.extra().connect_timeout_s)
        logger.info(
            "AFD %s joined %s's group formed again (epoch %d)",
            self._me(),
            self._peer_name(0),
            epoch,
        )

    def _epoch_moved(self, transport: Transport) -> AFDPeerError | None:
        """Attention side, waiting to rejoin: the error to stop the wait with when the FFN
        rank formed its group again meanwhile (the next attempt joins that)."""
        epoch = self._store_epoch(transport)
        if epoch == self._group_epoch:
            return None
        return AFDPeerError(
            f"{self._me()}: {self._peer_name(0)} forms its group again (epoch {epoch}); "
            "joining that instead"
        )

    # -- an FFN rank that outlived FFN rank 0's store --------------------------------------
    def _reattach_store(self, stop) -> StopServing | bool:
        """Rejoin thread of an FFN rank whose store went with FFN rank 0: wait for a store
        at afd.host:afd.port again and register this rank, its served peers and its epoch
        there. True once registered; False when stopped; StopServing when this rank must
        stop (the new store holds another deployment, or a newer epoch of its group)."""
        t, me = self._transport, self._me()
        logger.warning(
            "AFD %s: lost the rendezvous store at %s:%d (FFN rank 0 stopped); serving on, and "
            "registering again with a restarted FFN rank 0's",
            me,
            self.config.host,
            self.config.port,
        )
        while not stop.wait(REATTACH_EVERY_S):
            if self._closed:
                return False
            if not _listening(self.config.host, self.config.port):
                continue
            try:
                t.reopen_store()
                problem = self._shape_problem(t, self.config.extra().connect_timeout_s)
                if problem:
                    return StopServing(
                        f"{me}: the rendezvous at {self.config.host}:{self.config.port} now "
                        f"holds another deployment ({problem}); this FFN rank stops"
                    )
                epoch = self._store_epoch(t)
                if epoch > self._group_epoch:
                    return StopServing(self._superseded(epoch))
                if epoch < self._group_epoch:
                    t.store_add(epoch_key(self.group), self._group_epoch - epoch)
                keep_seat(t, "ffn", self.role_rank)
                t.store_add(claim_key("ffn", self.role_rank), 1)
                for i, peer in enumerate(self.peers):
                    if self._active_peers[i]:
                        keep_seat(t, "attention", peer)
                        t.store_add(claim_key("attention", peer), 1)
            except (AFDPeerError, TransportError, RuntimeError, ValueError) as exc:
                logger.debug("AFD %s: not registered yet: %s", me, exc)
                continue
            logger.info(
                "AFD %s: registered with the restarted FFN rank 0's rendezvous (group epoch "
                "%d, attention ranks %s served)",
                me,
                self._group_epoch,
                [p for p, up in zip(self.peers, self._active_peers, strict=True) if up],
            )
            return True
        return False

    def _superseded(self, epoch: int) -> str:
        return (
            f"{self._me()}: a restarted process of this FFN rank formed its group again "
            f"(epoch {epoch}, this process has {self._group_epoch}); this one stops"
        )

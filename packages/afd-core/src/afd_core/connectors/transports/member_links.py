"""Each attention member of an AFD group gets channels of its own with its FFN rank.

In an AFD group (one FFN rank at group rank 0, its attention peers) a link joins the FFN
rank with one member: a control pair (gloo, CPU) and the transport's data pair (gloo on
CPU, a two-rank communicator per direction on a device). A lost member then fails alone:
the connector drops it (`drop_member`: a device link's pending kernels are released at
once, so nothing of the others waits behind them on a stream), the others go on, and a restarted member gets a fresh link (`relink` on the FFN
rank, `join_link` on the member; a failed gloo pair or an aborted communicator cannot be
used again). The link of a member's `incarnation`-th process lives under its own store
prefix.

The groups between an FFN rank's own workers (tensor parallel, expert groups) are one
group of all members (`per_member_links` False): they stop together.
"""

from __future__ import annotations

from abc import abstractmethod

from afd_core.connectors.transports.transport import TransportError


class MemberLinks:
    """StoreTransport mixin. A subclass makes (`_link`), connects (`_check_link`) and
    aborts (`_abort_link`) one link; a link has `.ctrl` (a two-member gloo group) and
    `.remote` (the other side's rank in its pairs)."""

    per_member_links = False  # the AFD group's transport: set by its connector
    # a restarted member's link can be connected off the serving thread (prepare_link)
    # and swapped in between two steps (install_link): nothing of it touches what the
    # serving thread uses. Not on a device, where connecting posts device operations on
    # the streams the serving thread launches on.
    links_connect_off_serving_thread = True

    def _init_links(self) -> None:
        self._links: dict = {}  # group rank -> its link (per_member_links)

    @abstractmethod
    def _link(self, member: int, incarnation: int):
        """Member `member`'s link, for its `incarnation`-th process (0: the first)."""

    @abstractmethod
    def _check_link(self, peer: int, link=None) -> None:
        """Connect link `peer`'s pairs now (`link`, default the installed one), while its
        other side does the same."""

    @abstractmethod
    def _abort_link(self, link) -> None:
        """Stop everything of the link's (pending operations end with an error)."""

    @property
    def _prefix(self) -> str:
        return self.group_prefix

    def _connect_member_links(self, prefix: str) -> None:
        if self.group_rank == 0:
            self._links = {}
            members = self.group_members or range(self.group_size)
            for m in (m for m in members if m != 0):  # every member connects its link now
                self._links[m] = self._link(m, 0)
                self._check_link(m)
        else:
            self._links = {0: self._link(self.group_rank, 0)}
            self._check_link(0)

    def prepare_link(self, member: int, incarnation: int):
        """FFN rank, on the rejoin thread: a restarted member's fresh link, connected (the
        member is connecting its side now); TransportError if it does not connect."""
        link = self._link(member, incarnation)
        try:
            self._check_link(member, link)
        except TransportError:
            self._abort_link(link)
            raise
        finally:
            self._forget_link_keys(member, incarnation)
            self._forget_guard_keys(member, incarnation)
        return link

    def _forget_guard_keys(self, member: int, incarnation: int) -> None:
        """The keys the link's two sides met through to filter their listeners
        (listener_filter.py), once the link connected (or gave up)."""
        from afd_core.connectors.transports.listener_filter import guard_keys

        prefix = f"{self._prefix}/link{member}/{incarnation}"
        for channel in ("ctrl", "data"):
            for key in guard_keys(0) + guard_keys(1):
                self.store_delete(f"{prefix}/{channel}/{key}")

    def _forget_link_keys(self, member: int, incarnation: int) -> None:
        """The store keys a link's pairs met through, once they connected (or gave up):
        each restart makes a fresh link, and the store must not grow with them."""

    def install_link(self, member: int, link) -> None:
        """FFN rank, between two steps: `link` replaces the member's failed one."""
        old = self._links.get(member)
        self._links[member] = link
        if old is not None and old is not link:
            self._abort_link(old)

    def discard_link(self, link) -> None:
        """FFN rank: a prepared link that is not installed (its member was admitted on
        another one) is stopped, its pairs closed."""
        self._abort_link(link)

    def relink(self, member: int, incarnation: int) -> None:
        """FFN rank: a restarted member's fresh link replaces its failed one, connected
        here (the member is connecting its side now)."""
        old = self._links.pop(member, None)
        if old is not None:
            self._abort_link(old)
        self.install_link(member, self.prepare_link(member, incarnation))

    def join_link(self, incarnation: int) -> None:
        """A restarted attention member joins a running group: its link only, no waiting
        for the other members (they are serving)."""
        self._links = {0: self._link(self.group_rank, incarnation)}
        self._check_link(0)

    def _ctrl_of(self, peer: int) -> tuple:
        if not self.per_member_links:
            return super()._ctrl_of(peer)
        link = self._member_link(peer)
        return link.ctrl, link.remote

    def _member_link(self, peer: int):
        link = self._links.get(peer)
        if link is None:  # dropped (drop_member): its restart brings a fresh one
            raise TransportError(f"the link with group rank {peer} was dropped")
        return link

    def _close_links(self) -> None:
        for link in self._links.values():
            self._abort_link(link)
        self._links = {}

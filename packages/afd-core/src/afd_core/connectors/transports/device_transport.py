"""A data channel of device point-to-point communicators, for every accelerator: NCCL on
CUDA (`nccl.py`), HCCL on Ascend (afd-npu). The rendezvous store and the CPU control
channel are the shared `StoreTransport`'s; only the communicator and the device runtime
differ per platform.

In an AFD group (one FFN rank and its attention peers) each attention member has a link of
its own with the FFN rank (`member_links.py`): a gloo control pair and two communicators of
two ranks, one per direction (`to_first`: attention -> FFN, `from_first`: FFN ->
attention). A lost member's link is aborted alone (a watchdog expiry names it, or the
connector drops it), and its restart gets a fresh one, as on gloo. The groups of an FFN
rank's own workers (tensor parallel, expert groups) get two communicators over the whole
group. Whichever, each direction is driven on a stream of its own: a receive enqueued before a send on one stream would hold the send back until the
peer answered, which deadlocks as soon as micro-batches overlap. Device communicators match
point-to-point operations in issue order per peer, not by tag: the protocol issues every
data operation in the same order on both sides and keeps its status message on the control
channel (docs/protocol.md), so the tags the protocol passes are not needed here.

The operations posted inside one `grouped_ops()` block (a layer/micro-batch's sends to every
peer, or its receives) go out as one launch per communicator (with links: one per peer), inside the communicator's
`group_start()`/`group_end()` (NCCL's ncclGroupStart/End) where it has them, with one event
and one watchdog entry for the launch: not one NCCL kernel, event and watchdog entry per
(layer, micro-batch, peer, tensor). A communicator without group calls (HCCL through
torch.distributed) gets its operations one by one, still under one event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from afd_core.connectors.transports.device import ChannelAborted, DeviceRuntime, Watchdog
from afd_core.connectors.transports.member_links import MemberLinks
from afd_core.connectors.transports.rendezvous import StoreTransport, abort_groups
from afd_core.connectors.transports.transport import Handle, TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)


class DeviceComm(Protocol):
    """One communicator of a group: point-to-point operations enqueued on a stream."""

    def send(self, tensor, peer: int, stream) -> None: ...

    def recv(self, tensor, peer: int, stream) -> None: ...

    def abort(self) -> None:
        """Make every enqueued operation return (after a timeout); the communicator is
        unusable afterwards."""

    # Optional: `group_start()` / `group_end()` around operations that go out as one launch
    # (NCCL's ncclGroupStart/ncclGroupEnd); a communicator without them posts one by one.


class CommFactory(Protocol):
    def unique_id(self) -> bytes:
        """A new communicator id (group rank 0 mints it, the others read it)."""

    def connect(self, unique_id: bytes, rank: int, size: int, device, store=None) -> DeviceComm:
        """Join the communicator; returns when all `size` ranks joined (or, for a
        communicator created lazily, when its first operation runs). `store`: the
        group's rendezvous store, for communicators built on one."""


DIRECTIONS = ("to_first", "from_first")  # attention -> FFN (group rank 0), and back


PRECONNECT_POLL_S = 0.001


@dataclass
class DeviceLink:
    """One attention member's channels with its FFN rank: the control pair (gloo), this
    side's send and receive communicators (two ranks each), and why it failed, once it
    did (its later operations raise that)."""

    ctrl: object
    comms: dict  # direction -> communicator of the pair
    remote: int  # the other side's rank in each pair
    failure: str | None = field(default=None)

    def comm(self, send: bool, first: bool):
        """The communicator this side sends (or receives) on: group rank 0 sends on
        `from_first` and receives on `to_first`, a member the other way round."""
        return self.comms["from_first" if first == send else "to_first"]


class _Launch:
    """The operations of one communicator posted in one `grouped_ops` block (or a single
    operation outside any): enqueued together when the block ends, completed by one event."""

    __slots__ = ("comm", "stream", "send", "ops", "event", "joined", "member")

    def __init__(self, comm, stream, send: bool, member: int | None = None):
        self.comm, self.stream, self.send = comm, stream, send
        self.member = member  # the link's group rank (per-member links), else None
        self.ops: list[tuple] = []  # (tensor, peer)
        self.event = None  # recorded after the launch
        self.joined = None  # the stream last ordered after `event` (later waits on it: free)

    def what(self) -> str:
        # on a member's link the ops name the other rank of its pair: name the member
        peers = [self.member] if self.member is not None else sorted({p for _, p in self.ops})
        ranks = ("group rank " if len(peers) == 1 else "group ranks ") + ", ".join(map(str, peers))
        return f"{'send to' if self.send else 'receive from'} {ranks}"


class LaunchHandle(Handle):
    """One operation of a launch: `wait` orders the caller's current stream after the
    launch's event (no host wait), once per stream for all the launch's operations."""

    __slots__ = ("_launch", "_transport")

    def __init__(self, launch: _Launch, transport: DeviceTransport):
        self._launch, self._transport = launch, transport

    def wait(self, timeout_s: float | None = None) -> None:
        t = self._transport
        launch = self._launch
        t._check(launch.member)  # an aborted channel (or link) fails every later wait, by name
        if launch.event is None:
            raise RuntimeError("an operation was waited for inside its own grouped_ops block")
        current = t.runtime.current_stream()
        if launch.joined is not None and launch.joined == current:
            return
        check = lambda: t._check(launch.member)  # noqa: E731
        t.runtime.wait_event(launch.event, check)
        check()  # an abort (of this link) may be what ended the wait
        launch.joined = current


class DeviceTransport(MemberLinks, StoreTransport):
    channel = "device"  # the communicator's name in error messages (NCCL, HCCL)
    # connecting a link posts its first operations on the shared streams (_preconnect)
    links_connect_off_serving_thread = False

    def __init__(self, *args, runtime: DeviceRuntime, comm_factory: CommFactory, **kwargs):
        super().__init__(*args, **kwargs)
        self.runtime = runtime
        self._factory = comm_factory
        self._comms: dict[str, DeviceComm] = {}
        self._send_comm = self._recv_comm = None
        self._send_stream = self._recv_stream = None
        self._watchdog: Watchdog | None = None
        self._failure: str | None = None
        self._block = threading.local()  # .launches: the open grouped_ops block's, by comm
        self._init_links()

    def _start_streams(self) -> None:
        """The two streams (one per direction) and the watchdog, once per transport."""
        if self._watchdog is not None:
            return
        self._send_stream = self.runtime.new_stream()
        self._recv_stream = self.runtime.new_stream()
        self._watchdog = Watchdog(
            f"afd-g{self.group}-r{self.group_rank}",
            self._expired,
            self.runtime.thread_init,
            on_key_expired=self._link_expired,
        )

    def _pair_comms(self, prefix: str, rank: int, size: int) -> dict:
        """The communicators of one direction each, rank 0 minting their ids in the store;
        the same order on every member: each join waits for the others."""
        comms = {}
        for direction in DIRECTIONS:
            key = f"{prefix}/{self.channel.lower()}/{direction}"
            if rank == 0:
                self._store.set(key, self._factory.unique_id())
            uid = self._store.get(key)
            comms[direction] = self._factory.connect(
                uid, rank, size, self.runtime.device, store=self._store
            )
        return comms

    def _connect_channels(self, prefix: str) -> None:
        if not self.per_member_links:
            super()._connect_channels(prefix)
            return
        self._start_streams()
        self._connect_member_links(prefix)

    def _connect_data(self, prefix: str) -> None:
        self._comms = self._pair_comms(prefix, self.group_rank, self.group_size)
        first = self.group_rank == 0
        self._send_comm = self._comms["from_first" if first else "to_first"]
        self._recv_comm = self._comms["to_first" if first else "from_first"]
        self._start_streams()
        self._preconnect(
            [
                (direction, self._comms[direction], peer, first == (direction == "from_first"))
                for direction in DIRECTIONS
                for peer in self.peer_ranks
            ],
            self._abort_comms,
        )

    # -- per-member links (the AFD group) --------------------------------------------------
    def join_link(self, incarnation: int) -> None:
        self._start_streams()  # a restarted member's fresh transport
        super().join_link(incarnation)

    def _link(self, member: int, incarnation: int) -> DeviceLink:
        import torch.distributed as dist

        prefix = f"{self._prefix}/link{member}/{incarnation}"
        me = 0 if self.group_rank == 0 else 1
        ctrl = self.channel_group(dist.PrefixStore(f"{prefix}/ctrl", self._store), me, 2)
        try:
            comms = self._pair_comms(prefix, me, 2)
        except Exception:
            abort_groups(ctrl)
            raise
        return DeviceLink(ctrl, comms, 1 - me)

    def _check_link(self, peer: int, link=None) -> None:
        link = link or self._links[peer]
        me = 1 - link.remote
        self._connect_pair(
            link.ctrl,
            me,
            link.remote,
            f"connecting AFD group {self.group}'s link with group rank {peer} "
            f"({self.channel_where()})",
        )
        self._preconnect(
            [(d, link.comms[d], link.remote, (me == 0) == (d == "from_first")) for d in DIRECTIONS],
            lambda: self._abort_link(link),
        )

    def _abort_link(self, link: DeviceLink) -> None:
        link.failure = link.failure or f"the {self.channel} link was closed"
        self._abort_all(link.comms.values())
        abort_groups(link.ctrl)

    def drop_member(self, member: int) -> None:
        link = self._links.get(member) if self.per_member_links else None
        if link is not None:
            link.failure = link.failure or f"group rank {member} was dropped"
            self._abort_all(link.comms.values())

    def _link_expired(self, member: int, what: str, timeout_s: float) -> None:
        """Watchdog: an operation of one member's link did not complete in time: that
        link alone is aborted (its pending kernels end), the others go on."""
        link = self._links.get(member)
        if link is None:
            return
        reason = (
            f"{what}: no answer within {timeout_s:.0f}s; the {self.channel} link with group "
            f"rank {member} was aborted (the peer stopped, or the two sides are out of step)"
        )
        logger.error("AFD group %s: %s", self.group, reason)
        link.failure = reason
        self._abort_all(link.comms.values())

    def _preconnect(self, pairs: list[tuple], abort: Callable[[], None]) -> None:
        """Connect every point-to-point pair now, in one order all members follow.

        NCCL connects a pair lazily, at its first send or receive, with a host-side
        handshake that blocks until the peer's first operation on the same communicator.
        The protocol's first step would post the FFN rank's receive on `to_first` while the
        attention rank posts its receive on `from_first`: each host waits for the other's
        first operation on the other communicator, forever, before anything is enqueued for
        the watchdog to see. Here one byte goes each way, `to_first` first (the peers send,
        group rank 0 receives from each in rank order), then `from_first`; the wait is
        bounded by the connect timeout. `pairs`: (direction, communicator, peer, whether
        this side sends) in that order; `abort` stops them on failure."""
        import torch

        rt = self.runtime
        buffers, events = [], []
        for direction, comm, peer, sending in pairs:
            stream = self._send_stream if sending else self._recv_stream
            buf = torch.zeros(1, dtype=torch.uint8, device=rt.device)
            stream.wait_stream(rt.current_stream())
            try:
                (comm.send if sending else comm.recv)(buf, peer, stream)
            except Exception as exc:
                abort()
                raise TransportError(
                    f"connecting the {self.channel} pair with group rank {peer} "
                    f"({direction}): {type(exc).__name__}: {exc}"
                ) from None
            event = rt.new_event()
            event.record(stream)
            buffers.append(buf)
            events.append((event, direction, peer))
        deadline = time.monotonic() + self.connect_timeout_s
        for event, direction, peer in events:
            while not event.query():
                if time.monotonic() > deadline:
                    abort()
                    raise TransportError(
                        f"the {self.channel} pair with group rank {peer} ({direction}) did "
                        f"not connect within {self.connect_timeout_s:.0f}s"
                    )
                time.sleep(PRECONNECT_POLL_S)
        del buffers  # the operations completed: their buffers may go

    def _expired(self, what: str, timeout_s: float) -> None:
        self._failure = (
            f"{what}: no answer within {timeout_s:.0f}s; the {self.channel} data channel was "
            "aborted (the peer stopped, or the two sides are out of step)"
        )
        logger.error("AFD group %s: %s", self.group, self._failure)
        self._abort_comms()

    def _abort_comms(self) -> None:
        self._abort_all(self._comms.values())
        self._comms.clear()

    def _abort_all(self, comms) -> None:
        for comm in list(comms):
            try:
                comm.abort()
            except Exception:  # noqa: BLE001 - going down anyway
                logger.debug("AFD: %s abort failed", self.channel, exc_info=True)

    def _check(self, member: int | None = None) -> None:
        if self._failure is not None:
            raise ChannelAborted(self._failure)
        if self.per_member_links:
            if member is None:
                return
            link = self._links.get(member)
            if link is None:
                raise TransportError(
                    f"the {self.channel} data channel has no link with group rank {member} "
                    "(not connected, or already closed)"
                )
            if link.failure is not None:
                raise ChannelAborted(link.failure)
            return
        if self._send_comm is None:
            raise TransportError(
                f"the {self.channel} data channel is not connected (or already closed)"
            )

    @contextmanager
    def grouped_ops(self) -> Iterator[None]:
        if getattr(self._block, "launches", None) is not None:  # nested: the outer block launches
            yield
            return
        self._block.launches = launches = {}
        try:
            yield
        finally:
            self._block.launches = None
        self._check()  # the watchdog may have aborted the channel since the posts
        for launch in launches.values():  # one per communicator, in the order first used
            self._launch(launch)

    def _post(self, comm, stream, tensor, peer: int, send: bool, member=None) -> Handle:
        self._check(member)
        launches = getattr(self._block, "launches", None)
        if launches is None:
            launch = _Launch(comm, stream, send, member)
            launch.ops.append((tensor, peer))
            self._launch(launch)
        else:
            launch = launches.get(id(comm))
            if launch is None:
                launch = launches[id(comm)] = _Launch(comm, stream, send, member)
            launch.ops.append((tensor, peer))
        return LaunchHandle(launch, self)

    def _launch(self, launch: _Launch) -> None:
        runtime, comm, stream = self.runtime, launch.comm, launch.stream
        # the operations run after everything the caller enqueued so far (the rows are
        # computed, the receive buffers are free)
        stream.wait_stream(runtime.current_stream())
        op = comm.send if launch.send else comm.recv
        grouped = len(launch.ops) > 1 and hasattr(comm, "group_start")
        try:
            if grouped:
                comm.group_start()
            try:
                for tensor, peer in launch.ops:
                    op(tensor, peer, stream)
            finally:
                if grouped:
                    comm.group_end()
        except Exception as exc:
            raise TransportError(
                f"{launch.what()}: {self.channel} {type(exc).__name__}: {exc}"
            ) from None
        event = runtime.new_event()
        event.record(stream)
        launch.event = event
        if not runtime.is_capturing():
            # a captured launch runs at replay, where no Python runs: the replay as a whole
            # is watched instead (watch_device_work, after each replay)
            for tensor, _ in launch.ops:
                runtime.record_stream(tensor, stream)
            self._watchdog.watch(event, launch.what(), self.timeout_s, key=launch.member)

    def watch_device_work(self, what: str) -> None:
        self._check()
        event = self.runtime.new_event()
        event.record(self.runtime.current_stream())
        self._watchdog.watch(event, what, self.timeout_s)

    def isend(self, tensor, peer: int, tag: int) -> Handle:
        return self._post_to(tensor, peer, True)

    def irecv(self, tensor, peer: int, tag: int) -> Handle:
        return self._post_to(tensor, peer, False)

    def endpoint(self, peer: int, send: bool) -> tuple:
        """(communicator, stream, the peer's rank on it) that reach group rank `peer`."""
        stream = self._send_stream if send else self._recv_stream
        if not self.per_member_links:
            return (self._send_comm if send else self._recv_comm), stream, peer
        self._check(peer)
        link = self._links[peer]
        return link.comm(send, first=self.group_rank == 0), stream, link.remote

    def _post_to(self, tensor, peer: int, send: bool) -> Handle:
        comm, stream, rank = self.endpoint(peer, send)
        member = peer if self.per_member_links else None
        return self._post(comm, stream, tensor, rank, send, member=member)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        self._abort_comms()
        self._close_links()
        self._send_comm = self._recv_comm = None
        super().close()

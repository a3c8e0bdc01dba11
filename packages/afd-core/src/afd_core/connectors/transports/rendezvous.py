"""What every AFD transport shares: the rendezvous store and the control channel.

FFN rank 0 hosts a TCPStore at `host:port`; every rank of the deployment reaches it at
start-up (roll call, the deployment's shape, failure reasons, barriers), and each group of
one FFN rank and its attention peers waits there for all its members before it connects.
The control channel (one small int64 message per step, the status message, side groups'
commands) is a gloo process group on CPU whose idle receive waits very long, because an FFN
rank waits for the next step as long as its peers are idle; it never synchronizes a device.
Every gloo operation of AFD's passes its own bound; a group's own timeout bounds only how
long its pairs connect (`gloo_group`).
The data channel is the subclass's: gloo on CPU (`gloo.py`), a device communicator on
accelerators. A dead peer closes its sockets, which fails a pending receive at once.
"""

from __future__ import annotations

import datetime
import errno
import os
import re
import socket
import threading
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable

from afd_core.connectors.transports.transport import (
    PROGRESS_EVERY_S,
    Handle,
    Transport,
    TransportError,
)
from afd_core.log import get_logger
from afd_core.net import connect_to, listening_socket

# An idle deployment may wait for days between steps; peer death is detected by the socket.
CONTROL_TIMEOUT = datetime.timedelta(days=30)
LAZY_INIT = "TORCH_GLOO_LAZY_INIT"  # PyTorch's switch: a group's pairs connect on first use
# gloo's side of a pair that waits for the other side's connect waits five times its
# group's timeout (tcp::Pair::waitUntilConnected, "a longer timeout when waiting for
# initial connect"): measured 27/52/102 s at a group timeout of 5/10/20 s
GLOO_INITIAL_CONNECT_FACTOR = 5
STORE_ATTEMPT_S = 3.0  # one attempt to reach the rendezvous store
# how long FFN rank 0 retries a rendezvous port that is in use: long enough for a peer's
# momentary connection to itself on that port (see connect_to) to end, short enough that a
# port held by another process is named at once
logger = get_logger(__name__)
BIND_RETRY_S = 5.0
CONTROL_TAG, STATUS_TAG = 0, 1  # control channel: attention -> FFN steps, FFN -> attention status
FIRST_WORD_TAG = 1 << 30  # a pair's first word each way at start-up; no other tag comes near


class StoreTransport(Transport):
    """A transport's shared part: FFN rank 0's TCPStore (rendezvous, barriers, roll call)
    and the control channel, a gloo process group on CPU (its idle receive waits very long). A
    subclass adds the data channel (`_connect_data`, `isend`, `irecv`): gloo on CPU, a
    device communicator on accelerators."""

    def __init__(
        self,
        host: str,
        port: int,
        group: int | str,
        group_rank: int,
        group_size: int,
        is_store_master: bool,
        timeout_s: float,
        connect_timeout_s: float,
    ):
        self.host, self.port = host, port
        self.group, self.group_rank, self.group_size = group, group_rank, group_size
        self.is_store_master = self.hosts_store = is_store_master
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._store = None
        self._ctrl = None
        self._deadline = None
        self._door = None
        self._channel: tuple[str, str] | None = None  # where the channels bind, chosen once
        # the group ranks that connect at start-up: every member, unless the deployment
        # formed without some after an FFN loss (admission/formation.py); the others join later
        self.group_members: list[int] | None = None
        # where the group's keys live in the store (an AFD group's epoch: admission/group_epoch.py)
        self.group_prefix = f"afd/g{group}"
        # a side group (an expert group, FFN tensor parallelism): its members agree on a
        # launch of their own first (`_agree_launch`), as the store may outlive them
        self.fresh_launch = False

    def open_store(self) -> None:
        import torch.distributed as dist

        from afd_core.connectors.transports.gate import deployment_secret

        wait_s = self.formation_timeout_s or self.connect_timeout_s
        started = time.monotonic()
        self._deadline = started + wait_s
        self._waiting_since, self._said = started, started  # for the progress lines
        secret = deployment_secret()
        if secret is not None:
            self._open_gated_store(secret)
            self._store.set_timeout(datetime.timedelta(seconds=self.connect_timeout_s))
            return
        if not self.is_store_master:
            self._refuse_if_gated()
        while True:
            # short attempts of our own: after a refused connection TCPStore's own retry
            # sleeps up to ~10 s, which would overshoot a short connect timeout
            remaining = self._deadline - time.monotonic()
            attempt = remaining if self.is_store_master else min(remaining, STORE_ATTEMPT_S)
            listening = self.is_store_master or _listening(self.host, self.port)
            if not listening and remaining > 0.5:
                self._say_waiting()
                time.sleep(0.2)  # not up yet: wait quietly (TCPStore logs every failure)
                continue
            listen_fd = None
            try:
                if self.is_store_master:
                    # TCPStore's own listener takes every interface whatever the host says:
                    # it gets a socket bound to afd.host's address only
                    listen_fd = self._listen_rendezvous().detach()
                self._store = dist.TCPStore(
                    self.host,
                    self.port,
                    None,
                    self.is_store_master,
                    timeout=datetime.timedelta(seconds=max(attempt, 0.1)),
                    wait_for_workers=False,
                    master_listen_fd=listen_fd,
                    use_libuv=True,
                )
                break
            except Exception as exc:
                if listen_fd is not None:
                    _close_fd(listen_fd)
                if not self.is_store_master and self._deadline - time.monotonic() > 0.5:
                    time.sleep(0.2)
                    continue
                what = "listen on" if self.is_store_master else "reach FFN rank 0's rendezvous at"
                within = "" if self.is_store_master else f" within {wait_s:.0f}s"
                hint = (
                    "check afd.host/afd.port (another process may hold the port)"
                    if self.is_store_master
                    else "check afd.host/afd.port and that the FFN server is started"
                )
                raise TransportError(
                    f"could not {what} {self.host}:{self.port}{within} ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:200]}); {hint}"
                ) from None
        self._store.set_timeout(datetime.timedelta(seconds=self.connect_timeout_s))

    def reopen_store(self) -> None:
        """A new client of the rendezvous store at host:port in place of a lost one (FFN rank
        0 restarted: admission/group_epoch.py), within connect_timeout_s; the groups connected
        through the old one stay as they are."""
        if self.is_store_master:
            raise TransportError("the rank holding the store cannot reopen it")
        old_door, self._door = self._door, None
        saved, self.formation_timeout_s = self.formation_timeout_s, None
        try:
            self.open_store()
        finally:
            self.formation_timeout_s = saved
            if old_door is not None:
                old_door.close()

    def _say_waiting(self) -> None:
        """Every PROGRESS_EVERY_S: that this rank still waits for FFN rank 0's rendezvous
        (its server may still be loading its weights), and for how much longer."""
        now = time.monotonic()
        if now - self._said < PROGRESS_EVERY_S:
            return
        self._said = now
        logger.info(
            "AFD: waiting for FFN rank 0's rendezvous at %s:%d for %.0f s (its server may still "
            "be loading); giving up in %.0f s (startup_timeout_s)",
            self.host,
            self.port,
            now - self._waiting_since,
            self._deadline - now,
        )

    def _listen_rendezvous(self) -> socket.socket:
        """FFN rank 0's listener on afd.host:afd.port, retried for BIND_RETRY_S while the
        port is in use."""
        give_up = min(time.monotonic() + BIND_RETRY_S, self._deadline)
        while True:
            try:
                return listening_socket(self.host, self.port)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() >= give_up:
                    raise
                time.sleep(0.2)

    def _refuse_if_gated(self) -> None:
        from afd_core.connectors.transports.gate import SECRET_ENV, SECRET_FILE_ENV, gate_greets

        while not _listening(self.host, self.port) and time.monotonic() < self._deadline:
            self._say_waiting()
            time.sleep(0.2)
        if gate_greets(self.host, self.port):
            raise TransportError(
                f"the rendezvous at {self.host}:{self.port} requires the deployment secret, "
                f"which this rank does not have: set {SECRET_ENV} or {SECRET_FILE_ENV} as on "
                "the FFN server"
            )

    def _open_gated_store(self, secret: bytes) -> None:
        """The store behind the gate (gate.py): on FFN rank 0 the store listens
        on loopback and the gate on afd.host:afd.port; elsewhere the store client goes
        through a local forwarder that proves the secret."""
        import torch.distributed as dist

        from afd_core.connectors.transports.gate import Forwarder, Gate, GateError

        timeout = datetime.timedelta(seconds=max(self._deadline - time.monotonic(), 0.1))
        if self.is_store_master:
            try:
                door = self._listen_rendezvous()
            except OSError as exc:
                raise TransportError(
                    f"could not listen on {self.host}:{self.port} ({exc.strerror}); check "
                    "afd.host/afd.port"
                ) from None
            inner = listening_socket("127.0.0.1", 0)  # the store itself: loopback only
            store_port = inner.getsockname()[1]
            try:
                self._store = dist.TCPStore(
                    "127.0.0.1",
                    store_port,
                    None,
                    True,
                    timeout=timeout,
                    wait_for_workers=False,
                    master_listen_fd=inner.detach(),
                    use_libuv=True,
                )
            except Exception:
                door.close()
                raise
            self._door = Gate(door, store_port, secret)
            return
        forwarder = Forwarder(self.host, self.port, secret)
        while True:
            try:
                forwarder.check(min(STORE_ATTEMPT_S, max(self._deadline - time.monotonic(), 0.1)))
                break
            except GateError as exc:
                forwarder.close()
                raise TransportError(str(exc)) from None
            except OSError as exc:
                if time.monotonic() > self._deadline:
                    forwarder.close()
                    raise TransportError(
                        f"could not reach FFN rank 0's rendezvous at {self.host}:{self.port} "
                        f"within {self._deadline - self._waiting_since:.0f}s ({exc}); check "
                        "afd.host/afd.port and that the FFN server is started"
                    ) from None
                self._say_waiting()
                time.sleep(0.2)
        self._door = forwarder
        self._store = dist.TCPStore(
            "127.0.0.1", forwarder.port, None, False, timeout=timeout, wait_for_workers=False
        )

    def join_group(self, fail_key: str | None = None) -> None:
        if self.fresh_launch:
            self._agree_launch(fail_key)
        prefix = self.group_prefix
        # Wait for the whole group in the store first: members start minutes apart (model
        # loading), and a gloo group would apply its short step timeout to that wait.
        arriving = len(self.group_members) if self.group_members else self.group_size
        self.barrier(f"{prefix}/arrived", arriving, self._deadline - time.monotonic(), fail_key)
        # a member that saw the failure while the others arrived will not connect
        if fail_key is not None and (reason := self.store_try_get(fail_key)) is not None:
            raise TransportError(reason.decode())
        try:
            self._connect_channels(prefix)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(
                f"AFD group {self.group} ({self.group_size} ranks) could not connect "
                f"({self.channel_where()}): "
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            ) from None

    def _agree_launch(self, fail_key: str | None) -> None:
        """A side group's members meet under a prefix of this launch's own. The store (in
        FFN rank 0's process) outlives an FFN server restarted alone: under a fixed prefix
        the restarted members would find the dead launch's arrival count (the barrier
        passes at once) and its gloo keys (they connect to dead processes). Group rank 0
        names the launch with a new uuid; each other member asks with a token of its own
        and joins the launch that answers that token, which only a live group rank 0 can.
        Group rank 0 deletes the previous launch's keys. Every wait stops at once, with
        its reason, once `fail_key` is set (the deployment's start-up failed)."""
        base, me = self.group_prefix, self.group_rank
        deadline = self._deadline

        def check(waiting_for: str) -> None:
            if fail_key is not None and (reason := self.store_try_get(fail_key)) is not None:
                raise TransportError(reason.decode())
            if time.monotonic() > deadline:
                raise TransportError(
                    f"group {self.group}: {waiting_for} within {self.connect_timeout_s:.0f}s"
                )

        if me == 0:
            launch = uuid.uuid4().hex[:16]
            if (previous := self.store_try_get(f"{base}/launch")) is not None:
                self._forget_launch(base, previous.decode())
            self._store.set(f"{base}/launch", launch.encode())
            prefix, asked = f"{base}/{launch}", {}
            # answer every member's latest ask until all arrived under this launch
            while (n := self._store.add(f"{prefix}/arrived", 0)) < self.group_size - 1:
                for m in range(1, self.group_size):
                    token = self.store_try_get(f"{base}/ask/{m}")
                    if token is not None and asked.get(m) != token:
                        if m in asked:
                            self.store_delete(f"{base}/answer/{m}/{asked[m].decode()}")
                        self._store.set(f"{base}/answer/{m}/{token.decode()}", launch.encode())
                        asked[m] = token
                check(f"only {n} of {self.group_size - 1} other members joined its launch")
                time.sleep(0.05)
        else:
            token = uuid.uuid4().hex[:16]
            self._store.set(f"{base}/ask/{me}", token.encode())
            while (launch := self.store_try_get(f"{base}/answer/{me}/{token}")) is None:
                check("its group rank 0 did not answer (not started, or gone)")
                time.sleep(0.05)
            launch = launch.decode()
        self.group_prefix = f"{base}/{launch}"

    def _forget_launch(self, base: str, previous: str) -> None:
        """Delete a dead launch's keys: its arrival counts, its gloo channels' addresses
        and the answers to its members, so a side group restarted any number of times
        leaves the store as it found it. A member of the new launch asks before or after
        this; its answer is written only after it, so nothing of the new launch is lost."""
        stale = (f"{base}/{previous}/", f"{base}/answer/")
        try:
            keys = self._store.list_keys()
        except Exception:  # noqa: BLE001 - a store without listing: the counts at least
            keys = [f"{base}/{previous}/arrived", f"{base}/{previous}/arrived/left"]
        for key in keys:
            if key.startswith(stale):
                self.store_delete(key)

    def barrier(
        self,
        key: str,
        count: int,
        timeout_s: float,
        fail_key: str | None = None,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        try:
            self._barrier(key, count, timeout_s, fail_key, progress)
        except TransportError:
            raise
        except Exception as exc:  # the store went away: FFN rank 0's process stopped
            raise TransportError(
                f"lost the rendezvous store at {self.host}:{self.port} while waiting at "
                f"{key!r} (FFN rank 0 stopped: {type(exc).__name__})"
            ) from None

    def _barrier(self, key, count, timeout_s, fail_key, progress) -> None:
        started = time.monotonic()
        deadline, said = started + max(timeout_s, 1.0), started
        self._store.add(key, 1)
        while (n := self._store.add(key, 0)) < count:
            if fail_key is not None and (reason := self.store_try_get(fail_key)) is not None:
                raise TransportError(reason.decode())
            if progress is not None and time.monotonic() - said >= PROGRESS_EVERY_S:
                said = time.monotonic()
                progress(said - started)
            if time.monotonic() > deadline:
                raise TransportError(
                    f"only {n} of {count} AFD ranks reached {key!r} at the rendezvous "
                    f"{self.host}:{self.port} within {timeout_s:.0f}s"
                )
            time.sleep(0.05)
        # The store lives in the master's process: it leaves the barrier last, so no rank
        # still polling finds the store gone.
        left = self._store.add(key + "/left", 1)
        if self.is_store_master:
            while left < count:
                if time.monotonic() > deadline:
                    raise TransportError(f"only {left} of {count} AFD ranks left {key!r}")
                time.sleep(0.01)
                left = self._store.add(key + "/left", 0)

    def _connect_channels(self, prefix: str) -> None:
        """Connect this group's data and control channels (every member arrived)."""
        import torch.distributed as dist

        self._connect_data(prefix)
        self._ctrl = self.channel_group(
            dist.PrefixStore(prefix + "/ctrl", self._store),
            self.group_rank,
            self.group_size,
            self.group_members,
        )
        # the pairs every step uses (an AFD group's steps and statuses, a tensor-parallel
        # leader's commands); an expert group's other pairs connect in its first group
        # step, which every member enters at once
        for peer in self.peer_ranks:
            self._connect_pair(
                self._ctrl,
                self.group_rank,
                peer,
                f"connecting AFD group {self.group}'s control channel with group rank {peer} "
                f"({self.channel_where()})",
            )

    @property
    def peer_ranks(self) -> range | tuple[int]:
        """The group ranks this rank's steps talk to: group rank 0 with each member, a
        member with group rank 0."""
        return range(1, self.group_size) if self.group_rank == 0 else (0,)

    def _connect_pair(self, group, me: int, remote: int, what: str) -> None:
        """Connect one pair of a gloo group now, one word each way (the lower rank receives
        first) while the other side does the same, within the connect timeout. A pair
        connects at its first operation; left to the first step, the side that waits for
        the other's connect would wait from its first receive (posted at start-up by a
        listener) to the peer's first step, and fail if that came after the connect bound
        (`gloo_group`)."""
        import torch

        self._store.set_timeout(datetime.timedelta(seconds=self.connect_timeout_s))
        word = torch.zeros(1, dtype=torch.int64)
        ops = (group.recv, group.send) if me < remote else (group.send, group.recv)
        for op in ops:
            self._handle(
                lambda op=op: op([word], remote, FIRST_WORD_TAG),
                what,
                bound_s=self.connect_timeout_s,
            ).wait()

    def _channel_choice(self) -> tuple[str, str]:
        """Where this transport's channels bind (channel_address.py), chosen at its first
        group and kept: every link of an FFN rank binds to the same address."""
        from afd_core.connectors.transports.channel_address import channel_choice

        if self._channel is None:
            self._channel = channel_choice(self.host)
        return self._channel

    def channel_device(self):
        """A gloo device for one of this transport's groups, on its channel address."""
        from afd_core.connectors.transports.channel_address import channel_device

        return channel_device(self._channel_choice())

    def channel_group(self, store, rank: int, size: int, members=None):
        """A gloo group (`gloo_group`) on a device of its own whose listener only the
        group's `members` (default: all) reach (listener_filter.py); `store` is the group's
        prefix store, where its members meet first."""
        from afd_core.connectors.transports.listener_filter import (
            exchange_sources,
            made_with_listener,
        )

        device, listener = made_with_listener(self.channel_device)
        members = range(size) if members is None else members
        where = listener.address if listener is not None else None
        try:
            allowed = exchange_sources(store, rank, members, where, self.connect_timeout_s)
        except TransportError as exc:
            raise TransportError(
                f"connecting AFD group {self.group}'s channels ({self.channel_where()}): {exc}"
            ) from None
        if listener is not None:
            try:
                listener.allow_only(allowed)
            except (OSError, ValueError) as exc:
                logger.warning("AFD: a gloo listener is left unfiltered: %s", exc)
        return gloo_group(store, rank, size, self.connect_timeout_s, device)

    def channel_where(self) -> str:
        """For error messages: where this rank's channels are."""
        from afd_core.connectors.transports.channel_address import describe

        try:
            return f"this rank's channels at {describe(self._channel_choice())}"
        except TransportError as exc:
            return str(exc)

    def _ctrl_of(self, peer: int) -> tuple:
        """The control group that reaches group rank `peer`, and its rank there."""
        return self._ctrl, peer

    @abstractmethod
    def _connect_data(self, prefix: str) -> None:
        """Connect this group's data channel (the store is open, every member arrived)."""

    def close(self) -> None:
        abort_groups(self._ctrl)
        self._ctrl = None
        if self._door is not None:  # the gate or forwarder of a store with a secret
            try:  # a store's `set` is not answered: one round trip, so the relay has
                self._store.check(["afd/closing"])  # passed on what was written
            except Exception:  # noqa: BLE001 - the store may be gone
                pass
            self._door.close()
            self._door = None
        self._store = None

    def store_set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def store_get(self, key: str, timeout_s: float) -> bytes:
        """The key's value once written, polled (store_keys.py: a blocking get would hold
        the process's other store operations behind it); TransportError after timeout_s."""
        from afd_core.connectors.transports.store_keys import KeysNotWritten, read_when_written

        try:
            return read_when_written(self._store, [key], timeout_s)[0]
        except KeysNotWritten as exc:
            raise TransportError(f"no answer for {key!r} within {timeout_s:.0f}s: {exc}") from None

    def store_add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def store_try_get(self, key: str) -> bytes | None:
        return self._store.get(key) if self._store.check([key]) else None

    def store_delete(self, key: str) -> None:
        try:
            self._store.delete_key(key)
        except Exception:  # noqa: BLE001 - the store may be gone; a leftover key is harmless
            logger.debug("AFD: store key %r not deleted", key, exc_info=True)

    def _handle(self, post, what: str, bound_s: float | None = None) -> Handle:
        """A posted gloo operation, whose wait lasts at most the step timeout (`bound_s`:
        that long). Posting may connect the pair first (`gloo_group`)."""
        timeout_s = self.timeout_s if bound_s is None else bound_s
        try:
            return GlooHandle(post(), what, timeout_s)
        except Exception as exc:  # posting fails at once when the pair is already closed
            reason = gloo_reason(exc, timeout_s, connect_s=self.connect_timeout_s)
            raise TransportError(f"{what}: {reason}") from None

    def isend_control(self, tensor, peer: int) -> Handle:
        # bounded: the peer's listener has its receive posted whenever it is alive
        return self._handle(
            lambda: _op(self._ctrl_of(peer), "send", tensor, CONTROL_TAG),
            "control send",
        )

    def irecv_control(self, tensor, peer: int, bound_s: float | None = None) -> Handle:
        # an idle deployment waits this long for the next step, whatever the group's timeout
        return self._handle(
            lambda: _op(self._ctrl_of(peer), "recv", tensor, CONTROL_TAG),
            "control receive",
            bound_s=CONTROL_TIMEOUT.total_seconds() if bound_s is None else bound_s,
        )

    def isend_status(self, tensor, peer: int) -> Handle:
        return self._handle(
            lambda: _op(self._ctrl_of(peer), "send", tensor, STATUS_TAG),
            "status send",
        )

    def irecv_status(self, tensor, peer: int) -> Handle:
        return self._handle(
            lambda: _op(self._ctrl_of(peer), "recv", tensor, STATUS_TAG),
            "status receive",
        )


def _op(group_and_rank: tuple, what: str, tensor, tag: int):
    group, rank = group_and_rank
    return getattr(group, what)([tensor], rank, tag)


def abort_groups(*groups) -> None:
    """Stop gloo groups before they are dropped: a group dropped while one of its
    operations is in progress (a listener's receive from a peer still alive) waits for it
    in its destructor, for as long as the group's timeout."""
    for group in groups:
        if group is not None:
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - already broken: nothing left to stop
                pass


_lazy_lock = threading.Lock()


def gloo_group(store, rank: int, size: int, connect_timeout_s: float, device):
    """A gloo process group on `device` (channel_address.py: the address AFD's channels
    bind to) whose pairs connect at their first operation, not all at once: in an AFD group
    only the FFN rank talks to each attention peer, and a full mesh of 64 peers would hold
    about 2,000 connections per group for nothing. PyTorch reads its switch
    (TORCH_GLOO_LAZY_INIT) from the environment when a group is built, beside the device's
    own flag: set for AFD's groups only, and put back.

    The group's own timeout bounds how long a pair connects, inside its first operation,
    to `connect_timeout_s` (after the store gave the peer's address: the store's timeout
    bounds that wait); every operation passes its own bound to `wait`."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._devices = [device]
    options._timeout = datetime.timedelta(seconds=connect_timeout_s / GLOO_INITIAL_CONNECT_FACTOR)
    with _lazy_lock:
        before = os.environ.get(LAZY_INIT)
        os.environ[LAZY_INIT] = "1"
        try:
            return dist.ProcessGroupGloo(store, rank, size, options)
        finally:
            if before is None:
                os.environ.pop(LAZY_INIT, None)
            else:
                os.environ[LAZY_INIT] = before


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _listening(host: str, port: int) -> bool:
    try:
        connect_to(host, port, timeout=1.0).close()
        return True
    except OSError:
        return False


def gloo_reason(exc: BaseException, timeout_s: float, connect_s: float | None = None) -> str:
    """Why a gloo operation failed, in words; `connect_s`: the bound of the pair's connect,
    which a posted operation makes first (gloo_group)."""
    text = str(exc)
    # gloo's words for a pair that did not connect: the side waiting for the connect, the
    # side connecting (after its tries; the address it tried follows)
    for words in ("Connect timeout", "timed out connecting"):
        if connect_s is not None and words in text:
            detail = text.split(words, 1)[1].strip(" :").splitlines()[0][:200]
            detail = re.sub(r"\$\d+$", "", detail)  # gloo's sequence number of the pair
            said = f"{words}: {detail}" if detail not in ("", "[none]") else words
            return f"the pair did not connect within {connect_s:.0f}s ({said})"
    if "Connection closed by peer" in text or "Connection reset" in text:
        return "the peer closed the connection (process exited or crashed)"
    if "Timed out" in text or "timeout" in text.lower():
        return f"no answer within {timeout_s:.0f}s"
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


class GlooHandle(Handle):
    """A posted gloo operation; `wait` lasts at most timeout_s unless told otherwise (never
    the group's own timeout, which is the connect bound: `gloo_group`)."""

    __slots__ = ("_work", "_what", "_timeout_s")

    def __init__(self, work, what: str, timeout_s: float):
        self._work, self._what, self._timeout_s = work, what, timeout_s

    def wait(self, timeout_s: float | None = None) -> None:
        bound = self._timeout_s if timeout_s is None else timeout_s
        try:
            self._work.wait(datetime.timedelta(seconds=bound))
        except Exception as exc:
            raise TransportError(f"{self._what}: {gloo_reason(exc, bound)}") from None

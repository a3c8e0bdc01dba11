"""Connectors without a peer: a transport that records instead of moving, and an inbox of
prepared control messages, for tests of the connector's own bookkeeping (no processes)."""

from __future__ import annotations

import contextlib
import weakref

from afd_core.config import parse_afd_config
from afd_core.connectors.base import WireSpec
from afd_core.connectors.nccl import NcclConnector
from afd_core.connectors.protocol.control import ControlFlag, ControlMessage


class Done:
    def wait(self, timeout_s=None):
        return None


class RecordingTransport:
    """Holds no tensor: it keeps weak references to what it was asked to send."""

    def __init__(self):
        self.sent: list[weakref.ref] = []
        self.watched: list[str] = []

    def isend(self, tensor, peer, tag):
        base = tensor._base if tensor._base is not None else tensor  # a row slice's tensor
        self.sent.append(weakref.ref(base))
        return Done()

    def irecv(self, tensor, peer, tag):
        return Done()

    def grouped_ops(self):
        return contextlib.nullcontext()

    def isend_control(self, tensor, peer):
        return Done()

    def irecv_status(self, tensor, peer):
        return Done()

    timeout_s = 0.3  # the step timeout, for the bounded waits of the tests

    def watch_device_work(self, what):
        self.watched.append(what)

    def drop_member(self, member):
        self.dropped = [*getattr(self, "dropped", []), member]


def connector(role, a=1, wire=None):
    from tests.afd_core.nccl_standin import HostRuntime

    cfg = parse_afd_config(
        {"role": role, "connector": "nccl", "num_attention_ranks": a}, device_type="cuda"
    )
    conn = NcclConnector(cfg, 0, wire or WireSpec(4, "float32", 2, 16), runtime=HostRuntime())
    conn._transport = RecordingTransport()
    return conn


class ListInbox:
    def __init__(self, items):
        self.items = list(items)

    def get(self, block=True, timeout_s=None):
        if self.items:
            return self.items.pop(0)
        assert not block or timeout_s is not None, "would block forever"
        return None

    def served(self, i):
        pass


def control(sender, step, rows, flags=ControlFlag.NONE):
    return ControlMessage(sender, step, rows, 4, "float32", flags).encode()

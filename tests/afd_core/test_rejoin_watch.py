"""The FFN rank's rejoin thread (connectors/admission/rejoin.py, RejoinWatch) over a store
in a dict: each request is prepared on a thread of its own, so one whose process died (its
preparation waits out the connect bound) does not hold the next; and no more than two per
peer are prepared at once (a flood of requests waits its turn)."""

from __future__ import annotations

import json
import threading
import time

from afd_core.connectors.admission.rejoin import RejoinWatch
from afd_core.connectors.transports.transport import TransportError


class DictStore:
    def __init__(self):
        self.kv: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.hosts_store = True

    def store_add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.kv.get(key, b"0")) + amount
            self.kv[key] = str(value).encode()
            return value

    def store_set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.kv[key] = value

    def store_get(self, key: str, timeout_s: float) -> bytes:
        with self.lock:
            if key not in self.kv:
                raise TransportError(f"no answer for {key!r}")
            return self.kv[key]

    def store_delete(self, key: str) -> None:
        with self.lock:
            self.kv.pop(key, None)


class Connector:
    """What RejoinWatch reads of an FFN rank; `_prepare_rejoin` holds a request whose
    incarnation is in `stalled` until `release` is set."""

    def __init__(self, peers: int, stalled: set[int]):
        self._transport = DictStore()
        self.peers = list(range(peers))
        self.group, self._group_epoch = 0, 0
        self.stalled, self.release = stalled, threading.Event()
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def _me(self) -> str:
        return "ffn rank 0"

    def _group_prefix(self) -> str:
        return "afd/g0"

    def _prepare_rejoin(self, i: int, request):
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if request.incarnation in self.stalled:
                self.release.wait(30)
            return ("ready", i, request.incarnation)
        finally:
            with self.lock:
                self.in_flight -= 1

    def request(self, member: int, incarnation: int) -> None:
        t = self._transport
        number = t.store_add("afd/g0/rejoin/count", 1)
        t.store_set(f"afd/g0/rejoin/{number}", json.dumps(
            {"member": member, "incarnation": incarnation}).encode())  # fmt: skip


class Inbox:
    def __init__(self):
        self.items: list = []

    def put(self, i: int, item) -> None:
        self.items.append(item)


def _until(predicate, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.02)


def test_a_stalled_preparation_does_not_hold_the_next_request():
    c, inbox = Connector(peers=2, stalled={1}), Inbox()
    watch = RejoinWatch(c, inbox, "ffn rank 0")
    watch.start()
    time.sleep(0.3)  # it counts the requests from its start: these come after
    try:
        c.request(member=1, incarnation=1)  # its process died: its link never connects
        c.request(member=1, incarnation=2)  # its restart
        _until(lambda: ("ready", 0, 2) in inbox.items)
        assert ("ready", 0, 1) not in inbox.items
        c.release.set()
        _until(lambda: len(inbox.items) == 2)
        _until(lambda: not any(k.startswith("afd/g0/rejoin/") and k[-1].isdigit()
                               for k in c._transport.kv))  # fmt: skip
    finally:
        c.release.set()
        watch.close()


def test_a_flood_of_requests_is_prepared_two_per_peer_at_a_time():
    c, inbox = Connector(peers=1, stalled=set(range(1, 7))), Inbox()
    watch = RejoinWatch(c, inbox, "ffn rank 0")
    watch.start()
    time.sleep(0.3)  # it counts the requests from its start: these come after
    try:
        for incarnation in range(1, 7):
            c.request(member=1, incarnation=incarnation)
        _until(lambda: c.in_flight == 2)
        time.sleep(0.5)  # the watch waits for a slot meanwhile
        assert c.most_in_flight == 2 and inbox.items == []
        c.release.set()
        _until(lambda: len(inbox.items) == 6)
        assert c.most_in_flight == 2
    finally:
        c.release.set()
        watch.close()

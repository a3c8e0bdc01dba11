"""How the FFN rank assembles a step from its peers' control messages: the ranks of one
attention server together (that wait bounded, naming who is missing), goodbyes that are no
step, a close that wakes the serving thread, and a control listener that cannot die
silently."""

from __future__ import annotations

import threading

import pytest

from afd_core.connectors.base import AFDPeerError
from afd_core.connectors.protocol.control import ControlFlag
from afd_core.connectors.protocol.inbox import ControlInbox
from afd_core.connectors.transports.transport import TransportError
from tests.afd_core.connector_fakes import ListInbox, connector, control

pytestmark = pytest.mark.vllm  # needs torch


def ffn_of(peers_servers, items):
    conn = connector("ffn", a=len(peers_servers))
    conn._peer_server = list(peers_servers)
    conn._inbox = ListInbox(items)
    return conn


def test_a_servers_ranks_are_waited_for_within_the_step_timeout_naming_the_missing_one(
    monkeypatch,
):
    conn = ffn_of([0, 0], [(0, control(0, 0, (2,))), (1, control(1, 0, (3,)))])
    assert conn.recv_control().rows == ((2, 3),)
    # where links fail alone, the late rank is dropped and the step goes on without it
    # (issue 36, review M3: one late DP rank stopped the FFN rank for everyone)
    conn = ffn_of([0, 0], [(0, control(0, 0, (2,)))])  # one server of two ranks
    assert conn.recv_control().rows == ((2, 0),)
    assert conn.peers_lost == [1] and conn._transport.dropped == [2]
    # elsewhere it stops the FFN rank, naming the late rank
    monkeypatch.setattr(type(conn), "survives_peer_loss", False)
    conn = ffn_of([0, 0], [(0, control(0, 0, (2,)))])
    with pytest.raises(AFDPeerError, match=r"attention rank\(s\) 1 did not announce .* 0s"):
        conn.recv_control()


@pytest.mark.parametrize(
    "bad",
    [
        [0x1234, *control(1, 0, (3,))[1:]],  # bad magic: not an AFD message
        control(1, 5, (3,)),  # out of step: step 5 where step 0 is next
    ],
    ids=["malformed", "out-of-step"],
)
def test_a_bad_control_message_costs_its_sender_only(bad, monkeypatch):
    """Issue 36 (review M3): a malformed or out-of-step control message stopped the FFN
    rank for every peer; where links fail alone its sender is dropped instead."""
    conn = ffn_of([0, 1], [(1, bad), (0, control(0, 0, (2,)))])
    assert conn.recv_control().rows == ((2, 0),)
    assert conn.peers_lost == [1]
    monkeypatch.setattr(type(conn), "survives_peer_loss", False)
    conn = ffn_of([0, 1], [(1, bad), (0, control(0, 0, (2,)))])
    with pytest.raises(AFDPeerError, match="bad magic|announced step 5"):
        conn.recv_control()


def test_goodbyes_alone_are_no_step():
    """A SHUTDOWN is not a step to serve: the FFN rank waits for a real one (before, 5 real
    steps were served as 7)."""
    shutdown = control(0, 0, (), ControlFlag.SHUTDOWN)
    conn = ffn_of([0, 1], [(0, shutdown), (1, control(1, 0, (4,)))])
    plan = conn.recv_control()
    assert plan.rows == ((0, 4),) and len(plan.live) == 1
    # the last peer leaving ends the serving (an empty plan with every peer gone)
    conn._plan = None
    conn._inbox = ListInbox([(1, control(1, 1, (), ControlFlag.SHUTDOWN))])
    assert conn.recv_control().live == () and conn.all_peers_left


class BlockingTransport:
    """Control receives that never complete, or fail with what the test asks."""

    def __init__(self, fail=None):
        self.fail = fail

    def irecv_control(self, buf, peer, bound_s=None):
        fail = self.fail

        class Handle:
            def wait(self, timeout_s=None):
                if fail is not None:
                    raise fail
                threading.Event().wait()

        return Handle()


def test_close_wakes_the_serving_thread_waiting_for_the_next_step():
    inbox = ControlInbox(BlockingTransport(), 1, "ffn rank 0")
    inbox.start()
    conn = ffn_of([0], [])
    conn._inbox = inbox
    errors = []

    def serve():
        try:
            conn.recv_control()
        except AFDPeerError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    inbox.close()
    t.join(timeout=5)
    assert not t.is_alive()
    assert errors == ["ffn rank 0: closed while waiting for the next step"]


def test_a_listener_that_fails_with_anything_reports_it_as_its_peers_failure():
    inbox = ControlInbox(BlockingTransport(fail=ValueError("bad buffer")), 1, "ffn rank 0")
    inbox.start()
    i, error = inbox.get(timeout_s=5)
    assert i == 0 and isinstance(error, TransportError)
    assert "control listener failed: ValueError('bad buffer')" in str(error)
    # a connector whose channels span the group stops
    conn = ffn_of([0], [(0, error)])
    conn.survives_peer_loss = False
    with pytest.raises(AFDPeerError, match="attention rank 0: control listener failed"):
        conn.recv_control()
    # one whose peers have links of their own (gloo, and NCCL's per-peer communicator
    # pairs) drops that peer, aborts its link, and waits for the others
    conn = ffn_of([0], [(0, error)])
    with pytest.raises(AssertionError, match="would block forever"):  # the fake inbox
        conn.recv_control()
    assert conn.peers_lost == [0] and conn._transport.dropped == [1]

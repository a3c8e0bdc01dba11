"""What the connector does for a device channel beyond the protocol's order, found by
reading the CUDA path against NCCL's and CUDA graphs' semantics (issue 25), each tested
without a GPU:

* a tensor being sent stays referenced until its send is joined (inside a capture the
  allocator is given no stream use, so a freed temporary would go back to the graph's pool
  for the next micro-batch to overwrite);
* a replayed graph's exchanges are watched like posted operations (no Python posts them);
* a capture step is served alone: another server's real step waits for the next step.
"""

from __future__ import annotations

import gc

import pytest

from afd_core.connectors.protocol.control import ControlFlag
from tests.afd_core.connector_fakes import ListInbox, connector, control

pytestmark = pytest.mark.vllm  # needs torch


def test_the_attention_sides_rows_stay_alive_until_the_exchange_is_joined():
    import torch

    conn = connector("attention")
    conn.begin_step((2, 3))  # two micro-batches: each send gets its own copy of the rows
    ex = conn.start_exchange(torch.ones(2, 4), 0, 0)
    gc.collect()
    copy = conn._transport.sent[0]
    assert copy() is not None  # nobody but the exchange holds the copy
    ex.wait()
    gc.collect()
    assert copy() is None  # joined: the memory may go back


def test_the_ffn_sides_outputs_stay_alive_until_the_sends_are_settled():
    import torch

    from afd_core.connectors.base import StepPlan

    conn = connector("ffn", a=2)
    conn._plan = StepPlan(0, (), ((2, 1), (1, 1)), ControlFlag.NONE)
    conn.send_ffn_output(torch.ones(3, 4), 0, 0)  # a clone is sent (two micro-batches)
    gc.collect()
    slices = conn._transport.sent
    assert len(slices) == 2 and all(s() is not None for s in slices)
    conn.settle_sends()
    gc.collect()
    assert all(s() is None for s in slices)


def test_a_replayed_step_is_watched_on_both_sides():
    """The attention side after mark_exchanged, the FFN side after each replay (the graph
    cache calls `watch` then, and only then)."""
    from afd_core.connectors.base import StepPlan
    from afd_core.step.graphs import FFNGraphCache

    conn = connector("attention")
    conn.begin_step((2,))
    conn.mark_exchanged()
    [what] = conn._transport.watched
    assert what.startswith("the replayed exchanges of step 0 with FFN rank 0")

    class Backend:
        def capture(self, fn):
            fn()
            return "graph"

        def replay(self, graph):
            pass

    watched = []
    cache = FFNGraphCache(Backend())
    rows = ((2,),)
    for flags in (ControlFlag.NONE, ControlFlag.CAPTURE, ControlFlag.NONE, ControlFlag.NONE):
        cache.run(
            StepPlan(0, (), rows, flags),
            lambda capturing=False: None,
            lambda: None,
            watch=lambda: watched.append(1),
        )
    assert len(watched) == cache.stats.replayed == 2


def test_the_transport_watches_a_replay_and_a_stuck_one_aborts_the_channel():
    import time

    from afd_core.connectors.transports.device import ChannelAborted, Watchdog
    from afd_core.connectors.transports.nccl import NcclTransport
    from tests.afd_core.nccl_standin import HostRuntime

    class Never:
        def record(self, stream):
            pass

        def query(self):
            return False

    aborted = []

    class Comm:
        def abort(self):
            aborted.append(1)

    runtime = HostRuntime()
    t = NcclTransport("127.0.0.1", 1, 0, 1, 2, False, 0.2, 5.0, runtime=runtime, comm_factory=None)
    t._comms = {"to_first": Comm(), "from_first": Comm()}
    t._send_comm = t._recv_comm = Comm()
    t._watchdog = Watchdog("t", t._expired)
    t.watch_device_work("a finished replay")  # its event is set at once (host stream)
    runtime.new_event = Never
    t.watch_device_work("the replay of step 7")
    deadline = time.monotonic() + 5
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(aborted) == 2  # both communicators
    with pytest.raises(ChannelAborted, match="the replay of step 7: no answer within 0s"):
        t.watch_device_work("the next one")


def test_a_capture_step_is_served_alone_and_the_other_servers_step_follows():
    """Two attention servers on one FFN rank: server 0 captures while server 1 runs a real
    step. The FFN rank serves the capture alone (its peers record, nothing moves), then the
    real step; never one step mixing both (it would move server 1's data while capturing,
    or capture server 0's nothing as data)."""
    conn = connector("ffn", a=2)
    conn._peer_server = [0, 1]  # attention rank 0 and 1: two servers of one rank each
    conn._inbox = ListInbox(
        [(0, control(0, 0, (8,), ControlFlag.CAPTURE)), (1, control(1, 0, (3,)))]
    )
    first = conn.recv_control()
    assert first.rows == ((8, 0),) and first.flags & ControlFlag.CAPTURE
    conn._plan = None
    second = conn.recv_control()
    assert second.rows == ((0, 3),) and not second.flags & ControlFlag.CAPTURE
    # the other way round, and two captures together are one step
    conn._inbox = ListInbox(
        [
            (1, control(1, 1, (2,))),
            (0, control(0, 1, (8,), ControlFlag.CAPTURE)),
        ]
    )
    assert conn.recv_control().rows == ((0, 2),)
    assert conn.recv_control().rows == ((8, 0),)
    conn._inbox = ListInbox(
        [
            (0, control(0, 2, (8,), ControlFlag.CAPTURE)),
            (1, control(1, 2, (4,), ControlFlag.CAPTURE)),
        ]
    )
    assert conn.recv_control().rows == ((8, 4),)

"""FFN ranks of one expert group (an FFN server with data parallelism): every member walks
every (layer, micro-batch) that has rows on any member, with zero rows of its own if need
be, and knows every member's rows (vLLM's DP metadata); across real processes on gloo."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import traceback

import pytest

from afd_core.connectors.base import AFDPeerError, StepPlan
from afd_core.connectors.protocol.control import ControlFlag
from afd_core.connectors.transports.transport import Completed, TransportError
from afd_core.step.expert_group import ExpertGroup, GroupStep, agree, expert_group_name
from tests.afd_core.gloo_harness import assert_no_errors, free_port, make, run_processes
from tests.afd_core.test_scale_out import job
from tests.afd_core.test_step_protocol import expected

# the group's vectors are torch tensors (the CPU build comes with vLLM): everything but the
# pure agreement needs it
needs_torch = pytest.mark.vllm

LAYERS = 3
# one attention server of two (or three) data-parallel ranks (they step together): rows
# per micro-batch of each step; the ranks split their steps differently
STEPS = {
    0: [(2, 3), (4,), (1, 1, 1, 1), (3,), (0, 2)],
    1: [(1,), (2, 2), (3,), (2, 1), (1,)],
    2: [(2,), (1, 1, 1), (2,), (0, 4), (3, 3)],
}


# -- the agreement, alone ----------------------------------------------------------------


def test_the_group_runs_the_most_micro_batches_and_knows_every_members_rows():
    agreed = agree(7, [[7, 2, 5, 3, 0, 0], [7, 1, 4, 0, 0, 0], [7, 0, 0, 0, 0, 0]], 2)
    assert agreed == GroupStep(7, ((5, 4, 0), (3, 0, 0)))
    assert agreed.num_microbatches == 2 and agreed.total(1) == 3


def test_members_at_different_steps_stop_naming_both():
    with pytest.raises(AFDPeerError, match=r"FFN rank 2 at 4, FFN rank 3 at 5"):
        agree(4, [[4, 1, 1, 0, 0, 0], [5, 1, 1, 0, 0, 0]], 2)


class _QueueTransport:
    """Control messages between threads: member r's sends to s land in boxes[(r, s)]."""

    timeout_s, connect_timeout_s = 7.0, 11.0

    def __init__(self, rank: int, boxes):
        self.rank, self.boxes = rank, boxes
        self.closed = threading.Event()

    def isend_control(self, tensor, peer):
        self.boxes[(self.rank, peer)].put(tensor.clone())
        return Completed()

    def irecv_control(self, tensor, peer, bound_s=None):
        box, closed = self.boxes[(peer, self.rank)], self.closed

        class _Recv:
            def wait(self, timeout_s=None):
                while not closed.is_set():
                    with contextlib.suppress(queue.Empty):
                        tensor.copy_(box.get(timeout=0.05))
                        return
                raise TransportError("closed")

        return _Recv()

    def close(self):
        self.closed.set()


def _run_members(size: int, work) -> list:
    boxes = {(r, s): queue.Queue() for r in range(size) for s in range(size)}
    out: list = [None] * size

    def member(r):
        group = ExpertGroup(_QueueTransport(r, boxes), r, size, 4)
        try:
            out[r] = work(group)
        except Exception as exc:  # noqa: BLE001 - compared below
            out[r] = exc
        finally:
            group.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


@needs_torch
def test_a_silent_member_fails_the_start_up_check_within_the_connect_bound_and_a_step_within_its_own():
    """Review M8: the group's control receives waited up to 30 days (the idle bound): a
    member that hung or stuck in vLLM's MoE collective held the others for good. The
    start-up check waits the connect bound, each step's agreement the step timeout."""
    transport = _QueueTransport(0, {(r, s): queue.Queue() for r in (0, 1) for s in (0, 1)})
    transport.timeout_s, transport.connect_timeout_s = 0.2, 0.5
    group = ExpertGroup(transport, 0, 2, 4)  # FFN rank 5, its other member, never sends
    try:
        for run, bound in (
            (lambda: group.check_peers([0]), 0.5),
            (lambda: group.agree(_plan(0, [1])), 0.2),
        ):
            t0 = time.monotonic()
            with pytest.raises(
                AFDPeerError, match=f"lost a member: no vector from FFN rank 5 within {bound}s"
            ):
                run()
            assert bound <= time.monotonic() - t0 < bound + 5
    finally:
        group.close()


def _plan(step, rows_per_mb):
    return StepPlan(step, (), tuple((n,) for n in rows_per_mb), ControlFlag.NONE)


@needs_torch
def test_three_members_agree_on_rows_with_zero_row_members():
    plans = {0: [3, 1], 1: [0], 2: [2, 2, 2]}
    out = _run_members(3, lambda g: g.agree(_plan(0, plans[g.rank])))
    assert out[0] == out[1] == out[2] == GroupStep(0, ((3, 0, 2), (1, 0, 2), (0, 0, 2)))


@needs_torch
def test_peers_of_one_attention_server_pass_the_start_up_check():
    assert _run_members(2, lambda g: g.check_peers([0, 0])) == [None, None]


@needs_torch
def test_peers_of_two_attention_servers_fail_the_start_up_check_naming_them():
    servers = {0: [0], 1: [1]}  # attention ranks 0 and 1 on servers of their own
    out = _run_members(2, lambda g: g.check_peers(servers[g.rank]))
    for exc in out:
        assert isinstance(exc, AFDPeerError), out
        assert "FFN ranks 4..5 of one FFN server (--data-parallel-size 2)" in str(exc)
        assert "attention servers starting at ranks 0, 1" in str(exc)


# -- a 2A2F deployment whose FFN ranks are one expert group, as real processes --------------


def group_ffn_main(rank, a, port, q):
    try:
        import threading

        import torch

        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", rank, a, 2, port, layers=LAYERS)
        conn.init()
        side = conn.make_side_transport(expert_group_name(0), rank, 2, connect_scale=2.0)
        side.connect()
        group = ExpertGroup(side, rank, 2, 0)
        group.check_peers(conn.peer_servers())
        # the "MoE": a collective of its own across the group, as vLLM's all-gather is; a
        # member that skipped a layer/micro-batch would hang it or see another layer
        moe = conn.make_side_transport("moe", rank, 2, connect_scale=2.0)
        moe.connect()
        other = 1 - rank
        computed = []

        def compute(layer, h, logits, ids, group_rows):
            mine = torch.tensor([layer, h.shape[0]], dtype=torch.int64)
            theirs = torch.zeros(2, dtype=torch.int64)
            recv = moe.irecv_control(theirs, other)
            moe.isend_control(mine, other).wait()
            recv.wait()
            assert theirs.tolist() == [layer, group_rows[other]], (theirs, layer, group_rows)
            assert h.shape[0] == group_rows[rank]
            computed.append((layer, tuple(group_rows)))
            return h * 2 + layer

        server = FFNStepServer(conn, list(range(LAYERS)), compute, group=group)
        server.serve(threading.Event())
        q.put(
            (
                ("ffn", rank),
                {
                    "computed": computed,
                    "steps": group.steps,
                    "zero_rows": group.zero_row_microbatches,
                },
            )
        )
        conn.close()
        moe.close()
        group.close()
    except Exception:
        q.put((("ffn", rank), "ERROR " + traceback.format_exc()))


def group_attention_main(rank, a, port, q):
    try:
        import torch

        from afd_core.step.attention import AttentionStepDriver

        conn = make("attention", rank, a, 2, port, layers=LAYERS)  # one server: start_rank 0
        conn.init()
        driver = AttentionStepDriver(conn)
        for step, rows in enumerate(STEPS[rank]):
            out = driver.run(rows, [job(conn, rank, step, mb, n) for mb, n in enumerate(rows)])
            for mb, n in enumerate(rows):
                assert torch.equal(out[mb], expected(rank, step, mb, n, LAYERS)), (step, mb)
        driver.close()
        conn.close()
        q.put((("attention", rank), "ok"))
    except Exception:
        q.put((("attention", rank), "ERROR " + traceback.format_exc()))


@needs_torch
@pytest.mark.parametrize("a", [2, 3], ids=["2A2F", "3A2F"])
def test_ffn_ranks_of_an_expert_group_compute_every_micro_batch_together(a):
    """2A2F, and 3A2F: member 0 serves attention ranks 0 and 1, member 1 rank 2 (blocks of
    uneven size, topology.py)."""
    from afd_core.topology import Topology

    port = free_port()
    results = run_processes(
        [(group_ffn_main, r, a, port) for r in (0, 1)]
        + [(group_attention_main, r, a, port) for r in range(a)]
    )
    assert_no_errors(results)
    assert [results[("attention", r)] for r in range(a)] == ["ok"] * a
    first, second = results[("ffn", 0)], results[("ffn", 1)]
    assert first["steps"] == second["steps"] == len(STEPS[0])
    # both members computed the same (layer, micro-batch) sequence with the same rows per
    # member (the sum of its peers'): the most micro-batches any peer had, zero rows for a
    # member whose peers had fewer
    assert first["computed"] == second["computed"]
    peers = [Topology(a, 2).peers_of(k) for k in (0, 1)]
    want = []
    for s in range(len(STEPS[0])):
        n_mb = max(len(STEPS[p][s]) for p in range(a))

        def rows_of(member, mb, s=s):
            return sum(STEPS[p][s][mb] for p in peers[member] if mb < len(STEPS[p][s]))

        rows = [(rows_of(0, mb), rows_of(1, mb)) for mb in range(n_mb)]
        want += [(layer, r) for layer in range(LAYERS) for r in rows if sum(r)]
    assert first["computed"] == want
    zero = sum(1 for layer, r in want if layer == 0 for n in r if n == 0)
    assert first["zero_rows"] == second["zero_rows"] == zero > 0  # each counts the group's


@needs_torch
def test_a_member_without_senders_of_its_own_learns_the_group_step_and_joins_it_without_rows():
    """Issue 36: member 0's peer sends a step that member 1's peer does not (held, dropped
    or rejoining; `senders` names DP rank 0 only). Member 1 is woken by member 0's vector,
    reads its senders word, and takes part with no rows: both agree on the same step."""
    from afd_core.connectors.protocol.control import ControlMessage

    boxes = {(r, s): queue.Queue() for r in (0, 1) for s in (0, 1)}
    groups = [ExpertGroup(_QueueTransport(r, boxes), r, 2, 4) for r in (0, 1)]
    woken = threading.Event()
    groups[1].on_vector = woken.set
    groups[1]._start_receiving()  # as the first agreement (the start-up check) does
    sent = ControlMessage(0, 3, (2,), 8, "float32", senders=0b01)
    out = {}
    try:
        worker = threading.Thread(
            target=lambda: out.setdefault(0, groups[0].agree(StepPlan(3, (sent,), ((2,),), 0)))
        )
        worker.start()
        assert woken.wait(10)
        assert groups[1].pending_senders() == 0b01
        out[1] = groups[1].agree(StepPlan(0, (), (), ControlFlag.NONE))
        worker.join(10)
        assert out[0] == out[1] == GroupStep(0, ((2, 0),))
        assert (groups[0].empty_steps, groups[1].empty_steps) == (0, 1)
        assert groups[1].pending_senders() == 0  # consumed
    finally:
        for g in groups:
            g.close()

"""The DP ranks of an attention server whose FFN ranks are one expert group switch to
returned FFN links at the same step (afd_core.step.served_together); the FFN rank tells
its peers its group's size at the handshake; an expert group's idle member stops once
another member's process is gone (ExpertGroup.watch_members)."""

from __future__ import annotations

import os
import threading
import time
import traceback
from types import SimpleNamespace

import pytest

from afd_core.connectors.base import AFDFFNLostError
from afd_core.step.served_together import ServedTogether, for_attention_server, gather_over
from tests.afd_core.gloo_harness import (
    assert_no_errors,
    checked_step,
    free_port,
    make,
    run_processes,
    wait_for,
)

pytestmark = pytest.mark.vllm  # needs torch


def _on_gloo_threads(size: int, work) -> list:
    """work(group, index) on `size` threads, each a rank of one gloo group; their results
    (or the exception each raised)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()
    results: list = [None] * size

    def run(i):
        try:
            group = dist.ProcessGroupGloo(store, i, size, timedelta(seconds=20))
            results[i] = work(group, i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def _thread_group(size: int, work) -> list:
    """work(gather, index) on `size` threads over one gloo group; their results."""
    return _on_gloo_threads(size, lambda group, i: work(gather_over(group, i, size), i))


def test_gather_over_a_gloo_group_gives_every_ranks_value_in_rank_order():
    got = _thread_group(3, lambda gather, i: [gather(10 + i), gather(i % 2)])
    assert got == [[[10, 11, 12], [0, 1, 0]]] * 3


class _Link:
    """A connector's link state for ServedTogether: steps begun on its link, None when no
    FFN rank serves it; hold_step raises as the connector's does."""

    def __init__(self, steps):
        self.steps = steps
        self.holds: list[str] = []
        self.step_senders = 0  # what the check sets for the step's control message

    def link_steps(self):
        return self.steps

    def hold_step(self, waiting_for):
        self.holds.append(waiting_for)
        raise AFDFFNLostError(waiting_for)


def _check_all(links: list[_Link]) -> list:
    """One step's check on every rank at once: None where the step goes on, else the
    error."""

    def work(gather, i):
        try:
            ServedTogether(gather, [4 + r for r in range(len(links))], i).check(links[i])
        except AFDFFNLostError as exc:
            return str(exc)
        return None

    return _thread_group(len(links), work)


def test_every_rank_served_steps():
    links = [_Link(0), _Link(7)]
    assert _check_all(links) == [None, None]
    assert [link.step_senders for link in links] == [0b11, 0b11]  # both send, both say so


def test_a_rank_on_a_new_link_holds_its_step_while_a_sibling_is_not_served():
    links = [_Link(0), _Link(None)]
    got = _check_all(links)
    assert got[0] == "attention rank(s) [5] of this server are not served by their FFN ranks yet"
    assert got[1] == "this rank is not served by its FFN rank"  # fails as it would alone
    assert [link.step_senders for link in links] == [0, 0]  # nobody sends


def test_every_rank_computes_the_same_senders_from_the_states():
    """Stepped ranks send; fresh ones only where no rank is away: the set each rank's
    control message carries (its FFN rank's group serves the rest with no rows)."""
    links = [_Link(3), _Link(None), _Link(0), _Link(9)]
    got = _check_all(links)
    assert got[0] is None and got[3] is None and got[1] and got[2]
    assert [link.step_senders for link in links] == [0b1001] * 4


def test_a_rank_that_stepped_on_its_link_steps_on_while_a_sibling_is_not_served():
    """Its FFN rank's group lost the sibling's member: its step fails there, at once, and
    it learns its FFN server is gone (it does not idle on a dead link)."""
    links = [_Link(12), _Link(None)]
    got = _check_all(links)
    assert got[0] is None and links[0].holds == []
    assert got[1] is not None


def test_for_attention_server_is_none_where_nothing_switches_together():
    conn = SimpleNamespace(ffn_loss_fatal=False, survives_peer_loss=True, ffn_expert_group=2)
    afd = SimpleNamespace(async_dp=False, start_rank=0)

    def config(dp):
        return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp))

    assert for_attention_server(config(1), afd, conn) is None  # one DP rank
    assert for_attention_server(config(2), SimpleNamespace(async_dp=True), conn) is None
    fatal = SimpleNamespace(ffn_loss_fatal=True, survives_peer_loss=True, ffn_expert_group=2)
    assert for_attention_server(config(2), afd, fatal) is None  # TP or graphs: loss stops
    alone = SimpleNamespace(ffn_loss_fatal=False, survives_peer_loss=False, ffn_expert_group=2)
    assert for_attention_server(config(2), afd, alone) is None  # links span the group


def test_for_attention_server_agrees_across_the_dp_group_whether_any_ffn_rank_is_a_group(
    monkeypatch,
):
    """Each DP rank knows only its own FFN rank's group size; the start-up all-reduce makes
    them all check (or none): here only rank 1's FFN rank is in an expert group."""
    import vllm.distributed.parallel_state as ps

    local = threading.local()
    monkeypatch.setattr(ps, "get_dp_group", lambda: local.dp)
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=2))
    afd = SimpleNamespace(async_dp=False, start_rank=6)

    def attach(groups):
        def run(group, i):
            local.dp = SimpleNamespace(cpu_group=group, rank_in_group=i, world_size=2)
            conn = SimpleNamespace(
                ffn_loss_fatal=False, survives_peer_loss=True, ffn_expert_group=groups[i]
            )
            return for_attention_server(config, afd, conn)

        return _on_gloo_threads(2, run)

    together = attach([1, 2])
    assert all(isinstance(t, ServedTogether) for t in together)
    assert [t.ranks for t in together] == [[6, 7], [6, 7]]
    assert [t.index for t in together] == [0, 1]
    assert attach([1, 1]) == [None, None]


# -- a real deployment -------------------------------------------------------------------


def hold_ffn(port, q):
    try:
        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", 0, 1, 1, port, layers=3)
        conn.expert_group_size = 3  # as FFNRole sets its server's DP size
        conn.init()
        server = FFNStepServer(conn, [0, 1, 2], lambda layer, h, *_: h * 2 + layer)
        server.serve(threading.Event())
        conn.close()
        q.put(("ffn", server.steps))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def hold_attention(port, q):
    try:
        conn = make("attention", 0, 1, 1, port, layers=3)
        conn.init()
        told = conn.ffn_expert_group
        fresh = conn.link_steps()
        try:
            conn.hold_step("attention rank(s) [1] of this server are not served yet")
            held = "not raised"
        except AFDFFNLostError as exc:
            held = str(exc)
        oks = [checked_step(conn, 0, s, 3) for s in range(3)]
        q.put(("attention", {"told": told, "fresh": fresh, "held": held, "oks": oks}))
        q.put(("after", conn.link_steps()))
        conn.close()
    except Exception:
        q.put(("attention", "ERROR " + traceback.format_exc()))


def test_a_held_step_sends_nothing_and_the_links_first_step_follows():
    """The attention rank learns its FFN rank's group size at the handshake; a held step
    fails with its reason, and the FFN rank, which saw nothing of it, serves the next
    steps from step 0."""
    port = free_port()
    out = run_processes([(hold_ffn, port), (hold_attention, port)], timeout=90, expect=3)
    assert_no_errors(out)
    got = out["attention"]
    assert got["told"] == 3 and got["fresh"] == 0, got
    assert got["held"].startswith("attention rank 0: step held: attention rank(s) [1]"), got
    assert got["oks"] == [True] * 3, got
    assert out["after"] == 3 and out["ffn"] == 3, out


def watched_member(rank, port, marks, q):
    """Member `rank` of a 2A2F expert group. Member 1 dies once both are up; member 0,
    idle (no attention rank steps), must stop serving with the reason at once."""
    name = f"ffn{rank}"
    try:
        from afd_core.connectors.base import AFDPeerError
        from afd_core.step.expert_group import ExpertGroup, expert_group_name
        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", rank, 2, 2, port, layers=3, start_rank=0)
        conn.expert_group_size = 2
        conn.init()
        side = conn.make_side_transport(expert_group_name(0), rank, 2, 2.0)
        side.connect()
        group = ExpertGroup(side, rank, 2, 0)
        group.check_peers(conn.peer_servers())
        group.watch_members(conn.stop_serving)
        (marks / f"up-{name}").touch()
        if rank == 1:
            wait_for(marks / "up-ffn0", 60)
            time.sleep(0.5)
            (marks / "died").write_text(str(time.monotonic()))
            os._exit(9)
        try:
            FFNStepServer(conn, [0, 1, 2], lambda layer, h, *_: h).serve(threading.Event())
            q.put((name, "served on"))
        except AFDPeerError as exc:
            died = float((marks / "died").read_text())
            q.put((name, {"error": str(exc), "after_s": time.monotonic() - died}))
        (marks / "ffn-done").touch()
        group.close()
        conn.close()
    except Exception:
        q.put((name, "ERROR " + traceback.format_exc()))


def idle_attention(rank, port, marks, q):
    try:
        conn = make("attention", rank, 2, 2, port, layers=3, start_rank=0)
        conn.init()
        q.put((f"att{rank}", conn.ffn_expert_group))
        wait_for(marks / "ffn-done", 60)
        conn.close()
    except Exception:
        q.put((f"att{rank}", "ERROR " + traceback.format_exc()))


def test_an_idle_expert_group_member_stops_at_once_when_another_members_process_dies(tmp_path):
    """Without the watch it would learn it only at its next step, and its attention peer,
    held until its sibling is served again, would send none."""
    port = free_port()
    targets = [(watched_member, r, port, tmp_path) for r in (0, 1)]
    targets += [(idle_attention, r, port, tmp_path) for r in (0, 1)]
    out = run_processes(targets, timeout=90, expect=3)  # member 1 dies
    assert_no_errors(out)
    assert out["att0"] == out["att1"] == 2, out
    got = out["ffn0"]
    assert isinstance(got, dict), got
    assert got["error"].startswith(
        "FFN rank 0: its expert group (FFN ranks 0..1) lost FFN rank 1: control receive: "
    ), got
    print(f"the idle member stopped {got['after_s']:.2f} s after the other died")
    assert got["after_s"] < 5, got

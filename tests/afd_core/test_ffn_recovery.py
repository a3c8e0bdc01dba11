"""Recovery from a lost FFN server in other shapes than test_ffn_loss.py's (issue 36,
review M6), real processes over gloo:

* an attention server that stays dead does not block the others' recovery: the restarted
  FFN server forms with the ranks present after recovery_grace_s, and the dead server,
  restarted later, rejoins;
* two FFN servers (2A2F): restarting only the failed one re-forms the deployment, the other
  FFN server and its peers are served throughout, and a later loss of the other FFN server
  is recovered too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import pytest

from tests.afd_core.gloo_harness import (
    assert_no_errors,
    checked_step,
    free_port,
    make,
    run_processes,
    wait_for,
)

pytestmark = pytest.mark.vllm  # needs torch

LAYERS = 3
WAIT_S = 90.0  # bound on every wait for another process of the test
TIMEOUT_S = 3.0  # every side's step timeout
GRACE_S = 3.0  # recovery_grace_s of these tests
SERVED_AGAIN = 4  # steps an attention server must be served after its FFN rank is back
SLOW_MEMBER_S = 1.5  # a restarted expert group's last member starts this much later


def ffn(rank, a, f, port, marks, incarnation, q):
    """FFN rank `rank`, its `incarnation`-th process: it crashes in the middle of a step
    once marks/"crash-ffn<rank>-<incarnation>" exists; a restart (incarnation > 0) starts
    once the previous process is gone and marks/"restart-ffn<rank>-<incarnation>" exists."""
    name = f"ffn{rank}-{incarnation}"
    try:
        from afd_core.step.ffn import FFNStepServer

        if incarnation > 0:
            wait_for(marks / f"gone-ffn{rank}-{incarnation - 1}", WAIT_S)
            wait_for(marks / f"restart-ffn{rank}-{incarnation}", WAIT_S)
            (marks / f"restarted-ffn{rank}-{incarnation}").write_text(str(time.time()))
        conn = make("ffn", rank, a, f, port, layers=LAYERS, timeout=TIMEOUT_S, start_rank=rank)
        conn.init()
        crash = marks / f"crash-ffn{rank}-{incarnation}"

        def compute(layer, h, *_):
            if layer == 1 and crash.exists():
                (marks / f"gone-ffn{rank}-{incarnation}").touch()
                os._exit(9)  # a crash: links (and, on FFN rank 0, the store) gone
            return h * 2 + layer

        FFNStepServer(conn, list(range(LAYERS)), compute).serve(threading.Event())
        out = {"lost": conn.peers_lost, "rejoined": conn.peers_rejoined}
        conn.close()
        q.put((name, out))
    except Exception:
        q.put((name, "ERROR " + traceback.format_exc()))


def group_ffn(rank, a, f, first, size, port, marks, incarnation, q):
    """FFN rank `rank`, member rank - first of the expert group of the FFN server whose
    ranks are first..first + size - 1, its `incarnation`-th process. Its member dies in the
    middle of a step once marks/"crash-ffn<rank>-<incarnation>" exists; a member whose group
    fails (a member died) records the error and exits, as vLLM tears the whole FFN server
    down. A restart (incarnation > 0) starts once every member of the previous process is
    gone and marks/"restart-ffn<first>-<incarnation>" exists."""
    name = f"ffn{rank}-{incarnation}"
    try:
        from afd_core.step.expert_group import ExpertGroup, expert_group_name
        from afd_core.step.ffn import FFNStepServer

        members = range(first, first + size)
        if incarnation > 0:
            for m in members:
                wait_for(marks / f"gone-ffn{m}-{incarnation - 1}", WAIT_S)
            wait_for(marks / f"restart-ffn{first}-{incarnation}", WAIT_S)
            (marks / f"restarted-ffn{rank}-{incarnation}").write_text(str(time.time()))
            if rank == first + size - 1:
                # its last member loads slower: its attention peer is served again well
                # after its siblings are (the watches alone differ by up to a second)
                time.sleep(SLOW_MEMBER_S)
        conn = make("ffn", rank, a, f, port, layers=LAYERS, timeout=TIMEOUT_S, start_rank=first)
        conn.expert_group_size = size  # as FFNRole sets it: its peers are told
        conn.init()
        side = conn.make_side_transport(expert_group_name(first), rank - first, size, 2.0)
        side.connect()
        group = ExpertGroup(side, rank - first, size, first)
        group.check_peers(conn.peer_servers())
        group.watch_members(conn.stop_serving)  # as FFNRole does
        conn.serve_group_steps(group)
        crash = marks / f"crash-ffn{rank}-{incarnation}"
        moe = None
        if (marks / "moe-collective").exists():
            moe = conn.make_side_transport(f"moe{first}", rank - first, size, 2.0)
            moe.connect()

        def compute(layer, h, logits, ids, group_rows):
            if layer == 1 and crash.exists():
                (marks / f"gone-ffn{rank}-{incarnation}").touch()
                os._exit(9)  # a crash: links and group channels gone
            if moe is not None:
                _moe_collective(moe, rank - first, size, h.shape[0])
            return h * 2 + layer

        try:
            FFNStepServer(conn, list(range(LAYERS)), compute, group=group).serve(threading.Event())
        except Exception as exc:  # the group broke: vLLM stops the whole FFN server
            (marks / f"error-ffn{rank}-{incarnation}").write_text(f"{type(exc).__name__}: {exc}")
            print(f"{name} exits on: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            (marks / f"gone-ffn{rank}-{incarnation}").touch()
            os._exit(1)
        out = {
            "steps": group.steps,
            "empty_steps": group.empty_steps,
            "lost": conn.peers_lost,
            "rejoined": conn.peers_rejoined,
        }
        conn.close()
        group.close()
        q.put((name, out))
    except Exception:
        q.put((name, "ERROR " + traceback.format_exc()))


def _moe_collective(moe, me: int, size: int, rows: int) -> None:
    """A stand-in for vLLM's MoE collectives on the FFN side (its DP group's all-gather of
    the rows): every member exchanges its row count with every other and waits for theirs,
    up to WAIT_S (vLLM's gloo group waits 30 minutes)."""
    import torch

    mine = torch.tensor([rows], dtype=torch.int64)
    others = [r for r in range(size) if r != me]
    sends = [moe.isend(mine, r, 0) for r in others]
    for r in others:
        moe.irecv(torch.zeros(1, dtype=torch.int64), r, 0).wait(WAIT_S)
    for h in sends:
        h.wait(WAIT_S)


def attention(rank, a, f, port, marks, plan, incarnation, q, start_rank=None, server_size=1):
    """Attention server `rank` (one rank; or a rank of the server of `server_size` ranks
    from start_rank), its `incarnation`-th process, stepping until `plan` says it is done:

    * "die-with-ffn": after 3 good steps, it dies (without a goodbye) once it lost its FFN
      rank; its restart (incarnation 1) starts on marks/"restart-att<rank>";
    * "recover": it waits out the loss of its FFN rank and is served SERVED_AGAIN steps
      after it is back (as often as marks/"losses-att<rank>" says), then steps on until
      marks/"stop" exists (a rank of a server of several ranks leaves at once);
    * "steady": it must never fail a step, until marks/"stop" exists.
    """
    name = f"att{rank}-{incarnation}"
    try:
        from afd_core.connectors.base import AFDFFNLostError

        if incarnation > 0:
            wait_for(marks / f"restart-att{rank}", WAIT_S)
        losses = int((marks / f"losses-att{rank}").read_text()) if plan == "recover" else 0
        start = rank if start_rank is None else start_rank
        conn = make(
            "attention", rank, a, f, port, layers=LAYERS, timeout=TIMEOUT_S, start_rank=start
        )
        t0 = time.monotonic()
        conn.init()
        init_s = time.monotonic() - t0
        together = None
        if server_size > 1:  # the ranks of one server step in lockstep, as vLLM's DP ranks
            together = _served_together(marks, rank, start, server_size, conn.ffn_expert_group)
        outcomes, back_at, lost_at, lost_count, slowest = [], [], [], 0, 0.0
        deadline = time.monotonic() + WAIT_S
        (marks / f"up-{name}").touch()
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: not done: {outcomes}")
            if plan == "steady" and (marks / "stop").exists():
                break
            if incarnation > 0 and outcomes[-SERVED_AGAIN:] == ["ok"] * SERVED_AGAIN:
                break
            served = outcomes[-SERVED_AGAIN:] == ["ok"] * SERVED_AGAIN
            if plan == "recover" and lost_count == losses and served:
                (marks / f"done-{name}").touch()
                # the ranks of one server leave together, as a vLLM server's data-parallel
                # ranks do: after the same SERVED_AGAIN steps on their new links (one
                # leaving a step before the other would fail their expert group's step)
                if server_size > 1 or (marks / "stop").exists():
                    break
            try:
                began = time.monotonic()
                if together is not None:
                    together.check(conn)
                ok = checked_step(conn, rank, len(outcomes), LAYERS)
                slowest = max(slowest, time.monotonic() - began)
                if outcomes and outcomes[-1] == "lost":
                    back_at.append(time.time())
                    (marks / f"back-{name}-{lost_count}").touch()
                outcomes.append("ok" if ok else "wrong")
                if outcomes == ["ok"] * 3:
                    (marks / f"stepped-{name}").touch()
            except AFDFFNLostError:
                slowest = max(slowest, time.monotonic() - began)
                if not outcomes or outcomes[-1] != "lost":
                    lost_count += 1
                    lost_at.append(time.time())
                    (marks / f"lost-{name}-{lost_count}").touch()
                outcomes.append("lost")
                if plan == "die-with-ffn":
                    (marks / f"gone-{name}").touch()
                    os._exit(9)
            if plan == "steady" and outcomes[-1] != "ok":
                raise AssertionError(f"{name}: a step failed while the other FFN rank was lost")
            time.sleep(0.05)
        conn.close()
        q.put(
            (
                name,
                {
                    "outcomes": outcomes,
                    "back_at": back_at,
                    "init_s": init_s,
                    "lost_at": lost_at,
                    "slowest_s": slowest,
                },
            )
        )
    except Exception:
        q.put((name, "ERROR " + traceback.format_exc()))


def _served_together(marks, rank, start, size, ffn_expert_group):
    """The lockstep of an attention server's DP ranks, and its per-step agreement: a gloo
    group of the server's ranks (a stand-in for vLLM's DP CPU group, on the port in
    marks/"dp-port-<start>"), with afd_core's ServedTogether over it, or a plain
    all-reduce per step where marks/"without-served-together" exists (the gap it closes)."""
    from datetime import timedelta

    import torch.distributed as dist

    from afd_core.step.served_together import ServedTogether, gather_over

    index = rank - start
    store = dist.TCPStore(
        "127.0.0.1",
        int((marks / f"dp-port-{start}").read_text()),
        size,
        is_master=index == 0,
        timeout=timedelta(seconds=WAIT_S),
    )
    group = dist.ProcessGroupGloo(store, index, size, timedelta(seconds=WAIT_S))
    gather = gather_over(group, index, size)
    assert any(gather(int(ffn_expert_group > 1))), ffn_expert_group  # told at the handshake
    if (marks / "without-served-together").exists():

        class Lockstep:
            def check(self, conn):
                gather(1)

        return Lockstep()
    return ServedTogether(gather, list(range(start, start + size)), index)


def server_attention(rank, a, f, port, marks, plan, incarnation, start_rank, server_size, q):
    """`attention` for a rank of an attention server of `server_size` ranks from
    start_rank."""
    attention(
        rank,
        a,
        f,
        port,
        marks,
        plan,
        incarnation,
        q,
        start_rank=start_rank,
        server_size=server_size,
    )


def _collapse(outcomes: list[str]) -> list[str]:
    return [o for i, o in enumerate(outcomes) if i == 0 or outcomes[i - 1] != o]


def conductor(marks, script, q):
    """Touches marks in order: each (wait for this mark, then touch that one)."""
    try:
        for wait, touch in script:
            wait_for(marks / wait, WAIT_S)
            (marks / touch).touch()
        q.put(("conductor", "done"))
    except Exception:
        (marks / "stop").touch()  # the steady processes end, so the test reports at once
        q.put(("conductor", "ERROR " + traceback.format_exc()))


def test_an_attention_server_that_stays_dead_does_not_block_the_ffn_servers_recovery(
    tmp_path, monkeypatch
):
    """2A1F: the FFN server and attention server 1 die; only the FFN server is
    restarted: attention server 0 is served again within recovery_grace_s and a few
    seconds; attention server 1, restarted afterwards, rejoins and is served."""
    monkeypatch.setenv("AFD_TEST_RECOVERY_GRACE_S", str(GRACE_S))
    (tmp_path / "losses-att0").write_text("1")
    port = free_port()
    script = [
        ("stepped-att0-0", "crash-ffn0-0"),  # both up: the FFN crashes in the next step
        ("gone-att1-0", "restart-ffn0-1"),  # attention server 1 died too: FFN restarts
        ("back-att0-0-1", "restart-att1"),  # server 0 served again: server 1 restarts
        ("done-att0-0", "stop"),
    ]
    targets = [
        (ffn, 0, 2, 1, port, tmp_path, 0),
        (ffn, 0, 2, 1, port, tmp_path, 1),
        (attention, 0, 2, 1, port, tmp_path, "recover", 0),
        (attention, 1, 2, 1, port, tmp_path, "die-with-ffn", 0),
        (attention, 1, 2, 1, port, tmp_path, "die-with-ffn", 1),
        (conductor, tmp_path, script),
    ]
    out = run_processes(targets, timeout=150, expect=4)  # ffn0-0 and att1-0 crash
    assert_no_errors(out)
    got = out["att0-0"]
    assert _collapse(got["outcomes"]) == ["ok", "lost", "ok"], got
    restarted = float((tmp_path / "restarted-ffn0-1").read_text())
    recovery_s = got["back_at"][0] - restarted
    print(f"attention 0 served again {recovery_s:.1f} s after the FFN restart began")
    # the restarted FFN waits recovery_grace_s for attention server 1, not its start-up
    # bound (30 s here): the bound is the grace, the connect and a retry of the watch
    assert recovery_s < GRACE_S + 8, recovery_s
    again = out["att1-1"]
    assert _collapse(again["outcomes"]) == ["ok"], again
    assert out["ffn0-1"]["rejoined"] == [1], out["ffn0-1"]
    print(f"attention 1's restart was served after an init of {again['init_s']:.1f} s")


def test_two_ffn_servers_restarting_only_the_failed_one_reforms_the_deployment(
    tmp_path, monkeypatch
):
    """2A2F (FFN rank k serves attention rank k): FFN server 0, which holds the store,
    crashes and is restarted alone: attention server 0 is served again while FFN server 1
    and attention server 1 are served throughout without a failed step; then FFN server 1
    crashes and is restarted alone (the store lives on): attention server 1 is served
    again, attention server 0 throughout."""
    monkeypatch.setenv("AFD_TEST_RECOVERY_GRACE_S", str(GRACE_S))
    for rank in (0, 1):
        (tmp_path / f"losses-att{rank}").write_text("1")
    port = free_port()
    script = [
        ("stepped-att0-0", "crash-ffn0-0"),
        ("gone-ffn0-0", "restart-ffn0-1"),
        ("done-att0-0", "crash-ffn1-0"),  # FFN 0 is back: now FFN 1 fails
        ("gone-ffn1-0", "restart-ffn1-1"),
        ("done-att1-0", "stop"),
    ]
    targets = [
        (ffn, 0, 2, 2, port, tmp_path, 0),
        (ffn, 1, 2, 2, port, tmp_path, 0),
        (ffn, 0, 2, 2, port, tmp_path, 1),
        (ffn, 1, 2, 2, port, tmp_path, 1),
        (attention, 0, 2, 2, port, tmp_path, "recover", 0),
        (attention, 1, 2, 2, port, tmp_path, "recover", 0),
        (conductor, tmp_path, script),
    ]
    out = run_processes(targets, timeout=200, expect=5)  # both first FFN processes crash
    assert_no_errors(out)
    att0, att1 = out["att0-0"], out["att1-0"]
    for got in (att0, att1):
        assert _collapse(got["outcomes"]) == ["ok", "lost", "ok"], got
    # each lost only its own FFN server, and not while the other one was lost
    assert att1["lost_at"][0] > att0["back_at"][0], (att0, att1)
    restarted0 = float((tmp_path / "restarted-ffn0-1").read_text())
    restarted1 = float((tmp_path / "restarted-ffn1-1").read_text())
    first = att0["back_at"][0] - restarted0
    second = att1["back_at"][0] - restarted1
    print(
        f"FFN 0 restarted: attention 0 served again after {first:.1f} s; "
        f"FFN 1 restarted: attention 1 served again after {second:.1f} s"
    )
    assert first < GRACE_S + 8 and second < GRACE_S + 8, (first, second)


def _served_again(out, marks, first) -> float:
    """Seconds from the restarted FFN server's start to the slowest of `out`'s attention
    ranks being served again."""
    restarted = float((marks / f"restarted-ffn{first}-1").read_text())
    return max(got["back_at"][0] for got in out) - restarted


def test_an_expert_group_losing_one_member_fails_its_peers_steps_and_reforms_when_restarted(
    tmp_path, monkeypatch
):
    """2A2F as one FFN server whose two ranks are an expert group (vLLM DP 2 on the FFN
    server) and one attention server of two ranks: FFN rank 1 dies in a step; FFN rank 0
    gets an error from its group (no hang) and exits (vLLM tears the server down); both
    attention ranks fail their step with an error; both FFN ranks are restarted (FFN rank 0
    hosts a fresh store) and serve both attention ranks again, the group in step."""
    monkeypatch.setenv("AFD_TEST_RECOVERY_GRACE_S", str(GRACE_S))
    for rank in (0, 1):
        (tmp_path / f"losses-att{rank}").write_text("1")
    port = free_port()
    (tmp_path / "dp-port-0").write_text(str(free_port()))
    script = [
        ("stepped-att1-0", "crash-ffn1-0"),
        ("lost-att1-0-1", "restart-ffn0-1"),  # restarts once both members are gone
        ("done-att1-0", "stop"),
    ]
    targets = [
        (group_ffn, 0, 2, 2, 0, 2, port, tmp_path, 0),
        (group_ffn, 1, 2, 2, 0, 2, port, tmp_path, 0),
        (group_ffn, 0, 2, 2, 0, 2, port, tmp_path, 1),
        (group_ffn, 1, 2, 2, 0, 2, port, tmp_path, 1),
        (server_attention, 0, 2, 2, port, tmp_path, "recover", 0, 0, 2),
        (server_attention, 1, 2, 2, port, tmp_path, "recover", 0, 0, 2),
        (conductor, tmp_path, script),
    ]
    out = run_processes(targets, timeout=200, expect=5)  # both first FFN processes exit
    assert_no_errors(out)
    error = (tmp_path / "error-ffn0-0").read_text()
    print(f"FFN rank 0's error from its group: {error}")
    atts = [out["att0-0"], out["att1-0"]]
    for got in atts:
        assert _collapse(got["outcomes"]) == ["ok", "lost", "ok"], got
        assert got["slowest_s"] < 3 * TIMEOUT_S + 5, got  # a failed step is bounded
    assert out["ffn0-1"]["steps"] == out["ffn1-1"]["steps"] > 0, out
    served = _served_again(atts, tmp_path, 0)
    print(f"both attention ranks served again {served:.1f} s after the group's restart")
    assert served < GRACE_S + 10, served


@pytest.mark.parametrize("connector", ["gloo", "nccl"])
def test_an_expert_group_of_ffn_ranks_above_0_reforms_when_restarted_while_the_store_lives(
    connector, tmp_path, monkeypatch
):
    """3A3F-like: FFN server 0 is FFN rank 0 alone (it hosts the store) serving attention
    rank 0; FFN server 1 is FFN ranks 1-2, an expert group, serving attention ranks 1-2 (one
    attention server). FFN rank 2 dies, FFN rank 1 exits on its group's error; ranks 1-2
    are restarted alone (the store and its keys of the old group live on): attention rank 0
    is served throughout, attention ranks 1-2 fail their steps and are served again."""
    if connector == "nccl":  # the device connector over its CPU stand-in
        monkeypatch.setenv("AFD_TEST_CONNECTOR", "nccl")
    monkeypatch.setenv("AFD_TEST_RECOVERY_GRACE_S", str(GRACE_S))
    for rank in (1, 2):
        (tmp_path / f"losses-att{rank}").write_text("1")
    port = free_port()
    (tmp_path / "dp-port-1").write_text(str(free_port()))
    script = [
        ("stepped-att2-0", "crash-ffn2-0"),
        ("lost-att2-0-1", "restart-ffn1-1"),
        ("done-att2-0", "stop"),
    ]
    targets = [
        (ffn, 0, 3, 3, port, tmp_path, 0),
        (group_ffn, 1, 3, 3, 1, 2, port, tmp_path, 0),
        (group_ffn, 2, 3, 3, 1, 2, port, tmp_path, 0),
        (group_ffn, 1, 3, 3, 1, 2, port, tmp_path, 1),
        (group_ffn, 2, 3, 3, 1, 2, port, tmp_path, 1),
        (attention, 0, 3, 3, port, tmp_path, "steady", 0),
        (server_attention, 1, 3, 3, port, tmp_path, "recover", 0, 1, 2),
        (server_attention, 2, 3, 3, port, tmp_path, "recover", 0, 1, 2),
        (conductor, tmp_path, script),
    ]
    out = run_processes(targets, timeout=200, expect=7)  # FFN 1-2's first processes exit
    assert_no_errors(out)
    print(f"FFN rank 1's error from its group: {(tmp_path / 'error-ffn1-0').read_text()}")
    steady = out["att0-0"]
    assert _collapse(steady["outcomes"]) == ["ok"], steady
    print(f"attention 0's slowest step: {steady['slowest_s']:.2f} s")
    assert steady["slowest_s"] < TIMEOUT_S, steady
    atts = [out["att1-0"], out["att2-0"]]
    for got in atts:
        assert _collapse(got["outcomes"]) == ["ok", "lost", "ok"], got
    assert out["ffn1-1"]["steps"] == out["ffn2-1"]["steps"] > 0, out
    served = _served_again(atts, tmp_path, 1)
    print(f"attention ranks 1-2 served again {served:.1f} s after the group's restart")
    assert served < GRACE_S + 10, served


def lockstep_attention(rank, port, marks, out_of_step_at, steps, q):
    """Attention rank `rank` of one server of two ranks (lockstep, served together),
    stepping exactly `steps` times, as its sibling does; at step `out_of_step_at` it
    announces a step number one too high (a control message its FFN rank cannot accept:
    it drops this rank, whose process lives on and rejoins). Where marks/"hang-att<rank>"
    holds a step number, it stops itself (SIGSTOP) in that step after its first layer's
    exchange, its pid in marks/"hung-att<rank>" for the test to continue it."""
    name = f"att{rank}"
    try:
        import signal

        from afd_core.connectors.base import AFDFFNLostError

        conn = make("attention", rank, 2, 2, port, layers=LAYERS, timeout=TIMEOUT_S, start_rank=0)
        conn.init()
        together = _served_together(marks, rank, 0, 2, conn.ffn_expert_group)
        hang = marks / f"hang-att{rank}"
        hang_at = int(hang.read_text()) if hang.exists() else None

        def hang_mid_step():
            (marks / f"hung-att{rank}").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
            return True

        outcomes, slowest, errors = [], 0.0, []
        for n in range(steps):
            if n == out_of_step_at:
                conn._step += 1
            began = time.monotonic()
            try:
                together.check(conn)
                after = hang_mid_step if n == hang_at else None
                right = checked_step(conn, rank, n, LAYERS, after_first_layer=after)
                outcomes.append("ok" if right else "wrong")
            except AFDFFNLostError as exc:
                outcomes.append("lost")
                errors.append(str(exc))
            slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.02)
        conn.close()
        q.put((name, {"outcomes": outcomes, "slowest_s": slowest, "first_error": errors[:1]}))
    except Exception:
        q.put((name, "ERROR " + traceback.format_exc()))


def test_an_expert_group_member_whose_peer_alone_is_dropped_serves_the_group_without_it(
    tmp_path,
):
    """Issue 36: 2A2F as one attention server (two ranks, lockstep) and one FFN server (an
    expert group of two). FFN rank 1 drops attention rank 1 alone (a control message out of
    step; the same holds for a hang or a partition of that link) while both servers run
    on. Attention rank 0 steps on; its FFN rank waited in the group's agreement for FFN
    rank 1, which had no peer left to step for, until timeout_s broke the group and the
    whole FFN server stopped (checked: with the attention ranks' plain lockstep all-reduce,
    marks/"without-served-together", FFN rank 0 exits on "lost a member: no vector from
    FFN rank 1 within 3s"). Now the attention ranks say each step which of them send it, and FFN rank 1
    takes part in the steps its peer does not send, with no rows: attention rank 0 never
    fails a step, attention rank 1 rejoins and is served again, the group stays whole."""
    port = free_port()
    (tmp_path / "dp-port-0").write_text(str(free_port()))
    steps = 150  # about 5 s of steps: rank 1 rejoins within them (its watch retries each 1 s)
    targets = [
        (group_ffn, 0, 2, 2, 0, 2, port, tmp_path, 0),
        (group_ffn, 1, 2, 2, 0, 2, port, tmp_path, 0),
        (lockstep_attention, 0, port, tmp_path, None, steps),
        (lockstep_attention, 1, port, tmp_path, 10, steps),
    ]
    out = run_processes(targets, timeout=200)
    assert_no_errors(out)
    steady, dropped = out["att0"], out["att1"]
    assert steady["outcomes"] == ["ok"] * steps, _collapse(steady["outcomes"])
    # attention rank 1 learns of the drop at once (its link closed under its wait), and
    # rank 0, which waits for it in their lockstep, with it: 0.17 s here; 6.5 s (rank 1's
    # step bound, 2 x timeout_s) while the drop left the gloo pairs open
    print(f"attention 0's slowest step: {steady['slowest_s']:.2f} s")
    assert steady["slowest_s"] < TIMEOUT_S, steady
    assert _collapse(dropped["outcomes"]) == ["ok", "lost", "ok"], dropped
    # it is told why (a DROPPED status before its link closes), not "the peer closed the
    # connection"
    (error,) = dropped["first_error"]
    assert "dropped this rank" in error and "announced step 11, but step 10" in error, error
    lost = dropped["outcomes"].count("lost")
    ffn0, ffn1 = out["ffn0-0"], out["ffn1-0"]
    print(f"attention 1: {lost} steps lost; FFN rank 1 stepped {ffn1['empty_steps']} times "
          "without it")  # fmt: skip
    assert ffn0["steps"] == ffn1["steps"] == steps, out
    assert ffn1["lost"] == ffn1["rejoined"] == [1] and ffn0["lost"] == [], out
    assert ffn1["empty_steps"] >= lost > 0 and ffn0["empty_steps"] == 0, out


HANG_S = 8.0  # how long attention rank 1 stays stopped in the middle of its step


def test_an_expert_group_member_whose_peer_hangs_mid_step_finishes_the_step_without_it(
    tmp_path,
):
    """Issue 36: the shape above, with vLLM's MoE collectives among the FFN ranks (a
    stand-in: every member waits for the others in each (layer, micro-batch)). Attention
    rank 1 stops (SIGSTOP) in the middle of a step, after its first layer: FFN rank 1
    waits timeout_s for its next rows, drops it, and computes the rest of the step with
    the group with no rows of its own, so FFN rank 0, waiting for it in the collective, and
    attention rank 0 are served. Rank 0 then waits for its stopped sibling in their
    lockstep (vLLM's DP all-reduce); continued, rank 1 finds its link dropped, and
    rejoins. The FFN server never stops."""
    port = free_port()
    (tmp_path / "dp-port-0").write_text(str(free_port()))
    (tmp_path / "moe-collective").touch()
    hang_at, steps = 10, 150
    (tmp_path / "hang-att1").write_text(str(hang_at))
    hung = tmp_path / "hung-att1"

    def resume():
        deadline = time.monotonic() + WAIT_S
        while not hung.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if hung.exists():
            time.sleep(HANG_S)
            os.kill(int(hung.read_text()), signal.SIGCONT)

    continuer = threading.Thread(target=resume, daemon=True)
    continuer.start()
    targets = [
        (group_ffn, 0, 2, 2, 0, 2, port, tmp_path, 0),
        (group_ffn, 1, 2, 2, 0, 2, port, tmp_path, 0),
        (lockstep_attention, 0, port, tmp_path, None, steps),
        (lockstep_attention, 1, port, tmp_path, None, steps),
    ]
    out = run_processes(targets, timeout=200)
    continuer.join(1)
    assert_no_errors(out)
    steady, stopped = out["att0"], out["att1"]
    ffn0, ffn1 = out["ffn0-0"], out["ffn1-0"]
    lost = stopped["outcomes"].count("lost")
    print(f"attention 0's slowest step: {steady['slowest_s']:.2f} s; attention 1: {lost} "
          f"steps lost; FFN rank 1 stepped {ffn1['empty_steps']} times without it")  # fmt: skip
    assert steady["outcomes"] == ["ok"] * steps, _collapse(steady["outcomes"])
    # its step waited timeout_s for FFN rank 1, and the next one for its stopped sibling
    assert steady["slowest_s"] < HANG_S + 2 * TIMEOUT_S, steady
    assert _collapse(stopped["outcomes"]) == ["ok", "lost", "ok"], _collapse(stopped["outcomes"])
    assert stopped["outcomes"][hang_at] == "lost", stopped["outcomes"][: hang_at + 2]
    (error,) = stopped["first_error"]
    assert "dropped this rank" in error and "no answer within 3s" in error, error
    assert ffn0["steps"] == ffn1["steps"] == steps, out
    assert ffn1["lost"] == ffn1["rejoined"] == [1] and ffn0["lost"] == [], out
    assert ffn1["empty_steps"] >= lost - 1 and ffn0["empty_steps"] == 0, out


def tp_ffn(tp_rank, port, marks, incarnation, q):
    """TP rank `tp_rank` of FFN rank 1 of a 2A2F deployment (FFN server 1: FFN rank 1 with
    tensor parallelism 2), its `incarnation`-th process: the leader (TP rank 0) is the FFN
    rank, the follower computes every layer with it. The follower dies in a step once
    marks/"crash-ffn1tp<tp_rank>-<incarnation>" exists; the leader, whose group breaks,
    records the error and exits (vLLM stops the server). A restart waits for both."""
    name = f"ffn1tp{tp_rank}-{incarnation}"
    try:
        import torch

        from afd_core.step.ffn import FFNStepServer
        from afd_core.step.ffn_tp import (
            TensorParallelFollower,
            TensorParallelLeader,
            tp_group_name,
        )
        from tests.afd_core.gloo_harness import HIDDEN

        if incarnation > 0:
            for r in (0, 1):
                wait_for(marks / f"gone-ffn1tp{r}-{incarnation - 1}", WAIT_S)
            wait_for(marks / f"restart-ffn1-{incarnation}", WAIT_S)
            (marks / f"restarted-ffn1-{incarnation}").write_text(str(time.time()))
        conn = make("ffn", 1, 2, 2, port, layers=LAYERS, timeout=TIMEOUT_S, start_rank=1)
        crash = marks / f"crash-ffn1tp{tp_rank}-{incarnation}"
        if tp_rank == 1:  # never initialized: not an AFD rank
            side = conn.make_side_transport(tp_group_name(1), 1, 2, connect_scale=2.0)
            side.connect()
            follower = TensorParallelFollower(side, 1, 1, HIDDEN, torch.float32)

            def follow(layer, *_):
                if layer == 1 and crash.exists():
                    (marks / f"gone-{name}").touch()
                    os._exit(9)

            follower.serve(follow, threading.Event())
            q.put((name, {"computed": follower.computed}))
            follower.close()
            return
        conn.init()
        side = conn.make_side_transport(tp_group_name(1), 0, 2, connect_scale=2.0)
        side.connect()
        leader = TensorParallelLeader(side, 2, 1)

        def compute(layer, h, logits, ids):
            leader.share(layer, h, logits, ids)
            return h * 2 + layer

        try:
            FFNStepServer(conn, list(range(LAYERS)), compute).serve(threading.Event())
        except Exception as exc:  # the TP group broke: vLLM stops the whole FFN server
            (marks / f"error-{name}").write_text(f"{type(exc).__name__}: {exc}")
            (marks / f"gone-{name}").touch()
            os._exit(1)
        leader.stop()
        q.put((name, {"shared": leader.shared}))
        conn.close()
        leader.close()
    except Exception:
        q.put((name, "ERROR " + traceback.format_exc()))


@pytest.mark.parametrize("connector", ["gloo", "nccl"])
def test_an_ffn_rank_above_0_with_tensor_parallelism_losing_a_follower_reforms_when_restarted(
    connector, tmp_path, monkeypatch
):
    """2A2F whose FFN server 1 is FFN rank 1 with tensor parallelism 2 (a leader and a
    follower; FFN rank 0 holds the store): the follower dies in a step, the leader gets its
    TP group's error and exits; both are restarted alone (the store and the old TP group's
    keys live on): attention rank 0 is served throughout, attention rank 1 fails its steps
    and is served again, the restarted follower computing every layer with its leader."""
    if connector == "nccl":  # the device connector over its CPU stand-in
        monkeypatch.setenv("AFD_TEST_CONNECTOR", "nccl")
    monkeypatch.setenv("AFD_TEST_RECOVERY_GRACE_S", str(GRACE_S))
    (tmp_path / "losses-att1").write_text("1")
    port = free_port()
    script = [
        ("stepped-att1-0", "crash-ffn1tp1-0"),
        ("lost-att1-0-1", "restart-ffn1-1"),
        ("done-att1-0", "stop"),
    ]
    targets = [
        (ffn, 0, 2, 2, port, tmp_path, 0),
        (tp_ffn, 0, port, tmp_path, 0),
        (tp_ffn, 1, port, tmp_path, 0),
        (tp_ffn, 0, port, tmp_path, 1),
        (tp_ffn, 1, port, tmp_path, 1),
        (attention, 0, 2, 2, port, tmp_path, "steady", 0),
        (attention, 1, 2, 2, port, tmp_path, "recover", 0),
        (conductor, tmp_path, script),
    ]
    out = run_processes(targets, timeout=200, expect=6)  # FFN 1's first processes exit
    assert_no_errors(out)
    print(f"FFN rank 1's error from its TP group: {(tmp_path / 'error-ffn1tp0-0').read_text()}")
    steady = out["att0-0"]
    assert _collapse(steady["outcomes"]) == ["ok"], steady
    assert steady["slowest_s"] < TIMEOUT_S, steady
    got = out["att1-0"]
    assert _collapse(got["outcomes"]) == ["ok", "lost", "ok"], got
    assert out["ffn1tp0-1"]["shared"] == out["ffn1tp1-1"]["computed"] > 0, out
    served = _served_again([got], tmp_path, 1)
    print(f"attention 1 served again {served:.1f} s after FFN server 1's restart")
    assert served < GRACE_S + 10, served

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


def attention(rank, a, f, port, marks, plan, incarnation, q):
    """Attention server `rank` (one rank), its `incarnation`-th process, stepping until
    `plan` says it is done:

    * "die-with-ffn": after 3 good steps, it dies (without a goodbye) once it lost its FFN
      rank; its restart (incarnation 1) starts on marks/"restart-att<rank>";
    * "recover": it waits out the loss of its FFN rank and is served SERVED_AGAIN steps
      after it is back (as often as marks/"losses-att<rank>" says);
    * "steady": it must never fail a step, until marks/"stop" exists.
    """
    name = f"att{rank}-{incarnation}"
    try:
        from afd_core.connectors.base import AFDFFNLostError

        if incarnation > 0:
            wait_for(marks / f"restart-att{rank}", WAIT_S)
        losses = int((marks / f"losses-att{rank}").read_text()) if plan == "recover" else 0
        conn = make(
            "attention", rank, a, f, port, layers=LAYERS, timeout=TIMEOUT_S, start_rank=rank
        )
        t0 = time.monotonic()
        conn.init()
        init_s = time.monotonic() - t0
        outcomes, back_at, lost_at, lost_count = [], [], [], 0
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
                if (marks / "stop").exists():
                    break
            try:
                ok = checked_step(conn, rank, len(outcomes), LAYERS)
                if outcomes and outcomes[-1] == "lost":
                    back_at.append(time.time())
                    (marks / f"back-{name}-{lost_count}").touch()
                outcomes.append("ok" if ok else "wrong")
                if outcomes == ["ok"] * 3:
                    (marks / f"stepped-{name}").touch()
            except AFDFFNLostError:
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
                {"outcomes": outcomes, "back_at": back_at, "init_s": init_s, "lost_at": lost_at},
            )
        )
    except Exception:
        q.put((name, "ERROR " + traceback.format_exc()))


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

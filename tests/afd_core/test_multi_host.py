"""The gloo connector across hosts (network namespaces, tests/netns.py): an FFN rank on one
host and an attention rank on each of two others, over a bridge. Each rank's channels bind
to the address it reaches the rendezvous from (connectors/transports/channel_address.py), so
the steps are right and nothing of AFD listens anywhere else; a rank told to bind elsewhere fails
with an error naming the address. A stranger on a fourth host reaches no gloo listener
(connectors/transports/listener_filter.py): its connections are never made, so its junk
cannot cost the FFN rank a descriptor (review M1)."""

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
from tests.netns import enter, hosts, listening, reach

pytestmark = pytest.mark.vllm  # needs torch

STEPS = 5


def ffn(ns, host, port, marks, q):
    try:
        enter(ns)
        from afd_core.step.ffn import FFNStepServer

        conn = make("ffn", 0, 2, 1, port, host=host)
        conn.init()
        (marks / "ffn.pid").write_text(str(os.getpid()))
        (marks / "ffn-up").touch()
        server = FFNStepServer(conn, [0, 1, 2], lambda layer, h, *_: h * 2 + layer)
        server.serve(threading.Event())
        conn.close()
        q.put(("ffn", "served"))
    except Exception:
        q.put(("ffn", "ERROR " + traceback.format_exc()))


def attention(ns, rank, host, port, marks, q):
    try:
        enter(ns)
        conn = make("attention", rank, 2, 1, port, host=host, start_rank=rank, connect_timeout=15)
        conn.init()
        outcome = [checked_step(conn, rank, step) for step in range(STEPS)]
        (marks / f"stepped{rank}").touch()
        deadline = time.monotonic() + 60
        while not (marks / "checked").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # connected while the test looks at the sockets
        outcome += [checked_step(conn, rank, step) for step in range(STEPS, 2 * STEPS)]
        conn.close()
        q.put((rank, outcome))
    except Exception:
        q.put((rank, "ERROR " + traceback.format_exc()))


def test_three_hosts_serve_steps_and_listen_only_on_their_own_address(tmp_path):
    with hosts(4) as (h_ffn, h_a0, h_a1, h_stranger):
        port = free_port()
        done = {}

        def deploy():
            done.update(
                run_processes(
                    [
                        (ffn, h_ffn.name, h_ffn.address, port, tmp_path),
                        (attention, h_a0.name, 0, h_ffn.address, port, tmp_path),
                        (attention, h_a1.name, 1, h_ffn.address, port, tmp_path),
                    ],
                    timeout=120,
                )
            )

        runner = threading.Thread(target=deploy)
        runner.start()
        try:
            wait_for(tmp_path / "stepped0", 90)
            wait_for(tmp_path / "stepped1", 90)
            sockets = {h: listening(h.name) for h in (h_ffn, h_a0, h_a1)}
            ports = {h: [int(a.rsplit(":", 1)[1]) for a in sockets[h]] for h in sockets}
            made = {h: reach(h_stranger.name, h.address, ports[h]) for h in sockets}
            # review M1's scanner on one of the FFN rank's gloo listeners: 50 connections
            # that send 8 bytes and close, each a descriptor for good where one is made
            ffn_fds = f"/proc/{int((tmp_path / 'ffn.pid').read_text())}/fd"
            time.sleep(0.5)
            fds_before = len(os.listdir(ffn_fds))
            gloo_port = next(p for p in ports[h_ffn] if p != port)
            flood = reach(h_stranger.name, h_ffn.address, [gloo_port], per_port=50)
            time.sleep(0.5)
            fds_after = len(os.listdir(ffn_fds))
        finally:
            (tmp_path / "checked").touch()
            runner.join(180)
        assert_no_errors(done)
        # the steps before the stranger came and after it left
        assert done[0] == [True] * 2 * STEPS and done[1] == [True] * 2 * STEPS
        # the stranger reaches the rendezvous (the gate's or the store's port) and nothing
        # else: 4 gloo listeners on the FFN host (a control and a data pair per attention
        # rank), 2 on each attention host
        assert made[h_ffn] == {p: int(p == port) for p in ports[h_ffn]}, made
        assert len(ports[h_ffn]) == 5 and all(len(ports[h]) == 2 for h in (h_a0, h_a1)), ports
        assert made[h_a0] == {p: 0 for p in ports[h_a0]}, made
        assert made[h_a1] == {p: 0 for p in ports[h_a1]}, made
        assert flood == {gloo_port: 0} and fds_after == fds_before, (flood, fds_before, fds_after)
        for h, addresses in sockets.items():
            assert addresses, (h, "no AFD listener seen")
            # the store (FFN host) and every gloo pair: on the host's own address only
            assert all(a.rsplit(":", 1)[0] == h.address for a in addresses), (h, addresses)
        assert f"{h_ffn.address}:{port}" in sockets[h_ffn]


CONNECT_TIMEOUT_S = 6


def test_a_rank_bound_to_an_address_its_peer_cannot_reach_fails_naming_it(tmp_path):
    with hosts(2) as (h_ffn, h_a0):
        port = free_port()
        out = run_processes(
            [
                (alone, h_ffn.name, "ffn", h_ffn.address, port, None),
                (alone, h_a0.name, "attention", h_ffn.address, port, "127.0.0.1"),
            ],
            timeout=120,
        )
        print(f"\nattention: {out['attention']}\nffn: {out['ffn']}")
        assert "channels at 127.0.0.1" in out["attention"][0], out
        assert "channels at " + h_ffn.address in out["ffn"][0], out
        # within the connect timeout, not gloo's five times its group's timeout (the
        # attention rank is the side waiting for a connect: 127.0.0.1 sorts first); and not
        # much sooner either: pins gloo's factor of 5 (gloo_group), which gives each pair
        # the whole connect timeout (measured 6.6 s for both ranks)
        for role, (error, elapsed_s) in out.items():
            assert f"the pair did not connect within {CONNECT_TIMEOUT_S}s" in error, out
            assert 0.8 * CONNECT_TIMEOUT_S < elapsed_s < 2 * CONNECT_TIMEOUT_S, (role, elapsed_s)


def alone(ns, role, host, port, channel_address, q):
    """One rank of a 1A1F deployment, bound where told (None: AFD's choice); its init()'s
    outcome and how long it took are the result."""
    import os

    enter(ns)
    if channel_address is not None:
        os.environ["AFD_CHANNEL_ADDRESS"] = channel_address
    conn = make(role, 0, 1, 1, port, host=host, connect_timeout=CONNECT_TIMEOUT_S)
    start = time.monotonic()
    try:
        conn.init()
        q.put((role, ("connected", time.monotonic() - start)))
    except Exception as exc:  # noqa: BLE001 - the expected failure is the result
        q.put((role, (f"{type(exc).__name__}: {exc}", time.monotonic() - start)))

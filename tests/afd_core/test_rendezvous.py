"""The rendezvous store: it listens on afd.host's address only (TCPStore's own listener
takes every interface, whatever the host it is given)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from afd_core.connectors.transports.gloo import GlooTransport
from afd_core.connectors.transports.rendezvous import _listening as reachable
from afd_core.connectors.transports.transport import TransportError
from afd_core.net import connect_to, listening_socket
from tests.afd_core.gloo_harness import free_port

pytestmark = pytest.mark.vllm  # needs torch


def test_the_store_listens_on_the_hosts_address_only():
    """Bound to 127.0.0.1, the store is not reachable on another address of this machine
    (127.0.0.2 is loopback too: a listener on every interface would answer there)."""
    port = free_port()
    t = GlooTransport("127.0.0.1", port, 0, 0, 2, True, 5.0, 5.0)
    t.open_store()
    try:
        assert reachable("127.0.0.1", port)
        assert not reachable("127.0.0.2", port)
        client = GlooTransport("127.0.0.1", port, 0, 1, 2, False, 5.0, 5.0)
        client.open_store()
        client.store_set("k", b"v")
        assert t.store_get("k", 5.0) == b"v"
    finally:
        t.close()


def test_a_taken_address_is_a_named_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t = GlooTransport("127.0.0.1", port, 0, 0, 2, True, 1.0, 1.0)
        with pytest.raises(TransportError, match=f"could not listen on 127.0.0.1:{port}"):
            t.open_store()


def _connected_to_itself(port: int) -> socket.socket:
    """What the kernel may make of a connection to a local port where nothing listens: a
    source port equal to the destination, the socket connected to itself."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.connect(("127.0.0.1", port))
    assert sock.getsockname() == sock.getpeername()
    return sock


def test_a_connection_to_itself_is_no_rendezvous_and_leaves_the_port_free():
    """A rank polling for FFN rank 0 before it listens (rendezvous ports from the ephemeral
    range, as the tests use) may connect to itself: that is 'nothing listens' (it once made
    the rank wait on itself for minutes), and closing it frees the port at once."""
    port = free_port()
    with pytest.raises(ConnectionRefusedError, match="a connection to itself"):
        connect_to("127.0.0.1", port, 1.0, source_address=("127.0.0.1", port))
    listening_socket("127.0.0.1", port).close()  # no TIME_WAIT left to keep FFN rank 0 out


def test_ffn_rank_0_waits_out_a_probe_that_holds_its_port():
    """While another rank's probe is connected to itself on the rendezvous port, FFN rank 0
    cannot listen there: it retries (it once stopped at once with EADDRINUSE)."""
    import torch.distributed  # noqa: F401 - imported before the probe's second starts

    port = free_port()
    t = GlooTransport("127.0.0.1", port, 0, 0, 2, True, 10.0, 10.0)
    probe = _connected_to_itself(port)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    threading.Timer(1.0, probe.close).start()
    t.open_store()
    try:
        assert reachable("127.0.0.1", port)
    finally:
        t.close()


SECRET = "s3cret-for-the-afd-tests-0123456789"


def test_with_a_secret_the_store_answers_only_ranks_that_prove_it(monkeypatch):
    """The store behind the gate: a rank with the secret works as before; a raw store client
    (a stranger) is closed before it reaches the store and writes nothing; a rank with
    another secret, or none, gets a named error."""
    import datetime

    import torch.distributed as dist

    monkeypatch.setenv("AFD_DEPLOYMENT_SECRET", SECRET)
    port = free_port()
    master = GlooTransport("127.0.0.1", port, 0, 0, 2, True, 5.0, 5.0)
    master.open_store()
    try:
        rank = GlooTransport("127.0.0.1", port, 0, 1, 2, False, 5.0, 5.0)
        rank.open_store()
        rank.store_set("afd/rank/attention/0", b"claimed")  # a set is not answered: wait
        assert master.store_get("afd/rank/attention/0", 5.0) == b"claimed"
        # a stranger speaking the store's protocol directly
        with pytest.raises(Exception):  # noqa: B017 - whatever the store client raises
            stranger = dist.TCPStore(
                "127.0.0.1", port, None, False, datetime.timedelta(seconds=2), False
            )
            stranger.set("afd/failed", b"stranger")
        assert master.store_try_get("afd/failed") is None
        assert master._door.refused >= 1
        monkeypatch.setenv("AFD_DEPLOYMENT_SECRET", "another-secret-of-enough-length")
        with pytest.raises(TransportError, match="refused this rank: its deployment secret"):
            GlooTransport("127.0.0.1", port, 0, 1, 2, False, 2.0, 2.0).open_store()
        monkeypatch.delenv("AFD_DEPLOYMENT_SECRET")
        with pytest.raises(TransportError, match="requires the deployment secret, which this"):
            GlooTransport("127.0.0.1", port, 0, 1, 2, False, 2.0, 2.0).open_store()
        rank.close()
    finally:
        master.close()


def test_a_rank_with_a_secret_names_a_rendezvous_without_one(monkeypatch):
    port = free_port()
    master = GlooTransport("127.0.0.1", port, 0, 0, 2, True, 5.0, 5.0)
    master.open_store()
    try:
        monkeypatch.setenv("AFD_DEPLOYMENT_SECRET", SECRET)
        with pytest.raises(TransportError, match="did not ask for the deployment secret"):
            GlooTransport("127.0.0.1", port, 0, 1, 2, False, 8.0, 8.0).open_store()
    finally:
        master.close()


def test_the_secret_comes_from_the_environment_or_a_file_and_is_checked(monkeypatch, tmp_path):
    from afd_core.connectors.transports.gate import deployment_secret
    from afd_core.errors import AFDConfigError

    monkeypatch.delenv("AFD_DEPLOYMENT_SECRET", raising=False)
    monkeypatch.delenv("AFD_DEPLOYMENT_SECRET_FILE", raising=False)
    assert deployment_secret() is None
    monkeypatch.setenv("AFD_DEPLOYMENT_SECRET", "short")
    with pytest.raises(AFDConfigError, match="has 5 bytes; allowed: at least 16"):
        deployment_secret()
    monkeypatch.delenv("AFD_DEPLOYMENT_SECRET")
    monkeypatch.setenv("AFD_DEPLOYMENT_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(AFDConfigError, match="cannot be read"):
        deployment_secret()
    (tmp_path / "secret").write_text(SECRET + "\n")
    monkeypatch.setenv("AFD_DEPLOYMENT_SECRET_FILE", str(tmp_path / "secret"))
    assert deployment_secret() == SECRET.encode()
    monkeypatch.setenv("AFD_DEPLOYMENT_SECRET", SECRET)
    with pytest.raises(AFDConfigError, match="both AFD_DEPLOYMENT_SECRET and"):
        deployment_secret()


# from a host outside the deployment: a raw store client, then an AFD rank without the
# secret (tests/e2e/test_multi_host.py runs this part against a live deployment)
STRANGER_WITHOUT_SECRET = """
import datetime, os, sys
import torch.distributed as dist
host, port = sys.argv[1], int(sys.argv[2])
try:
    s = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=3), False)
    s.set("afd/failed", b"a stranger stopped your start-up")
    print("STRANGER-WROTE")
except Exception as exc:
    print("STRANGER-REFUSED", type(exc).__name__)
from afd_core.connectors.transports.gloo import GlooTransport
from afd_core.connectors.transports.rendezvous import _listening as reachable
from afd_core.connectors.transports.transport import TransportError
try:
    GlooTransport(host, port, 0, 1, 2, False, 4.0, 4.0).open_store()
    print("NOSECRET-ADMITTED")
except TransportError as exc:
    print("NOSECRET-REFUSED", exc)
"""
STRANGER = (
    STRANGER_WITHOUT_SECRET
    + """
os.environ["AFD_DEPLOYMENT_SECRET"] = sys.argv[3]
t = GlooTransport(host, port, 0, 1, 2, False, 4.0, 4.0)
t.open_store()
t.store_set("from-the-namespace", b"hello")
t.close()
print("MEMBER-ADMITTED")
"""
)


def test_a_stranger_in_another_network_namespace_is_refused_and_changes_nothing(monkeypatch):
    """Two hosts on this machine: the FFN server's store behind the gate on a veth address
    (198.18.0.0/15, test-only), and a network namespace holding a stranger (raw store
    client, then an AFD rank without the secret) and a member with it. Traffic stays
    between the two ends of the veth pair; the namespace is removed afterwards."""
    import os
    import subprocess
    import sys

    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"]).returncode != 0:
        pytest.skip("needs root and `ip netns` (network namespaces) to make a second host")
    ns, veth = f"afdgate{os.getpid() % 100000}", f"afdg{os.getpid() % 100000}"
    octet = os.getpid() % 250 + 1
    here, there = f"198.18.{octet}.1", f"198.18.{octet}.2"

    def ip(*args, check=True):
        return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)

    monkeypatch.setenv("AFD_DEPLOYMENT_SECRET", SECRET)
    master = None
    try:
        ip("netns", "add", ns)
        ip("link", "add", veth, "type", "veth", "peer", "name", veth + "n")
        ip("link", "set", veth + "n", "netns", ns)
        ip("addr", "add", f"{here}/30", "dev", veth)
        ip("link", "set", veth, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{there}/30", "dev", veth + "n")
        ip("netns", "exec", ns, "ip", "link", "set", veth + "n", "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        port = free_port()
        master = GlooTransport(here, port, 0, 0, 2, True, 10.0, 10.0)
        master.open_store()
        env = {k: v for k, v in os.environ.items() if k != "AFD_DEPLOYMENT_SECRET"}
        out = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", STRANGER, here, str(port), SECRET],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        lines = out.stdout
        assert "STRANGER-REFUSED" in lines and "STRANGER-WROTE" not in lines, lines + out.stderr
        assert "NOSECRET-REFUSED" in lines and "requires the deployment secret" in lines, lines
        assert "MEMBER-ADMITTED" in lines, lines + out.stderr[-2000:]
        assert master.store_get("from-the-namespace", 5.0) == b"hello"
        assert master.store_try_get("afd/failed") is None
        assert master._door.refused >= 2  # the raw client and the rank without the secret
    finally:
        if master is not None:
            master.close()
        ip("netns", "del", ns, check=False)
        ip("link", "del", veth, check=False)


def test_a_pair_that_did_not_connect_is_named_with_the_connect_bound():
    """gloo's words for a pair that did not connect, from either side, become the connect
    bound and the address tried (without gloo's sequence number); other failures keep the
    operation's own bound."""
    from afd_core.connectors.transports.rendezvous import gloo_reason

    refused = RuntimeError(
        "[pair.cc:152] timed out connecting: SO_ERROR: Connection refused, "
        "remote=[127.0.0.1]:47007$0"
    )
    assert gloo_reason(refused, 2592000, connect_s=6) == (
        "the pair did not connect within 6s (timed out connecting: SO_ERROR: Connection "
        "refused, remote=[127.0.0.1]:47007)"
    )
    waited = RuntimeError("[pair.cc:1] Connect timeout [none]")
    assert (
        gloo_reason(waited, 120, connect_s=6)
        == "the pair did not connect within 6s (Connect timeout)"
    )
    assert (
        gloo_reason(RuntimeError("Timed out waiting 5000ms"), 5, connect_s=6)
        == "no answer within 5s"
    )


def _side_member(port: int, rank: int, connect_timeout_s: float = 20.0) -> GlooTransport:
    """Member `rank` of a two-member side group (an expert group, FFN tensor parallelism)
    on the store at `port`, made as p2p.make_side_transport makes it."""
    from afd_core.connectors.admission.membership import FAILED_KEY

    t = GlooTransport("127.0.0.1", port, "side", rank, 2, False, 5.0, connect_timeout_s)
    t.fresh_launch, t.fail_key = True, FAILED_KEY
    return t


@pytest.mark.parametrize("rank", [0, 1])
def test_a_side_group_member_whose_deployment_failed_stops_at_once_with_the_reason(rank):
    """A side group's launch agreement watches the deployment's failure flag as the group
    barrier does: before, a member waited out its whole connect timeout (20 s here) for a
    group rank 0 (or members) that would never come."""
    import time

    from afd_core.connectors.admission.membership import FAILED_KEY

    port = free_port()
    store = GlooTransport("127.0.0.1", port, 0, 0, 2, True, 5.0, 5.0)
    store.open_store()
    try:
        store.store_set(FAILED_KEY, b"attention rank 1: hidden_size 64 != 128")
        member = _side_member(port, rank)
        started = time.monotonic()
        with pytest.raises(TransportError, match="hidden_size 64 != 128"):
            member.connect()
        assert time.monotonic() - started < 3.0
    finally:
        store.close()


def test_a_side_group_started_again_and_again_leaves_the_store_as_it_found_it():
    """The store outlives a side group restarted alone: each launch's group rank 0
    deletes the previous launch's keys (arrival counts, gloo addresses, answers), so the
    keys stay flat over restarts instead of growing by a launch's worth each time."""
    port = free_port()
    store = GlooTransport("127.0.0.1", port, 0, 0, 2, True, 5.0, 5.0)
    store.open_store()
    counts = []
    try:
        for _ in range(4):
            members = [_side_member(port, r) for r in (0, 1)]
            errors = []

            def connect(t, errors=errors):
                try:
                    t.connect()
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=connect, args=(t,)) for t in members]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors
            for t in members:
                t.close()
            keys = store._store.list_keys()
            counts.append(sum(k.startswith("afd/gside/") for k in keys))
        launches = {k.split("/")[2] for k in keys if k.startswith("afd/gside/")}
        launches -= {"launch", "ask", "answer"}
        assert len(launches) == 1, sorted(keys)  # only the last launch's keys are left
        assert counts[1] == counts[2] == counts[3], counts
    finally:
        store.close()

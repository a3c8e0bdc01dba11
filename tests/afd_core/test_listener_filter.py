"""The socket filter on AFD's gloo listeners (connectors/transports/listener_filter.py):
only the addresses it is given connect; everyone else's SYN is dropped. Loopback has a
whole /8 of addresses, so a client bound to 127.0.0.2 stands in for a stranger here; across
hosts, tests/afd_core/test_multi_host.py."""

from __future__ import annotations

import os
import socket
import sys
import threading

import pytest

from afd_core.connectors.transports.listener_filter import (
    allow_only,
    exchange_sources,
    filter_program,
    made_with_listener,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux filters")


def connects(allowed: list[str], source: str, family=socket.AF_INET) -> bool:
    """Whether a client from `source` connects to a filtered listener on loopback (and its
    bytes arrive)."""
    loopback = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    with socket.socket(family) as listener, socket.socket(family) as client:
        listener.bind((loopback, 0))
        listener.listen(4)
        allow_only(listener.fileno(), allowed)
        client.bind((source, 0))
        client.settimeout(0.5)
        try:
            client.connect(listener.getsockname()[:2])
        except TimeoutError:
            return False
        accepted, _ = listener.accept()
        with accepted:
            client.sendall(b"hi")
            return accepted.recv(2) == b"hi"


@pytest.mark.parametrize(
    "allowed, source, expected",
    [
        (["127.0.0.1"], "127.0.0.1", True),
        (["127.0.0.1"], "127.0.0.2", False),  # the stranger: no connection at all
        (["10.0.0.1", "127.0.0.2", "127.0.0.1"], "127.0.0.2", True),
        (["127.0.0.3", "::1"], "127.0.0.2", False),
        ([], "127.0.0.1", False),
    ],
)
def test_only_the_given_addresses_connect(allowed, source, expected):
    assert connects(allowed, source) is expected


def test_ipv6_sources_are_matched_on_all_sixteen_bytes():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        assert connects(["::1"], "::1", socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    assert not connects(["::2", "127.0.0.1"], "::1", socket.AF_INET6)
    assert not connects(["0:0:0:0:0:0:1:1"], "::1", socket.AF_INET6)  # last word only differs


def test_the_program_has_a_comparison_per_address_and_ends_in_a_return():
    program = filter_program(["198.18.0.1", "198.18.0.2", "fd00::1"])
    assert len(program) == 5 + (1 + 2 + 2) + (8 + 1) + 1
    assert program[-1][0] == 0x06  # every path ends in a return
    with pytest.raises(ValueError, match="too many addresses"):
        filter_program([f"10.0.{i // 250}.{i % 250 + 1}" for i in range(300)])


def test_members_learn_where_each_other_connects_from():
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    found = {}

    def member(rank, address):
        found[rank] = exchange_sources(store, rank, range(3), address, timeout_s=10)

    threads = [
        threading.Thread(target=member, args=(r, a))
        for r, a in enumerate(["127.0.0.1", "127.0.0.2", None])  # rank 2: no listener seen
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    # each is allowed the others' listeners and the address each routes from toward them
    assert found[0] == {"127.0.0.1", "127.0.0.2"}, found
    assert found[1] == {"127.0.0.1"}, found
    assert found[2] == {"127.0.0.1", "127.0.0.2"}, found


def test_a_member_that_never_comes_is_named_within_the_bound():
    torch_dist = pytest.importorskip("torch.distributed")
    from afd_core.connectors.transports.transport import TransportError

    with pytest.raises(TransportError, match=r"group rank\(s\) \[1\] did not say where"):
        exchange_sources(torch_dist.HashStore(), 0, range(2), "127.0.0.1", timeout_s=0.5)


def test_a_gloo_devices_listener_is_found_and_filtered():
    torch_dist = pytest.importorskip("torch.distributed")

    device, listener = made_with_listener(
        lambda: torch_dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=True)
    )
    assert listener is not None and listener.address == "127.0.0.1"
    with socket.socket(fileno=os.dup(listener.fd)) as same:  # gloo's own fd stays open
        port = same.getsockname()[1]
    listener.allow_only(["127.0.0.3"])
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.2", 0))
        stranger.settimeout(0.5)
        with pytest.raises(TimeoutError):
            stranger.connect(("127.0.0.1", port))
    del device

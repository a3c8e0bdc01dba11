"""free_port: the port a local server about to start is given, from the kernel or from
AFD_PORT_RANGE (each test worker has its own slice, tests/conftest.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from afd_core import net
from afd_core.net import PORT_RANGE_ENV, free_port, port_range


def test_a_port_comes_from_the_range_is_free_and_is_not_handed_out_twice(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "21000-21009")
    monkeypatch.setattr(net, "_handed_out", type(net._handed_out)(maxlen=512))
    ports = [free_port() for _ in range(10)]
    assert sorted(ports) == list(range(21000, 21010))  # none twice, though none was bound
    with pytest.raises(RuntimeError, match=f"{PORT_RANGE_ENV}=21000-21009: no port"):
        free_port()


def test_a_port_of_the_range_that_is_taken_is_skipped(monkeypatch):
    monkeypatch.setattr(net, "_handed_out", type(net._handed_out)(maxlen=512))
    for _ in range(20):  # a held port whose next one is free (the other test worker's
        held = socket.socket()  # processes take ports of their own meanwhile)
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            held.close()
    else:
        pytest.fail("no kernel-picked port with a free next one in 20 tries")
    with held:
        monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port + 1}")
        assert free_port() == port + 1


def test_without_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free


def test_this_worker_has_a_slice_below_the_ephemeral_ports():
    value = os.environ.get(PORT_RANGE_ENV)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        assert value is None or port_range(value)  # one process: the kernel's, or the user's
        return
    ports = port_range(value)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert ports.stop <= low, (value, low)


@pytest.mark.parametrize("value", ["", "5", "9-x", "30000-20000", "80-90", "60000-70000"])
def test_a_bad_range_is_named_with_what_is_allowed(value):
    with pytest.raises(ValueError) as err:
        port_range(value)
    assert f"{PORT_RANGE_ENV}={value!r}: expected LOW-HIGH" in str(err.value)
    assert "1024 <= LOW < HIGH <= 65535" in str(err.value)


def test_two_workers_get_disjoint_slices_below_the_ephemeral_ports(monkeypatch):
    from tests.conftest import _worker_port_range

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(port_range(_worker_port_range())))
    assert not slices[0] & slices[1]
    assert max(slices[0] | slices[1]) < low
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert _worker_port_range() is None  # one process: the kernel picks

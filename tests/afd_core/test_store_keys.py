"""AFD's waits for rendezvous-store keys poll, so they do not hold the process's other
store operations (connectors/transports/store_keys.py), and what they work around: a
TCPStore client's blocking wait does (torch 2.13)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

pytestmark = pytest.mark.vllm  # needs torch

WAIT_S = 2.0


@pytest.fixture
def client():
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=10)
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout)
    yield dist.TCPStore("127.0.0.1", master.port, None, False, timeout=timeout)
    del master


def _set_beside(client, wait) -> float:
    """Seconds a `set` from this thread takes while `wait` runs on another."""
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    client.set("other", b"1")
    took = time.monotonic() - t0
    waiter.join(WAIT_S + 5)
    return took


def test_a_blocking_wait_holds_the_clients_other_operations(client):
    def wait():
        with pytest.raises(Exception):  # noqa: B017 - torch's DistStoreError
            client.wait(["never"], datetime.timedelta(seconds=WAIT_S))

    assert _set_beside(client, wait) > WAIT_S / 2


def test_a_polled_wait_does_not(client):
    from afd_core.connectors.transports.store_keys import wait_for_keys

    assert _set_beside(client, lambda: wait_for_keys(client, ["never"], WAIT_S)) < 0.5
    assert not wait_for_keys(client, ["never"], 0.1)
    threading.Timer(0.3, lambda: client.set("late", b"1")).start()
    t0 = time.monotonic()
    assert wait_for_keys(client, ["late", "other"], WAIT_S)
    assert time.monotonic() - t0 < 1.0

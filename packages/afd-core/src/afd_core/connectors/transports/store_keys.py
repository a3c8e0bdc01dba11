"""Waiting for rendezvous-store keys without holding the store's connection.

A TCPStore client sends one request at a time on its one socket: a blocking `wait` or
`get` for a key that does not come holds every other thread's store operation of the
process behind it until its timeout (measured with torch 2.13: a `set` from another thread
waited 3.7 s behind a 4 s `wait`). On an FFN rank, a rejoin whose process died before it
wrote its keys held the rejoin of its next restart for the whole connect bound that way.
So AFD's own waits poll with `check`, each a short round trip.
"""

from __future__ import annotations

import time

FIRST_PAUSE_S = 0.002  # then doubled per miss, up to MAX_PAUSE_S: a key that is written
MAX_PAUSE_S = 0.05  # soon is seen within milliseconds, a slow one costs 20 checks a second


def wait_for_keys(store, keys: list[str], timeout_s: float) -> bool:
    """True once every key is in `store` (a torch.distributed Store), False if they are
    not all there after timeout_s; the store's own errors propagate."""
    deadline = time.monotonic() + timeout_s
    pause = FIRST_PAUSE_S
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, MAX_PAUSE_S)
    return True


class KeysNotWritten(Exception):
    """`read_when_written` gave up; its text says why (not written in time, or the store's
    own error)."""


def read_when_written(store, keys: list[str], timeout_s: float) -> list[bytes]:
    """The keys' values once every one is written (`wait_for_keys`); KeysNotWritten after
    timeout_s or when the store fails."""
    try:
        if wait_for_keys(store, keys, timeout_s):
            return [store.get(key) for key in keys]
        failure = "not written"
    except Exception as exc:  # noqa: BLE001 - the store's connection error
        failure = str(exc).splitlines()[0][:200] if str(exc) else repr(exc)
    raise KeysNotWritten(failure)

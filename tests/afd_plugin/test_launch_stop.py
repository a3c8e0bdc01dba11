"""`afd launch` and `afd ray` stop every process on Ctrl-C or SIGTERM, even when the signal
arrives inside a call that swallows KeyboardInterrupt, as a Ray call can: `afd ray`'s
driver polls its actors through Ray, and a Ctrl-C that landed there left it serving with
every server up (tests/e2e/test_ray.py, twice in a row before the fix)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from afd_plugin.deploy.launch import serve

POLLS_BOUND = 50  # a driver that missed the signal would poll forever: fail instead


class SwallowingProc:
    """A process handle whose poll() gets the signal (sent at its `at`-th call, from inside
    it) and swallows the KeyboardInterrupt the default handler raises there."""

    def __init__(self, sig: int, at: int):
        self.sig, self.at, self.calls, self.returncode = sig, at, 0, None

    def poll(self):
        self.calls += 1
        if self.calls > POLLS_BOUND:
            raise AssertionError("the driver never saw the signal")
        if self.calls == self.at:
            try:
                signal.raise_signal(self.sig)
            except KeyboardInterrupt:
                pass  # what a Ray call may do with it
        return None


class FakeServer:
    def __init__(self, name: str, proc):
        self.spec = SimpleNamespace(name=name, port=8000)
        self.url, self.log_path, self.proc = f"http://h/{name}", f"{name}.log", proc
        self.started = self.stopped = False

    def start(self):
        self.started = True
        return self

    def is_healthy(self) -> bool:
        return True

    def log_tail(self, lines: int = 40) -> str:
        return ""

    def stop(self):
        self.stopped = True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("at", [1, 4], ids=["while-starting", "while-serving"])
def test_a_signal_inside_a_swallowing_call_stops_every_process(sig, at, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    polled = SwallowingProc(sig, at)
    servers = [FakeServer("ffn0", SimpleNamespace(poll=lambda: None, returncode=None))]
    servers.append(FakeServer("attention0", polled))
    assert serve(servers, timeout=30) == 130
    assert all(s.started and s.stopped for s in servers)
    assert polled.calls < POLLS_BOUND
    assert "stopped every process this command started" in capsys.readouterr().err
    # the command's handlers are gone once it returns
    assert {s: signal.getsignal(s) for s in before} == before

"""Chaos, end to end (real `vllm serve`, Qwen3-MoE, fp32 greedy): two attention servers and
one FFN server under a bounded load, one client per attention server sending requests one
after another (the two servers step concurrently through the one FFN rank; one request per
server at a time, so every answer compares exactly with the colocated server's).

Phases, each bounded in requests and time:
1. `kill -9` attention server 1: every request of server 0 succeeds with the colocated
   tokens (server 1's fail: it is gone).
2. restart attention server 1: it rejoins the running FFN server and serves the colocated
   tokens again; server 0 is served throughout. The recovery time is printed.
3. `kill -9` the FFN server with a request in flight on each attention server: both fail
   within the step timeout, none hangs; both attention servers stay up, answer /health with
   503, and fail new requests at once.
4. restart the FFN server (same command): both attention servers, never restarted, are
   served again (/health 200) and every request succeeds with the colocated tokens. The
   recovery time is printed.

Printed per phase: requests sent / succeeded / failed / hung per server.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import pytest

from afd_plugin.deploy.servers import Server, ServerError, complete, running, scale_out_deployment
from tests.e2e.conftest import (
    DEV_MODE,
    MAX_TOKENS,
    PROMPTS,
    reference,
    with_reference,
)

pytestmark = pytest.mark.e2e

ARCH = "qwen3_moe"
STEP_TIMEOUT_S = 10  # connector timeout_s
REQUEST_TIMEOUT_S = 90  # a request without an answer by then counts as hung
PHASE_REQUESTS = 6  # requests per server and phase (bounded load)
LONG_TOKENS = 480  # several seconds of generation here: in flight when the kill comes


class Client:
    """Sends PROMPTS in turn to one server, one request at a time, and sorts the outcomes."""

    def __init__(self, server: Server, ref: list):
        self.server, self.ref = server, ref
        self.outcomes: Counter = Counter()
        self.errors: list[str] = []
        self.failed_in: list[float] = []  # seconds from sending to the error

    def run(self, n: int, stop: threading.Event | None = None, pause_s: float = 0.0) -> None:
        for i in range(n):
            if stop is not None and stop.is_set():
                return
            self.one(i % len(PROMPTS))
            time.sleep(pause_s)

    def one(self, k: int, max_tokens: int = MAX_TOKENS) -> None:
        """One request; its tokens are compared when it has the reference's length."""
        self.outcomes["sent"] += 1
        t0 = time.monotonic()
        try:
            got = complete(self.server.url, PROMPTS[k], max_tokens, timeout=REQUEST_TIMEOUT_S)
        except ServerError as exc:
            self.outcomes["failed"] += 1
            self.failed_in.append(time.monotonic() - t0)
            self.errors.append(str(exc)[:300])
            return
        except Exception as exc:  # noqa: BLE001 - a timeout or a refused connection
            hung = time.monotonic() - t0 >= REQUEST_TIMEOUT_S - 1
            self.outcomes["hung" if hung else "failed"] += 1
            self.failed_in.append(time.monotonic() - t0)
            self.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            return
        same = max_tokens != MAX_TOKENS or got.token_ids == self.ref[k].token_ids
        self.outcomes["succeeded" if same else "wrong tokens"] += 1

    def take(self) -> dict:
        out = dict(self.outcomes)
        self.outcomes.clear()
        return out


def _kill(server: Server) -> None:
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(30)


def _long_request(client: Client) -> threading.Thread:
    """One request long enough (LONG_TOKENS) to be in flight when a server is killed."""
    thread = threading.Thread(target=client.one, args=(0, LONG_TOKENS), daemon=True)
    thread.start()
    return thread


def test_lose_an_attention_server_then_the_ffn_server_under_load(checkpoints, log_dir):
    model = str(checkpoints(ARCH))
    afd = scale_out_deployment(
        model,
        log_dir,
        attention=[1, 1],
        ffn=[1],
        env=DEV_MODE,
        afd_extra={"connector_extra_config": {"timeout_s": STEP_TIMEOUT_S}},
        tag=f"{ARCH}-chaos-",
    )
    servers = with_reference(ARCH, model, log_dir, afd)
    ffn = next(s for s in servers if s.spec.name.endswith("ffn0"))
    att0 = next(s for s in servers if s.spec.name.endswith("attention0"))
    att1 = next(s for s in servers if s.spec.name.endswith("attention1"))
    table = {}
    with running(servers, timeout=600):
        ref = reference(ARCH, servers)
        c0, c1 = Client(att0, ref), Client(att1, ref)

        # phase 1: server 1 killed in the middle of a request, server 0 under load
        # (killed a fixed time after its long request started: a kill after some of
        # server 0's requests came too late once, on a less loaded machine)
        t1 = _long_request(c1)
        load = threading.Thread(target=c0.run, args=(PHASE_REQUESTS,), daemon=True)
        load.start()
        time.sleep(1.0)  # both in flight; server 1's request has seconds to go
        _kill(att1)
        load.join(REQUEST_TIMEOUT_S * PHASE_REQUESTS)
        t1.join(REQUEST_TIMEOUT_S + 30)
        c1.run(1)  # server 1 is gone: refused at once
        table["kill attention 1"] = {"attention 0": c0.take(), "attention 1": c1.take()}
        assert table["kill attention 1"] == {
            "attention 0": {"sent": PHASE_REQUESTS, "succeeded": PHASE_REQUESTS},
            "attention 1": {"sent": 2, "failed": 2},
        }, (table, c0.errors, c1.errors)

        # phase 2: server 1 restarted (same command, same ranks) rejoins the FFN server
        restarted = Server(att1.spec, log_dir)
        restarted.log_path = log_dir / f"{att1.spec.name}-restarted.log"
        servers.append(restarted)  # stopped with the others
        started = time.monotonic()
        restarted.start()
        stop0 = threading.Event()
        # server 0 keeps serving while server 1 starts (paced: two cores start a server)
        t0 = threading.Thread(target=c0.run, args=(10_000, stop0, 0.5), daemon=True)
        t0.start()
        try:
            while not restarted.is_healthy():
                assert restarted.proc.poll() is None, restarted.log_tail(60)
                assert time.monotonic() - started < 300, restarted.log_tail(60)
                time.sleep(0.5)
            recovery_s = time.monotonic() - started
            c1.server = restarted
            c1.run(PHASE_REQUESTS)
        finally:
            stop0.set()
            t0.join(REQUEST_TIMEOUT_S + 30)
        table["restart attention 1"] = {"attention 0": c0.take(), "attention 1": c1.take()}
        phase2 = table["restart attention 1"]
        assert phase2["attention 1"] == {"sent": PHASE_REQUESTS, "succeeded": PHASE_REQUESTS}, (
            table,
            c1.errors,
        )
        assert phase2["attention 0"]["sent"] == phase2["attention 0"].get("succeeded"), (
            table,
            c0.errors,
        )
        assert "rejoined" in ffn.log_path.read_text(errors="replace"), ffn.log_tail(60)

        # phase 3: the FFN server killed with requests in flight on both servers
        threads = [_long_request(c) for c in (c0, c1)]
        time.sleep(1.0)
        killed = time.monotonic()
        _kill(ffn)
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 30)
        ended_in = time.monotonic() - killed
        attention = [att0, restarted]
        for server in attention:  # up, not ready, refusing at once
            assert server.proc.poll() is None, server.log_tail(60)
            assert server.health_status() == 503, server.log_tail(60)
        for c in (c0, c1):
            c.run(2)
        refused_in = max(c0.failed_in[-2:] + c1.failed_in[-2:])
        table["kill FFN"] = {"attention 0": c0.take(), "attention 1": c1.take()}
        for name, row in table["kill FFN"].items():
            assert row == {"sent": 3, "failed": 3}, (table, name, c0.errors, c1.errors)
        assert ended_in < STEP_TIMEOUT_S, ended_in
        assert refused_in < 5.0, (refused_in, c0.errors, c1.errors)

        # phase 4: the FFN server restarted; the attention servers are served again
        ffn_again = Server(ffn.spec, log_dir)
        ffn_again.log_path = log_dir / f"{ffn.spec.name}-restarted.log"
        servers.append(ffn_again)
        started = time.monotonic()
        ffn_again.start()
        while not all(s.is_healthy() for s in [ffn_again, *attention]):
            assert ffn_again.proc.poll() is None, ffn_again.log_tail(60)
            for server in attention:
                assert server.proc.poll() is None, server.log_tail(60)
            assert time.monotonic() - started < 300, ffn_again.log_tail(60)
            time.sleep(0.5)
        ffn_recovery_s = time.monotonic() - started
        for c in (c0, c1):
            c.run(PHASE_REQUESTS)
        table["restart FFN"] = {"attention 0": c0.take(), "attention 1": c1.take()}
        for name, row in table["restart FFN"].items():
            assert row == {"sent": PHASE_REQUESTS, "succeeded": PHASE_REQUESTS}, (
                table,
                name,
                c0.errors,
                c1.errors,
            )
        print(f"\nrecovery of attention server 1 after its restart: {recovery_s:.1f} s")
        print(f"every request ended {ended_in:.1f} s after the FFN server was killed")
        print(f"while no FFN server ran, requests were refused within {refused_in:.2f} s")
        print(f"recovery of both attention servers after the FFN restart: {ffn_recovery_s:.1f} s")
        for phase, rows in table.items():
            for name, row in rows.items():
                print(f"{phase:22s} {name}: {row}")

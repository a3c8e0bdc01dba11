"""Chaos, end to end (real `vllm serve`, Qwen3-MoE, fp32 greedy): two attention servers and
one FFN server under a bounded load, one client per attention server sending requests one
after another (the two servers step concurrently through the one FFN rank; one request per
server at a time, so every answer compares exactly with the colocated server's).

Phases, each bounded in requests and time:
1. `kill -9` the FFN server with a request in flight on each attention server: both fail
   within the step timeout, none hangs; both attention servers stay up, answer /health with
   503, and fail new requests at once.
2. restart the FFN server (same command): both attention servers, never restarted, are
   served again (/health 200) and every request succeeds with the colocated tokens. The
   recovery time is printed.

An attention server killed (and cut off, and sent junk) and restarted alone, while the
server beside it is served throughout, is tests/e2e/test_multi_host.py's host-loss test,
across hosts.

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


def test_lose_the_ffn_server_under_load_and_restart_it(checkpoints, log_dir):
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

        # phase 1: the FFN server killed with requests in flight on both servers
        threads = [_long_request(c) for c in (c0, c1)]
        time.sleep(1.0)
        killed = time.monotonic()
        _kill(ffn)
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 30)
        ended_in = time.monotonic() - killed
        attention = [att0, att1]
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

        # phase 2: the FFN server restarted; the attention servers are served again
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
        print(f"\nevery request ended {ended_in:.1f} s after the FFN server was killed")
        print(f"while no FFN server ran, requests were refused within {refused_in:.2f} s")
        print(f"recovery of both attention servers after the FFN restart: {ffn_recovery_s:.1f} s")
        for phase, rows in table.items():
            for name, row in rows.items():
                print(f"{phase:22s} {name}: {row}")

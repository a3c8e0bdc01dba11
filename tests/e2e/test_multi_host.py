"""AFD across hosts, end to end: four hosts (network namespaces on one bridge,
tests/netns.py), each running its part of one deployment spec with `afd launch SPEC --host
NAME`: 2A2F with both servers spanning two hosts, the attention server's data-parallel
group (head with the API server, the other headless: vLLM's multi-node flags) and the FFN
server's expert group (two FFN ranks). Greedy tokens identical to the colocated server's;
the head of each server spanning hosts shows the other host's rank on its /metrics
(relayed through the rendezvous store), and the attention server stays healthy. The deployment has a secret: a fourth host without it is refused at the
rendezvous (a raw store client, and an AFD rank), and nothing of AFD listens anywhere but
on each host's address.

A second deployment is issue 36's case: one attention server that loses a host (junk on
its hosts' ports, then one host off the network) costs the other server, which shares
its FFN rank, nothing."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from afd_plugin.deploy.servers import BASE_ENV, SHARED_CORES, Completion, running
from tests.afd_core.test_rendezvous import STRANGER_WITHOUT_SECRET
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, assert_same, reference, with_reference
from tests.netns import hosts, listeners, require_tools

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


def spec_text(model: str, machines: dict, servers: str, secret_file=None, extra: str = "") -> str:
    """A spec of these hosts (name -> tests.netns.Host) and servers (TOML), every server
    with this module's args and environment; `extra`: more connector_extra_config."""
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
connector_extra_config = {{ connect_timeout_s = {START_S}{extra} }}
{hosts_toml}{servers}
[roles.attention]
args = {toml_list}
env = {env}

[roles.ffn]
args = {toml_list}
env = {env}
"""


def launch(spec: Path, machines: dict, log_dir: Path, tmp_path: Path) -> dict:
    """`afd launch SPEC --host NAME` in each host's namespace: host name -> its launcher
    (its output in tmp_path/launch-NAME.log, its servers' logs under log_dir/NAME)."""
    launchers = {}
    for name, host in machines.items():
        log = open(tmp_path / f"launch-{name}.log", "wb")  # noqa: SIM115 - the child's
        launchers[name] = subprocess.Popen(
            ["ip", "netns", "exec", host.name, sys.executable, "-m", "afd_plugin.cli",
             "launch", str(spec), "--host", name, "--log-dir", str(log_dir / name),
             "--timeout", str(START_S)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
    return launchers


def wait_healthy(launchers: dict, apis: list, tmp_path: Path) -> float:
    """Seconds until every (host, url) in `apis` answers /health 200 from its host; fails
    with a launcher's output if one exits first."""
    started = time.monotonic()
    for host, url in apis:
        while _in(host, "-c", HEALTH, url) != "200":
            for name, p in launchers.items():
                assert p.poll() is None, (tmp_path / f"launch-{name}.log").read_text()[-3000:]
            assert time.monotonic() - started < START_S, f"{url} not healthy in time"
            time.sleep(2)
    return time.monotonic() - started


def stop(launchers, wait_s: float = 60) -> None:
    """Ctrl-C to each launcher (it stops what it started); SIGKILL to its group after
    wait_s."""
    for p in launchers:
        try:
            os.killpg(p.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    for p in launchers:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _in(host, *argv: str, timeout: float = 300) -> str:
    out = subprocess.run(
        ["ip", "netns", "exec", host.name, sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def _ports_only_elsewhere(sockets: list[tuple[str, str]], address: str) -> list[int]:
    """The ports listening on a host's loopback or every interface, but not (also) on its
    own address."""
    own, elsewhere = set(), set()
    for a, _ in sockets:
        (own if a.startswith(address + ":") else elsewhere).add(int(a.rsplit(":", 1)[1]))
    return sorted(elsewhere - own)


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
        launchers = {}
        try:
            launchers = launch(spec, by_name, log_dir / layout, tmp_path)
            api = by_name[API_HOST]
            url = f"http://{api.address}:8000"
            took = wait_healthy(launchers, [(api, url)], tmp_path)
            print(f"\n{layout}: four hosts healthy after {took:.0f} s")
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
            # listening elsewhere (loopback: the secret's gate relays, docs/security.md). A
            # port the kernel also gave a listener on the host's own address (a gloo
            # channel: it answers, by design) is no probe: CI once saw a loopback relay and
            # a channel share port 44481, and took the channel's answer for the relay's
            probes = [
                (m.address, port)
                for m in quiet
                for port in _ports_only_elsewhere(sockets[m.name], m.address)
            ]
            answered = json.loads(_in(stranger, "-c", PROBE, json.dumps(probes)))
        finally:
            stop(launchers.values())
        assert "STRANGER-REFUSED" in refused and "STRANGER-WROTE" not in refused, refused
        assert "NOSECRET-REFUSED" in refused and "requires the deployment secret" in refused
        assert_same(reference(ARCH, colocated), got)
        # its FFN ranks are an expert group: both attention DP ranks began every step with
        # served_together's all-reduce over vLLM's own DP group (and the tokens are right)
        attention_logs = "".join(
            log.read_text() for host in ("a0", "a1") for log in log_dir.glob(f"{layout}/{host}/*")
        )
        assert attention_logs.count("are expert groups: they are served together") == 2
        for role_steps in steps.values():
            assert role_steps.get("0", 0) > 0 and role_steps.get("1", 0) > 0, steps
        assert healthy == "200", healthy
        # every listener on the host's own address or loopback (AFD's secret gate: FFN rank
        # 0's store and each rank's forwarder to the gate), but vLLM's own torch.distributed
        # store (`distributed_init_method=tcp://...`, which torch's TCPStore serves on every
        # interface): its port is in vLLM's log; from another host only that one answers
        vllm_ports = {
            m.group(1)
            for log in log_dir.glob(f"{layout}/*/*.log")
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
        assert all(str(port) in vllm_ports for _, port in answered), (answered, vllm_ports, sockets)
        assert f"{machines[0].address}:29650" in [a for a, _ in sockets[machines[0].name]]
        assert [p.returncode for p in launchers.values()] == [130] * len(HOSTS)


# -- one attention server loses a host: the issue 36 case ------------------------------------
# FFN rank 0 alone on f0 serves attention server A (two data-parallel ranks, spanning a0 and
# a1) and attention server B (one rank, on b0)
LOSS_HOSTS = ("f0", "a0", "a1", "b0")
LOSS_SERVERS = """
[[servers]]
name = "ffn0"
role = "ffn"
port = 8100
hosts = [{ host = "f0", ranks = 1 }]

[[servers]]
name = "attentionA"
role = "attention"
port = 8000
data_parallel_size = 2
hosts = [{ host = "a0", ranks = 1 }, { host = "a1", ranks = 1 }]

[[servers]]
name = "attentionB"
role = "attention"
port = 8000
hosts = [{ host = "b0", ranks = 1 }]
"""
LOSS_TIMEOUT_S, LOSS_LIVENESS_S = 8, 4
LOSS_EXTRA = f", timeout_s = {LOSS_TIMEOUT_S}, liveness_timeout_s = {LOSS_LIVENESS_S}"
LOAD_MAX = 400  # requests at most; the load stops when the test says so

# steady load from B's host: one request after another (0.3 s apart: two cores also start
# A again meanwhile), each bounded (60 s, or the 7th argument), until the stop file
# exists; the whole history (prompt, start, end, token ids or the error) rewritten after each
LOAD = """
import json, os, sys, time
from afd_plugin.deploy.servers import complete
url, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
stop, out, most = sys.argv[4], sys.argv[5], int(sys.argv[6])
bound = float(sys.argv[7]) if len(sys.argv) > 7 else 60.0
history = []
while not os.path.exists(stop) and len(history) < most:
    i, t0 = len(history) % len(prompts), time.time()
    try:
        c = complete(url, prompts[i], max_tokens, timeout=bound)
        history.append([i, t0, time.time(), c.token_ids, None])
    except Exception as exc:
        history.append([i, t0, time.time(), None, repr(exc)[:300]])
    with open(out + ".tmp", "w") as f:
        json.dump(history, f)
    os.replace(out + ".tmp", out)
    time.sleep(0.3)
"""

PEERS_UP = """
import json, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
text = urllib.request.urlopen(sys.argv[1] + "/metrics", timeout=10).read().decode()
print(json.dumps({
    s.labels["peer"]: s.value
    for f in text_string_to_metric_families(text) for s in f.samples
    if s.name == "afd_peer_up" and s.labels.get("role") == "ffn"
}))
"""


def test_an_attention_server_losing_a_host_costs_the_other_server_nothing(
    checkpoints, log_dir, tmp_path
):
    """Issue 36's case, with `afd launch` on four hosts: a stranger sends junk, HTTP and
    idle connections to every port A's hosts listen on (vLLM's own among them), then a1
    drops off the network (iptables DROP: no FIN, no RST). The FFN rank drops what it loses
    of A and serves on; then A alone is restarted on its two hosts and rejoins. B, under
    steady load throughout, loses no request and gets the colocated tokens; the FFN server
    and B stay up and healthy."""
    import random

    require_tools("iptables")

    from tests.afd_core.test_nemesis import hostile

    model = str(checkpoints(ARCH))
    colocated = with_reference(ARCH, model, log_dir, [])
    with (
        hosts(len(LOSS_HOSTS) + 1, tag="afdhl") as (*machines, stranger),
        running(colocated, timeout=600),
    ):
        by_name = dict(zip(LOSS_HOSTS, machines, strict=True))
        spec = tmp_path / "deploy.toml"
        spec.write_text(spec_text(model, by_name, LOSS_SERVERS, extra=LOSS_EXTRA))
        f0, a0, a1, b0 = (by_name[n] for n in LOSS_HOSTS)
        ffn_url, b_url = f"http://{f0.address}:8100", f"http://{b0.address}:8000"
        a_url = f"http://{a0.address}:8000"
        stopfile, history_file = tmp_path / "stop-load", tmp_path / "history.json"
        launchers, load, junk = {}, None, {}
        try:
            launchers = launch(spec, by_name, log_dir / "host-loss", tmp_path)
            took = wait_healthy(launchers, [(a0, a_url), (b0, b_url)], tmp_path)
            print(f"\nhost loss: four hosts healthy after {took:.0f} s")
            load = subprocess.Popen(
                ["ip", "netns", "exec", b0.name, sys.executable, "-c", LOAD, b_url,
                 str(MAX_TOKENS), json.dumps(PROMPTS), str(stopfile), str(history_file),
                 str(LOAD_MAX)],
            )  # fmt: skip
            time.sleep(3)  # served before any fault
            rng = random.Random(36)
            for host in (a0, a1):
                junk[host.name] = hostile(stranger.name, host, rng)
            time.sleep(3)
            head_alive = launchers["a0"].poll() is None  # vLLM's own sockets took junk too
            fault_at = time.time()
            for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
                subprocess.run(
                    ["ip", "netns", "exec", a1.name, "iptables", "-A", chain, flag, "eth0",
                     "-j", "DROP"],
                    check=True, timeout=30,
                )  # fmt: skip
            # the bound on losing a silent peer (liveness), a step's (timeout_s), and more
            time.sleep(LOSS_LIVENESS_S + LOSS_TIMEOUT_S + 6)
            peers_up = json.loads(_in(f0, "-c", PEERS_UP, ffn_url))
            # A restarted alone: a1 back on the network, what is left of A stopped, the
            # same `afd launch` on its two hosts; it rejoins the running FFN rank
            subprocess.run(["ip", "netns", "exec", a1.name, "iptables", "-F"], check=True)
            stop([launchers.pop(n) for n in ("a0", "a1")], wait_s=5)  # fate: vLLM's
            restart_at, restart_wall = time.monotonic(), time.time()
            again_dir = tmp_path / "again"
            again_dir.mkdir()
            again = launch(spec, {"a0": a0, "a1": a1}, log_dir / "host-loss-again", again_dir)
            launchers |= {f"{n} again": p for n, p in again.items()}
            wait_healthy(again, [(a0, a_url)], again_dir)
            rejoin_s = time.monotonic() - restart_at
            rows = json.loads(_in(a0, "-c", CLIENT, a_url, str(MAX_TOKENS), json.dumps(PROMPTS)))
            stopfile.touch()
            load.wait(120)
            b_health, ffn_health = _in(b0, "-c", HEALTH, b_url), _in(f0, "-c", HEALTH, ffn_url)
            ffn_alive = launchers["f0"].poll() is None
        finally:
            if load is not None and load.poll() is None:
                load.kill()
            # A's hosts: their fate is vLLM's (a partitioned host cannot stop cleanly)
            stop([launchers.pop(n) for n in ("a0", "a1") if n in launchers], wait_s=5)
            stop(launchers.values())
        history = json.loads(history_file.read_text())
        ffn_log = "\n".join(
            p.read_text(errors="replace") for p in (log_dir / "host-loss" / "f0").glob("*.log")
        )
        ref = reference(ARCH, colocated)
        after = [h for h in history if h[1] > fault_at]
        slowest = max(end - start for _, start, end, _, _ in history)
        print(
            f"host loss: junk to {sum(len(ports) for ports in junk.values())} ports; "
            f"{len(history)} requests on B, "
            f"{sum(h[4] is not None for h in history)} failed, {len(after)} after a1 went "
            f"off the network, slowest {slowest:.1f} s; A's head survived the junk: "
            f"{head_alive}; FFN peer_up {peers_up}"
        )
        print(f"host loss: A restarted and healthy again after {rejoin_s:.0f} s")
        # B: nothing lost, every request the colocated tokens, served after the loss too
        assert [h[4] for h in history if h[4] is not None] == [], history
        for i, _, _, token_ids, _ in history:
            assert token_ids == ref[i].token_ids, (PROMPTS[i], token_ids)
        assert len(after) >= 5 and history[-1][1] > restart_wall, history  # and during A's restart
        # the FFN server and B up and healthy; the FFN rank dropped A's rank on a1 and
        # serves B's
        assert ffn_alive and ffn_health == "200" and b_health == "200", (ffn_health, b_health)
        assert "attention rank 1 is lost and dropped" in ffn_log, ffn_log[-3000:]
        assert peers_up.get("1") == 0 and peers_up.get("2") == 1, peers_up
        # A, restarted alone, rejoined (both ranks) and gives the colocated tokens
        assert "attention rank 0 rejoined" in ffn_log and "attention rank 1 rejoined" in ffn_log
        assert_same(ref, [Completion(*row) for row in rows])
        assert [p.returncode for p in launchers.values()] == [130] * 4, launchers

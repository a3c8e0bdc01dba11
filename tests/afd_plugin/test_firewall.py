"""The firewall rules `afd launch --print` prints for bare hosts (afd_plugin.deploy.firewall),
applied in network-namespace hosts: a stranger reaches only the attention API port; the
deployment's hosts reach everything, the kernel-chosen ports of AFD's channels included."""

from __future__ import annotations

import contextlib
import shutil
import subprocess

import pytest

from afd_plugin.deploy.firewall import host_rules
from afd_plugin.deploy.spec import check_spec
from tests.netns import hosts


def _spec(f: str, a0: str) -> dict:
    return {
        "model": "/models/m",
        "hosts": {"f": {"address": f}, "a0": {"address": a0}},
        "servers": [
            {"name": "ffn0", "role": "ffn", "port": 8100, "hosts": "f"},
            {"name": "attention0", "role": "attention", "port": 8000, "hosts": "a0"},
        ],
    }


def test_every_port_the_deployment_listens_on_is_covered():
    d = check_spec(_spec("10.0.0.1", "10.0.0.2"))
    f = "\n".join(host_rules(d, "f"))
    a0 = "\n".join(host_rules(d, "a0"))
    assert "-s 10.0.0.2 -j ACCEPT" in f and "-s 10.0.0.1 -j ACCEPT" in a0
    assert "--dport 29650 -j DROP" in f and "--dport 8100 -j DROP" in f
    assert "--dport 8000 -j ACCEPT" in a0 and "8000" not in f
    for rules in (f, a0):  # replies first, the ephemeral range last
        lines = rules.splitlines()
        assert "ESTABLISHED" in lines[1] and "ip_local_port_range" in lines[-1]


def _listen(namespace: str, port: int, stack: contextlib.ExitStack) -> int:
    """A process listening on `port` (0: one the kernel picks) in `namespace`; its port."""
    code = (
        "import socket,sys,time\n"
        f"s=socket.create_server(('0.0.0.0', {port}))\n"
        "print(s.getsockname()[1], flush=True)\n"
        "time.sleep(60)"
    )
    proc = subprocess.Popen(
        ["ip", "netns", "exec", namespace, "python3", "-c", code], stdout=subprocess.PIPE, text=True
    )
    stack.callback(proc.wait, timeout=10)
    stack.callback(proc.kill)
    return int(proc.stdout.readline())


def _reaches(namespace: str, address: str, port: int) -> bool:
    code = (
        "import socket,sys\n"
        f"s=socket.socket(); s.settimeout(1.0)\n"
        f"sys.exit(s.connect_ex(({address!r}, {port})) != 0)"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "python3", "-c", code], timeout=20, check=False
    )
    return out.returncode == 0


@pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables is not installed")
def test_the_rules_keep_a_stranger_off_and_let_the_deployment_in():
    with hosts(3, tag="afdfw") as (hf, ha, stranger):
        d = check_spec(_spec(hf.address, ha.address))
        for host, ns in (("f", hf.name), ("a0", ha.name)):
            for rule in host_rules(d, host):
                subprocess.run(
                    ["ip", "netns", "exec", ns, "sh", "-c", rule.split("  #")[0]],
                    check=True,
                    timeout=20,
                )
        with contextlib.ExitStack() as stack:
            for ns, port in ((hf.name, 29650), (hf.name, 8100), (ha.name, 8000)):
                _listen(ns, port, stack)
            channel = _listen(hf.name, 0, stack)  # a port the kernel picks, as gloo's
            on_f = [("rendezvous", 29650), ("ffn api", 8100), ("channel", channel)]
            for what, port in on_f:
                assert not _reaches(stranger.name, hf.address, port), what
                assert _reaches(ha.name, hf.address, port), what
            assert _reaches(stranger.name, ha.address, 8000)
            assert _reaches(hf.name, ha.address, 8000)

"""Several hosts on this machine: Linux network namespaces on one bridge.

`hosts(n)` makes a switch namespace holding a bridge and n host namespaces, each with one
interface (eth0) wired to the bridge and an address from 198.18.0.0/15 (the benchmarking
range, used only inside these namespaces), and removes them all afterwards (deleting a
namespace deletes its interfaces). Nothing is added to this machine's own namespace.
Processes enter a host with `ip netns exec NAME ...`, or, for a spawned Python process,
`enter(NAME)` first thing (setns: the threads it starts later follow it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    address: str  # eth0's address


def can_make_namespaces() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return None


def require_tools(*names: str) -> None:
    """A fault test's tools (iptables, tc) are on PATH: an error naming the missing ones
    before any namespace or server is made (not a skip: the test has not run)."""
    import shutil

    if missing := [n for n in names if shutil.which(n) is None]:
        raise RuntimeError(
            f"this test needs {', '.join(missing)} on PATH to inject its faults inside the "
            "namespaces; install them (Debian: apt-get install iptables iproute2)"
        )


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip()}")


@contextlib.contextmanager
def hosts(n: int, tag: str = "afd") -> Iterator[list[Host]]:
    if why := can_make_namespaces():
        pytest.skip(why)
    pid = os.getpid() % 100000
    subnet = 1 + pid % 250  # 198.18.<subnet>.0/24: another test run has another
    switch = f"{tag}sw{pid}"
    made = [switch]
    try:
        _ip("netns", "add", switch)
        _ip("link", "add", "br0", "type", "bridge", ns=switch)
        _ip("link", "set", "br0", "up", ns=switch)
        out = []
        for i in range(n):
            name = f"{tag}h{i}-{pid}"
            _ip("netns", "add", name)
            made.append(name)
            outside, inside = f"{tag}{pid}p{i}", f"{tag}{pid}h{i}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "netns", switch)
            _ip("link", "set", inside, "netns", name)
            _ip("link", "set", outside, "master", "br0", ns=switch)
            _ip("link", "set", outside, "up", ns=switch)
            _ip("link", "set", inside, "name", "eth0", ns=name)
            address = f"198.18.{subnet}.{i + 1}"
            _ip("addr", "add", f"{address}/24", "dev", "eth0", ns=name)
            _ip("link", "set", "eth0", "up", ns=name)
            _ip("link", "set", "lo", "up", ns=name)
            out.append(Host(name, address))
        yield out
    finally:
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def enter(namespace: str) -> None:
    """Move this process (its calling thread, and every thread it starts later) into a
    host's network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    finally:
        os.close(fd)


def listening(namespace: str) -> list[str]:
    """The local addresses (host:port) of every listening TCP socket in a namespace."""
    return [address for address, _ in listeners(namespace)]


def listeners(namespace: str) -> list[tuple[str, str]]:
    """(host:port, the owning process's name) of every listening TCP socket there."""
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "ss", "-Hltnp"], capture_output=True, text=True
    )
    found = []
    for line in out.stdout.splitlines():
        if not line.strip():
            continue
        fields = line.split()
        owner = line.split('(("', 1)[1].split('"', 1)[0] if '(("' in line else "?"
        found.append((fields[3], owner))
    return found


REACH = """
import json, os, select, socket, sys, time
address, ports, per_port, wait_s = json.loads(sys.argv[1])
pending = {}
for port in ports:
    for _ in range(per_port):
        s = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        s.setblocking(False)
        s.connect_ex((address, port))
        pending[s] = port
made = {port: 0 for port in ports}
deadline = time.monotonic() + wait_s
while pending and time.monotonic() < deadline:
    _, ready, _ = select.select([], list(pending), [], max(0.0, deadline - time.monotonic()))
    for s in ready:
        port = pending.pop(s)
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
            made[port] += 1
            try:
                s.send(os.urandom(8))  # a few bytes that match nothing, then gone
            except OSError:
                pass
        s.close()
for s in pending:
    s.close()
print(json.dumps(made))
"""


def reach(namespace: str, address: str, ports, per_port: int = 1, wait_s: float = 1.5) -> dict:
    """From a host: `per_port` connections to each of `ports` at `address`, all at once;
    each one made sends 8 random bytes and closes (review M1's scanner). Returns how many
    were made per port within wait_s (a filtered port drops the SYN: none)."""
    import json

    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "python", "-c", REACH,
         json.dumps([address, sorted(ports), per_port, wait_s])],
        capture_output=True, text=True, timeout=60 + wait_s,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}

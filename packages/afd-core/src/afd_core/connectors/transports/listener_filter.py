"""Only a group's own members reach its gloo listener: a kernel socket filter on each.

Every AFD gloo group has a device of its own (channel_address.py), and a device listens on
a port the kernel picks from the moment it is made. gloo checks no peer: it keeps every
connection whose first bytes match no pair for the process's life and aborts the process
when `accept` fails for want of descriptors (review M1), so whoever reached the port could
leak a descriptor per connection and, in the end, kill the rank.

So before any pair of a group connects, its members tell each other through the rendezvous
store where they will connect from (`exchange_sources`: first each listener's address,
then the addresses each member's kernel routes from toward the others' listeners), and each
attaches a classic BPF filter to its listener that passes only packets from those addresses
(`allow_only`). The kernel runs a listening socket's filter on every packet that reaches it,
the SYN included, and drops what it refuses: a stranger's connection is never made, gloo
sees nothing, and the stranger sees what a firewall's DROP shows. The connections the
listener accepts inherit the filter.

What it does not cover: a stranger on a member's host connects from the member's address
(on one host, loopback: any local process); NCCL's and HCCL's own sockets; vLLM's. Linux
only (elsewhere, and where the listener cannot be told apart from another socket made at
the same moment, the group works unfiltered and says so in the log).
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from afd_core.connectors.transports.transport import TransportError
from afd_core.log import get_logger

logger = get_logger(__name__)

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>
SKF_NET_OFF = -0x100000  # classic BPF: offsets from the packet's network (IP) header
# classic BPF opcodes (<linux/filter.h>)
LD_B_ABS, LD_W_ABS, RSH_K, JEQ_K, RET_K = 0x30, 0x20, 0x74, 0x15, 0x06
ACCEPT, DROP = 0xFFFFFFFF, 0

_made_lock = threading.Lock()  # one device made at a time: its listener is the one new socket


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


@dataclass(frozen=True)
class Listener:
    """A gloo device's listening socket in this process."""

    fd: int
    address: str  # the address it is bound to

    def allow_only(self, addresses: Iterable[str]) -> None:
        allow_only(self.fd, addresses)


def _sockets() -> set[tuple[int, str]]:
    """(descriptor, "socket:[inode]") of this process's sockets."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add((int(name), target))
    return found


def _listening_address(fd: int) -> str | None:
    """The bound address of descriptor `fd` if it is a listening TCP socket, else None."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if s.type != socket.SOCK_STREAM or not s.getsockopt(
            socket.SOL_SOCKET, socket.SO_ACCEPTCONN
        ):
            return None
        return s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()


def made_with_listener(make: Callable[[], object]) -> tuple[object, Listener | None]:
    """make() (a gloo device, which listens from birth) and the listening socket it opened,
    or None where that cannot be told (not Linux; not exactly one new listener)."""
    if not sys.platform.startswith("linux"):
        return make(), None
    with _made_lock:
        before = _sockets()
        made = make()
        new = [
            Listener(fd, address)
            for fd, _ in sorted(_sockets() - before)
            if (address := _listening_address(fd)) is not None
        ]
    if len(new) != 1:
        logger.warning(
            "AFD: %d listening sockets appeared while a gloo device was made (one expected): "
            "its listener is left unfiltered (docs/security.md)",
            len(new),
        )
        return made, None
    return made, new[0]


def _address_words(address: str) -> tuple[int, list[int]]:
    """(IP version, the address as 32-bit big-endian words)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a v4 peer of a dual-stack listener sends IPv4 packets
    raw = ip.packed
    return ip.version, [int.from_bytes(raw[i : i + 4], "big") for i in range(0, len(raw), 4)]


def filter_program(addresses: Iterable[str]) -> list[tuple[int, int, int, int]]:
    """Classic BPF that passes IPv4/IPv6 packets whose source is one of `addresses` and
    drops every other packet: (code, jt, jf, k) instructions."""
    by_version: dict[int, list[list[int]]] = {4: [], 6: []}
    for address in sorted(set(addresses)):
        version, words = _address_words(address)
        if words not in by_version[version]:
            by_version[version].append(words)
    v4 = [(LD_W_ABS, 0, 0, SKF_NET_OFF + 12)]  # IPv4 source: bytes 12..15 of the header
    for i, (word,) in enumerate(by_version[4]):
        left = len(by_version[4]) - i  # this and the later comparisons
        v4.append((JEQ_K, left, 0, word))  # equal: jump past the rest to the ACCEPT below
    v4 += [(RET_K, 0, 0, DROP), (RET_K, 0, 0, ACCEPT)]
    v6 = []
    for words in by_version[6]:  # IPv6 source: bytes 8..23, four words
        block = []
        for j, word in enumerate(words):
            block.append((LD_W_ABS, 0, 0, SKF_NET_OFF + 8 + 4 * j))
            # unequal: skip this address's remaining loads and comparisons and its ACCEPT
            block.append((JEQ_K, 0, 2 * (3 - j) + 1, word))
        v6 += block + [(RET_K, 0, 0, ACCEPT)]
    v6.append((RET_K, 0, 0, DROP))
    head = [(LD_B_ABS, 0, 0, SKF_NET_OFF), (RSH_K, 0, 0, 4)]  # the IP version nibble
    # version 4: fall into the v4 block; 6: jump over it; anything else: drop
    head += [(JEQ_K, 2, 0, 4), (JEQ_K, len(v4) + 1, 0, 6), (RET_K, 0, 0, DROP)]
    program = head + v4 + v6
    if len(program) > 4096 or any(jt > 255 or jf > 255 for _, jt, jf, _ in program):
        raise ValueError(f"too many addresses for one socket filter: {len(set(addresses))}")
    return [(code, jt, jf, k & 0xFFFFFFFF) for code, jt, jf, k in program]


def allow_only(fd: int, addresses: Iterable[str]) -> None:
    """Attach a filter to socket `fd` (and so to the connections it accepts later) that
    passes only packets from `addresses`."""
    program = filter_program(addresses)
    instructions = (_SockFilter * len(program))(*(_SockFilter(*i) for i in program))
    prog = _SockFprog(len(program), instructions)
    s = socket.socket(fileno=os.dup(fd))  # the same socket: options set here are its
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(prog))
    finally:
        s.close()


def exchange_sources(
    store, rank: int, members: Iterable[int], listener_address: str | None, timeout_s: float
) -> set[str]:
    """Through `store` (the group's prefix store), the addresses the group's other
    `members` connect from; each member calls it with its group `rank` (with no listener,
    a member still publishes, so the others do not wait for it)."""
    from afd_core.connectors.transports.channel_address import routed_address
    from afd_core.connectors.transports.store_keys import KeysNotWritten, read_when_written

    others = [m for m in members if m != rank]

    def gather(kind: str, mine: str) -> dict[int, str]:
        store.set(f"guard/{kind}/{rank}", mine)
        keys = [f"guard/{kind}/{m}" for m in others]
        try:  # polled: a blocking wait holds the process's other store operations
            values = read_when_written(store, keys, timeout_s)
        except KeysNotWritten as exc:
            raise TransportError(
                f"group rank(s) {others} did not say where they connect from within "
                f"{timeout_s:.0f}s ({exc})"
            ) from None
        return {m: value.decode() for m, value in zip(others, values, strict=True)}

    def routed_from(address: str) -> str:
        try:
            return routed_address(address)
        except TransportError:
            return ""  # no route: the pair's connect fails, naming the address

    listeners = gather("listener", listener_address or "")
    mine = sorted({routed_from(a) for a in listeners.values() if a} | {listener_address or ""})
    sources = gather("from", json.dumps([a for a in mine if a]))
    allowed = {a for a in listeners.values() if a}
    for text in sources.values():
        allowed.update(json.loads(text))
    return allowed


def guard_keys(rank: int) -> list[str]:
    """The store keys `exchange_sources` writes for group rank `rank`."""
    return [f"guard/{kind}/{rank}" for kind in ("listener", "from")]

"""Where this process's AFD channels (gloo pairs) bind and what address they announce.

A gloo pair listens on its device's address and announces it through the rendezvous store;
the peer connects there. PyTorch's default device takes the address the host name resolves
to (or GLOO_SOCKET_IFNAME): across hosts that is often loopback or an address of another
network, and the peer then connects to itself or nowhere. AFD chooses instead, in order:

1. `AFD_CHANNEL_INTERFACE`: a network interface (its address);
2. `AFD_CHANNEL_ADDRESS`: a local address;
3. the local address the kernel routes to the rendezvous (`afd.host`) from: loopback when
   the deployment runs on one host (nothing of AFD listens elsewhere), the interface that
   faces FFN rank 0's host otherwise.

Each group gets a device of its own, as with PyTorch's default: pairs of two lazily
connected groups on one shared device never connect (measured with torch 2.13).
"""

from __future__ import annotations

import os
import socket

from afd_core import envs
from afd_core.connectors.transports.transport import TransportError


def channel_choice(rendezvous_host: str) -> tuple[str, str]:
    """("interface", name) or ("address", address) of this process's AFD channels."""
    if interface := os.environ.get(envs.AFD_CHANNEL_INTERFACE, "").strip():
        return "interface", interface
    if address := os.environ.get(envs.AFD_CHANNEL_ADDRESS, "").strip():
        return "address", address
    return "address", routed_address(rendezvous_host)


def routed_address(host: str) -> str:
    """The local address this host reaches `host` from (no packet is sent)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # UDP: only picks the route
            return probe.getsockname()[0]
    except OSError as exc:
        raise TransportError(
            f"no route from this host to the rendezvous afd.host={host!r} ({exc.strerror or exc}):"
            f" check afd.host, or set {envs.AFD_CHANNEL_ADDRESS} / {envs.AFD_CHANNEL_INTERFACE}"
        ) from None


def describe(choice: tuple[str, str]) -> str:
    kind, value = choice
    return f"interface {value}" if kind == "interface" else value


def channel_device(choice: tuple[str, str]):
    """A gloo device for one AFD group on `choice` (channel_choice; its pairs connect on
    first use)."""
    import torch.distributed as dist

    kind, value = choice
    try:
        return dist.ProcessGroupGloo.create_device(
            **{"interface" if kind == "interface" else "hostname": value}, lazy_init=True
        )
    except Exception as exc:  # noqa: BLE001 - gloo's own text, without its stack
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise TransportError(
            f"AFD's channels cannot bind to {describe(choice)} ({first}): set "
            f"{envs.AFD_CHANNEL_ADDRESS} to an address of this host, or "
            f"{envs.AFD_CHANNEL_INTERFACE} to its interface"
        ) from None

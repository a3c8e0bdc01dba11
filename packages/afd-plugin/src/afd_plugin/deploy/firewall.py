"""The firewall rules that keep strangers off a deployment's internal ports on bare hosts
(`afd launch --print`).

vLLM's multi-node sockets (its data-parallel coordination, torch's TCPStore) trust whoever
reaches them, and AFD's gloo/NCCL channels listen on ports the kernel picks from its
ephemeral range. So on every host: accept everything from the deployment's other hosts,
accept clients only on the attention servers' API ports, and drop the rest of what the
deployment listens on: the rendezvous port, the FFN servers' API ports (health and
metrics: open them to your monitoring), the data-parallel RPC ports and the ephemeral
range. Other services of the host (SSH) are left alone. iptables syntax, one block per
host; IPv6 addresses get ip6tables.

Prefill/decode: the router's port takes clients (it is the public API); the prefill
servers' API ports are internal (the router reaches them from its host, a deployment
host). KV transfers: vLLM's ExampleConnector moves KV through a shared folder and opens
no port. NixlConnector listens on its side channel (VLLM_NIXL_SIDE_CHANNEL_PORT + the DP
rank, 5600 by default), dropped here for strangers, and moves the blocks over UCX, whose
TCP transport takes ports the rules leave open between deployment hosts only if they are
in the ephemeral range (the deployment hosts' accept rule covers any port); RDMA
transports do not pass iptables at all.
"""

from __future__ import annotations

import ipaddress

from afd_plugin.deploy.spec import nixl_side_channel_ports

EPHEMERAL = "$(tr '\\t' ':' < /proc/sys/net/ipv4/ip_local_port_range)"


def _tool(address: str) -> str:
    try:
        return "ip6tables" if ipaddress.ip_address(address).version == 6 else "iptables"
    except ValueError:  # a host name: resolved by iptables when the rule is added
        return "iptables"


def host_rules(d, host: str) -> list[str]:
    """`d`: a checked Deployment. The rules for `host`, in order."""
    me = d.spec.hosts[host].address
    tool = _tool(me)
    out = [
        f"{tool} -A INPUT -i lo -j ACCEPT",
        # replies to this host's own connections arrive on ephemeral ports too
        f"{tool} -A INPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
    ]
    peers = sorted({h.address for name, h in d.spec.hosts.items() if name != host} - {me})
    out += [f"{tool} -A INPUT -p tcp -s {a} -j ACCEPT  # deployment host" for a in peers]
    internal: dict[int, str] = {}
    router = d.spec.router
    if router is not None and router.host == host:
        out.append(
            f"{tool} -A INPUT -p tcp --dport {router.port} -j ACCEPT  "
            f"# {router.name}'s API (the P/D router): clients"
        )
    for plan in d.servers:
        head = plan.placements[0].host
        if head == host:
            if plan.spec.role == "attention":
                out.append(
                    f"{tool} -A INPUT -p tcp --dport {plan.spec.port} -j ACCEPT  "
                    f"# {plan.spec.name}'s API: clients"
                )
            elif plan.spec.role == "prefill":
                internal[plan.spec.port] = f"{plan.spec.name}'s API (prefill: the router's)"
            else:
                internal[plan.spec.port] = f"{plan.spec.name}'s API (health, metrics)"
            if len(plan.placements) > 1:
                internal[plan.spec.data_parallel_rpc_port] = f"{plan.spec.name}'s DP RPC"
        first = 0
        for p in plan.placements:
            if p.host == host:
                for port in nixl_side_channel_ports(d.spec, plan.spec, p, first):
                    internal[port] = f"{plan.spec.name}'s NIXL side channel"
            first += p.ranks
    if host == d.rendezvous_host:
        internal[d.spec.rendezvous_port] = "the rendezvous"
    out += [
        f"{tool} -A INPUT -p tcp --dport {port} -j DROP  # {what}"
        for port, what in sorted(internal.items())
    ]
    out.append(
        f"{tool} -A INPUT -p tcp --dport {EPHEMERAL} -j DROP  # AFD's and vLLM's channels "
        "(ephemeral ports)"
    )
    return out


def format_rules(d) -> str:
    lines = [
        "# firewall (bare hosts): only the deployment's hosts reach its internal ports; "
        "clients reach the attention API ports and the P/D router's (docs/deploy.md, Network "
        "checklist)"
    ]
    for host, spec in d.spec.hosts.items():
        lines.append(f"\n# on host {host} ({spec.address})")
        lines += host_rules(d, host)
    return "\n".join(lines)

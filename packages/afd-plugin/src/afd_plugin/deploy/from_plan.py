"""`afd plan --write-spec FILE --host NAME=ADDRESS:DEVICES ...`: the plan's best shape as a
deployment spec (afd_plugin.deploy.spec) for `afd launch`.

A:F with m micro-batches becomes an attention server whose A data-parallel ranks are the
attention ranks, and the FFN servers the planner priced (afd_core.capabilities.ffn_layout,
the table the servers' start-up check reads): one FFN server whose F data-parallel ranks
are one expert group (with vLLM's --enable-expert-parallel where the platform runs it), F
FFN servers of one rank each where the platform has no expert groups (Ascend), or FFN
servers of several tensor-parallel devices each (F > A, CPU only). The first candidate of
the plan that can run this way is written, the ones skipped named. Hosts are filled in the
order given, FFN devices first (FFN rank 0's host holds the rendezvous), one device per
rank or TP worker; a tensor-parallel server stays on one host; each host's device count
is written, so servers sharing a host get disjoint devices. The file is checked as the
servers will check it (check_spec) before it is written. `model` is the plan's model as
given (a preset's name is a placeholder for the checkpoint's path).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from afd_core.capabilities import CapabilityError, FFNLayout, ffn_server_problem
from afd_core.capabilities import ffn_layout as platform_ffn_layout
from afd_plugin.deploy.spec import SpecError, check_spec

API_PORTS = {"ffn": 8100, "attention": 8000}
RPC_PORTS = {"ffn": 13346, "attention": 13345}  # both heads may share a host


@dataclass(frozen=True)
class PlanHost:
    name: str
    address: str
    devices: int


def parse_host(text: str) -> PlanHost:
    """NAME=ADDRESS:DEVICES, e.g. gpu0=10.0.0.1:8."""
    name, eq, rest = text.partition("=")
    address, colon, devices = rest.rpartition(":")
    if not (eq and colon and name and address and devices.isdigit() and int(devices) > 0):
        raise SpecError(
            f"--host {text!r} is invalid; allowed: NAME=ADDRESS:DEVICES with DEVICES >= 1 "
            "(e.g. gpu0=10.0.0.1:8)"
        )
    return PlanHost(name, address, int(devices))


def ffn_layout(candidate, platform: str) -> FFNLayout:
    """The FFN servers the planner priced for this candidate, or SpecError why `platform`
    cannot run them (a plan made for another platform)."""
    a, f = candidate.attention_devices, candidate.ffn_devices
    layout = getattr(candidate, "layout", None)
    try:
        layout = layout or platform_ffn_layout(a, f, platform)
    except CapabilityError as exc:
        raise SpecError(str(exc)) from None
    problem = ffn_server_problem(
        platform, layout.tensor_parallel, layout.ranks_per_server, layout.expert_parallel
    )
    if problem:  # planned for another platform than the spec's
        raise SpecError(f"{a}A{f}F: {problem}")
    return layout


class _Hosts:
    """Devices left per host, taken in the order the hosts were given."""

    def __init__(self, hosts: list[PlanHost]):
        self.hosts = hosts
        self.free = {h.name: h.devices for h in hosts}

    def spread(self, ranks: int) -> list[tuple[str, int]]:
        out = []
        for h in self.hosts:
            take = min(ranks, self.free[h.name])
            if take:
                out.append((h.name, take))
                self.free[h.name] -= take
                ranks -= take
        if ranks:
            raise self._short()
        return out

    def whole(self, devices: int) -> str:
        """A host with `devices` free devices (a tensor-parallel server stays on one)."""
        for h in self.hosts:
            if self.free[h.name] >= devices:
                self.free[h.name] -= devices
                return h.name
        raise self._short(f" ({devices} on one host)")

    def _short(self, what: str = "") -> SpecError:
        return SpecError(
            f"the --host options have too few devices for this shape{what}; allowed: hosts "
            "with enough devices"
        )


def spec_toml(
    candidate, model: str, hosts: list[PlanHost], platform: str, rendezvous_port: int = 29650
) -> str:
    a, f = candidate.attention_devices, candidate.ffn_devices
    layout = ffn_layout(candidate, platform)
    free = _Hosts(hosts)
    tp = layout.tensor_parallel
    if layout.servers == 1:
        dp = layout.ranks_per_server
        ffn = [("ffn0", dp, tp, free.spread(dp) if tp == 1 else [(free.whole(tp), 1)])]
    else:
        ffn = [
            (f"ffn{i}", 1, tp, [(free.whole(tp), 1)] if tp > 1 else free.spread(1))
            for i in range(layout.servers)
        ]
    servers = [("ffn", *s) for s in ffn] + [("attention", "attention0", a, 1, free.spread(a))]
    lines = [
        f"# written by `afd plan`: {a}A{f}F, m = {candidate.microbatches}, "
        f"{candidate.batch_per_attention_device} requests per attention device, "
        f"TPOT {candidate.tpot_ms:.1f} ms (estimated)",
        f"model = {json.dumps(model)}",
        f"platform = {json.dumps(platform)}",
        f"rendezvous_port = {rendezvous_port}",
        "",
        "[afd]",
        "# micro-batches per step: the attention servers' (an FFN server serves what they send)",
        f"num_microbatches = {candidate.microbatches}",
    ]
    for h in hosts:
        lines += [
            "",
            f"[hosts.{json.dumps(h.name)}]",
            f"address = {json.dumps(h.address)}",
            f"devices = {h.devices}",
        ]
    for i, (role, name, dp, tp_size, placed) in enumerate(servers):
        where = ", ".join(
            f"{{ host = {json.dumps(host)}, ranks = {ranks} }}" for host, ranks in placed
        )
        lines += [
            "",
            "[[servers]]",
            f'name = "{name}"',
            f'role = "{role}"',
            f"port = {API_PORTS[role] + (i if role == 'ffn' else 0)}",
            f"tensor_parallel_size = {tp_size}",
            f"data_parallel_size = {dp}",
            f"data_parallel_rpc_port = {RPC_PORTS[role] + (i if role == 'ffn' else 0)}",
            f"hosts = [{where}]",
        ]
        if role == "ffn" and layout.expert_parallel:
            # the plan priced each expert on one device of the group (vLLM's EP)
            lines.append('args = ["--enable-expert-parallel"]')
    return "\n".join(lines) + "\n"


def write_spec(candidates, model: str, host_args: list[str], platform: str, path: Path) -> str:
    """Write the spec of the first candidate that can run (checked first); returns what
    was written and which candidates were skipped, for the user."""
    import tomllib

    hosts = [parse_host(h) for h in host_args]
    if not hosts:
        raise SpecError("--write-spec needs at least one --host NAME=ADDRESS:DEVICES")
    skipped = []
    for c in candidates:
        try:
            text = spec_toml(c, model, hosts, platform)
        except SpecError as exc:
            skipped.append(str(exc))
            continue
        check_spec(tomllib.loads(text))
        path.write_text(text)
        shape = f"{c.attention_devices}A{c.ffn_devices}F m={c.microbatches}"
        return f"{shape}" + (f" (skipped: {'; '.join(skipped)})" if skipped else "")
    raise SpecError("no shape of the plan can be written: " + "; ".join(skipped))

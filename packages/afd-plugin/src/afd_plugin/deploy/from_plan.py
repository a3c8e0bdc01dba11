"""`afd plan --write-spec FILE --host NAME=ADDRESS:DEVICES ...`: the plan's best shape as a
deployment spec (afd_plugin.deploy.spec) for `afd launch`.

A:F with m micro-batches becomes an attention server whose A data-parallel ranks are the
attention ranks, and FFN ranks the point-to-point protocol can serve it with (f FFN ranks,
f dividing A): with F <= A, one FFN server whose F data-parallel ranks are the FFN ranks
(one expert group); with F > A, f FFN servers of F / f tensor-parallel devices each (CPU
only: FFN tensor parallelism is rejected on CUDA and Ascend, docs/cuda.md). The first
candidate of the plan that can run this way is written, the ones skipped named. Hosts are
filled in the order given, FFN devices first (FFN rank 0's host holds the rendezvous), one
device per rank or TP worker; a tensor-parallel server stays on one host. The file is
checked as `afd launch` checks it before it is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from afd_core import topology
from afd_core.topology import TopologyError
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


def ffn_layout(a: int, f: int, platform: str) -> tuple[int, int]:
    """(FFN ranks, tensor-parallel devices per FFN rank) for A:F, or SpecError why not
    (afd_core.topology.ffn_layout: the rule the planner applies too)."""
    try:
        return topology.ffn_layout(a, f, platform)
    except TopologyError as exc:
        raise SpecError(str(exc)) from None


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
    ffn_ranks, tp = ffn_layout(a, f, platform)
    free = _Hosts(hosts)
    if tp == 1:
        ffn = [("ffn0", ffn_ranks, 1, free.spread(ffn_ranks))]
    else:
        ffn = [(f"ffn{i}", 1, tp, [(free.whole(tp), 1)]) for i in range(ffn_ranks)]
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
        f"num_microbatches = {candidate.microbatches}",
    ]
    for h in hosts:
        lines += ["", f"[hosts.{json.dumps(h.name)}]", f"address = {json.dumps(h.address)}"]
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

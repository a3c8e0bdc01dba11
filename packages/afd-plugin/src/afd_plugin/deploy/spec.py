"""A deployment spec: one TOML file describing an AFD deployment across hosts.

It names the model, the hosts (an address each), and the servers: each server's role, TP
and DP size, its API port, and the hosts it runs on (one, or several for a data-parallel
group across hosts: the first host is the head, with the API server; the others run
headless, as with vLLM's --data-parallel-start-rank). AFD's rank numbers, each server's
`start_rank` and the deployment's shape follow from the order of the servers; the
rendezvous is FFN rank 0's host. Every bad field is named with its value and what is
allowed (as the `afd` config is), before anything starts. `commands()` turns a spec into
each host's `vllm serve` commands (afd_plugin.deploy.launch starts them).

    model = "/models/Qwen3-30B-A3B"
    platform = "cpu"                    # cpu | cuda | npu
    rendezvous_port = 29650
    secret_file = "/etc/afd/secret"     # optional: AFD_DEPLOYMENT_SECRET_FILE on every host

    [hosts.a]
    address = "10.0.0.1"
    interface = "eth1"                  # optional: the interface of that address
    devices = 8                         # optional: its GPUs/NPUs, placed per server
    env = { NCCL_IB_HCA = "mlx5" }      # optional: this host's environment

    [[servers]]
    name = "ffn0"
    role = "ffn"
    port = 8100
    hosts = ["a"]                       # one per data-parallel rank group, see below
    ...

Prefill/decode (docs/pd.md): servers of role "prefill" are ordinary vLLM servers (no `afd`
config), the KV producers, each with its own `--kv-transfer-config` in `args`; the
attention servers are then the KV consumers. An optional `[router]` (a host and a port)
runs `afd pd-router` in front of them.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
)

from afd_core.config import (  # the afd config's roles and string rule
    ROLES,
    AFDConfigError,
    Str,
    parse_afd_config,
)
from afd_plugin.deploy import devices, server_check


class SpecError(ValueError):
    """A deployment spec that cannot run; the message names the field and the value."""


def _require_int(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("expected an integer")
    return v


# TOML integers only (the afd config's Int also takes digit strings, for JSON on a command
# line; a spec has typed values)
Int = Annotated[int, BeforeValidator(_require_int)]


_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


def _address(v: str) -> str:
    try:
        ipaddress.ip_address(v)
    except ValueError:
        if not _HOST_NAME.match(v):
            raise ValueError("expected an IP address or a host name (no port, no scheme)") from None
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HostSpec(_Strict):
    address: Annotated[Str, AfterValidator(_address)]
    # the network interface holding `address`: vLLM's and AFD's groups bind to it
    interface: Str | None = None
    # the host's accelerators: each server there gets its own of them (devices.py)
    devices: Int | None = Field(default=None, ge=1)
    env: dict[Str, Str] = Field(default_factory=dict)  # every process on this host


class Placement(_Strict):
    """`ranks` data-parallel ranks of a server on `host`."""

    host: Str = Field(min_length=1)
    ranks: Int = Field(default=1, ge=1)
    # the host's device numbers these ranks use (default: the next free ones)
    devices: list[Annotated[int, BeforeValidator(_require_int), Field(ge=0)]] | None = None


SPEC_ROLES = ("attention", "ffn", "prefill")  # AFD's roles, and ordinary prefill servers
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class ServerSpec(_Strict):
    name: Str = Field(min_length=1, pattern=_NAME)
    role: Literal["attention", "ffn", "prefill"]
    port: Int = Field(ge=1, le=65535)
    tensor_parallel_size: Int = Field(default=1, ge=1)
    # where the server's data-parallel ranks run: a host name (every rank there), or a
    # list of {host, ranks} (the first is the head, the rest headless)
    hosts: Str | list[Placement]
    data_parallel_size: Int = Field(default=1, ge=1)
    data_parallel_rpc_port: Int = Field(default=13345, ge=1, le=65535)
    args: list[Str] = Field(default_factory=list)
    env: dict[Str, Str] = Field(default_factory=dict)

    def placements(self) -> list[Placement]:
        if isinstance(self.hosts, str):
            return [Placement(host=self.hosts, ranks=self.data_parallel_size)]
        return list(self.hosts)


class RoleDefaults(_Strict):
    args: list[Str] = Field(default_factory=list)
    env: dict[Str, Str] = Field(default_factory=dict)
    # Ray resources of one process of the role (afd ray): CPU defaults to 1, GPU (cuda) /
    # NPU (npu) to the process's TP x local DP ranks
    ray_resources: dict[Str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    # afd k8s: a patch of every pod template of the role (tolerations, affinity, node
    # selectors, RDMA devices, capabilities, image pull secrets...), merged as a Kubernetes
    # strategic-merge patch before `afd k8s --pod-patch` files
    pod_patch: dict[Literal["metadata", "spec"], Any] = Field(default_factory=dict)


class RouterSpec(_Strict):
    """`afd pd-router` in front of the prefill servers and the attention servers."""

    name: Str = Field(default="router", min_length=1, pattern=_NAME)
    host: Str = Field(min_length=1)  # a host of [hosts]; it listens on that address
    port: Int = Field(ge=1, le=65535)
    args: list[Str] = Field(default_factory=list)  # more `afd pd-router` flags (timeouts)
    env: dict[Str, Str] = Field(default_factory=dict)


class DeploymentSpec(_Strict):
    model: Str = Field(min_length=1)
    platform: Literal["cpu", "cuda", "npu"] = "cpu"
    rendezvous_port: Int = Field(default=29650, ge=1, le=65535)
    secret_file: Str | None = None
    served_model_name: Str | None = None
    # the `afd` config keys every server shares (connector_extra_config, num_microbatches…)
    afd: dict[Str, Any] = Field(default_factory=dict)
    hosts: dict[Str, HostSpec]
    servers: list[ServerSpec]
    roles: dict[Literal["attention", "ffn", "prefill"], RoleDefaults] = Field(default_factory=dict)
    router: RouterSpec | None = None


FIELD_HELP = {
    "model": "a model path or name, the same on every host",
    "platform": "'cpu', 'cuda' or 'npu'",
    "rendezvous_port": "1..65535 (FFN rank 0's host listens there)",
    "secret_file": "a path to the deployment secret, the same on every host",
    "hosts": "a table of host names, each with an address",
    "address": "an IP address or a host name",
    "servers": "a list of at least one attention and one FFN server",
}

# afd config keys the spec sets itself
DERIVED_AFD_KEYS = ("role", "host", "port", "num_attention_ranks", "num_ffn_ranks", "start_rank")
# [afd] keys that only attention servers take (an FFN server serves whatever micro-batches
# its peers announce, and its start-up check refuses them)
ATTENTION_AFD_KEYS = ("num_microbatches",)


def _format(err: dict, raw: dict) -> SpecError:
    where = ".".join(str(p) for p in err["loc"])
    value: Any = raw
    for part in err["loc"]:
        try:
            value = value[part]
        except (KeyError, IndexError, TypeError):
            value = err.get("input")
            break
    if err["type"] == "extra_forbidden":
        known = list(_model_at(tuple(err["loc"][:-1])).model_fields)
        close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return SpecError(
            f"deployment spec: unknown key {where!r}.{hint} Allowed: {', '.join(known)}"
        )
    if err["type"] == "missing":
        top = str(err["loc"][0])
        help_ = FIELD_HELP.get(top, "")
        return SpecError(
            f"deployment spec: {where} is missing" + (f"; allowed: {help_}" if help_ else "")
        )
    msg = err["msg"].removeprefix("Value error, ")
    help_ = FIELD_HELP.get(where, FIELD_HELP.get(str(err["loc"][-1]), ""))
    return SpecError(
        f"deployment spec: {where}={value!r} is invalid: {msg}"
        + (f"; allowed: {help_}" if help_ else "")
    )


def _model_at(loc: tuple) -> type[BaseModel]:
    """The schema class at a location (for the list of allowed keys)."""
    if not loc:
        return DeploymentSpec
    if loc[0] == "hosts":
        return HostSpec
    if loc[0] == "servers":
        return Placement if "hosts" in loc[1:] else ServerSpec
    if loc[0] == "roles":
        return RoleDefaults
    if loc[0] == "router":
        return RouterSpec
    return DeploymentSpec


@dataclass(frozen=True)
class ServerPlan:
    """One server of a checked spec, with what follows from the order of the servers."""

    spec: ServerSpec
    start_rank: int  # its role's rank of its first worker (attention) / DP rank (FFN)
    placements: list[Placement]
    # per placement: the host's device numbers it runs on (None: all the host has)
    devices: tuple[tuple[int, ...] | None, ...] = ()

    @property
    def ranks(self) -> int:
        """AFD ranks it holds: attention DP x TP workers, or FFN DP ranks (none for a
        prefill server)."""
        dp = self.spec.data_parallel_size
        if self.spec.role == "prefill":
            return 0
        return dp * self.spec.tensor_parallel_size if self.spec.role == "attention" else dp


@dataclass(frozen=True)
class Deployment:
    spec: DeploymentSpec
    servers: list[ServerPlan]
    num_attention_ranks: int
    num_ffn_ranks: int
    rendezvous_host: str  # the host name of FFN rank 0
    notes: list[str] = field(default_factory=list)
    # why devices could not be placed on bare hosts (afd launch refuses it), or None
    unplaced_devices: str | None = None

    def require_placed_devices(self) -> None:
        if self.unplaced_devices:
            raise SpecError(f"deployment spec: {self.unplaced_devices}")

    @property
    def rendezvous_address(self) -> str:
        return self.spec.hosts[self.rendezvous_host].address

    def afd_servers(self) -> list[ServerPlan]:
        """The attention and FFN servers (not the prefill servers)."""
        return [p for p in self.servers if p.spec.role != "prefill"]

    def url(self, plan: ServerPlan) -> str:
        """A server's API, as the router reaches it (its head's address)."""
        address = self.spec.hosts[plan.placements[0].host].address
        host = f"[{address}]" if ":" in address else address
        return f"http://{host}:{plan.spec.port}"


def load_spec(path: str | Path) -> Deployment:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SpecError(f"deployment spec {path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"deployment spec {path}: not valid TOML ({exc})") from None
    return check_spec(raw)


def check_spec(raw: dict) -> Deployment:
    try:
        spec = DeploymentSpec.model_validate(raw)
    except ValidationError as exc:
        raise _format(exc.errors()[0], raw) from None
    names = [s.name for s in spec.servers]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise SpecError(f"deployment spec: servers[{i}].name={name!r} is used twice")
    for role in ROLES:
        if not any(s.role == role for s in spec.servers):
            raise SpecError(
                f"deployment spec: servers has no {role} server; allowed: {FIELD_HELP['servers']}"
            )
    if spec.router is not None:
        if not any(s.role == "prefill" for s in spec.servers):
            raise SpecError(
                "deployment spec: [router] needs prefill servers, and servers has none; "
                'allowed: a [router] with servers of role = "prefill", or no [router]'
            )
        if spec.router.name in names:
            raise SpecError(
                f"deployment spec: router.name={spec.router.name!r} is also a server's name; "
                "allowed: a name no server has"
            )
        if spec.router.host not in spec.hosts:
            raise SpecError(
                f"deployment spec: router.host={spec.router.host!r} is not in [hosts]; "
                f"allowed: {', '.join(sorted(spec.hosts))}"
            )
        if problem := _router_args_problem(spec.router.args):
            raise SpecError(f"deployment spec: router.args: {problem}")
    for key in spec.afd:
        if key in DERIVED_AFD_KEYS:
            raise SpecError(
                f"deployment spec: afd.{key} is set by the spec itself (from the servers "
                f"and hosts); allowed in [afd]: the other afd config keys"
            )
    for where, args, role in [
        *((f"roles.{r}.args", d.args, r) for r, d in spec.roles.items()),
        *((f"servers[{i}].args", s.args, s.role) for i, s in enumerate(spec.servers)),
    ]:
        if problem := server_check.owned_flag_problem(args, prefill=role == "prefill"):
            raise SpecError(f"deployment spec: {where}: {problem}")
    used: dict[tuple[str, int], str] = {}
    plans, next_rank = [], {"attention": 0, "ffn": 0, "prefill": 0}
    for i, s in enumerate(spec.servers):
        where = f"servers[{i}] ({s.name})"
        placements = s.placements()
        if sum(p.ranks for p in placements) != s.data_parallel_size:
            raise SpecError(
                f"deployment spec: {where}.hosts place {sum(p.ranks for p in placements)} "
                f"data-parallel rank(s) but data_parallel_size={s.data_parallel_size}; "
                "allowed: ranks that add up to data_parallel_size"
            )
        if s.role == "ffn" and s.data_parallel_size > 1 and s.tensor_parallel_size > 1:
            raise SpecError(
                f"deployment spec: {where} has data_parallel_size={s.data_parallel_size} and "
                f"tensor_parallel_size={s.tensor_parallel_size}; allowed on an FFN server: "
                "one of them above 1"
            )
        for p in placements:
            if p.host not in spec.hosts:
                raise SpecError(
                    f"deployment spec: {where}.hosts names host {p.host!r}, which is not in "
                    f"[hosts]; allowed: {', '.join(sorted(spec.hosts))}"
                )
        if len({p.host for p in placements}) != len(placements):
            raise SpecError(f"deployment spec: {where}.hosts names a host twice")
        head = placements[0].host
        ports = [("API port", s.port, head)]
        if len(placements) > 1:
            ports.append(("data_parallel_rpc_port", s.data_parallel_rpc_port, head))
        for what, port, host in ports:
            address = spec.hosts[host].address  # two host names may share one address
            if (address, port) in used:
                raise SpecError(
                    f"deployment spec: {where} {what} {port} on host {host!r} ({address}) is "
                    f"taken by {used[(address, port)]}; allowed: a port no other server uses "
                    "on that address"
                )
            used[(address, port)] = f"{s.name} ({what})"
        plan = ServerPlan(s, next_rank[s.role], placements)
        next_rank[s.role] += plan.ranks
        plans.append(plan)
        for k, p in enumerate(placements):  # NIXL's side channels (5600 + DP index)
            address = spec.hosts[p.host].address
            first = sum(q.ranks for q in placements[:k])
            for port in nixl_side_channel_ports(spec, s, p, first):
                if (address, port) in used:
                    raise SpecError(
                        f"deployment spec: {where} NIXL side channel port {port} on host "
                        f"{p.host!r} ({address}) is taken by {used[(address, port)]}; allowed: "
                        "another VLLM_NIXL_SIDE_CHANNEL_PORT in one server's env (each "
                        "NIXL server listens on it + its data-parallel rank)"
                    )
                used[(address, port)] = f"{s.name} (NIXL side channel)"
    if spec.router is not None:
        address = spec.hosts[spec.router.host].address
        if (address, spec.router.port) in used:
            raise SpecError(
                f"deployment spec: router.port={spec.router.port} on host "
                f"{spec.router.host!r} ({address}) is taken by {used[(address, spec.router.port)]}"
                "; allowed: a port no server uses on that address"
            )
        used[(address, spec.router.port)] = f"{spec.router.name} (router)"
    ffn0 = next(p for p in plans if p.spec.role == "ffn")
    rendezvous_host = ffn0.placements[0].host
    rendezvous = (spec.hosts[rendezvous_host].address, spec.rendezvous_port)
    if rendezvous in used:
        raise SpecError(
            f"deployment spec: rendezvous_port={spec.rendezvous_port} on host "
            f"{rendezvous_host!r} (FFN rank 0's) is taken by {used[rendezvous]}"
        )
    a, f = next_rank["attention"], next_rank["ffn"]
    if a < f:
        raise SpecError(
            f"deployment spec: the servers hold {a} attention rank(s) and {f} FFN rank(s); "
            "allowed: at least as many attention ranks as FFN ranks (every FFN rank serves "
            "a block of one or more attention ranks)"
        )
    try:
        plans, unplaced = devices.place(spec, plans)
    except devices.PlacementError as exc:
        raise SpecError(f"deployment spec: {exc}") from None
    d = Deployment(spec, plans, a, f, rendezvous_host, unplaced_devices=unplaced)
    _check_servers(d)
    return d


# how long a server may load its own weights, before it waits for its peers (afd launch's
# --timeout and afd k8s's --startup-timeout default to it)
OWN_LOAD_S = 1800.0


def connector_seconds(d: Deployment, key: str) -> float:
    """A bound of the deployment's connector (`connect_timeout_s`, `startup_timeout_s`,
    `timeout_s`) as its servers read it: the [afd] table's, else the connector's default."""
    afd = parse_afd_config(afd_config(d, d.afd_servers()[0]), device_type=d.spec.platform)
    return float(getattr(afd.extra(), key))


def startup_budget_s(d: Deployment, own_load_s: float = OWN_LOAD_S) -> float:
    """How long a server's head may take to answer /health: its own loading, then its
    peers' (their servers may still load: the connector's startup_timeout_s bounds that
    wait), then connecting (connect_timeout_s)."""
    return (
        own_load_s
        + connector_seconds(d, "startup_timeout_s")
        + connector_seconds(d, "connect_timeout_s")
    )


def _check_servers(d: Deployment) -> None:
    """Every server's `afd` config and start-up rules, as the server will check them."""
    platform = d.spec.platform
    has_group = any(p.spec.role == "ffn" and p.spec.data_parallel_size > 1 for p in d.servers)
    if problem := server_check.deployment_problem(d.spec.afd, has_group):
        raise SpecError(f"deployment spec: [afd]: {problem}")
    pd = any(p.spec.role == "prefill" for p in d.servers)
    for i, plan in enumerate(d.servers):
        s = plan.spec
        where = f"servers[{i}] ({s.name}, {s.role})"
        args = [*d.spec.roles.get(s.role, RoleDefaults()).args, *s.args]
        try:
            kv = server_check.kv_transfer(args)
        except ValueError as exc:
            raise SpecError(f"deployment spec: {where}.args: {exc}") from None
        if s.role == "prefill" or (pd and s.role == "attention"):
            _check_kv_role(where, s.role, kv)
        if s.role == "prefill":
            continue  # an ordinary vLLM server: no afd config, vLLM's own checks
        try:
            afd = parse_afd_config(afd_config(d, plan), device_type=platform)
        except AFDConfigError as exc:
            raise SpecError(f"deployment spec: [afd] for {where}: {exc}") from None
        try:
            flags = server_check.serve_flags(platform, _graph_flags(platform, args), args)
        except ValueError as exc:
            raise SpecError(f"deployment spec: {where}.args: {exc}") from None
        problem = server_check.startup_problem(
            afd, platform, flags, s.tensor_parallel_size, s.data_parallel_size
        )
        if problem:
            raise SpecError(f"deployment spec: {where} would stop at start-up: {problem}")


# the KV roles each role of a P/D spec takes (vLLM's kv_role values)
KV_ROLES = {"prefill": ("kv_producer", "kv_both"), "attention": ("kv_consumer", "kv_both")}


def _check_kv_role(where: str, role: str, kv) -> None:
    allowed = " or ".join(KV_ROLES[role])
    why = (
        "a prefill server hands the prompt's KV to the decode stage"
        if role == "prefill"
        else "with prefill servers in the spec, the attention servers load the prompt's KV"
    )
    if kv is None:
        raise SpecError(
            f"deployment spec: {where}.args has no --kv-transfer-config; {why}: allowed: "
            f"--kv-transfer-config with kv_role {allowed} in servers[].args or "
            f"roles.{role}.args (docs/pd.md)"
        )
    if kv.role not in KV_ROLES[role]:
        raise SpecError(
            f"deployment spec: {where}.args: --kv-transfer-config has kv_role={kv.role!r}; "
            f"{why}: allowed: kv_role {allowed}"
        )


NIXL_CONNECTORS = ("NixlConnector",)
NIXL_SIDE_CHANNEL_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default (envs.py)


def server_env(spec: DeploymentSpec, s: ServerSpec, host: str) -> dict[str, str]:
    """The env the spec gives a server's process on `host` (host, role, server)."""
    role = spec.roles.get(s.role, RoleDefaults())
    return {**spec.hosts[host].env, **role.env, **s.env}


def nixl(spec: DeploymentSpec, s: ServerSpec) -> bool:
    """Whether the server runs vLLM's NixlConnector (its args' --kv-transfer-config)."""
    try:
        kv = server_check.kv_transfer([*spec.roles.get(s.role, RoleDefaults()).args, *s.args])
    except ValueError:
        return False
    return kv is not None and kv.connector in NIXL_CONNECTORS


def nixl_side_channel_ports(spec: DeploymentSpec, s: ServerSpec, p: Placement, first: int):
    """The ports a NixlConnector server's ranks on placement `p` listen on for NIXL's
    handshake: VLLM_NIXL_SIDE_CHANNEL_PORT (its env, else vLLM's 5600) + each rank's
    data-parallel index (vLLM 0.32: nixl/base_scheduler.py); none without NIXL."""
    if not nixl(spec, s):
        return []
    base = server_env(spec, s, p.host).get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    base_port = int(base) if base and base.isdigit() else NIXL_SIDE_CHANNEL_PORT
    return [base_port + first + r for r in range(p.ranks)]


def _router_args_problem(args: list[str]) -> str | None:
    """Router flags the spec writes itself, or flags `afd pd-router` does not take."""
    owned = {"--prefill": "the prefill servers", "--decode": "the attention servers",
             "--host": "router.host", "--port": "router.port"}  # fmt: skip
    allowed = ("--prefill-timeout", "--connect-timeout", "--decode-read-timeout",
               "--health-timeout")  # fmt: skip
    for arg in args:
        if not arg.startswith("-"):
            continue
        flag = arg.split("=", 1)[0]
        if flag in owned:
            return f"{flag} is set by the spec itself (from {owned[flag]})"
        if flag not in allowed:
            return f"{flag} is not an afd pd-router flag; allowed: {', '.join(allowed)}"
    return None


# -- commands ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostCommand:
    """One process to start on a host: a server's head (API) or headless part."""

    host: str
    server: str
    argv: list[str]
    env: dict[str, str]
    api_port: int | None  # where its /health answers (the head), None for a headless part
    role: str  # attention, ffn, prefill, or "router" (afd pd-router)
    devices: int  # accelerators it drives: TP x its data-parallel ranks

    @property
    def name(self) -> str:
        """The process's name (its log's): the server's, `-headless` for a headless part."""
        return self.server if self.api_port else f"{self.server}-headless"


def afd_config(d: Deployment, plan: ServerPlan) -> dict:
    shared = d.spec.afd
    if plan.spec.role == "ffn":
        shared = {k: v for k, v in shared.items() if k not in ATTENTION_AFD_KEYS}
    return {
        **shared,
        "role": plan.spec.role,
        "host": d.rendezvous_address,
        "port": d.spec.rendezvous_port,
        "num_attention_ranks": d.num_attention_ranks,
        "num_ffn_ranks": d.num_ffn_ranks,
        "start_rank": plan.start_rank,
    }


# what each platform runs AFD steps with, unless the server's args choose (docs/cpu.md,
# docs/cuda.md: vLLM's CUDA default FULL_AND_PIECEWISE is rejected, docs/ascend.md: ACL
# graphs are rejected)
GRAPH_FLAGS = {
    "cpu": ["--enforce-eager"],
    "cuda": ["--compilation-config", '{"cudagraph_mode":"FULL_DECODE_ONLY"}'],
    "npu": ["--enforce-eager"],
}
# the flags by which a server's args choose (vLLM reads `_` in a flag as `-`, and -O<n>)
_GRAPH_CHOICES = ("--enforce-eager", "--compilation-config", "-cc", "--optimization-level")


def _graph_flags(platform: str, args: list[str]) -> list[str]:
    flags = [a.split("=", 1)[0] for a in args if a.startswith("-")]
    chosen = any(f.replace("_", "-") in _GRAPH_CHOICES or f.startswith("-O") for f in flags)
    return [] if chosen else GRAPH_FLAGS[platform]


def _api_server_flags(data_parallel_size: int, args: list[str]) -> list[str]:
    """One API server on the head of a data-parallel server, unless its args choose: `vllm
    serve` starts one per data-parallel rank by default (vLLM 0.32: entrypoints/cli/
    serve.py). Several API server processes now show AFD's ranks on /metrics and /health
    (patch metrics_registry, docs/metrics.md); one stays the default, as before."""
    flags = {a.split("=", 1)[0].replace("_", "-") for a in args if a.startswith("-")}
    chosen = bool(flags & {"--api-server-count", "-asc"})
    return ["--api-server-count", "1"] if data_parallel_size > 1 and not chosen else []


ROLE_ORDER = {"ffn": 0, "attention": 1, "prefill": 2}
PRINTED_ROUTER = ["afd", "pd-router"]


def router_command(d: Deployment, router: list[str]) -> HostCommand | None:
    """The spec's `afd pd-router` (None without [router]): the prefill servers and the
    attention servers as its backends, listening on its host's address."""
    r = d.spec.router
    if r is None:
        return None
    prefill = [d.url(p) for p in d.servers if p.spec.role == "prefill"]
    decode = [d.url(p) for p in d.servers if p.spec.role == "attention"]
    argv = [*router, "--prefill", *prefill, "--decode", *decode]
    argv += ["--host", d.spec.hosts[r.host].address, "--port", str(r.port), *r.args]
    env = {**d.spec.hosts[r.host].env, **r.env}
    return HostCommand(r.host, r.name, argv, env, r.port, "router", 0)


def commands(d: Deployment, serve: list[str], router: list[str] | None = None) -> list[HostCommand]:
    """Every process of the deployment, FFN servers first (FFN rank 0 holds the
    rendezvous), then attention and prefill servers, and the router last. `serve`: how to
    run `vllm serve` here (e.g. ["vllm", "serve"]); `router`: how to run `afd pd-router`
    (default: PRINTED_ROUTER)."""
    out = []
    order = sorted(d.servers, key=lambda p: ROLE_ORDER[p.spec.role])
    for plan in order:
        s = plan.spec
        role = d.spec.roles.get(s.role, RoleDefaults())
        head = d.spec.hosts[plan.placements[0].host]
        base = [*serve, d.spec.model]
        if d.spec.served_model_name:
            base += ["--served-model-name", d.spec.served_model_name]
        if s.tensor_parallel_size > 1:
            base += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
        if s.role != "prefill":  # a prefill server is plain vLLM: its args choose
            base += _graph_flags(d.spec.platform, [*role.args, *s.args])
            afd = json.dumps({"afd": afd_config(d, plan)}, separators=(",", ":"))
            base += ["--additional-config", afd]
        first = 0
        for k, p in enumerate(plan.placements):
            host = d.spec.hosts[p.host]
            argv = list(base)
            if s.data_parallel_size > 1:
                argv += ["--data-parallel-size", str(s.data_parallel_size)]
                if len(plan.placements) > 1:
                    argv += [
                        "--data-parallel-size-local", str(p.ranks),
                        "--data-parallel-address", head.address,
                        "--data-parallel-rpc-port", str(s.data_parallel_rpc_port),
                    ]  # fmt: skip
            if k == 0:
                argv += ["--host", host.address, "--port", str(s.port)]
                if s.role != "prefill":  # AFD's metrics and /health need one API server
                    argv += _api_server_flags(s.data_parallel_size, [*role.args, *s.args])
            else:
                argv += ["--headless", "--data-parallel-start-rank", str(first)]
            first += p.ranks
            argv += [*role.args, *s.args]
            env = {"VLLM_HOST_IP": host.address}
            if host.interface:
                env["GLOO_SOCKET_IFNAME"] = host.interface
                if s.role != "prefill":
                    env["AFD_CHANNEL_INTERFACE"] = host.interface
                if d.spec.platform == "cuda":
                    env["NCCL_SOCKET_IFNAME"] = host.interface
            if d.spec.platform == "npu":
                env["HCCL_IF_IP"] = host.address  # HCCL's host-side socket (CANN)
            if d.spec.secret_file and s.role != "prefill":
                env["AFD_DEPLOYMENT_SECRET_FILE"] = d.spec.secret_file
            if nixl(d.spec, s):  # vLLM's default, localhost, is not reachable from peers
                env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host.address
            env |= {**host.env, **role.env, **s.env}
            visible = plan.devices[k] if plan.devices else None
            if visible is not None:
                env[devices.VISIBLE_DEVICES[d.spec.platform]] = ",".join(map(str, visible))
            port = s.port if k == 0 else None
            count = s.tensor_parallel_size * p.ranks
            out.append(HostCommand(p.host, s.name, argv, env, port, s.role, count))
    r = router_command(d, PRINTED_ROUTER if router is None else router)
    return out if r is None else [*out, r]

"""`afd ray SPEC`: a deployment spec placed on a running Ray cluster (`afd-plugin[ray]`).

Each process of the spec (a server, or one host's part of a server spanning hosts) gets one
bundle of a placement group: its role's resources (`ray_resources`; CPU 1, and on CUDA/NPU
one GPU/NPU per TP x local DP rank) plus Ray's `node:<address>` resource of its spec host,
so it lands on the Ray node with that address (the spec's addresses are the nodes'
addresses: vLLM's and AFD's flags need them before anything starts). In its bundle an actor
(`ServerProcess`) starts the process as `afd launch` does (`python -m afd_plugin.vllm_serve`
of that node, the log on that node under --log-dir) and answers for it: exit code, /health
(asked on the node: the driver needs no route to the servers), the last log lines. The
driver prints progress until every API server is healthy, then watches; Ctrl-C, an error or
a process ending stops every process, kills the actors and removes the placement group. If
the driver dies, Ray kills its actors and each server gets SIGTERM (launcher.Server's
die_with_parent).

vLLM's own `--data-parallel-backend ray` is not used: its placement asks the cluster for the
platform's `ray_device_key`, which vLLM 0.32's CPU platform leaves empty (`No  found in Ray
cluster`, vllm/v1/engine/utils.py:691), and the spec's addresses must be known before vLLM
places anything; the spec's hosts place DP ranks instead (docs/deploy.md, Ray).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from afd_plugin.deploy.launch import (
    MODULE_ROUTER,
    MODULE_SERVE,
    HostProcess,
    _ProcessSpec,
    serve,
)
from afd_plugin.deploy.servers import ServerError
from afd_plugin.deploy.spec import (
    Deployment,
    HostCommand,
    SpecError,
    commands,
    load_spec,
    startup_budget_s,
)

DEVICE_RESOURCE = {"cuda": "GPU", "npu": "NPU"}  # Ray's names for the accelerators
ACTOR_START_S = 300.0  # a Ray worker process to start and import afd_plugin, on a busy node


def add_arguments(parser) -> None:
    parser.add_argument("spec", help="the deployment spec (TOML), see docs/deploy.md")
    parser.add_argument(
        "--address",
        default=None,
        help="the Ray cluster (HOST:PORT of its head); default: RAY_ADDRESS, else the local one",
    )
    parser.add_argument(
        "--log-dir", default="afd-logs", help="where each process logs, on its own node"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for /health (default: the spec's start-up budget, as afd launch)",
    )
    parser.add_argument(
        "--placement-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the placement group's resources",
    )


def bundle(d: Deployment, c: HostCommand) -> dict[str, float]:
    """The Ray resources of one process: its role's, pinned to its host's node."""
    role = d.spec.roles.get(c.role)
    out = {"CPU": 1.0}
    if (device := DEVICE_RESOURCE.get(d.spec.platform)) and c.devices:
        out[device] = float(c.devices)
    if role is not None:
        out |= role.ray_resources
    out[f"node:{d.spec.hosts[c.host].address}"] = 0.001
    return out


class _NodeProcess(HostProcess):
    die_with_parent = True  # the actor's death (its driver's) stops the server


class ServerProcess:
    """On a Ray node: one process of the spec, started when the actor is made."""

    def __init__(
        self, name: str, argv: list[str], address: str, port, env: dict, log_dir, router=False
    ):
        # MODULE_SERVE, MODULE_ROUTER: this node's Python (deploy.launch is imported in the
        # actor's process)
        program = MODULE_ROUTER if router else MODULE_SERVE
        spec = _ProcessSpec(name, [*program, *argv], address, port, env)
        self.server = _NodeProcess(spec, Path(log_dir))
        self.server.start()

    def poll(self) -> int | None:
        return self.server.proc.poll()

    def healthy(self) -> bool:
        return self.server.is_healthy()

    def log_tail(self, lines: int) -> str:
        return self.server.log_tail(lines)

    def stop(self) -> int | None:
        return self.server.stop()


class _RemoteProc:
    """`Popen.poll` and `returncode` of a process behind its actor (launcher.running uses
    them)."""

    def __init__(self, owner: RayServer):
        self.owner = owner
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self.owner.call("poll")
        return self.returncode


class RayServer:
    """The driver's handle of one process in its bundle, as launcher.running takes it."""

    def __init__(
        self, d: Deployment, c: HostCommand, resources: dict, pg, index: int, log_dir: Path
    ):
        address = d.spec.hosts[c.host].address
        self.spec = _ProcessSpec(c.name, c.argv, address, c.api_port, c.env)
        self.host = c.host
        self.router = c.role == "router"  # afd pd-router, not vllm serve
        self.resources = resources  # its bundle of the placement group
        self.log_path = f"{log_dir / (c.name + '.log')} on {c.host} ({address})"
        self._pg, self._index, self._log_dir = pg, index, log_dir
        self.actor = None
        self.proc = _RemoteProc(self)

    @property
    def url(self) -> str:
        return f"http://{self.spec.address}:{self.spec.port}"

    def start(self) -> RayServer:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        r = dict(self.resources)
        options = {"num_cpus": r.pop("CPU", 0), "num_gpus": r.pop("GPU", 0), "resources": r}
        strategy = PlacementGroupSchedulingStrategy(
            self._pg, placement_group_bundle_index=self._index
        )
        s = self.spec
        self.actor = (
            ray.remote(ServerProcess)
            .options(**options, scheduling_strategy=strategy, name=None, max_restarts=0)
            .remote(s.name, s.argv, s.address, s.port, s.env, str(self._log_dir), self.router)
        )
        self.call("poll", timeout=ACTOR_START_S)  # the actor is up and its process started
        return self

    def call(self, method: str, *args, timeout: float = 60.0):
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayError as exc:
            raise ServerError(
                f"{self.spec.name}: its Ray actor on host {self.host} failed: "
                f"{type(exc).__name__}: {str(exc)[-2000:]}"
            ) from None

    def is_healthy(self) -> bool:
        if self.spec.port is None:  # headless: its head's /health covers it
            return self.proc.poll() is None
        return bool(self.call("healthy"))

    def log_tail(self, lines: int = 40) -> str:
        try:
            return self.call("log_tail", lines)
        except ServerError as exc:
            return str(exc)

    def stop(self, timeout: float = 60.0) -> int | None:
        import ray

        if self.actor is None:
            return None
        try:
            return self.call("stop", timeout=timeout)
        except ServerError:
            return None
        finally:
            ray.kill(self.actor)


def check_nodes(d: Deployment, cmds: list[HostCommand], nodes: list[dict]) -> None:
    """Every spec host that runs one of `cmds` is a live node of the cluster."""
    alive = sorted(n["NodeManagerAddress"] for n in nodes if n.get("Alive"))
    used = {c.host for c in cmds}
    for host in sorted(used):
        address = d.spec.hosts[host].address
        if address not in alive:
            raise SpecError(
                f"afd ray: host {host!r} ({address}) is not a live node of the Ray cluster; "
                f"its nodes: {', '.join(alive) or 'none'} (start Ray there with "
                f"`ray start --address HEAD:PORT --node-ip-address {address}`)"
            )


def unreachable(address: str | None) -> str | None:
    """Why the head's GCS at HOST:PORT takes no connection, or None (also for the forms
    Ray resolves itself: none, "auto", "ray://...")."""
    if not address or address == "auto" or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return "not HOST:PORT of the Ray head (e.g. 10.0.0.1:6379)"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        return f"nothing takes connections there ({exc.strerror or exc}); is `ray start --head` running?"
    return None


def main(args) -> int:
    try:
        d = load_spec(args.spec)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Ray would start the actors under the driver's `uv run` (its py_executable and working
    # dir: a sync per worker); the servers run on each node's own installed afd-plugin
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
    except ImportError:
        print("error: afd ray needs Ray: pip install 'afd-plugin[ray]'", file=sys.stderr)
        return 2
    if why := unreachable(args.address):  # ray.init retries an absent GCS for minutes
        print(f"error: afd ray: --address {args.address}: {why}", file=sys.stderr)
        return 2
    try:
        ray.init(address=args.address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError) as exc:
        where = args.address or "RAY_ADDRESS / the local cluster"
        print(
            f"error: afd ray: cannot connect to the Ray cluster at {where}: {exc}", file=sys.stderr
        )
        return 2
    pg = None
    try:
        cmds = commands(d, [], [])
        check_nodes(d, cmds, ray.nodes())
        log_dir = Path(args.log_dir).absolute()
        bundles = [bundle(d, c) for c in cmds]
        pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=args.placement_timeout)
        except ray.exceptions.GetTimeoutError:
            wanted = "; ".join(
                f"{c.server} on {c.host}: {b}" for c, b in zip(cmds, bundles, strict=True)
            )
            raise ServerError(
                f"the Ray cluster cannot hold the placement group within "
                f"{args.placement_timeout:.0f}s; bundles: {wanted}; cluster resources "
                f"available: {ray.available_resources()}"
            ) from None
        servers = [
            RayServer(d, c, b, pg, i, log_dir)
            for i, (c, b) in enumerate(zip(cmds, bundles, strict=True))
        ]
        for s in servers:
            print(
                f"placing {s.spec.name} on {s.host} ({s.spec.address}): {s.resources}; log {s.log_path}"
            )
        timeout = args.timeout if args.timeout is not None else startup_budget_s(d)
        return serve(servers, timeout)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if pg is not None:
            remove_placement_group(pg)
        ray.shutdown()

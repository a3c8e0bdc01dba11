"""`afd k8s SPEC` (afd_plugin.deploy.k8s): every built-in resource passes Kubernetes' own
schema (kubernetes-validate, strict), the LeaderWorkerSet a schema of its own plus its pod
templates Kubernetes'; every container runs what `commands()` builds for `afd launch`, with
only the addresses replaced (expanded here as Kubernetes and sh expand them); the
rendezvous Service selects FFN rank 0's pod alone; bad inputs are named."""

from __future__ import annotations

import base64
import copy
import json
import re
import subprocess
import sys
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml

from afd_plugin.cli import main
from afd_plugin.deploy.k8s import (
    SECRET_PATH,
    SERVE,
    K8sOptions,
    default_name,
    manifests,
    render,
)
from afd_plugin.deploy.spec import SpecError, check_spec, commands
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "afd-2a1f-three-hosts.toml"
K8S_VERSION = "1.33.0"  # bundled by kubernetes-validate 1.37.0 (1.25 ... 1.37)
OPTS = K8sOptions(image="registry.example/afd:1", name="afd-test", namespace="serving")
RENDEZVOUS_DNS = "afd-test-rendezvous.serving.svc.cluster.local"

# the LeaderWorkerSet CRD (leaderworkerset.x-k8s.io/v1), the fields this module writes
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["replicas", "leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["size", "leaderTemplate", "workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "size": {"type": "integer", "minimum": 2},
                        "restartPolicy": {
                            "enum": ["RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]
                        },
                        "leaderTemplate": {"type": "object", "required": ["metadata", "spec"]},
                        "workerTemplate": {"type": "object", "required": ["metadata", "spec"]},
                    },
                },
            },
        },
    },
}


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
        if doc["kind"] != "LeaderWorkerSet":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            continue
        jsonschema.validate(doc, LWS_SCHEMA)
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
    docs = _docs(make())
    _validate(docs)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("Service") >= 3 and {"StatefulSet", "LeaderWorkerSet"} & set(kinds)
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
    lws = next(copy.deepcopy(d) for d in docs if d["kind"] == "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["size"] = 1
    with pytest.raises(jsonschema.ValidationError):
        _validate([lws])


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
        d for d in docs if d["metadata"]["name"] == "afd-test-ffn0" and d["kind"] != "Service"
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


def test_probes_devices_and_shared_memory():
    docs = _docs(spec_cuda())
    pods = {(n, part): pod for n, part, pod in _pods(docs)}
    head = pods[("afd-test-attention0", "head")]["spec"]["containers"][0]
    worker = pods[("afd-test-attention0", "worker")]["spec"]["containers"][0]
    ffn = pods[("afd-test-ffn0", "head")]["spec"]["containers"][0]
    assert head["resources"] == {"limits": {"nvidia.com/gpu": "4"}}  # TP 2 x 2 ranks
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": "4"}}
    assert ffn["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert head["command"][:3] == ["vllm", "serve", "/models/qwen3-30b-a3b"]
    assert "--enforce-eager" not in head["command"]
    # default connect_timeout_s (120 s) + --startup-timeout (900 s), every 10 s
    assert head["startupProbe"]["failureThreshold"] == 102
    assert head["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for c in (head, worker, ffn):
        assert "livenessProbe" not in c
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert "readinessProbe" not in worker and "startupProbe" not in worker
    assert _container_env(head, "10.1.1.1")["SOME_FLAG"] == "x$(POD_IP)$$y"  # escaped, not expanded
    cpu = _docs(example())
    sts = next(d for d in cpu if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "1"}}
    assert container["startupProbe"]["failureThreshold"] == 150  # (900 + 600) / 10
    raw = spec_cuda()
    raw["platform"] = "npu"
    raw["servers"][0]["data_parallel_size"] = 1  # Ascend runs no FFN expert group
    npu = _pods(_docs(raw))[0][2]["spec"]["containers"][0]
    assert npu["resources"] == {"limits": {"huawei.com/Ascend910": "1"}}


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
    long = K8sOptions(image="x", name="n" * 45)
    assert "would be named" in _refused(example(), long) and "52 at most" in _refused(
        example(), long
    )


def test_the_default_name_is_the_spec_files_stem_as_a_dns_label():
    assert default_name(EXAMPLE) == "afd-2a1f-three-hosts"
    assert default_name("/x/2A_2F.prod.toml") == "afd-2a-2f-prod"
    assert default_name("My Spec.toml") == "my-spec"


def test_afd_k8s_writes_the_manifests(tmp_path, capsys):
    out = tmp_path / "afd.yaml"
    argv = ["k8s", str(EXAMPLE), "--image", "img:1", "--namespace", "serving", "-o", str(out)]
    assert main(argv) == 0
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

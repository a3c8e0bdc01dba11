"""Prefill/decode deployment specs (docs/pd.md): prefill servers as a third role (ordinary
vLLM, their own KV-transfer config, no `afd` config), the attention servers as KV
consumers, an optional [router] that `afd launch`, `afd ray` and `afd k8s` run; ports,
devices and firewall rules with them; every bad field named."""

from __future__ import annotations

import copy
import json
import shlex
import tomllib

import pytest

from afd_plugin.cli import main
from afd_plugin.deploy.firewall import host_rules
from afd_plugin.deploy.k8s import K8sOptions, manifests
from afd_plugin.deploy.launch import MODULE_ROUTER, MODULE_SERVE, host_processes
from afd_plugin.deploy.ray_launch import bundle
from afd_plugin.deploy.spec import SpecError, check_spec, commands
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "afd-pd-three-hosts.toml"
OPTS = K8sOptions(image="registry.example/afd:1", name="afd-test", namespace="serving")


def example() -> dict:
    return tomllib.loads(EXAMPLE.read_text())


def kv(role: str, connector: str = "ExampleConnector") -> list[str]:
    config = {"kv_connector": connector, "kv_role": role}
    return ["--kv-transfer-config", json.dumps(config)]


def refused(raw: dict) -> str:
    with pytest.raises(SpecError) as exc:
        check_spec(raw)
    return str(exc.value)


def test_the_example_runs_prefill_servers_as_plain_vllm_and_the_router_last():
    d = check_spec(example())
    assert (d.num_attention_ranks, d.num_ffn_ranks) == (1, 1)  # a prefill server holds none
    cmds = commands(d, ["vllm", "serve"])
    assert [(c.server, c.role, c.host) for c in cmds] == [
        ("ffn0", "ffn", "f"),
        ("attention0", "attention", "a"),
        ("prefill0", "prefill", "p"),
        ("router", "router", "p"),
    ]
    prefill = cmds[2]
    assert "--additional-config" not in prefill.argv and "--enforce-eager" in prefill.argv
    assert prefill.argv[:5] == ["vllm", "serve", "/models/tiny-qwen3-moe", "--host", "198.18.7.1"]
    assert prefill.argv.count("--enforce-eager") == 1  # its args' own: the spec adds none
    assert not any(k.startswith("AFD_") for k in prefill.env), prefill.env
    router = cmds[3]
    assert router.argv == [
        "afd", "pd-router", "--prefill", "http://198.18.7.1:8200",
        "--decode", "http://198.18.7.2:8000", "--host", "198.18.7.1", "--port", "9000",
    ]  # fmt: skip
    assert router.api_port == 9000 and router.devices == 0
    # the printed router command is what the `afd` parser takes
    from afd_plugin.cli import build_parser

    args = build_parser().parse_args(router.argv[1:])
    assert args.prefill == ["http://198.18.7.1:8200"] and args.port == 9000


def test_launch_print_shows_the_prefill_server_and_the_router(capsys):
    assert main(["launch", str(EXAMPLE), "--print"]) == 0
    out = capsys.readouterr().out
    assert "# prefill0 (prefill server, API server)" in out
    assert "# router (P/D router)" in out
    assert "clients use the router router at http://198.18.7.1:9000" in out
    line = next(x for x in out.splitlines() if x.startswith("afd pd-router"))
    assert shlex.split(line)[-2:] == ["--port", "9000"]


def test_launch_starts_the_hosts_router_through_this_python(tmp_path):
    d = check_spec(example())
    procs = host_processes(d, "p", tmp_path)
    assert [p.spec.name for p in procs] == ["prefill0", "router"]
    assert procs[0].spec.argv[: len(MODULE_SERVE)] == MODULE_SERVE
    assert procs[1].spec.argv[: len(MODULE_ROUTER)] == MODULE_ROUTER
    assert procs[1].url == "http://198.18.7.1:9000"  # launch waits for its /health


def test_ray_places_the_router_and_the_prefill_server(tmp_path):
    raw = example()
    raw["platform"] = "cuda"
    for s in raw["servers"]:
        s["args"] = [a for a in s.get("args", []) if a != "--enforce-eager"]
    d = check_spec(raw)
    by = {c.server: c for c in commands(d, [], [])}
    assert by["router"].argv[0] == "--prefill"  # the actor adds MODULE_ROUTER on its node
    assert bundle(d, by["prefill0"]) == {"CPU": 1.0, "GPU": 1.0, "node:198.18.7.1": 0.001}
    assert bundle(d, by["router"]) == {"CPU": 1.0, "node:198.18.7.1": 0.001}


def test_a_prefill_server_needs_a_producer_kv_config():
    raw = example()
    raw["servers"][2]["args"] = []
    assert refused(raw) == (
        "deployment spec: servers[2] (prefill0, prefill).args has no --kv-transfer-config; a "
        "prefill server hands the prompt's KV to the decode stage: allowed: "
        "--kv-transfer-config with kv_role kv_producer or kv_both in servers[].args or "
        "roles.prefill.args (docs/pd.md)"
    )
    raw["servers"][2]["args"] = kv("kv_consumer")
    assert "kv_role='kv_consumer'" in refused(raw) and "kv_producer or kv_both" in refused(raw)
    # dotted flags as vLLM takes them; kv_both; the role's args
    raw["servers"][2]["args"] = ["--kv-transfer-config.kv_connector", "ExampleConnector"]
    raw["servers"][2]["args"] += ["--kv-transfer-config.kv_role=kv_both"]
    check_spec(raw)
    raw["servers"][2]["args"] = []
    raw["roles"]["prefill"]["args"] += kv("kv_producer")
    check_spec(raw)
    raw["servers"][2]["args"] = ["--kv-transfer-config", "kv_role=kv_producer"]
    assert "is not a JSON object" in refused(raw)


def test_attention_servers_of_a_pd_spec_are_consumers_and_ffn_servers_take_none():
    raw = example()
    raw["servers"][1]["args"] = []
    message = refused(raw)
    assert "servers[1] (attention0, attention).args has no --kv-transfer-config" in message
    assert "kv_consumer or kv_both" in message
    raw["servers"][1]["args"] = kv("kv_producer")
    assert "kv_role='kv_producer'" in refused(raw)
    raw = example()
    raw["servers"][0]["args"] = kv("kv_consumer")
    assert "would stop at start-up: AFD: --kv-transfer-config on an FFN server" in refused(raw)
    # without prefill servers attention servers need no KV config (as before)
    plain = example()
    del plain["router"]
    plain["servers"] = plain["servers"][:2]
    plain["servers"][1]["args"] = []
    check_spec(plain)


def test_prefill_servers_take_no_afd_config_and_no_owned_flags():
    raw = example()
    raw["servers"][2]["args"] += ["--additional-config", '{"afd": {"role": "attention"}}']
    assert "holds an 'afd' key; a prefill server is an ordinary vLLM server" in refused(raw)
    raw["servers"][2]["args"][-1] = '{"ascend_scheduler_config": {}}'
    d = check_spec(raw)  # other plugins' keys pass
    (c,) = [c for c in commands(d, ["vllm", "serve"]) if c.server == "prefill0"]
    assert c.argv[-1] == '{"ascend_scheduler_config": {}}'
    raw = example()
    raw["servers"][2]["args"] += ["--port", "1"]
    assert "servers[2].args: --port is set by the spec itself" in refused(raw)


def test_the_router_is_checked():
    raw = example()
    raw["router"]["host"] = "q"
    assert refused(raw) == "deployment spec: router.host='q' is not in [hosts]; allowed: a, f, p"
    raw = example()
    raw["router"]["port"] = 8200
    assert refused(raw) == (
        "deployment spec: router.port=8200 on host 'p' (198.18.7.1) is taken by prefill0 (API "
        "port); allowed: a port no server uses on that address"
    )
    raw = example()
    raw["router"]["name"] = "ffn0"
    assert "router.name='ffn0' is also a server's name" in refused(raw)
    raw = example()
    raw["router"]["prot"] = 1
    assert "unknown key 'router.prot'. Did you mean 'port'?" in refused(raw)
    raw = example()
    raw["router"]["args"] = ["--port", "1"]
    assert "router.args: --port is set by the spec itself" in refused(raw)
    raw["router"]["args"] = ["--prefill-timeout", "60", "--retries", "2"]
    assert "--retries is not an afd pd-router flag" in refused(raw)
    raw["router"]["args"] = ["--prefill-timeout", "60"]
    (c,) = [c for c in commands(check_spec(raw), []) if c.role == "router"]
    assert c.argv[-2:] == ["--prefill-timeout", "60"]
    raw = example()
    raw["servers"] = raw["servers"][:2]
    assert "[router] needs prefill servers" in refused(raw)
    raw["servers"][0]["role"] = "prefil"
    assert "'attention', 'ffn' or 'prefill'" in refused(raw)


def test_ports_and_devices_count_prefill_servers():
    raw = example()
    raw["servers"][2]["hosts"] = "a"
    raw["servers"][2]["port"] = 8000
    assert "taken by attention0 (API port)" in refused(raw)
    raw = example()
    raw["platform"] = "cuda"
    raw["hosts"]["a"]["devices"] = 2
    raw["servers"][2]["hosts"] = "a"
    raw["servers"][2]["tensor_parallel_size"] = 2
    raw["router"]["host"] = "a"
    assert "has 2 device(s) but its server parts need 3" in refused(raw)
    raw["hosts"]["a"]["devices"] = 3
    d = check_spec(raw)
    env = {c.server: c.env.get("CUDA_VISIBLE_DEVICES") for c in commands(d, [])}
    assert env["attention0"] == "0" and env["prefill0"] == "1,2"


def test_nixl_side_channels_are_ports_the_spec_checks_and_the_firewall_drops():
    raw = example()
    raw["servers"][1]["args"] = kv("kv_consumer", "NixlConnector")
    raw["servers"][2]["args"] = kv("kv_producer", "NixlConnector")
    raw["servers"][2]["hosts"] = "a"  # both NIXL servers on one host: one side channel port
    raw["router"]["host"] = "a"
    assert "NIXL side channel port 5600 on host 'a' (198.18.7.2) is taken by attention0" in (
        refused(raw)
    )
    raw["servers"][2]["env"] = {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5700"}
    d = check_spec(raw)
    by = {c.server: c for c in commands(d, [])}
    # vLLM's default side channel host is localhost, which peers cannot reach
    assert by["prefill0"].env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "198.18.7.2"
    assert by["attention0"].env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "198.18.7.2"
    rules = "\n".join(host_rules(d, "a"))
    assert "--dport 5600 -j DROP  # attention0's NIXL side channel" in rules
    assert "--dport 5700 -j DROP  # prefill0's NIXL side channel" in rules
    assert "--dport 8200 -j DROP  # prefill0's API (prefill: the router's)" in rules
    assert "--dport 9000 -j ACCEPT  # router's API (the P/D router): clients" in rules


def test_example_connector_opens_no_port_and_the_router_port_is_public():
    d = check_spec(example())
    p = "\n".join(host_rules(d, "p"))
    assert "--dport 9000 -j ACCEPT" in p and "--dport 8200 -j DROP" in p
    assert "5600" not in p and "NIXL" not in p
    # the router's host is a deployment host: every other host accepts it on any port
    assert "-s 198.18.7.1 -j ACCEPT  # deployment host" in "\n".join(host_rules(d, "a"))


def test_k8s_renders_prefill_statefulsets_and_the_router_deployment():
    from tests.afd_plugin.test_deploy_k8s import _validate

    raw = example()
    raw["secret_file"] = None
    del raw["secret_file"]
    docs = manifests(check_spec(raw), OPTS)
    _validate(docs)
    by = {(x["kind"], x["metadata"]["name"]): x for x in docs}
    sts = by[("StatefulSet", "afd-test-prefill0")]
    pod = sts["spec"]["template"]
    assert pod["metadata"]["labels"]["afd.role"] == "prefill"
    assert "initContainers" not in pod["spec"]  # no rendezvous to wait for
    (container,) = pod["spec"]["containers"]
    assert "--additional-config" not in container["command"]
    assert not any(e["name"].startswith("AFD_") for e in container["env"])
    assert by[("Service", "afd-test-prefill0-api")]["spec"]["ports"][0]["port"] == 8200
    router = by[("Deployment", "afd-test-router")]
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    assert rc["command"] == [
        "python3", "-m", "afd_plugin.cli", "pd-router",
        "--prefill", "http://afd-test-prefill0-api.serving.svc:8200",
        "--decode", "http://afd-test-attention0-api.serving.svc:8000",
        "--host", "$(POD_IP)", "--port", "9000",
    ]  # fmt: skip
    assert rc["readinessProbe"]["httpGet"]["path"] == "/health"
    assert by[("Service", "afd-test-router")]["spec"]["ports"][0]["port"] == 9000
    policy = by[("NetworkPolicy", "afd-test-router-api")]
    assert policy["spec"]["podSelector"]["matchLabels"]["afd.role"] == "router"
    # the public API policy still selects attention heads alone, not prefill servers
    api = by[("NetworkPolicy", "afd-test-api")]
    assert api["spec"]["podSelector"]["matchLabels"]["afd.role"] == "attention"
    assert by[("PodDisruptionBudget", "afd-test-prefill0")]["spec"]["maxUnavailable"] == 1


def test_k8s_gang_digest_leaves_prefill_servers_out():
    from afd_plugin.deploy.k8s import DEPLOYMENT_HASH

    raw = copy.deepcopy(example())
    raw["platform"] = "cuda"
    for s in raw["servers"]:
        s["args"] = [a for a in s.get("args", []) if a != "--enforce-eager"]
    for r in raw["roles"].values():
        r["args"] = [a for a in r["args"] if a != "--enforce-eager"]
    d = check_spec(raw)
    docs = manifests(d, OPTS)
    annotations = {
        x["metadata"]["name"]: x["spec"]["template"]["metadata"].get("annotations", {})
        for x in docs
        if x["kind"] == "StatefulSet"
    }
    assert DEPLOYMENT_HASH in annotations["afd-test-ffn0"]
    assert DEPLOYMENT_HASH not in annotations["afd-test-prefill0"]
    raw["servers"][2]["args"] += ["--max-num-seqs", "8"]
    again = manifests(check_spec(raw), OPTS)
    digest = {
        x["metadata"]["name"]: x["spec"]["template"]["metadata"].get("annotations", {})
        for x in again
        if x["kind"] == "StatefulSet"
    }
    assert digest["afd-test-ffn0"] == annotations["afd-test-ffn0"]  # no AFD roll

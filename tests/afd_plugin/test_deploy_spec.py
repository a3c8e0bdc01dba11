"""Deployment specs (afd_plugin.deploy.spec) and `afd launch --print`: every bad field is
named with its value and what is allowed; ranks, start ranks, the rendezvous and every
host's `vllm serve` flags follow from the servers (vLLM's multi-node data-parallel flags for
a server spanning hosts)."""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib

import pytest

from afd_plugin.cli import main
from afd_plugin.deploy.spec import SpecError, check_spec, commands
from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "afd-2a1f-three-hosts.toml"


def example() -> dict:
    return tomllib.loads(EXAMPLE.read_text())


def test_the_example_spec_derives_ranks_and_rendezvous():
    d = check_spec(example())
    assert (d.num_attention_ranks, d.num_ffn_ranks) == (2, 1)
    assert d.rendezvous_host == "f" and d.rendezvous_address == "198.18.7.1"
    assert [(p.spec.name, p.start_rank) for p in d.servers] == [("ffn0", 0), ("attention0", 0)]


def test_attention_ranks_need_not_be_a_multiple_of_ffn_ranks():
    """3A2F: FFN rank 0 serves attention ranks 0 and 1, FFN rank 1 serves rank 2."""
    raw = example()
    raw["servers"].append({"name": "ffn1", "role": "ffn", "port": 8101, "hosts": "f"})
    raw["servers"][1].update(
        data_parallel_size=3, hosts=[{"host": "a0", "ranks": 2}, {"host": "a1", "ranks": 1}]
    )
    d = check_spec(raw)
    assert (d.num_attention_ranks, d.num_ffn_ranks) == (3, 2)


def test_a_server_spanning_hosts_gets_vllms_multi_node_flags():
    d = check_spec(example())
    cmds = commands(d, ["vllm", "serve"])
    assert [(c.host, c.server, c.api_port) for c in cmds] == [
        ("f", "ffn0", 8100),
        ("a0", "attention0", 8000),
        ("a1", "attention0", None),
    ]
    head, headless = cmds[1].argv, cmds[2].argv
    for argv in (head, headless):
        flags = " ".join(argv)
        assert "--data-parallel-size 2 --data-parallel-size-local 1" in flags
        assert "--data-parallel-address 198.18.7.2 --data-parallel-rpc-port 13345" in flags
        assert "--enforce-eager" in argv
    assert "--headless" not in head and head[head.index("--port") + 1] == "8000"
    assert headless[headless.index("--data-parallel-start-rank") + 1] == "1"
    assert "--headless" in headless and "--port" not in headless
    afd = json.loads(head[head.index("--additional-config") + 1])["afd"]
    assert afd == {
        "connector_extra_config": {"connect_timeout_s": 600},
        "role": "attention",
        "host": "198.18.7.1",
        "port": 29650,
        "num_attention_ranks": 2,
        "num_ffn_ranks": 1,
        "start_rank": 0,
    }
    assert cmds[2].env == {
        "VLLM_HOST_IP": "198.18.7.3",
        "GLOO_SOCKET_IFNAME": "eth0",
        "AFD_CHANNEL_INTERFACE": "eth0",
    }


KV_CONSUMER = '{"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}'


def _bad(change) -> str:
    raw = example()
    change(raw)
    with pytest.raises(SpecError) as exc:
        check_spec(raw)
    return str(exc.value)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda r: r.update(modle="x"), "unknown key 'modle'. Did you mean 'model'?"),
        (lambda r: r.pop("model"), "model is missing; allowed: a model path"),
        (lambda r: r.update(platform="tpu"), "platform='tpu' is invalid"),
        (lambda r: r["hosts"]["f"].update(adress="x"), "unknown key 'hosts.f.adress'"),
        (lambda r: r["servers"][0].update(role="expert"), "servers.0.role='expert' is invalid"),
        (lambda r: r["servers"][0].update(port=70000), "servers.0.port=70000 is invalid"),
        (lambda r: r["servers"][0].update(hosts="nowhere"), "names host 'nowhere'"),
        (
            lambda r: r["servers"][1].update(data_parallel_size=3),
            "place 2 data-parallel rank(s) but data_parallel_size=3",
        ),
        (lambda r: r["servers"][1].update(name="ffn0"), "servers[1].name='ffn0' is used twice"),
        (lambda r: r["servers"].pop(0), "servers has no ffn server"),
        (lambda r: r["afd"].update(start_rank=1), "afd.start_rank is set by the spec itself"),
        (
            lambda r: (
                r["servers"].append({"name": "ffn1", "role": "ffn", "port": 8101, "hosts": "a1"})
                or r["servers"][1].update(data_parallel_size=1, hosts="a0")
                or None
            ),
            "1 attention rank(s) and 2 FFN rank(s)",
        ),
        (
            lambda r: r.update(rendezvous_port=8100),
            "rendezvous_port=8100 on host 'f' (FFN rank 0's) is taken by ffn0",
        ),
        (
            lambda r: r["servers"].append(
                {"name": "x", "role": "attention", "port": 8000, "hosts": "a0"}
            ),
            "API port 8000 on host 'a0' (198.18.7.2) is taken by attention0",
        ),
        # two host names, one address: the ports are the address's
        (
            lambda r: (
                r["hosts"].update(b={"address": "198.18.7.2"})
                or r["servers"].append(
                    {"name": "x", "role": "attention", "port": 8000, "hosts": "b"}
                )
                or None
            ),
            "API port 8000 on host 'b' (198.18.7.2) is taken by attention0",
        ),
        (lambda r: r["hosts"]["f"].update(address="10.0.0.1:22"), "hosts.f.address='10.0.0.1:22'"),
        (lambda r: r["hosts"]["f"].update(address="not an address"), "an IP address or a host"),
        # the [afd] table as every server parses it
        (lambda r: r["afd"].update(num_microbatchs=2), "unknown key 'num_microbatchs'"),
        (
            lambda r: r["afd"]["connector_extra_config"].update(connect_timeout_s="ten minutes"),
            "connect_timeout_s",
        ),
        (lambda r: r["afd"].update(num_microbatches=9), "num_microbatches"),
        # a server's start-up rules
        (
            lambda r: r["roles"]["ffn"]["args"].append("--enable-dbo"),
            "servers[0] (ffn0, ffn) would stop at start-up: AFD: --enable-dbo on an FFN server",
        ),
        (
            lambda r: (
                r["servers"][0].update(data_parallel_size=2)
                or r["roles"]["ffn"]["args"].append("--enable-expert-parallel")
                or r["servers"][1].update(data_parallel_size=2)
                or None
            ),
            "--enable-expert-parallel on an FFN server is not supported on CPU",
        ),
        (
            lambda r: r["roles"]["attention"]["args"].extend(["--compilation-config", "{}"]),
            "would stop at start-up: AFD on CPU: cudagraph_mode=FULL_AND_PIECEWISE",
        ),
        (
            lambda r: (
                r["afd"].update(async_dp=True) or r["servers"][0].update(data_parallel_size=2)
            ),
            "[afd]: afd.async_dp with an FFN expert group",
        ),
        (
            lambda r: r["roles"]["ffn"]["args"].extend(["--kv-transfer-config", KV_CONSUMER]),
            "servers[0] (ffn0, ffn) would stop at start-up: AFD: --kv-transfer-config on an FFN "
            "server: an FFN server holds no KV cache",
        ),
        (  # vLLM's dotted form, underscores
            lambda r: r["servers"][0].update(args=["--kv_transfer_config.kv_role=kv_both"]),
            "allowed: give --kv-transfer-config to the attention servers",
        ),
        (
            lambda r: r["servers"][0].update(args=["--kv-offloading-size", "4"]),
            "AFD: --kv-offloading-size on an FFN server",
        ),
        # flags the spec owns
        (
            lambda r: r["servers"][1].update(args=["--port", "9000"]),
            "servers[1].args: --port is set by the spec itself; allowed: set servers[].port",
        ),
        (
            lambda r: r["roles"]["attention"]["args"].append("--data_parallel_size=4"),
            "roles.attention.args: --data_parallel_size is set by the spec itself",
        ),
        (
            lambda r: r["servers"][0].update(args=["--additional-config", "{}"]),
            "--additional-config is set by the spec itself",
        ),
    ],
)
def test_every_bad_field_is_named(change, expected):
    assert expected in _bad(change)


def test_an_attention_server_may_take_a_kv_transfer_config():
    """The decode stage of a prefill/decode deployment (docs/pd.md)."""
    raw = example()
    raw["roles"]["attention"]["args"].extend(["--kv-transfer-config", KV_CONSUMER])
    check_spec(raw)


def test_afd_launch_print_shows_every_hosts_commands(capsys):
    assert main(["launch", str(EXAMPLE), "--print"]) == 0
    out = capsys.readouterr().out
    assert "rendezvous 198.18.7.1:29650 (host f)" in out
    assert out.index("# host f") < out.index("# host a0") < out.index("# host a1")
    lines = [line for line in out.splitlines() if line and not line.startswith(("#", "ip"))]
    assert len(lines) == 3
    # then the firewall rules of every host (tests/afd_plugin/test_firewall.py)
    assert out.index("# host a1") < out.index("# firewall") < out.index("# on host a1")
    words = shlex.split(lines[2])
    assert words[:3] == [
        "VLLM_HOST_IP=198.18.7.3",
        "GLOO_SOCKET_IFNAME=eth0",
        "AFD_CHANNEL_INTERFACE=eth0",
    ]
    assert words[3:6] == ["vllm", "serve", "/models/tiny-qwen3-moe"]


def test_afd_launch_refuses_a_bad_spec_or_host_before_starting_anything(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE.read_text().replace('role = "ffn"', 'role = "fnn"'))
    assert main(["launch", str(bad), "--print"]) == 2
    assert "servers.0.role='fnn' is invalid" in capsys.readouterr().err
    assert main(["launch", str(EXAMPLE), "--host", "b", "--log-dir", str(tmp_path)]) == 2
    assert "--host 'b' is not a host of the spec; allowed: a0, a1, f" in capsys.readouterr().err
    assert not any(tmp_path.glob("*.log"))
    raw = copy.deepcopy(example())
    assert check_spec(raw)  # the example itself is valid


@pytest.mark.parametrize(
    "platform, args, expected",
    [
        ("cpu", [], ["--enforce-eager"]),
        ("npu", [], ["--enforce-eager"]),  # ACL graphs are rejected (docs/ascend.md)
        ("cuda", [], ["--compilation-config", '{"cudagraph_mode":"FULL_DECODE_ONLY"}']),
        ("cuda", ["--enforce_eager"], []),  # the args choose (vLLM reads `_` as `-`)
        ("cuda", ["-O0"], []),
        ("cuda", ['--compilation-config={"cudagraph_mode": "NONE"}'], []),
    ],
)
def test_each_platform_runs_with_graph_flags_afd_takes_unless_the_args_choose(
    platform, args, expected
):
    raw = example()
    raw["platform"] = platform
    raw["roles"]["ffn"]["args"] = args
    ffn = commands(check_spec(raw), ["vllm", "serve"])[0].argv
    graph = [a for a in ffn if a in ("--enforce-eager", "--compilation-config")]
    if expected:
        i = ffn.index(expected[0])
        assert ffn[i : i + len(expected)] == expected and graph == expected[:1]
    else:
        assert graph == [] and ffn[-len(args) :] == args


def test_a_data_parallel_servers_head_runs_one_api_server_unless_the_args_choose():
    """`vllm serve` would start one API server per data-parallel rank, whose /metrics and
    /health know nothing of AFD's ranks (docs/metrics.md); a headless part runs none."""
    d = check_spec(example())
    ffn, head, headless = (c.argv for c in commands(d, ["vllm", "serve"]))
    assert " ".join(head).count("--api-server-count 1") == 1
    assert "--api-server-count" not in ffn + headless  # one rank; headless
    raw = example()
    raw["servers"][1]["args"] = ["--api_server_count=2"]  # vLLM reads `_` as `-`
    head = commands(check_spec(raw), ["vllm", "serve"])[1].argv
    assert [a for a in head if "api" in a] == ["--api_server_count=2"]


def test_the_collective_libraries_bind_each_hosts_address_or_interface():
    raw = example()
    raw["platform"] = "cuda"
    assert commands(check_spec(raw), [])[1].env["NCCL_SOCKET_IFNAME"] == "eth0"
    raw["platform"] = "npu"
    env = commands(check_spec(raw), [])[2].env
    assert env["HCCL_IF_IP"] == "198.18.7.3" and "NCCL_SOCKET_IFNAME" not in env


def _cuda(**hosts) -> dict:
    """CUDA: an FFN server of 2 ranks and an attention server of 4, both on host g0."""
    return {
        "model": "/models/m",
        "platform": "cuda",
        "hosts": {"g0": {"address": "10.0.0.1", **hosts}},
        "servers": [
            {"name": "ffn0", "role": "ffn", "port": 8100, "data_parallel_size": 2, "hosts": "g0"},
            {"name": "attention0", "role": "attention", "port": 8000, "data_parallel_size": 4,
             "hosts": "g0"},
        ],
    }  # fmt: skip


def test_servers_sharing_a_host_get_disjoint_devices():
    d = check_spec(_cuda(devices=8))
    visible = [c.env["CUDA_VISIBLE_DEVICES"] for c in commands(d, ["vllm", "serve"])]
    assert visible == ["0,1", "2,3,4,5"]
    raw = _cuda(devices=8)
    raw["servers"][1]["hosts"] = [{"host": "g0", "ranks": 4, "devices": [7, 6, 5, 4]}]
    visible = [c.env["CUDA_VISIBLE_DEVICES"] for c in commands(check_spec(raw), ["vllm", "serve"])]
    assert visible == ["0,1", "7,6,5,4"]
    # npu: Ascend's variable (one rank per FFN server there)
    raw = _cuda(devices=8)
    raw.update(platform="npu")
    raw["servers"][0]["data_parallel_size"] = 1
    npu = commands(check_spec(raw), ["vllm", "serve"])
    assert [c.env["ASCEND_RT_VISIBLE_DEVICES"] for c in npu] == ["0", "1,2,3,4"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda r: r["hosts"]["g0"].update(devices=5), "host 'g0' has 5 device(s) but its server"),
        (
            lambda r: (
                r["servers"][0].update(hosts=[{"host": "g0", "ranks": 2, "devices": [0, 1]}])
                or r["servers"][1].update(
                    hosts=[{"host": "g0", "ranks": 4, "devices": [1, 2, 3, 4]}]
                )
            ),
            "attention0 on host 'g0': device 1 is also ffn0's",
        ),
        (
            lambda r: r["servers"][1].update(hosts=[{"host": "g0", "ranks": 4, "devices": [2, 3]}]),
            "devices=[2, 3] lists 2 but it runs 4",
        ),
        (
            lambda r: r["servers"][1].update(
                hosts=[{"host": "g0", "ranks": 4, "devices": [2, 3, 4, 8]}]
            ),
            "device 8 is out of range; allowed: 0..7",
        ),
        (lambda r: r["servers"][0].update(env={"CUDA_VISIBLE_DEVICES": "0"}), "the spec writes it"),
    ],
)
def test_an_overlap_or_an_overcommit_is_refused(change, expected):
    raw = _cuda(devices=8)
    change(raw)
    with pytest.raises(SpecError, match=re.escape(expected)):
        check_spec(raw)


def test_afd_launch_refuses_a_shared_host_without_a_device_count(capsys, tmp_path):
    d = check_spec(_cuda())  # afd k8s and afd ray place pods and actors themselves
    with pytest.raises(SpecError, match=r"host 'g0' runs 2 server parts \(ffn0, attention0\)"):
        d.require_placed_devices()
    path = tmp_path / "d.toml"
    path.write_text(
        'model = "/models/m"\nplatform = "cuda"\n[hosts.g0]\naddress = "10.0.0.1"\n'
        '[[servers]]\nname = "ffn0"\nrole = "ffn"\nport = 8100\nhosts = "g0"\n'
        '[[servers]]\nname = "attention0"\nrole = "attention"\nport = 8000\nhosts = "g0"\n'
    )
    assert main(["launch", str(path), "--print"]) == 2
    assert "[hosts.g0] devices = N" in capsys.readouterr().err


def test_env_per_host_then_role_then_server():
    raw = example()
    raw["hosts"]["a0"]["env"] = {"NCCL_IB_HCA": "mlx5_0", "X": "host"}
    raw["roles"]["attention"]["env"] = {"X": "role"}
    cmds = {c.host: c for c in commands(check_spec(raw), ["vllm", "serve"])}
    assert cmds["a0"].env["NCCL_IB_HCA"] == "mlx5_0" and cmds["a0"].env["X"] == "role"
    assert "NCCL_IB_HCA" not in cmds["a1"].env


def test_vllms_defaults_the_spec_check_relies_on():
    """afd_plugin.deploy.server_check reads DBO thresholds and the graph mode from a
    server's flags, with vLLM 0.32's defaults where its flags say nothing."""
    from vllm.config import ParallelConfig

    from afd_plugin.deploy import server_check

    pc = ParallelConfig()
    assert pc.dbo_decode_token_threshold == server_check.DBO_DECODE_TOKEN_THRESHOLD
    assert pc.dbo_prefill_token_threshold == server_check.DBO_PREFILL_TOKEN_THRESHOLD
    assert (pc.use_ubatching, pc.num_ubatches) == (False, 0)

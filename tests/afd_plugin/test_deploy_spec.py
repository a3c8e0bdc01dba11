"""Deployment specs (afd_plugin.deploy.spec) and `afd launch --print`: every bad field is
named with its value and what is allowed; ranks, start ranks, the rendezvous and every
host's `vllm serve` flags follow from the servers (vLLM's multi-node data-parallel flags for
a server spanning hosts)."""

from __future__ import annotations

import copy
import json
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
            "API port 8000 on host 'a0' is taken by attention0",
        ),
    ],
)
def test_every_bad_field_is_named(change, expected):
    assert expected in _bad(change)


def test_afd_launch_print_shows_every_hosts_commands(capsys):
    assert main(["launch", str(EXAMPLE), "--print"]) == 0
    out = capsys.readouterr().out
    assert "rendezvous 198.18.7.1:29650 (host f)" in out
    assert out.index("# host f") < out.index("# host a0") < out.index("# host a1")
    lines = [line for line in out.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 3
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
        ("cuda", ["--compilation-config={}"], []),
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


def test_the_collective_libraries_bind_each_hosts_address_or_interface():
    raw = example()
    raw["platform"] = "cuda"
    assert commands(check_spec(raw), [])[1].env["NCCL_SOCKET_IFNAME"] == "eth0"
    raw["platform"] = "npu"
    env = commands(check_spec(raw), [])[2].env
    assert env["HCCL_IF_IP"] == "198.18.7.3" and "NCCL_SOCKET_IFNAME" not in env

"""`afd plan --write-spec`: the plan's first shape that AFD can run, as a deployment spec
that `afd launch` accepts (afd_plugin.deploy.from_plan)."""

from __future__ import annotations

import tomllib
from types import SimpleNamespace

import pytest

from afd_plugin.cli import main
from afd_plugin.deploy.from_plan import parse_host, spec_toml, write_spec
from afd_plugin.deploy.spec import SpecError, afd_config, check_spec, commands

HOSTS = [parse_host("g0=10.0.0.1:4"), parse_host("g1=10.0.0.2:4")]


def shape(a, f, m=2):
    return SimpleNamespace(
        attention_devices=a, ffn_devices=f, microbatches=m, batch_per_attention_device=64,
        tpot_ms=40.0,
    )  # fmt: skip


def servers(text: str) -> list[tuple]:
    d = check_spec(tomllib.loads(text))
    return [
        (
            p.spec.name,
            p.spec.tensor_parallel_size,
            p.start_rank,
            [(x.host, x.ranks) for x in p.placements],
        )
        for p in d.servers
    ]


def test_f_at_most_a_is_one_ffn_expert_group_then_the_attention_ranks():
    text = spec_toml(shape(4, 2), "m", HOSTS, "cuda")
    assert servers(text) == [
        ("ffn0", 1, 0, [("g0", 2)]),
        ("attention0", 1, 0, [("g0", 2), ("g1", 2)]),
    ]
    assert "num_microbatches = 2" in text
    d = check_spec(tomllib.loads(text))
    ffn, attention = d.servers
    # the plan prices each expert on one device of the group: vLLM's expert parallelism
    assert ffn.spec.args == ["--enable-expert-parallel"]
    # g0 holds both servers: each its own devices, as its device count allows
    assert (ffn.devices, attention.devices) == (((0, 1),), ((2, 3), (0, 1)))
    argv = {c.name: c for c in commands(d, ["vllm", "serve"])}
    assert argv["ffn0"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert argv["attention0"].env["CUDA_VISIBLE_DEVICES"] == "2,3"
    # micro-batches are the attention server's: the FFN server's afd config has none
    assert (
        "num_microbatches" not in afd_config(d, ffn)
        and afd_config(d, attention)["num_microbatches"] == 2
    )


def test_without_expert_groups_each_ffn_device_is_a_server_of_its_own():
    """Ascend runs no FFN expert group: 4A2F is two FFN servers of one rank each."""
    text = spec_toml(shape(4, 2, m=1), "m", HOSTS, "npu")
    assert servers(text) == [
        ("ffn0", 1, 0, [("g0", 1)]),
        ("ffn1", 1, 1, [("g0", 1)]),
        ("attention0", 1, 0, [("g0", 2), ("g1", 2)]),
    ]
    d = check_spec(tomllib.loads(text))
    visible = [c.env["ASCEND_RT_VISIBLE_DEVICES"] for c in commands(d, ["vllm", "serve"])]
    assert visible == ["0", "1", "2,3", "0,1"]


def test_f_above_a_is_ffn_tensor_parallelism_on_cpu_only():
    text = spec_toml(shape(2, 4), "m", HOSTS, "cpu")
    assert servers(text) == [
        ("ffn0", 2, 0, [("g0", 1)]),
        ("ffn1", 2, 1, [("g0", 1)]),
        ("attention0", 1, 0, [("g1", 2)]),
    ]
    with pytest.raises(SpecError, match="FFN tensor\\s+parallelism, which AFD rejects on cuda"):
        spec_toml(shape(2, 4), "m", HOSTS, "cuda")


def test_the_first_runnable_candidate_is_written_and_the_skipped_ones_named(tmp_path):
    path = tmp_path / "d.toml"
    written = write_spec(
        [shape(2, 4), shape(4, 2)], "m", ["g0=10.0.0.1:4", "g1=10.0.0.2:4"], "cuda", path
    )
    assert written.startswith("4A2F m=2 (skipped: 2A4F needs more FFN devices")
    assert check_spec(tomllib.loads(path.read_text()))


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (["g0=10.0.0.1"], "--host 'g0=10.0.0.1' is invalid; allowed: NAME=ADDRESS:DEVICES"),
        (["g0=10.0.0.1:0"], "DEVICES >= 1"),
        (["g0=10.0.0.1:3"], "too few devices for this shape"),
        ([], "needs at least one --host"),
    ],
)
def test_bad_hosts_are_named(hosts, expected, tmp_path):
    with pytest.raises(SpecError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        write_spec([shape(4, 2)], "m", hosts, "cuda", tmp_path / "d.toml")
    assert not (tmp_path / "d.toml").exists()


def test_afd_plan_writes_a_spec_afd_launch_accepts(tmp_path, capsys):
    path = tmp_path / "plan.toml"
    code = main(
        ["plan", "--model", "qwen3-30b-a3b", "--hardware", "h100", "--tpot-ms", "100",
         "--context", "2048", "--max-devices", "16", "--write-spec", str(path),
         "--host", "g0=10.0.0.1:8", "--host", "g1=10.0.0.2:8"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code in (0, 3) and f"wrote {path}" in out, out
    assert main(["launch", str(path), "--print"]) == 0
    assert "--additional-config" in capsys.readouterr().out

"""`afd ray` (afd_plugin.deploy.ray_launch) without a cluster: each process's bundle (its role's
resources, pinned to its host's node), the check that every spec host is a live node, the
errors before anything is placed, what a server started for an actor does when the actor
dies, and the vLLM fact behind not using vLLM's own Ray DP backend on CPU. The cluster run
is tests/e2e/test_ray.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from afd_plugin.cli import main
from afd_plugin.deploy.ray_launch import bundle, check_nodes
from afd_plugin.deploy.spec import SpecError, check_spec, commands
from tests.afd_plugin.test_deploy_spec import EXAMPLE, example


def _bundles(raw: dict) -> list[tuple[str, str, dict]]:
    d = check_spec(raw)
    return [(c.server, c.host, bundle(d, c)) for c in commands(d, [])]


def test_each_process_gets_one_cpu_pinned_to_its_hosts_node():
    assert _bundles(example()) == [
        ("ffn0", "f", {"CPU": 1.0, "node:198.18.7.1": 0.001}),
        ("attention0", "a0", {"CPU": 1.0, "node:198.18.7.2": 0.001}),
        ("attention0", "a1", {"CPU": 1.0, "node:198.18.7.3": 0.001}),
    ]


@pytest.mark.parametrize("platform, device", [("cuda", "GPU"), ("npu", "NPU")])
def test_accelerators_follow_tp_times_the_local_ranks(platform, device):
    raw = example()
    raw["platform"] = platform
    raw["servers"][1] |= {"tensor_parallel_size": 2, "data_parallel_size": 3}
    raw["servers"][1]["hosts"] = [{"host": "a0", "ranks": 2}, {"host": "a1", "ranks": 1}]
    got = [(host, b[device]) for _, host, b in _bundles(raw)]
    assert got == [("f", 1.0), ("a0", 4.0), ("a1", 2.0)]


def test_a_roles_ray_resources_replace_the_defaults():
    raw = example()
    raw["roles"]["ffn"]["ray_resources"] = {"CPU": 8, "memory": 4e9}
    ffn = _bundles(raw)[0][2]
    assert ffn == {"CPU": 8.0, "memory": 4e9, "node:198.18.7.1": 0.001}
    raw["roles"]["ffn"]["ray_resources"] = {"CPU": -1}
    with pytest.raises(SpecError, match=r"roles\.ffn\.ray_resources\.CPU=-1 is invalid"):
        check_spec(raw)


def test_a_spec_host_that_is_no_live_node_is_named():
    d = check_spec(example())
    nodes = [
        {"NodeManagerAddress": "198.18.7.1", "Alive": True},
        {"NodeManagerAddress": "198.18.7.2", "Alive": True},
        {"NodeManagerAddress": "198.18.7.3", "Alive": False},
    ]
    with pytest.raises(SpecError) as err:
        check_nodes(d, commands(d, []), nodes)
    assert str(err.value) == (
        "afd ray: host 'a1' (198.18.7.3) is not a live node of the Ray cluster; its nodes: "
        "198.18.7.1, 198.18.7.2 (start Ray there with `ray start --address HEAD:PORT "
        "--node-ip-address 198.18.7.3`)"
    )
    nodes[2]["Alive"] = True
    check_nodes(d, commands(d, []), nodes)


def test_afd_ray_refuses_a_bad_spec_before_connecting(tmp_path, capsys):
    spec = tmp_path / "bad.toml"
    spec.write_text('model = "m"\n[hosts.a]\naddress = "10.0.0.1"\n')
    assert main(["ray", str(spec), "--address", "127.0.0.1:1"]) == 2
    assert "deployment spec: servers is missing" in capsys.readouterr().err


def test_afd_ray_names_an_address_where_no_ray_head_listens(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        assert main(["ray", str(EXAMPLE), "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"--address 127.0.0.1:{port}: nothing takes connections there" in err, err
    assert main(["ray", str(EXAMPLE), "--address", "10.0.0.1"]) == 2
    assert "not HOST:PORT of the Ray head" in capsys.readouterr().err


PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from afd_plugin.deploy.ray_launch import _NodeProcess
    from afd_plugin.deploy.launch import _ProcessSpec
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    p = _NodeProcess(_ProcessSpec("child", argv, "127.0.0.1", None), Path(sys.argv[1])).start()
    print(p.proc.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_server_started_for_an_actor_gets_sigterm_when_the_actor_dies(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)  # as Ray kills the actors of a dead driver
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the server outlived the process that started it")


@pytest.mark.vllm
def test_vllms_ray_dp_backend_has_no_device_key_on_cpu():
    """Why afd ray places DP ranks by the spec's hosts: vLLM 0.32's Ray DP placement asks
    each node for `current_platform.ray_device_key` (v1/engine/utils.py), empty on CPU."""
    import inspect

    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine import utils

    assert CpuPlatform.ray_device_key == ""
    assert 'assert n_node_devices, f"No {device_str} found in Ray cluster."' in inspect.getsource(
        utils.CoreEngineActorManager
    )

"""AFD on a real Ray cluster: a head node and two worker nodes, each in its own network
namespace (tests/netns.py), and `afd ray SPEC` run on the head: the FFN server placed on
one worker node, the attention server on the other, and, as the spec's prefill/decode
part (docs/pd.md), a prefill server and `afd pd-router` on the head, each by its bundle of
one placement group. Greedy tokens identical to the colocated server's, straight to the
attention server and through the router (the prompt's whole KV blocks prefilled on the
head, moved by vLLM's ExampleConnector, decoded by AFD); Ctrl-C on the driver stops every
server (their ports close on their nodes), and the cluster is stopped at the end with no
process of it left."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from afd_plugin.deploy.servers import Completion, running
from tests.e2e.conftest import MAX_TOKENS, PROMPTS, assert_same, reference, with_reference
from tests.e2e.test_multi_host import ARCH, ARGS, CLIENT, ENV, START_S, _in, spec_text
from tests.e2e.test_pd import ARGS as PD_ARGS
from tests.e2e.test_pd import PROMPTS as PD_PROMPTS
from tests.e2e.test_pd import kv_config, loaded_tokens
from tests.netns import hosts, listening

pytestmark = pytest.mark.e2e

RAY = str(Path(sys.executable).with_name("ray"))
RAY_PORT = 6379
PLACEMENT_GROUPS = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print(json.dumps([g["state"] for g in ray.util.placement_group_table().values()]))
"""


def _alive_in(sids: list[int]) -> list[str]:
    """Live (not zombie) processes of these sessions."""
    out = subprocess.run(["ps", "-eo", "sid=,pid=,stat=,comm="], capture_output=True, text=True)
    rows = [line.split(None, 3) for line in out.stdout.splitlines()]
    return [" ".join(r) for r in rows if int(r[0]) in sids and not r[2].startswith("Z")]


def _started(node: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while "Ray runtime started" not in log.read_text(errors="replace"):
        assert node.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@contextlib.contextmanager
def ray_cluster(machines, tmp: Path):
    """`ray start --block` on each namespace host (the first is the head, the others join
    it together); stopped, and every process of it gone, afterwards."""
    head = machines[0]
    nodes: list[subprocess.Popen] = []
    logs = [tmp / f"ray-node{i}.log" for i in range(len(machines))]
    short = Path(tempfile.mkdtemp(prefix="afdray", dir="/tmp"))  # AF_UNIX paths: 107 bytes
    try:
        for i, m in enumerate(machines):
            argv = [RAY, "start", "--block", f"--node-ip-address={m.address}", "--num-cpus=2"]
            argv += ["--disable-usage-stats", f"--temp-dir={short / str(i)}"]
            if i == 0:
                argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
            else:
                argv += [f"--address={head.address}:{RAY_PORT}"]
            with open(logs[i], "wb") as log:
                nodes.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", m.name, *argv],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                )  # fmt: skip
            if i == 0:
                _started(nodes[0], logs[0])
        for node, log in zip(nodes[1:], logs[1:], strict=True):
            _started(node, log)
        yield f"{head.address}:{RAY_PORT}"
    finally:
        for p in reversed(nodes):  # workers first, then the head
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
        sids = [p.pid for p in nodes]  # each `ray start` leads its own session
        for sid in sids:  # Ray's workers run in process groups of their own
            subprocess.run(["pkill", "-9", "-s", str(sid)], capture_output=True)
        for p in nodes:
            p.wait(10)
        deadline = time.monotonic() + 15
        while _alive_in(sids) and time.monotonic() < deadline:
            time.sleep(0.5)
        shutil.rmtree(short, ignore_errors=True)
        assert not _alive_in(sids), _alive_in(sids)


# 134 tokens with the tiny tokenizer: 4 whole KV blocks move from prefill to decode
LONG_PROMPT = PD_PROMPTS[0]


def servers(storage: Path) -> str:
    """The spec's servers: FFN on w1, attention (the KV consumer) on w2, the prefill server
    (the KV producer: plain vLLM, eager like the AFD servers) and the router on the head."""

    def kv(role: str) -> list[str]:
        return [*PD_ARGS, *kv_config(role, storage)]  # the P/D module's block size

    return f"""
[[servers]]
name = "ffn0"
role = "ffn"
port = 8100
hosts = "w1"

[[servers]]
name = "attention0"
role = "attention"
port = 8000
hosts = "w2"
args = {json.dumps(kv("kv_consumer"))}

[[servers]]
name = "prefill0"
role = "prefill"
port = 8200
hosts = "h"
args = {json.dumps([*ARGS, "--enforce-eager", *kv("kv_producer")])}
env = {{ {", ".join(f'{k} = "{v}"' for k, v in ENV.items())} }}

[router]
host = "h"
port = 8300
"""


PD_CLIENT = """
import json, sys
from afd_plugin.deploy.servers import complete, post
from tests.e2e.test_pd import prompt_tokens_by_source
router, prefill, decode, max_tokens, prompt = sys.argv[1:4] + [int(sys.argv[4]), sys.argv[5]]
before = prompt_tokens_by_source(decode)
routed = complete(router, prompt, max_tokens, timeout=120)
after = prompt_tokens_by_source(decode)
alone = complete(prefill, prompt, max_tokens, timeout=120)  # an ordinary colocated server
tokens = post(prefill, "/tokenize", {"model": "tiny", "prompt": prompt})["count"]
print(json.dumps({"routed": [routed.token_ids, routed.logprobs],
                  "alone": [alone.token_ids, alone.logprobs], "prompt_tokens": tokens,
                  "loaded": after.get("external_kv_transfer", 0)
                            - before.get("external_kv_transfer", 0)}))
"""


def test_afd_ray_places_each_server_on_its_node_and_gives_the_colocated_tokens(
    checkpoints, log_dir, tmp_path
):
    model = str(checkpoints(ARCH))
    colocated = with_reference(ARCH, model, log_dir, [])
    with (
        hosts(3, tag="afdray") as machines,
        running(colocated, timeout=600),
        ray_cluster(machines, tmp_path) as address,
    ):
        head, w1, w2 = machines
        spec = tmp_path / "deploy.toml"
        text = spec_text(model, {"h": head, "w1": w1, "w2": w2}, servers(tmp_path / "kv"))
        # vLLM's prompt tokens by source on the decode server's /metrics show the KV moved
        spec.write_text(text.replace(', "--disable-log-stats"', ""))
        driver_log = tmp_path / "afd-ray.log"
        with open(driver_log, "wb") as log:
            driver = subprocess.Popen(
                ["ip", "netns", "exec", head.name, sys.executable, "-X", "faulthandler", "-m",
                 "afd_plugin.cli",
                 "ray", str(spec), "--address", address, "--log-dir", str(log_dir / "ray"),
                 "--timeout", str(START_S)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            started = time.monotonic()
            while "all up" not in driver_log.read_text(errors="replace"):
                assert driver.poll() is None, driver_log.read_text()[-5000:]
                assert time.monotonic() - started < START_S + 60, driver_log.read_text()[-5000:]
                time.sleep(2)
            print(f"\nafd ray: healthy after {time.monotonic() - started:.0f} s")
            url = f"http://{w2.address}:8000"
            rows = json.loads(_in(w2, "-c", CLIENT, url, str(MAX_TOKENS), json.dumps(PROMPTS)))
            got = [Completion(*row) for row in rows]
            pd = json.loads(
                _in(head, "-c", PD_CLIENT, f"http://{head.address}:8300",
                    f"http://{head.address}:8200", url, str(MAX_TOKENS), LONG_PROMPT)
            )  # fmt: skip
            # each server on its own node: the rendezvous and FFN API on w1, attention on w2
            on_w1, on_w2 = listening(w1.name), listening(w2.name)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(driver.pid, signal.SIGINT)  # Ctrl-C: the driver stops everything
            try:
                driver.wait(120)
            except subprocess.TimeoutExpired:
                os.kill(driver.pid, signal.SIGABRT)  # its Python stacks into its log
                with contextlib.suppress(subprocess.TimeoutExpired):
                    driver.wait(10)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(driver.pid, signal.SIGKILL)
                driver.wait(10)
        out = driver_log.read_text()
        assert driver.returncode == 130, out[-5000:]
        groups = _in(head, "-c", PLACEMENT_GROUPS, address)
        assert json.loads(groups) == ["REMOVED"], groups
        assert_same(reference(ARCH, colocated), got)
        # through the router: what the colocated prefill server computes alone, with every
        # whole block below the prompt's last token loaded from the connector
        assert pd["routed"][0] == pd["alone"][0], pd
        worst = max(abs(a - b) for a, b in zip(pd["routed"][1], pd["alone"][1], strict=True))
        assert worst <= 1e-5, pd
        assert pd["loaded"] == loaded_tokens(pd["prompt_tokens"]) > 0, pd
        assert "placing prefill0 on h" in out and "placing router on h" in out, out
        assert {f"{w1.address}:29650", f"{w1.address}:8100"} <= set(on_w1), on_w1
        assert f"{w2.address}:8000" in on_w2 and f"{w2.address}:8100" not in on_w2, on_w2
        assert "placing ffn0 on w1" in out and "placing attention0 on w2" in out, out
        # stopped by the driver: nothing of the deployment listens any more
        gone = [
            a
            for m in (head, w1, w2)
            for a in listening(m.name)
            if a.endswith((":8000", ":8100", ":8200", ":8300", ":29650"))
        ]
        assert not gone, gone

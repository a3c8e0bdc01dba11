"""The afd_* metrics and /health with `--api-server-count` above 1 (issue 36).

vLLM then starts its API server processes and its engine cores side by side under `vllm
serve`, and each API server process serves a registry of its own making on /metrics
(PROMETHEUS_MULTIPROC_DIR). Here the test process stands for `vllm serve`: one child
publishes an attention rank's snapshot (its FFN rank lost), two children are API server
processes 0 and 1 of 2, each building vLLM 0.32's /metrics routes (real code) with AFD's
patches, as `vllm serve --api-server-count 2` does. The end-to-end check
with real servers is tests/e2e/test_ops.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.vllm

RANK = """
import sys
from afd_core.metrics import RoleMetrics
m = RoleMetrics("attention", 0)
m.info.update(connector="gloo", server="0")
m.set_peers([0], False)
m.count_step(False, 0.01)
m.publish(now=True)
print("published", flush=True)
sys.stdin.read()  # alive until the test ends
"""

API_SERVER = """
import json, os, sys
from afd_core import metrics
from afd_core.patches import metrics_registry
from afd_core.registration import StepStatus

status, _ = metrics_registry.apply()
assert status is StepStatus.DEFERRED, status  # applied when vLLM imports the module
api_rank = int(sys.argv[1])
metrics.register_collector(metrics.server_root_pid(2, api_rank))
from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.entrypoints.serve.instrumentator import register_instrumentator_api_routers

app = FastAPI()
register_instrumentator_api_routers(app)  # what vLLM's build_app calls
text = TestClient(app).get("/metrics").text
own_pid_root = metrics.AFDCollector(os.environ["AFD_METRICS_DIR"], os.getpid())
print(json.dumps({
    "afd": sorted({line.split("{")[0] for line in text.splitlines() if line.startswith("afd_")}),
    "peer_up": [line for line in text.splitlines() if line.startswith("afd_peer_up{")],
    "gone": metrics.ffn_ranks_gone(),
    "own_pid_root_sees": len(own_pid_root._snapshots()),
}))
"""


def test_each_api_server_process_serves_the_ranks_metrics_and_health(tmp_path):
    env = {
        **os.environ,
        "AFD_METRICS_DIR": str(tmp_path / "afd"),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),  # as vLLM sets it for them
    }
    (tmp_path / "prom").mkdir()
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)  # fmt: skip
    try:
        assert rank.stdout.readline().strip() == "published"
        for api_rank in (0, 1):
            out = subprocess.run(
                [sys.executable, "-c", API_SERVER, str(api_rank)],
                capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr[-3000:]
            seen = json.loads(out.stdout.strip().splitlines()[-1])
            assert seen["peer_up"] == ['afd_peer_up{peer="0",rank="0",role="attention"} 0.0']
            for name in ("afd_info", "afd_steps_total", "afd_step_duration_seconds_count",
                         "afd_last_step_age_seconds"):  # fmt: skip
                assert name in seen["afd"], (name, seen["afd"])
            # /health's patch reads the same snapshots: 503 in this process too
            assert seen["gone"] == ["attention rank 0 has no FFN rank 0"]
            # the ranks are the API server's siblings: rooted at itself it would see none
            assert seen["own_pid_root_sees"] == 0
    finally:
        rank.stdin.close()
        rank.wait(30)


def test_the_root_is_vllm_serve_only_for_an_api_server_of_several():
    from afd_core.metrics import server_root_pid

    assert server_root_pid(1, 0) == os.getpid()  # one API server: vllm serve itself
    assert server_root_pid(2, -1) == os.getpid()  # vllm serve, which starts them
    assert server_root_pid(2, 1) == os.getppid()


def test_the_default_registry_is_left_alone(monkeypatch):
    """One API server (no PROMETHEUS_MULTIPROC_DIR): vLLM serves the default registry,
    where the collector is already; it is not registered twice."""
    from prometheus_client import REGISTRY

    from afd_core import metrics

    collector = metrics.AFDCollector("/nonexistent", os.getpid())
    monkeypatch.setattr(metrics, "_registered", collector)
    metrics.serve_on(REGISTRY)  # would raise on a duplicate if it registered
    assert collector not in REGISTRY._collector_to_names

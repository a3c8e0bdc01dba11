"""The README's main job, `afd demo`, run as a user runs it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def afd_exe() -> str:
    return shutil.which("afd", path=str(Path(sys.executable).parent))


def leftover(marker: str) -> list[str]:
    r = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
    return [ln for ln in r.stdout.splitlines() if "pgrep" not in ln]


def test_demo_runs_and_matches_colocated(tmp_path):
    env = {**os.environ, "AFD_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run(
        [
            afd_exe(),
            "demo",
            "--arch",
            "qwen3_moe",
            "--max-tokens",
            "8",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]", "waiting for", "all healthy"):
        assert step in out
    assert out.count("[same tokens]") == 4
    assert "time per output token   AFD 1A1F:" in out and "ratio AFD/colocated:" in out
    assert "tokens matched the colocated server: yes" in out
    assert leftover(str(tmp_path)) == []  # every server it started is gone


def test_ctrl_c_stops_every_server(tmp_path):
    env = {**os.environ, "AFD_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [afd_exe(), "demo", "--arch", "qwen3_moe", "--no-baseline"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # as from a terminal: a suite started in the background (`./scripts/test &` in a
        # script) hands its children SIGINT ignored, and Python then keeps it ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(leftover(str(tmp_path / "cache"))) < 2:
        time.sleep(1)  # both servers are starting
    assert len(leftover(str(tmp_path / "cache"))) >= 2
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted; every server it started was stopped" in err
    time.sleep(1)
    assert leftover(str(tmp_path / "cache")) == []

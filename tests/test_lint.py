"""The code style the project's ruff config asks for (pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

TREES = ["packages", "tests", "benchmarks", "docker"]


def ruff() -> str:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert exe, "ruff (dev group) is not installed"
    return exe


def test_ruff_check():
    r = subprocess.run([ruff(), "check", *TREES], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format():
    r = subprocess.run(
        [ruff(), "format", "--check", *TREES], capture_output=True, text=True, cwd=REPO
    )
    assert r.returncode == 0, r.stdout + r.stderr

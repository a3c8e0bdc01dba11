"""The stand-in torch_npu / vllm_ascend packages (tests/afd_npu/standin), importable only
inside the `ascend` fixture: put on sys.path for a test module, then removed with every
module imported from them and every patch the afd-npu tests installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

STANDIN = Path(__file__).resolve().parent / "standin"
STANDIN_PACKAGES = (
    "torch_npu",
    "vllm_ascend",
    "afd_npu.workers.npu_worker",
    "afd_npu.models.deepseek_v4",
)


def _forget_standin_modules() -> None:
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in STANDIN_PACKAGES):
            del sys.modules[name]


@pytest.fixture(scope="module")
def ascend():
    """The stand-in vllm_ascend package, freshly imported for this module."""
    import importlib

    _forget_standin_modules()
    sys.path.insert(0, str(STANDIN))
    try:
        yield importlib.import_module("vllm_ascend")
    finally:
        from afd_npu.patches.ascend_config import restore_afd_ascend_config_patch

        restore_afd_ascend_config_patch()
        sys.path.remove(str(STANDIN))
        _forget_standin_modules()

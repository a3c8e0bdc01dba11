import sys
import types

import pytest

from afd_core import registration as reg
from afd_core.patches.import_hooks import pending, when_imported


def test_runs_now_when_already_imported():
    seen = []
    assert when_imported("json", lambda m: seen.append(m.__name__), "probe") is True
    assert seen == ["json"]


def test_runs_right_after_a_later_import(tmp_path, monkeypatch):
    pkg = tmp_path / "afd_hook_probe_mod.py"
    pkg.write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def bump(module):
        seen.append(module.VALUE)
        module.VALUE += 1

    assert when_imported("afd_hook_probe_mod", bump, "probe") is False
    assert "afd_hook_probe_mod" in pending()
    import afd_hook_probe_mod  # noqa: F401 - the import under test

    assert seen == [41] and sys.modules["afd_hook_probe_mod"].VALUE == 42
    assert "afd_hook_probe_mod" not in pending()
    sys.modules.pop("afd_hook_probe_mod", None)


def test_unrelated_imports_are_untouched():
    mod = types.ModuleType("x")
    assert when_imported("afd_never_imported_module", lambda m: None, "probe") is False
    import email.mime.text  # noqa: F401

    assert "afd_never_imported_module" in pending()
    del mod


def _broken(module):
    raise RuntimeError(f"cannot patch {module.__name__}")


@pytest.mark.parametrize("propagate", [False, True])
def test_a_failing_deferred_step_is_recorded_and_propagates_only_if_needed(
    tmp_path, monkeypatch, propagate
):
    name = f"afd_hook_broken_{int(propagate)}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    step = f"patch:probe_{int(propagate)}"
    assert when_imported(name, _broken, step, lambda: propagate) is False
    try:
        if propagate:
            with pytest.raises(RuntimeError, match=f"cannot patch {name}"):
                __import__(name)
        else:
            assert __import__(name).VALUE == 1  # vLLM's import goes on
        rec = reg.records()[step]
        assert rec.status is reg.StepStatus.FAILED and f"cannot patch {name}" in rec.reason
    finally:
        sys.modules.pop(name, None)

import os
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


FORCED_FAILURE = """
import importlib, os, sys
from afd_core import registration as reg
patch = importlib.import_module("afd_core.patches." + sys.argv[1])
def broken(module):
    raise RuntimeError("forced failure of " + sys.argv[1])
patch._patch = broken
assert sys.argv[2] not in sys.modules
status, _ = patch.apply()
assert status is reg.StepStatus.DEFERRED, status
try:
    importlib.import_module(sys.argv[2])
except RuntimeError as exc:
    print("STOPPED", exc)
else:
    print("IMPORTED", reg.records()["patch:" + sys.argv[1]].status.value)
"""
DEFERRED_PATCHES = {
    "engine_core": "vllm.v1.engine.async_llm",
    "health": "vllm.v1.engine.async_llm",
    "metrics_registry": "vllm.entrypoints.serve.instrumentator.metrics",
    "step_failure": "vllm.v1.core.sched.scheduler",
    "cpu_dp_collectives": "vllm.distributed.device_communicators.cpu_communicator",
    "mrv2_ubatch_runner": "vllm.v1.worker.gpu.model_runner",
}


@pytest.mark.vllm
def test_a_deferred_patch_that_fails_in_an_afd_servers_process_stops_it():
    """vLLM builds the config (where AFD's start-up check runs) before it imports the
    modules these patches touch, so a failure there came after the check: the check marks
    the process (and the engine-core and worker processes it starts) as an AFD server's,
    and then a failing deferred patch stops the import, naming it. Each deferred patch is
    forced to fail in a fresh process; without the mark vLLM's import goes on and the
    failure is only recorded."""
    import os
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from afd_core import envs

    def run(patch, module, marked):
        env = {k: v for k, v in os.environ.items() if k != envs.AFD_DEPLOYMENT_ROLE}
        if marked:
            env[envs.AFD_DEPLOYMENT_ROLE] = "ffn"
        out = subprocess.run(
            [sys.executable, "-c", FORCED_FAILURE, patch, module],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()[-1]

    jobs = [(p, m, True) for p, m in DEFERRED_PATCHES.items()] + [
        ("engine_core", DEFERRED_PATCHES["engine_core"], False)
    ]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda job: run(*job), jobs))
    n = len(DEFERRED_PATCHES)
    for (patch, _, _), line in zip(jobs[:n], results[:n], strict=True):
        assert line == f"STOPPED forced failure of {patch}", line
    assert results[n] == "IMPORTED failed"


def test_the_start_up_check_marks_the_process_as_an_afd_servers(monkeypatch):
    from afd_core import envs

    monkeypatch.delenv(envs.AFD_DEPLOYMENT_ROLE, raising=False)
    assert not envs.in_deployment()
    envs.mark_deployment("attention")
    assert envs.in_deployment() and os.environ[envs.AFD_DEPLOYMENT_ROLE] == "attention"

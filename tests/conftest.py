"""Shared test helpers. Importing this needs neither torch nor vLLM."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config, items):
    skip_vllm = pytest.mark.skip(reason="vLLM is not installed in this environment (core lane)")
    for item in items:
        needs_vllm = item.get_closest_marker("vllm") or item.get_closest_marker("e2e")
        if not HAVE_VLLM and needs_vllm:
            item.add_marker(skip_vllm)
    # one definition of the end-to-end tier: its folder (the workers' lane) and its marker
    # (`-m "not e2e"`) must name the same tests
    for item in items:
        if item.nodeid.startswith(E2E_LANE) != (item.get_closest_marker("e2e") is not None):
            raise pytest.UsageError(
                f"{item.nodeid}: end-to-end tests live in {E2E_LANE} and carry the e2e "
                "marker (pytestmark = pytest.mark.e2e); others do neither"
            )
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # on several workers (./scripts/test) the end-to-end lane is handed out first
        # (pytest_xdist_make_scheduler), so the other modules run beside it
        items.sort(key=lambda item: not item.nodeid.startswith(E2E_LANE))


E2E_LANE = "tests/e2e/"


def _worker_port_range() -> str | None:
    """This xdist worker's own slice of the ports below the kernel's ephemeral range, for
    free_port (AFD_PORT_RANGE): a port one worker picked and has not bound yet is then
    never picked by the other, nor handed by the kernel to a connection's local end or a
    bind to port 0 (it happened: a store's port, picked, was taken before it was bound)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 1:
        return None
    try:
        ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        end = int(ephemeral[0])
    except (OSError, ValueError, IndexError):
        return None
    start = max(10000, end - 12000)
    width = (end - start) // count
    if width < 500:
        return None
    low = start + int(worker[2:]) * width
    return f"{low}-{low + width - 1}"


if (_ports := _worker_port_range()) is not None:
    os.environ.setdefault("AFD_PORT_RANGE", _ports)  # the servers and processes it starts too


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Work units for ./scripts/test's workers: every end-to-end module together, one
    after the other on one worker (each starts several vLLM servers, which keep this
    machine's CPUs busy and use up to 15 GiB: two at once doubled each one's time and
    came within 1 GiB of the memory), every other module a unit of its own on the others
    (a module's tests share its fixtures)."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return E2E_LANE if nodeid.startswith(E2E_LANE) else nodeid.split("::", 1)[0]

    return Lanes(config, log)


# set in a process by AFD's start-up check (prepare_afd_config) for the servers it starts:
# a test that runs the check in the pytest process must not hand them to later servers
PROCESS_MARKS = (
    "AFD_METRICS_DIR",
    "AFD_DEPLOYMENT_ROLE",
    "AFD_SERVER_RANKS",
    "VLLM_USE_V2_MODEL_RUNNER",  # vLLM's runner choice, pinned (config_validation)
)


@pytest.fixture(autouse=True)
def _afd_process_marks_stay_in_their_test():
    before = {name: os.environ.get(name) for name in PROCESS_MARKS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def run_python(code: str, *, hide: tuple[str, ...] = (), env: dict | None = None, timeout=300):
    """Run code in a fresh interpreter of this environment; hide= makes modules unimportable
    (sys.modules[name] = None: `import` fails and importlib.util.find_spec returns None)."""
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in hide)
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
    )


# Test-only: a Triton backend entry named "cpu" for Triton's interpreter, with which vLLM's
# CPU build picks its model runner V2 here (tests/support/triton_cpu_site; docs/development.md)
TRITON_CPU_SITE = REPO / "tests" / "support" / "triton_cpu_site"


def mrv2_env(env: dict | None = None) -> dict:
    """What a server process needs, on top of `env`, for vLLM to pick model runner V2 on
    this machine: Triton's interpreter and the test-only "cpu" backend entry on its path."""
    env = dict(env or {})
    path = [
        str(TRITON_CPU_SITE),
        *filter(None, [env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))]),
    ]
    return env | {"PYTHONPATH": os.pathsep.join(path), "TRITON_INTERPRET": "1"}


AVX2_ONLY_SITE = REPO / "tests" / "afd_models" / "stand_ins" / "avx2_only"
X86 = platform.machine().lower() in ("x86_64", "amd64")


def avx2_only_env(env: dict | None = None) -> dict:
    """The environment (os.environ, then `env`) of a subprocess that stands in for an x86-64
    CPU with AVX2 and no AVX-512: vLLM loads its AVX2 kernels (vllm._C_AVX2) and torch and
    oneDNN run AVX2 code (tests/afd_models/stand_ins/README.md). x86-64 only (X86)."""
    full = {**os.environ, **(env or {})}
    path = [str(AVX2_ONLY_SITE), *filter(None, [full.get("PYTHONPATH")])]
    return full | {
        "PYTHONPATH": os.pathsep.join(path),
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch -> checkpoint dir, built on first use (AFD_CACHE_DIR reuses a cache if set)."""
    from afd_models.tiny import TinySpec, tiny_checkpoint

    cache = os.environ.get("AFD_TEST_CACHE_DIR")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = tiny_checkpoint(TinySpec(arch), cache_dir=root)
        return built[arch]

    return get


def platform_hook_check(platform_cls, model: str, graph_mode: str = "NONE"):
    """check(afd, ...): a real vLLM config built on CPU for `model`, given the `afd` key (and
    other additional config), a graph mode and parallel-config fields (`worker_cls` "auto"
    unless given; `before()` runs right after the build), then run through
    `platform_cls.check_and_update_config` as that platform's (patched) hook would be."""

    def check(afd, graph_mode=graph_mode, additional=None, before=lambda: None, **parallel):
        from vllm.config import CUDAGraphMode
        from vllm.engine.arg_utils import EngineArgs

        cfg = EngineArgs(model=model, max_model_len=128, enforce_eager=True).create_engine_config()
        before()
        cfg.additional_config = {"afd": dict(afd), **(additional or {})}
        cfg.compilation_config.cudagraph_mode = getattr(CUDAGraphMode, graph_mode)
        pc = cfg.parallel_config
        pc.worker_cls = parallel.pop("worker_cls", "auto")
        for k, v in parallel.items():
            setattr(pc, k, v)
        platform_cls.check_and_update_config(cfg)
        return cfg

    return check

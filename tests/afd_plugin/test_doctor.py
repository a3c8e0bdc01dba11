"""`afd doctor`, run the README's way (the console script), with and without vLLM."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from afd_models import cpu_ops
from afd_plugin.doctor import render_cpu_kernels
from tests.conftest import run_python


def afd_exe() -> str:
    exe = shutil.which("afd", path=str(Path(sys.executable).parent))
    assert exe, "the afd console script is not installed"
    return exe


DEFERRED_STEP_FAILS = (
    "import sys, afd_core.patches.step_failure as sf\n"
    "def moved(module): raise RuntimeError('update_from_output moved')\n"
    "sf._patch = moved\n"
    "from afd_plugin.cli import main; sys.exit(main(['doctor']))"
)


@pytest.fixture(scope="module")
def doctor_runs():
    """The doctor runs with vLLM, started together: each is mostly one core importing vLLM."""
    from concurrent.futures import ThreadPoolExecutor

    def cli(*args):
        return subprocess.run([afd_exe(), *args], capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = {
            "text": pool.submit(cli, "doctor"),
            "json": pool.submit(cli, "doctor", "--json"),
            "deferred step fails": pool.submit(run_python, DEFERRED_STEP_FAILS),
        }
        return {name: future.result() for name, future in runs.items()}


@pytest.mark.vllm
def test_doctor_reports_vllm_cpu_and_passes(doctor_runs):
    r = doctor_runs["text"]
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "vllm                0.32.0 (distribution vllm-cpu)" in out
    assert "supported vllm      0.32.0 -> yes" in out
    assert "platform            cpu" in out
    assert "patch:config_validation                applied" in out
    # deferred steps are resolved by importing what they wait for, as a server would
    assert "patch:engine_core                      applied" in out
    assert "patch:step_failure                     applied" in out
    for name in ("async_dp_engine", "engine_core", "replaces: vllm.platforms.cpu.CpuPlatform"):
        assert name in out
    assert "AFDDeepseekV2ForCausalLM" in out and "AFDQwen3MoeForCausalLM" in out
    assert "gloo         platforms: cpu  (usable here)" in out
    assert "vLLM CPU kernels: vllm._C" in out  # which of its builds depends on the CPU
    assert "DeepseekV4ForCausalLM                  needs 16 ops only vllm._C" in out
    assert out.rstrip().endswith("AFD can run here.")


@pytest.mark.vllm
def test_doctor_json(doctor_runs):
    r = doctor_runs["json"]
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["ok"] is True
    assert report["vllm_distribution"] == "vllm-cpu" and report["platform"] == "cpu"
    assert report["patches"]["async_dp_engine"]["status"] == "applied"
    assert len(report["models"]) == 8
    step = report["steps"]["patch:engine_core"]
    assert step == {"status": "applied", "reason": step["reason"]}

    def no_list_of_lists(value) -> bool:  # records are objects, lists hold names only
        if isinstance(value, dict):
            return all(no_list_of_lists(v) for v in value.values())
        if isinstance(value, list):
            return all(not isinstance(v, list) and no_list_of_lists(v) for v in value)
        return True

    assert no_list_of_lists(report)
    # progress on stderr while vLLM imports; stdout is the JSON alone
    assert "afd doctor: importing vLLM 0.32.0 (vllm-cpu)" in r.stderr, r.stderr
    assert "afd doctor: registering AFD" in r.stderr
    # DeepSeek-V4's ops are in vLLM's AVX-512 BF16 kernels only: all here or none
    kernels = report["cpu_kernels"]
    for role, ops in kernels["models"]["DeepseekV4ForCausalLM"].items():
        assert ops["needs"] == cpu_ops.needed("DeepseekV4ForCausalLM", [role])
        assert ops["missing"] == ([] if kernels["library"] == "vllm._C" else ops["needs"])


def test_doctor_names_the_ops_a_model_lacks_where_they_are_missing():
    """What an AVX2-only CPU shows (vLLM's AVX2 kernels lack every op V4 needs)."""
    avx2 = cpu_ops.report("vllm._C_AVX2", has=lambda op: False)
    lines = render_cpu_kernels(avx2)
    assert lines[1] == "vLLM CPU kernels: vllm._C_AVX2 (AVX2)"
    v4 = lines[2]
    assert v4.startswith("  DeepseekV4ForCausalLM                  needs 16 ops only vllm._C ")
    assert "(AVX-512 with BF16) has (attention 14, ffn 2): cannot run here: " in v4
    assert "attention lacks convert_weight_packed, bmm_cpu, " in v4
    assert v4.endswith("; ffn lacks biased_topk_cpu, hash_topk_cpu")
    here = render_cpu_kernels(cpu_ops.report("vllm._C", has=lambda op: True))
    assert here[2].endswith("(attention 14, ffn 2): all here")


@pytest.mark.vllm
def test_doctor_shows_a_deferred_step_that_fails_later(doctor_runs):
    r = doctor_runs["deferred step fails"]
    assert r.returncode == 1, r.stdout + r.stderr
    assert (
        "patch:step_failure                     failed  (RuntimeError: update_from_output"
        in r.stdout
    )
    assert "AFD cannot run here:" in r.stdout


def test_doctor_without_vllm_fails_with_the_reason():
    r = run_python(
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "def version(n):\n"
        "    if n in ('vllm', 'vllm-cpu'): raise m.PackageNotFoundError(n)\n"
        "    return real(n)\n"
        "m.version = version\n"
        "import sys; from afd_plugin.cli import main; sys.exit(main(['doctor']))",
        hide=("vllm",),
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "vllm                not installed" in r.stdout
    assert "vLLM is not installed: install afd-plugin[cpu], [cuda] or [npu]" in r.stdout


def test_demo_rejects_bad_options():
    for args, needle in (
        (["--shape", "1A2F"], "num_attention_ranks=1 < num_ffn_ranks=2"),
        (["--shape", "2A3F"], "num_attention_ranks=2 < num_ffn_ranks=3"),
        (["--shape", "x"], "expected <A>A<F>F"),
        (["--max-tokens", "0"], "allowed 1 or more"),
    ):
        r = subprocess.run([afd_exe(), "demo", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr, (args, r.stderr)

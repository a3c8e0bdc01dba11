"""Each role builds and loads only its own modules (a real vLLM model build on CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
PROBE = Path(__file__).with_name("role_build_probe.py")
BACKENDS = {
    "deepseek_v2": "CPU_MLA",
    "deepseek_v3": "CPU_MLA",
    "deepseek_v32": "CPU_MLA",
    "glm_moe_dsa": "CPU_MLA",
    "qwen3_moe": None,
}
SPARSE = ("deepseek_v32", "glm_moe_dsa")  # CPU refuses their sparse attention: a stand-in
GATED = "deepseek_v3 gate on attention"
V4 = "deepseek_v4"  # bf16: what vLLM's CPU kernels for V4 take; only its AVX-512 BF16 build
# has them (afd_models.cpu_ops): elsewhere V4's tests skip, naming the missing ops
Q35 = "qwen3_5_moe"  # bf16: its linear attention runs only in bf16 on CPU
STAND_INS = Path(__file__).with_name("stand_ins")  # torchvision, for vLLM's qwen3_5 import
BAD_CONFIG = ("deepseek_v2", "ffn with a bad afd config")
HIDDEN_OP = (V4, "attention with convert_weight_packed hidden")


def probe(jobs, env=None) -> dict:
    """key -> what the probe process reported for that job; a job it never reported (the
    process died or timed out before it) -> an error with the process's output."""
    cmd = [sys.executable, str(PROBE), json.dumps(jobs)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        stdout, died = r.stdout, f"exited {r.returncode}; stderr ends:\n{r.stderr[-3000:]}"
    except subprocess.TimeoutExpired as exc:  # what it wrote may come as bytes
        stdout, stderr = (
            t.decode() if isinstance(t, bytes) else t or "" for t in (exc.stdout, exc.stderr)
        )
        died = f"timed out; stderr ends:\n{stderr[-3000:]}"
    out = {}
    for line in stdout.splitlines():
        if line.startswith('{"key"'):
            d = json.loads(line)
            out[tuple(d["key"])] = d
    for job in jobs:
        out.setdefault(tuple(job["key"]), {"error": f"the probe process {died}"})
    return out


def outcome(d: dict, key) -> dict:
    """A job's result; skips when the probe found vLLM CPU ops missing, fails on an error."""
    if "missing_ops" in d:
        pytest.skip(d["skip"])
    if "error" in d:
        pytest.fail(f"building {key} failed:\n{d['error']}", pytrace=False)
    return d


@pytest.fixture(scope="module")
def built(checkpoints):
    """(arch, role) -> what the built model holds (a job that failed fails its own tests
    only, one lacking vLLM CPU ops skips them); the builds split over three processes."""
    jobs = [
        {
            "key": [arch, role],
            "checkpoint": str(checkpoints(arch)),
            "role": role,
            "backend": backend,
            "dense_for_sparse": arch in SPARSE,
        }
        for arch, backend in BACKENDS.items()
        for role in ("attention", "ffn")
    ]
    for role in ("attention", "ffn"):  # the router on the attention side
        jobs.append(
            {
                "key": [GATED, role],
                "checkpoint": str(checkpoints("deepseek_v3")),
                "role": role,
                "backend": "CPU_MLA",
                "afd": {"compute_gate_on_attention": True},
            }
        )

    v4 = str(checkpoints(V4))
    for role in ("attention", "ffn", "ffn-vs-native"):
        jobs.append({"key": [V4, role], "checkpoint": v4, "role": role, "dtype": "bfloat16"})
    jobs[-1] |= {"native_layers": "model.layers", "native_ffn": "ffn", "token_ids": True}
    # Qwen3.5-MoE: its own process, with the torchvision stand-in if torchvision is missing
    q35 = str(checkpoints(Q35))
    q35_jobs = [
        {"key": [Q35, role], "checkpoint": q35, "role": role, "dtype": "bfloat16"}
        for role in ("attention", "ffn", "ffn-vs-native")
    ]
    q35_jobs[-1] |= {
        "native_layers": "language_model.model.layers",
        "native_ffn": "mlp",
        "token_ids": False,
    }
    q35_env = dict(os.environ)
    if importlib.util.find_spec("torchvision") is None:
        q35_env["PYTHONPATH"] = os.pathsep.join(
            [str(STAND_INS), *filter(None, [os.environ.get("PYTHONPATH")])]
        )

    # a job that fails, first in a process: the tests of the jobs after it show it went on
    bad = {"key": BAD_CONFIG, "checkpoint": str(checkpoints("deepseek_v2")), "role": "ffn"}
    bad |= {"backend": "CPU_MLA", "afd": {"num_attention_ranks": 0}}
    # a job whose vLLM CPU op is taken as missing (what CPUs without AVX-512 BF16 get)
    hidden = {"key": HIDDEN_OP, "checkpoint": v4, "role": "attention", "dtype": "bfloat16"}
    hidden["hide_vllm_ops"] = ["convert_weight_packed"]
    # one process per core: each is mostly importing vLLM, then building tiny models
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(probe, [bad, hidden, *jobs[0::2]]), pool.submit(probe, jobs[1::2])]
        futures.append(pool.submit(probe, q35_jobs, q35_env))
        out = {k: d for f in futures for k, d in f.result().items()}
    return lambda *key: outcome(out[key], key)


def is_mlp(name: str) -> bool:
    return ".mlp." in name


@pytest.mark.parametrize("arch", list(BACKENDS))
def test_attention_role_holds_no_ffn_weights(built, arch):
    d = built(arch, "attention")
    names = list(d["params"])
    assert not [n for n in names if is_mlp(n)]
    assert any("embed_tokens" in n for n in names) and any("lm_head" in n for n in names)
    assert any("self_attn" in n for n in names)
    # bytes as built equal the checkpoint's attention-role tensors exactly
    assert sum(d["at_load"].values()) == sum(v for k, v in d["ckpt"].items() if not is_mlp(k))
    # the loader was handed every attention tensor once, and no FFN tensor
    assert sorted(d["seen"]) == sorted(k for k in d["ckpt"] if not is_mlp(k))
    assert "RemoteFFN" in d["modules"] and "MoERunner" not in d["modules"]


@pytest.mark.parametrize("arch", list(BACKENDS))
def test_ffn_role_holds_only_ffn_weights(built, arch):
    d = built(arch, "ffn")
    names = list(d["params"])
    assert names and all(is_mlp(n) for n in names)
    assert sum(d["at_load"].values()) == sum(v for k, v in d["ckpt"].items() if is_mlp(k))
    assert sorted(d["seen"]) == sorted(k for k in d["ckpt"] if is_mlp(k))
    assert "MoERunner" in d["modules"]
    assert not {"MLAAttention", "Attention", "VocabParallelEmbedding", "ParallelLMHead"} & set(
        d["modules"]
    )


def is_router_projection(name: str) -> bool:
    return name.endswith(".mlp.gate.weight")


def test_gate_on_attention_moves_the_router_projection_and_nothing_else(built):
    att, ffn = built(GATED, "attention"), built(GATED, "ffn")
    routers = sorted(k for k in att["ckpt"] if is_router_projection(k))
    assert len(routers) == 2  # MoE layers 1 and 2; layer 0 is dense
    # attention: its own tensors plus each MoE layer's router projection, built and loaded
    assert sorted(att["seen"]) == sorted(
        k for k in att["ckpt"] if not is_mlp(k) or is_router_projection(k)
    )
    assert [n for n in att["params"] if is_mlp(n)] == routers
    assert "GatedRemoteFFN" in att["modules"] and "MoERunner" not in att["modules"]
    # FFN: every MLP tensor but the router projection; the routing bias stays here
    assert sorted(ffn["seen"]) == sorted(
        k for k in ffn["ckpt"] if is_mlp(k) and not is_router_projection(k)
    )
    assert not [n for n in ffn["params"] if is_router_projection(n)]
    assert any(n.endswith("mlp.gate.e_score_correction_bias") for n in ffn["params"])
    assert "GateLinear" not in ffn["modules"] and "MoERunner" in ffn["modules"]


@pytest.mark.parametrize("arch", SPARSE)
def test_the_sparse_attention_indexer_stays_on_the_attention_side(built, arch):
    """V3.2 / GLM-MoE-DSA: vLLM's V3.2 model, not a V3 one without the indexer."""
    att = built(arch, "attention")
    assert att["cls"] == {"deepseek_v32": "AFDDeepseekV3ForCausalLM"}.get(
        arch, "AFDGlmMoeDsaForCausalLM"
    )
    assert {"Indexer", "SparseAttnIndexer", "DeepseekV32IndexerCache"} <= set(att["modules"])
    indexer_tensors = [k for k in att["ckpt"] if ".self_attn.indexer." in k]
    assert len(indexer_tensors) == 3 * 5  # wq_b, wk, k_norm (weight, bias), weights_proj
    assert set(indexer_tensors) <= set(att["seen"])
    assert not [n for n in built(arch, "ffn")["params"] if "indexer" in n]


def test_vllm_cpu_refuses_sparse_attention():
    """Why V3.2 / GLM-MoE-DSA have no end-to-end test on CPU (the README's model table)."""
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    sparse = AttentionSelectorConfig(576, torch.float32, None, None, use_mla=True, use_sparse=True)
    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported on CPU"):
        CpuPlatform.get_attn_backend_cls(None, sparse)


def is_v4_ffn(name: str) -> bool:
    return re.search(r"(^|\.)layers\.\d+\.ffn\.", name) is not None


def test_deepseek_v4_attention_role_keeps_the_streams_and_sends_the_ffn(built):
    att = built(V4, "attention")
    assert not [n for n in att["params"] if is_v4_ffn(n)]
    # the stream mixing and the norm around the FFN stay here, with attention and the head
    for name in ("model.layers.0.hc_ffn_fn", "model.layers.0.ffn_norm.weight", "lm_head.weight"):
        assert name in att["params"], name
    assert {"DeepseekV4CPUAttention", "DeepseekV4CPUIndexer", "RemoteFFN"} <= set(att["modules"])
    assert "MoERunner" not in att["modules"]
    assert sorted(att["seen"]) == sorted(k for k in att["ckpt"] if not is_v4_ffn(k))


def test_deepseek_v4_ffn_role_holds_only_the_moe_and_matches_vllms_own_layers(built):
    ffn = built(V4, "ffn")
    assert ffn["params"] and all(is_v4_ffn(n) for n in ffn["params"])
    assert any(n.endswith("ffn.gate.tid2eid") for n in ffn["params"])  # the hash layer
    assert sorted(ffn["seen"]) == sorted(k for k in ffn["ckpt"] if is_v4_ffn(k))
    assert sum(ffn["at_load"].values()) == sum(v for k, v in ffn["ckpt"].items() if is_v4_ffn(k))
    assert not {"DeepseekV4CPUAttention", "VocabParallelEmbedding"} & set(ffn["modules"])
    # the FFN role on rows and token ids as the exchange delivers them == vLLM's V4 layer's
    # FFN on the same input, bit for bit, the hash-routed layer 0 included
    diff = built(V4, "ffn-vs-native")["max_abs_diff"]
    assert diff.pop("native_cls") == "DeepseekV4ForCausalLM"
    assert diff == {"0": 0.0, "1": 0.0, "2": 0.0}, diff


def is_q35_ffn(name: str) -> bool:
    return re.search(r"(^|\.)layers\.\d+\.mlp\.", name) is not None


def test_qwen3_5_moe_attention_role_keeps_both_attention_kinds_and_the_vision_tower(built):
    att = built(Q35, "attention")
    assert att["cls"] == "AFDQwen3_5MoeForConditionalGeneration"
    assert not [n for n in att["params"] if is_q35_ffn(n)]
    want = {"QwenGatedDeltaNetAttention", "Qwen3NextAttention", "Qwen3_VisionTransformer"}
    assert want <= set(att["modules"]) and "RemoteFFN" in att["modules"]
    assert "GemmaRMSNorm" in att["modules"] and "MoERunner" not in att["modules"]
    assert any(n.startswith("visual.") for n in att["params"])
    assert sorted(att["seen"]) == sorted(k for k in att["ckpt"] if not is_q35_ffn(k))


def test_qwen3_5_moe_ffn_role_holds_only_the_moe_and_matches_vllms_own_layers(built):
    ffn = built(Q35, "ffn")
    assert ffn["params"] and all(is_q35_ffn(n) for n in ffn["params"])
    assert any("shared_expert_gate" in n for n in ffn["params"])
    assert sorted(ffn["seen"]) == sorted(k for k in ffn["ckpt"] if is_q35_ffn(k))
    assert not {"Qwen3_VisionTransformer", "QwenGatedDeltaNetAttention"} & set(ffn["modules"])
    diff = built(Q35, "ffn-vs-native")["max_abs_diff"]
    assert diff.pop("native_cls") == "Qwen3_5MoeForConditionalGeneration"
    assert diff == {"0": 0.0, "1": 0.0, "2": 0.0}, diff


def test_a_failing_build_fails_its_own_tests_only(built):
    """The first job of a probe process fails; the tests of the jobs after it pass."""
    with pytest.raises(pytest.fail.Exception, match="num_attention_ranks"):
        built(*BAD_CONFIG)


def test_a_role_lacking_vllm_cpu_ops_is_skipped_naming_them(built):
    """What a CPU whose vLLM kernels lack convert_weight_packed (AVX2 or AVX-512 without BF16)
    gets for DeepSeek-V4's attention role: the probe asks for the op and does not build."""
    with pytest.raises(pytest.skip.Exception) as skipped:
        built(*HIDDEN_OP)
    why = str(skipped.value)
    assert why.startswith(
        "DeepseekV4ForCausalLM (attention role) needs torch.ops._C.convert_weight_packed"
    ), why
    assert "which vLLM's CPU kernels here (vllm._C" in why

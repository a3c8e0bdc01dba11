"""Each role builds and loads only its own modules (a real vLLM model build on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
PROBE = Path(__file__).with_name("role_build_probe.py")
BACKENDS = {"deepseek_v2": "CPU_MLA", "deepseek_v3": "CPU_MLA", "qwen3_moe": None}


@pytest.fixture(scope="module")
def built(checkpoints):
    """(arch, role) -> what the built model holds; each build in a fresh process."""
    jobs = {
        (arch, role): [sys.executable, str(PROBE), str(checkpoints(arch)), role]
        + ([backend] if backend else [])
        for arch, backend in BACKENDS.items()
        for role in ("attention", "ffn")
    }

    def probe(cmd):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    # two at a time: each probe is mostly one core importing vLLM
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(jobs, pool.map(probe, jobs.values()), strict=True))
    out = {}
    for key, r in runs.items():
        assert r.returncode == 0, r.stderr[-3000:]
        out[key] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def is_mlp(name: str) -> bool:
    return ".mlp." in name


@pytest.mark.parametrize("arch", list(BACKENDS))
def test_attention_role_holds_no_ffn_weights(built, arch):
    d = built[(arch, "attention")]
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
    d = built[(arch, "ffn")]
    names = list(d["params"])
    assert names and all(is_mlp(n) for n in names)
    assert sum(d["at_load"].values()) == sum(v for k, v in d["ckpt"].items() if is_mlp(k))
    assert sorted(d["seen"]) == sorted(k for k in d["ckpt"] if is_mlp(k))
    assert "MoERunner" in d["modules"]
    assert not {"MLAAttention", "Attention", "VocabParallelEmbedding", "ParallelLMHead"} & set(
        d["modules"]
    )

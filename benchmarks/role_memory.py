"""Weight memory per AFD role vs the colocated model, for a tiny MoE with 64 experts.

Each variant is built and loaded by vLLM in a fresh process: the native (colocated) model,
the attention role and the FFN role. Reported: parameter bytes as built (exactly what the
loader fills), tensors the loader was handed, and the process's peak RSS growth during the
build (dominated by allocator and kernel-packing overheads at this size).

    uv run --no-sync python benchmarks/role_memory.py [--arch deepseek_v2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROBE = r"""
import json, os, resource, socket, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ckpt, role, backend = sys.argv[1], sys.argv[2], sys.argv[3]
from vllm.config import AttentionConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader import get_model
from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
from afd_core.workers.roles import afd_architecture
from afd_plugin import register_afd
import contextlib
register_afd(); _set_torch_accelerator_to_noop()
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
built = {}
_orig_load = DefaultModelLoader.load_weights
def load_weights(self, model, model_config):
    # parameters as built, before vLLM repacks them for the CPU kernels
    built.update({n: p.numel() * p.element_size() for n, p in model.named_parameters()})
    return _orig_load(self, model, model_config)
DefaultModelLoader.load_weights = load_weights
mc = ModelConfig(model=ckpt, dtype="float32", enforce_eager=True, max_model_len=256)
extra = {} if role == "colocated" else {"additional_config": {"afd": {"role": role}}}
kw = {"attention_config": AttentionConfig(backend=backend)} if backend != "-" else {}
vc = VllmConfig(model_config=mc, **extra, **kw)
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with set_current_vllm_config(vc):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    initialize_model_parallel(1, 1)
    ctx = contextlib.nullcontext() if role == "colocated" else afd_architecture(mc)
    with ctx:
        model = get_model(vllm_config=vc)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
def group(n):
    if ".mlp.experts" in n: return "routed experts"
    if ".mlp." in n: return "gate/shared/dense MLP"
    if "self_attn" in n: return "attention"
    return "embeddings/norms/lm_head"
groups = {}
for n, b in built.items():
    groups[group(n)] = groups.get(group(n), 0) + b
print(json.dumps({"groups": groups, "rss_kib": after - before}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="deepseek_v2", choices=["deepseek_v2", "qwen3_moe"])
    a = ap.parse_args()
    from afd_models.tiny import TinySpec, tiny_checkpoint

    spec = TinySpec(a.arch, num_layers=4, num_experts=64, hidden_size=256)
    ckpt = str(tiny_checkpoint(spec))
    backend = "CPU_MLA" if a.arch.startswith("deepseek") else "-"
    rows = {}
    for role in ("colocated", "attention", "ffn"):
        r = subprocess.run(
            [sys.executable, "-c", PROBE, ckpt, role, backend],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        rows[role] = json.loads(r.stdout.strip().splitlines()[-1])
    groups = ["embeddings/norms/lm_head", "attention", "gate/shared/dense MLP", "routed experts"]
    print(
        f"{a.arch}: {spec.num_layers} layers, {spec.num_experts} experts, hidden "
        f"{spec.hidden_size}, fp32 (parameter bytes as built, KiB)"
    )
    print(f"{'':26}" + "".join(f"{r:>12}" for r in rows))
    for g in groups:
        print(f"{g:26}" + "".join(f"{rows[r]['groups'].get(g, 0) / 1024:>12.1f}" for r in rows))
    totals = {r: sum(v["groups"].values()) for r, v in rows.items()}
    print(f"{'total':26}" + "".join(f"{totals[r] / 1024:>12.1f}" for r in rows))
    print(
        f"{'share of colocated':26}"
        + "".join(f"{totals[r] / totals['colocated']:>12.2f}" for r in rows)
    )
    print(f"{'peak RSS growth (KiB)':26}" + "".join(f"{rows[r]['rss_kib']:>12}" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

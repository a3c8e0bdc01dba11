"""Build AFD role models in this process, load their checkpoints, print what each holds.

python role_build_probe.py JOBS_JSON

JOBS_JSON: a list of {"key", "checkpoint", "role", "backend" (or null), "afd" (more `afd`
settings, e.g. {"compute_gate_on_attention": true}), "dtype", "dense_for_sparse",
"hide_vllm_ops"}. One JSON line per job on stdout: {"key", ...what the model holds}, or
{"key", "error": traceback} when building it failed (the next jobs still run), or {"key",
"missing_ops", "skip": reason} when the roles it builds need vLLM CPU ops that this
machine's vLLM kernels lack (afd_models.cpu_ops, asked before building; "hide_vllm_ops"
lists ops to take as missing, to show the skip where they are here). Several models per
process: importing vLLM costs far more than building a tiny model.

A job with "role": "ffn-vs-native" builds the FFN role and vLLM's own model of the same
checkpoint and reports, per layer, how far the FFN role's output (rows, and token ids when
"token_ids", as the exchange delivers them) is from the native layer's FFN on the same
input; "native_layers" (attribute path) and "native_ffn" name that FFN in vLLM's model.

dense_for_sparse: vLLM's CPU platform refuses sparse attention (DeepSeek-V3.2's indexer)
when the model is built; this stand-in selects the dense CPU MLA backend for it, so the
role's real modules (the indexer included) are built and loaded. No forward runs.
"""

import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "I64": 8}
# the roles of the model each job builds (ffn-vs-native: vLLM's whole model as well)
ROLES_BUILT = {"attention": ("attention",), "ffn": ("ffn",), "ffn-vs-native": ("attention", "ffn")}


def checkpoint_bytes(ckpt: str) -> dict[str, int]:
    from safetensors import safe_open

    out = {}
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open has no iteration protocol
            n = 1
            tensor = f.get_slice(k)
            for d in tensor.get_shape():
                n *= d
            out[k] = n * DTYPE_BYTES[tensor.get_dtype()]
    return out


def ffn_vs_native(job, build) -> dict:
    """Per layer: max |FFN role - native| on the same rows and token ids (0.0: identical)."""
    import torch
    from vllm.forward_context import set_forward_context

    afd, afd_config = build(job, "ffn")
    native, native_config = build(job, "native")
    g = torch.Generator().manual_seed(0)
    config = native_config.model_config.hf_text_config
    layers = native
    for attr in job["native_layers"].split("."):
        layers = getattr(layers, attr)
    out = {}
    for i in afd.ffn_layer_indices():
        dtype = native_config.model_config.dtype
        rows = (torch.randn(5, config.hidden_size, generator=g) * 0.5).to(dtype)
        ids = torch.randint(0, config.vocab_size, (5,), generator=g) if job["token_ids"] else None
        native_ffn = getattr(layers[i], job["native_ffn"])
        with torch.inference_mode():
            with set_forward_context(None, afd_config):
                mine = afd.compute_ffn_output(i, rows.clone(), None, ids)
            with set_forward_context(None, native_config):
                theirs = (
                    native_ffn(rows.clone(), ids) if ids is not None else native_ffn(rows.clone())
                )
        out[str(i)] = float((mine.float() - theirs.float()).abs().max())
    out["native_cls"] = type(native).__name__
    return {"max_abs_diff": out}


def main():
    jobs = json.loads(sys.argv[1])
    import vllm.v1.worker.cpu.shm  # noqa: F401 - as vLLM's CPU worker: CPU stand-ins for CUDA
    from vllm.config import AttentionConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model
    from vllm.platforms.cpu import CpuPlatform

    import afd_models.deepseek_v2 as ds
    import afd_models.deepseek_v4 as v4
    import afd_models.qwen3_moe as qw
    from afd_core.net import free_port

    wrappers = [ds.AFDDeepseekV2ForCausalLM, qw.AFDQwen3MoeForCausalLM, v4.AFDDeepseekV4ForCausalLM]
    try:  # vLLM's qwen3_5 needs torchvision (the stand-in, in the process that builds it)
        import afd_models.qwen3_5 as q35

        wrappers.append(q35.AFDQwen3_5MoeForConditionalGeneration)
    except ImportError:
        pass
    import afd_models.role as role_mod
    import afd_models.weights as weights_mod
    from afd_core.workers.roles import afd_architecture
    from afd_models import cpu_ops
    from afd_plugin import register_afd

    register_afd()
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does before loading

    state = {"seen": [], "at_load": {}, "dense_for_sparse": False}
    original_filter = weights_mod.filter_weights

    def recording(r, weights, gate_on_attention=False):
        for name, t in original_filter(r, weights, gate_on_attention):
            state["seen"].append(name)
            yield name, t

    role_mod.filter_weights = recording
    for cls in wrappers:

        def wrap(orig):
            def load_weights(self, weights):
                # parameter bytes as built, before vLLM repacks them for the CPU kernels
                state["at_load"].update(
                    {n: p.numel() * p.element_size() for n, p in self.named_parameters()}
                )
                return orig(self, weights)

            return load_weights

        cls.load_weights = wrap(cls.load_weights)

    original_select = CpuPlatform.get_attn_backend_cls.__func__

    def select(cls, selected_backend, attn_selector_config, num_heads=None):
        if state["dense_for_sparse"]:
            attn_selector_config = attn_selector_config._replace(use_sparse=False)
        return original_select(cls, selected_backend, attn_selector_config, num_heads)

    CpuPlatform.get_attn_backend_cls = classmethod(select)

    port = free_port()
    distributed = False

    def build(job, role):
        nonlocal distributed
        state.update(seen=[], at_load={}, dense_for_sparse=job.get("dense_for_sparse", False))
        mc = ModelConfig(
            model=job["checkpoint"],
            dtype=job.get("dtype", "float32"),
            enforce_eager=True,
            max_model_len=256,
        )
        backend = job.get("backend")
        kw = {"attention_config": AttentionConfig(backend=backend)} if backend else {}
        extra = {"additional_config": {"afd": {"role": role, **job.get("afd", {})}}}
        vc = VllmConfig(model_config=mc, **(extra if role != "native" else {}), **kw)
        with set_current_vllm_config(vc):
            if not distributed:
                init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
                initialize_model_parallel(1, 1)
                distributed = True
            if role == "native":
                return get_model(vllm_config=vc), vc
            with afd_architecture(mc):
                return get_model(vllm_config=vc), vc

    def holds(job) -> dict:
        if job["role"] == "ffn-vs-native":
            return ffn_vs_native(job, build)
        model, _ = build(job, job["role"])
        return {
            "cls": type(model).__name__,
            "params": {n: p.numel() * p.element_size() for n, p in model.named_parameters()},
            "at_load": state["at_load"],
            "seen": state["seen"],
            "ckpt": checkpoint_bytes(job["checkpoint"]),
            "modules": sorted({type(m).__name__ for m in model.modules()}),
        }

    library = cpu_ops.load_vllm_kernels()

    def vllm_ops_missing(job) -> dict:
        with open(os.path.join(job["checkpoint"], "config.json")) as f:
            arch = json.load(f)["architectures"][0]
        roles = ROLES_BUILT[job["role"]]
        hidden = set(job.get("hide_vllm_ops", ()))
        ops = cpu_ops.missing(arch, roles, lambda op: op not in hidden and cpu_ops.has_op(op))
        return {"missing_ops": ops, "skip": cpu_ops.why_missing(arch, roles, ops, library)}

    for job in jobs:
        try:
            gone = vllm_ops_missing(job)
            result = gone if gone["missing_ops"] else holds(job)
        except Exception:  # this job's tests fail with it; the other jobs still run
            result = {"error": traceback.format_exc()}
        print(json.dumps({"key": job["key"], **result}), flush=True)


if __name__ == "__main__":
    main()

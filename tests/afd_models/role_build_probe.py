"""Build one AFD role model in this process, load the checkpoint, print what it holds (JSON).

python role_build_probe.py CHECKPOINT ROLE [BACKEND]
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def main():
    ckpt, role = sys.argv[1], sys.argv[2]
    backend = sys.argv[3] if len(sys.argv) > 3 else None
    import socket

    from safetensors import safe_open
    from vllm.config import AttentionConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model

    import afd_models.weights as weights_mod
    from afd_core.workers.roles import afd_architecture
    from afd_plugin import register_afd

    register_afd()
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does before loading
    seen = []
    original = weights_mod.filter_weights

    def recording(r, weights):
        for name, t in original(r, weights):
            seen.append(name)
            yield name, t

    import afd_models.deepseek_v2 as ds
    import afd_models.qwen3_moe as qw
    import afd_models.role as role_mod

    role_mod.filter_weights = recording
    at_load = {}
    for cls in (ds.AFDDeepseekV2ForCausalLM, qw.AFDQwen3MoeForCausalLM):

        def wrap(orig):
            def load_weights(self, weights):
                # parameter bytes as built, before vLLM repacks them for the CPU kernels
                at_load.update(
                    {n: p.numel() * p.element_size() for n, p in self.named_parameters()}
                )
                return orig(self, weights)

            return load_weights

        cls.load_weights = wrap(cls.load_weights)

    mc = ModelConfig(model=ckpt, dtype="float32", enforce_eager=True, max_model_len=256)
    kw = {"attention_config": AttentionConfig(backend=backend)} if backend else {}
    vc = VllmConfig(model_config=mc, additional_config={"afd": {"role": role}}, **kw)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vc):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        with afd_architecture(mc):
            model = get_model(vllm_config=vc)
    params = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        ckpt_bytes = {}
        for k in f.keys():  # noqa: SIM118 - safe_open has no iteration protocol
            t = f.get_slice(k)
            shape = t.get_shape()
            n = 1
            for d in shape:
                n *= d
            ckpt_bytes[k] = n * 4
    print(
        json.dumps(
            {
                "cls": type(model).__name__,
                "params": params,
                "at_load": at_load,
                "seen": seen,
                "ckpt": ckpt_bytes,
                "modules": sorted({type(m).__name__ for m in model.modules()}),
            }
        )
    )


if __name__ == "__main__":
    main()

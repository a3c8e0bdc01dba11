"""Run a real single-process vLLM engine on a tiny MoE with afd_balanced routing and report
how the strategy was called (JSON on the last line)."""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main():
    ckpt = sys.argv[1]
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import (
        RoutingSimulator,
    )

    from afd_core.routing_simulator import balanced_topk_ids, expert_cycle
    from afd_plugin import register_afd

    register_afd()
    calls = []
    active = os.environ.get("VLLM_MOE_ROUTING_SIMULATION_STRATEGY") == "afd_balanced"
    if active:
        strategy = RoutingSimulator._routing_strategies["afd_balanced"]
        original = strategy.route_tokens

        def route_tokens(hidden_states, router_logits, top_k, indices_type=None):
            w, ids = original(hidden_states, router_logits, top_k, indices_type)
            n, e = router_logits.shape
            topn = int(os.environ.get("AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK") or 0)
            expected = balanced_topk_ids(n, expert_cycle(e, 1, topn, top_k), top_k, 0)
            calls.append(
                {
                    "tokens": n,
                    "matches": ids.tolist() == expected,
                    "dtype": str(ids.dtype),
                    "weights_ok": bool((w == 1.0 / top_k).all()),
                }
            )
            return w, ids

        strategy.route_tokens = route_tokens
    llm = LLM(model=ckpt, dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
    out = llm.generate(
        ["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0, logprobs=0)
    )
    o = out[0].outputs[0]
    logprobs = [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)]
    print(json.dumps({"calls": calls, "tokens": list(o.token_ids), "logprobs": logprobs}))


if __name__ == "__main__":
    main()

"""`afd_balanced`: a deterministic, evenly spread MoE routing for benchmarks.

Selected with VLLM_MOE_ROUTING_SIMULATION_STRATEGY=afd_balanced (vLLM's routing simulator).
It ignores the router: it CHANGES MODEL OUTPUT and exists to benchmark AFD at a known,
perfectly balanced expert load, independent of what random or real weights would route.

The expert cycle lists the selected experts rank-interleaved: local expert 0 of EP rank 0,
of rank 1, ..., then local expert 1 of each rank, ...; all local experts of each rank, or
only the first n with AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK=n. Token t takes the top_k
consecutive cycle entries starting at (t * top_k + ep_rank) mod len(cycle), so every rank
starts at a different expert and the load per expert differs by at most one assignment.
Weights are uniform, 1/top_k.
"""

from __future__ import annotations

import threading

from afd_core import envs
from afd_core.log import get_logger

STRATEGY_NAME = "afd_balanced"
logger = get_logger(__name__)


def expert_cycle(num_experts: int, ep_size: int, topn_per_rank: int, top_k: int) -> list[int]:
    """The ordered expert ids tokens are spread over; validates the shape."""
    if ep_size < 1:
        raise ValueError(f"afd_balanced: expert-parallel size {ep_size} must be >= 1")
    if num_experts < 1 or num_experts % ep_size:
        raise ValueError(
            f"afd_balanced: num_experts={num_experts} is not divisible by the expert-parallel "
            f"size {ep_size}; allowed: a positive multiple of {ep_size}"
        )
    local = num_experts // ep_size
    n = topn_per_rank or local
    if not 0 < n <= local:
        raise ValueError(
            f"afd_balanced: {envs.AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK}={topn_per_rank} is "
            f"out of range; allowed: 0 (all) or 1..{local} (the local experts per EP rank)"
        )
    if not 0 < top_k <= n * ep_size:
        raise ValueError(
            f"afd_balanced: top_k={top_k} needs at least that many distinct experts, but only "
            f"{n} per rank x {ep_size} EP ranks = {n * ep_size} are in the cycle; raise "
            f"{envs.AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK} or lower top_k"
        )
    return [rank * local + i for i in range(n) for rank in range(ep_size)]


def balanced_topk_ids(
    num_tokens: int, cycle: list[int], top_k: int, ep_rank: int
) -> list[list[int]]:
    """Pure-Python reference of the id pattern (used by tests and the torch path alike)."""
    c = len(cycle)
    return [[cycle[(t * top_k + j + ep_rank) % c] for j in range(top_k)] for t in range(num_tokens)]


def _ep_rank_and_size() -> tuple[int, int]:
    try:
        from vllm.distributed import parallel_state as ps

        if ps._EP is not None:
            group = ps.get_ep_group()
            return group.rank_in_group, group.world_size
    except Exception:  # no EP group in this process: a single-rank layout
        pass
    return 0, 1


def make_strategy():
    """Build the RoutingStrategy subclass (vLLM imported only here)."""
    import torch
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import (
        RoutingStrategy,
    )

    class AFDBalancedRouting(RoutingStrategy):
        def __init__(self) -> None:
            self._cache: dict[tuple, torch.Tensor] = {}
            self._lock = threading.Lock()
            self._warned = False

        def route_tokens(self, hidden_states, router_logits, top_k, indices_type=None):
            num_tokens = hidden_states.shape[0]
            num_experts = router_logits.shape[-1]
            ep_rank, ep_size = _ep_rank_and_size()
            topn = envs.force_lb_topn_per_rank()
            dtype = indices_type or torch.int32
            key = (num_experts, ep_size, ep_rank, topn, top_k, dtype, hidden_states.device)
            with self._lock:
                ids = self._cache.get(key)
                if ids is None or ids.shape[0] < num_tokens:
                    cycle = expert_cycle(num_experts, ep_size, topn, top_k)
                    rows = max(num_tokens, 1 if ids is None else 2 * ids.shape[0])
                    c = torch.tensor(cycle, dtype=torch.long)
                    pos = (
                        torch.arange(rows).unsqueeze(1) * top_k
                        + torch.arange(top_k).unsqueeze(0)
                        + ep_rank
                    ) % len(cycle)
                    ids = c[pos].to(device=hidden_states.device, dtype=dtype)
                    self._cache[key] = ids
                if not self._warned:
                    self._warned = True
                    logger.warning(
                        "MoE routing is simulated by 'afd_balanced' (benchmark tool): model "
                        "output is NOT the model's; %d experts, EP %d, top-n per rank %s",
                        num_experts,
                        ep_size,
                        topn or "all",
                    )
            weights = torch.full(
                (num_tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=hidden_states.device
            )
            return weights, ids[:num_tokens]

    return AFDBalancedRouting()


ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router.routing_simulator_router"


def _register(module) -> None:
    simulator = module.RoutingSimulator
    if STRATEGY_NAME in simulator.get_available_strategies():
        return
    simulator.register_strategy(STRATEGY_NAME, make_strategy())
    from afd_core.registration import STEP_ROUTING_STRATEGY, StepStatus, record

    record(STEP_ROUTING_STRATEGY, StepStatus.APPLIED)
    if envs.balanced_routing_requested():
        envs.force_lb_topn_per_rank()  # a malformed value fails here, before any forward
        logger.warning(
            "%s=afd_balanced: MoE routing is replaced by a deterministic balanced pattern; "
            "use it for benchmarks only, model output will be wrong",
            envs.VLLM_MOE_ROUTING_SIMULATION_STRATEGY,
        )


def register_afd_balanced_routing_strategy() -> bool:
    """Register `afd_balanced` with vLLM's RoutingSimulator (idempotent).

    True if registered now; False if deferred until vLLM imports its MoE router (the
    fused-MoE stack costs ~0.4 s to import, and only processes that build MoE layers
    import it, before they build them).
    """
    from afd_core.patches.import_hooks import when_imported
    from afd_core.registration import STEP_ROUTING_STRATEGY

    # registering it is never optional where the environment selects it: then a failure
    # stops the importing process, as an eager registration would
    return when_imported(
        ROUTER_MODULE, _register, STEP_ROUTING_STRATEGY, envs.balanced_routing_requested
    )

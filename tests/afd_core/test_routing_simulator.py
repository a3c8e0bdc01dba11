import pytest

from afd_core.routing_simulator import balanced_topk_ids, expert_cycle


@pytest.mark.parametrize(
    "experts,ep,topn,top_k,cycle",
    [
        (8, 1, 0, 2, [0, 1, 2, 3, 4, 5, 6, 7]),
        (8, 2, 0, 2, [0, 4, 1, 5, 2, 6, 3, 7]),
        (8, 2, 1, 2, [0, 4]),
        (16, 4, 2, 8, [0, 4, 8, 12, 1, 5, 9, 13]),
        (6, 3, 0, 3, [0, 2, 4, 1, 3, 5]),
    ],
)
def test_cycle(experts, ep, topn, top_k, cycle):
    assert expert_cycle(experts, ep, topn, top_k) == cycle


def test_id_pattern_and_rank_shift():
    cycle = expert_cycle(8, 2, 0, 2)
    assert balanced_topk_ids(3, cycle, 2, ep_rank=0) == [[0, 4], [1, 5], [2, 6]]
    assert balanced_topk_ids(3, cycle, 2, ep_rank=1) == [[4, 1], [5, 2], [6, 3]]


@pytest.mark.parametrize(
    "experts,ep,topn,top_k,tokens",
    [
        (8, 1, 0, 2, 5),
        (8, 2, 0, 2, 64),
        (16, 4, 2, 3, 7),
        (64, 8, 4, 8, 256),
        (6, 3, 1, 2, 1),
    ],
)
@pytest.mark.parametrize("ep_rank_sel", ["first", "last"])
def test_load_is_even(experts, ep, topn, top_k, tokens, ep_rank_sel):
    ep_rank = 0 if ep_rank_sel == "first" else ep - 1
    cycle = expert_cycle(experts, ep, topn, top_k)
    ids = balanced_topk_ids(tokens, cycle, top_k, ep_rank)
    for row in ids:
        assert len(set(row)) == top_k, "a token must not pick the same expert twice"
    counts = {e: 0 for e in cycle}
    for row in ids:
        for e in row:
            counts[e] += 1
    total = tokens * top_k
    assert sum(counts.values()) == total
    assert set(counts) == set(cycle)  # only the selected experts are used
    mean = total / len(cycle)
    assert max(counts.values()) == -(-total // len(cycle))  # ceil: the analytic maximum
    assert sum(counts.values()) / len(counts) == mean
    assert max(counts.values()) - min(counts.values()) <= 1


def test_topn_uses_only_first_local_experts():
    cycle = expert_cycle(16, 2, 3, 2)
    assert sorted(cycle) == [0, 1, 2, 8, 9, 10]


@pytest.mark.parametrize(
    "experts,ep,topn,top_k,match",
    [
        (10, 4, 0, 2, "not divisible by the expert-parallel size 4"),
        (0, 1, 0, 1, "num_experts=0"),
        (8, 2, 5, 2, r"=5 is out of range; allowed: 0 \(all\) or 1..4"),
        (8, 2, -1, 2, "out of range"),
        (8, 2, 1, 3, r"top_k=3 needs at least .* 1 per rank x 2 EP ranks = 2"),
        (8, 1, 0, 9, "top_k=9"),
        (8, 0, 0, 1, "expert-parallel size 0"),
    ],
)
def test_rejected(experts, ep, topn, top_k, match):
    with pytest.raises(ValueError, match=match):
        expert_cycle(experts, ep, topn, top_k)


def test_env_parsing(monkeypatch):
    from afd_core import envs

    monkeypatch.setenv(envs.AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK, "3")
    assert envs.force_lb_topn_per_rank() == 3
    monkeypatch.setenv(envs.AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK, "")
    assert envs.force_lb_topn_per_rank() == 0
    for bad in ("x", "-2", "1.5"):
        monkeypatch.setenv(envs.AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK, bad)
        with pytest.raises(ValueError, match="AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK"):
            envs.force_lb_topn_per_rank()


@pytest.mark.vllm
def test_torch_strategy_matches_reference(monkeypatch):
    import torch

    from afd_core import envs
    from afd_core.routing_simulator import make_strategy

    monkeypatch.setenv(envs.AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK, "0")
    strategy = make_strategy()
    for tokens in (1, 5, 40, 3):  # grows the cache, then reuses it
        h = torch.zeros(tokens, 16)
        logits = torch.randn(tokens, 8)
        w, ids = strategy.route_tokens(h, logits, top_k=2, indices_type=torch.int64)
        assert ids.dtype == torch.int64 and ids.shape == (tokens, 2)
        assert ids.tolist() == balanced_topk_ids(tokens, expert_cycle(8, 1, 0, 2), 2, 0)
        assert torch.allclose(w, torch.full((tokens, 2), 0.5))
    monkeypatch.setenv(envs.AFD_BENCHMARK_FORCE_LB_TOPN_PER_RANK, "9")
    with pytest.raises(ValueError, match="out of range"):
        strategy.route_tokens(torch.zeros(2, 4), torch.zeros(2, 8), top_k=2)


@pytest.mark.vllm
def test_registered_with_vllm_simulator():
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import (
        RoutingSimulator,
    )

    from afd_core.routing_simulator import register_afd_balanced_routing_strategy

    register_afd_balanced_routing_strategy()
    register_afd_balanced_routing_strategy()  # idempotent
    assert "afd_balanced" in RoutingSimulator.get_available_strategies()

import pytest

from afd_models.weights import filter_weights, is_ffn_weight, weight_wanted

FFN = [
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.1.mlp.experts.7.up_proj.weight",
    "model.layers.12.mlp.shared_experts.down_proj.weight",
    "model.layers.3.mlp.shared_expert_gate.weight",
]
ATTENTION = [
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "model.layers.2.self_attn.indexer.wk.weight",
    "model.mlp_like_but_not_a_layer.weight",
]


@pytest.mark.parametrize("name", FFN)
def test_ffn_names(name):
    assert (
        is_ffn_weight(name) and weight_wanted("ffn", name) and not weight_wanted("attention", name)
    )


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_names(name):
    assert not is_ffn_weight(name) and weight_wanted("attention", name)


def test_filter_is_one_lazy_pass():
    consumed = []

    def stream():
        for n in FFN + ATTENTION:
            consumed.append(n)
            yield n, object()

    it = filter_weights("ffn", stream())
    assert consumed == []  # nothing read before the loader asks
    assert [n for n, _ in it] == FFN
    assert consumed == FFN + ATTENTION  # each tensor read exactly once


def test_unknown_role():
    with pytest.raises(ValueError, match="role 'expert' is unknown"):
        weight_wanted("expert", "x")


def test_gate_on_attention_moves_only_the_router_projection():
    """The router's weight goes to attention; its correction bias, used by vLLM's expert
    selection, stays with the experts."""
    moved = "model.layers.1.mlp.gate.weight"
    assert weight_wanted("attention", moved, gate_on_attention=True)
    assert not weight_wanted("ffn", moved, gate_on_attention=True)
    for name in FFN:
        if name != moved:
            assert weight_wanted("ffn", name, gate_on_attention=True), name
    for name in ATTENTION:
        assert weight_wanted("attention", name, gate_on_attention=True), name
    assert [n for n, _ in filter_weights("attention", ((n, 0) for n in FFN), True)] == [moved]


def test_deepseek_v4_names_its_ffn_ffn():
    """V4's checkpoint says `ffn`; its norm and stream mixing around the FFN are attention's."""
    for name in ("layers.0.ffn.gate.tid2eid", "layers.1.ffn.experts.3.w2.weight"):
        assert weight_wanted("ffn", name) and not weight_wanted("attention", name)
    for name in ("layers.0.ffn_norm.weight", "layers.0.hc_ffn_fn", "layers.2.attn.wq_a.weight"):
        assert weight_wanted("attention", name) and not weight_wanted("ffn", name)

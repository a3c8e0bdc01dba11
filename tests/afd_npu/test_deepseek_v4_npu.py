"""DeepSeek-V4 on Ascend: the registration table picks afd-npu's wrapper where torch_npu is
importable, and the wrapper splits vLLM-Ascend's model by role (against a stand-in of
vllm_ascend.models.deepseek_v4 with its module structure; no Ascend kernel runs here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.afd_npu.conftest import STANDIN
from tests.conftest import run_python

pytestmark = pytest.mark.vllm

TABLE = (
    "from afd_plugin.model_table import MODEL_REGISTRATIONS as m; print(m['DeepseekV4ForCausalLM'])"
)


def test_the_v4_registration_follows_torch_npu():
    without = run_python(TABLE)
    assert without.returncode == 0, without.stderr
    assert without.stdout.strip() == "afd_models.deepseek_v4:AFDDeepseekV4ForCausalLM"
    with_npu = run_python(f"import sys; sys.path.insert(0, {str(STANDIN)!r})\n" + TABLE)
    assert with_npu.returncode == 0, with_npu.stderr
    assert with_npu.stdout.strip() == "afd_npu.models.deepseek_v4:AFDDeepseekV4ForCausalLM"


def _config(role: str):
    hf = SimpleNamespace(hidden_size=8, vocab_size=32, num_hidden_layers=3, num_hash_layers=1)
    return SimpleNamespace(
        additional_config={"afd": {"role": role}},
        model_config=SimpleNamespace(hf_config=hf),
        parallel_config=SimpleNamespace(),
    )


def test_each_role_builds_only_its_half_of_ascends_model(ascend):
    from vllm.model_executor.models.utils import PPMissingLayer
    from vllm_ascend.models import deepseek_v4 as ascend_v4

    from afd_npu.models.deepseek_v4 import AFDDeepseekV4ForCausalLM, ContextTokenRemoteFFN

    names = ("DeepseekV4MoE", "DeepseekV4Attention", "VocabParallelEmbedding", "ParallelLMHead")
    classes = [getattr(ascend_v4, n) for n in names]
    att = AFDDeepseekV4ForCausalLM(vllm_config=_config("attention"))
    ffn = AFDDeepseekV4ForCausalLM(vllm_config=_config("ffn"))
    assert [getattr(ascend_v4, n) for n in names] == classes  # restored
    for i, layer in enumerate(att.model.layers):
        assert isinstance(layer.mlp, ContextTokenRemoteFFN) and layer.mlp.exchange_index == i
        assert isinstance(layer.self_attn, ascend_v4.DeepseekV4Attention)
    for layer in ffn.model.layers:
        assert isinstance(layer.mlp, ascend_v4.DeepseekV4MoE)
        assert type(layer.self_attn) is PPMissingLayer
    assert not any(".mlp." in n for n, _ in att.named_parameters())
    assert not any(".self_attn." in n for n, _ in ffn.named_parameters())
    # the vocabulary-sized modules are attention's only
    assert type(ffn.model.embed_tokens) is PPMissingLayer and type(ffn.lm_head) is PPMissingLayer
    assert isinstance(att.lm_head, ascend_v4.ParallelLMHead)
    # vLLM-Ascend's MoE bookkeeping (run in its constructor): none on attention, all on FFN
    assert (att.num_moe_layers, att.num_logical_experts) == (0, 0)
    assert (ffn.num_moe_layers, ffn.num_logical_experts) == (3, 4)
    assert att.ffn_layer_indices() == [0, 1, 2] and att.routes_by_token_id()


def test_a_failed_construction_restores_ascends_classes(ascend, monkeypatch):
    from vllm_ascend.models import deepseek_v4 as ascend_v4

    from afd_npu.models.deepseek_v4 import AFDDeepseekV4ForCausalLM

    moe = ascend_v4.DeepseekV4MoE
    bad = _config("attention")
    bad.model_config.hf_config.num_hidden_layers = None  # range(None) fails mid-construction
    with pytest.raises(TypeError):
        AFDDeepseekV4ForCausalLM(vllm_config=bad)
    assert ascend_v4.DeepseekV4MoE is moe


def test_the_split_model_gives_the_unsplit_output(ascend, monkeypatch):
    """Attention: Ascend's layer calls mlp(x); the proxy sends the rows with the forward
    context's token ids. FFN: the hash-routed MoE reads them from Ascend's forward context,
    which the FFN worker enters with the ids that came over the wire. The two halves give
    what vLLM-Ascend's unsplit model gives."""
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm_ascend.ascend_forward_context import set_ascend_forward_context
    from vllm_ascend.models import deepseek_v4 as ascend_v4

    import afd_models.role as role
    from afd_npu.models.deepseek_v4 import AFDDeepseekV4ForCausalLM

    torch.manual_seed(0)
    full = ascend_v4.AscendDeepseekV4ForCausalLM(vllm_config=_config("attention"))
    att = AFDDeepseekV4ForCausalLM(vllm_config=_config("attention"))
    ffn = AFDDeepseekV4ForCausalLM(vllm_config=_config("ffn"))
    for half in (att, ffn):
        missing, unexpected = half.load_state_dict(full.state_dict(), strict=False)
        assert not missing
    vllm_config = VllmConfig()
    sent = []

    def exchange(hidden, index, logits=None, ids=None):
        sent.append((index, ids.tolist()))
        with set_ascend_forward_context(None, vllm_config, num_tokens=len(ids), input_ids=ids):
            return ffn.compute_ffn_output(index, hidden, logits, ids)

    monkeypatch.setattr(role, "_exchange", exchange)
    input_ids = torch.tensor([3, 1, 4, 1, 5])
    with set_forward_context(None, vllm_config), torch.no_grad():
        get_forward_context().input_ids = input_ids  # vLLM-Ascend's runner sets it
        expected = full(input_ids, torch.arange(5))
        out = att(input_ids, torch.arange(5))
    assert sent == [(i, [3, 1, 4, 1, 5]) for i in range(3)]
    assert torch.equal(out, expected)


def test_the_attention_proxy_needs_the_token_ids_in_the_forward_context(ascend):
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    from afd_npu.models.deepseek_v4 import ContextTokenRemoteFFN

    with set_forward_context(None, VllmConfig()), pytest.raises(RuntimeError, match="input_ids"):
        ContextTokenRemoteFFN(0)(torch.ones(2, 8))

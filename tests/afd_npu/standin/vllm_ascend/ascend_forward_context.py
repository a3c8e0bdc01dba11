"""Stand-in of vllm_ascend/ascend_forward_context.py: vLLM's forward context plus what
Ascend's MoE reads per call (the token count, the token ids of hash-routed layers)."""

from contextlib import contextmanager

from vllm.forward_context import get_forward_context, set_forward_context

entered = []  # (num_tokens, input_ids) per entry, for tests


@contextmanager
def set_ascend_forward_context(
    attn_metadata,
    vllm_config,
    num_tokens: int = 0,
    num_tokens_across_dp=None,
    in_profile_run: bool = False,
    num_actual_tokens=None,
    aclgraph_runtime_mode=None,
    batch_descriptor=None,
    model_instance=None,
    is_draft_model=False,
    skip_compiled: bool = False,
    max_tokens_across_pcp: int = 0,
    draft_attn_metadatas=None,
    has_sinks=False,
    input_ids=None,
    eplb_heat_collection_status: bool = False,
):
    entered.append((num_tokens, input_ids))
    with set_forward_context(attn_metadata, vllm_config, num_tokens=num_tokens):
        ctx = get_forward_context()
        ctx.input_ids = input_ids
        ctx.in_profile_run = in_profile_run
        yield

"""The attention side's layer exchange as one opaque op: `torch.ops.afd.ffn_exchange`.

The model's FFN proxies (afd_models.role) call it in place of a decoder layer's MLP/MoE. As
a registered custom op with a fake implementation, torch.compile traces it as one node (the
step's Python — the sequence split, the micro-batch yield, the connector — never enters a
traced graph), and a CUDA graph captures what its implementation enqueues: the device
send and receive of a captured step, replayed without Python. Inside it, the micro-batch
yield is a plain call (the op is already opaque), so neither needs vLLM: the GPU check
(tests/gpu/check.py) runs this op on a machine without vLLM.
"""

import threading

NAMESPACE, OP_NAME = "afd", "ffn_exchange"
_lock = threading.Lock()
_library = None  # torch.library.Library("afd"): the op lives as long as it does


def exchange(hidden_states, exchange_index: int, router_logits=None, token_ids=None):
    """Start the exchange of the calling micro-batch (the FFN output's receive is posted
    before the rows are sent, so neither side ever waits on the other's order), yield to the
    next micro-batch (DBO: its attention runs while the FFN ranks compute these rows), then
    wait for the FFN output. Over tensor parallel, this TP rank exchanges its share of the
    rows and the outputs are gathered from the TP group."""
    from afd_core.dbo import current_microbatch_id, yield_now
    from afd_core.runtime import active_connector, active_sequence_split

    split = active_sequence_split()
    n = hidden_states.shape[0]
    rows, logits, ids = hidden_states, router_logits, token_ids
    if split is not None:
        rows, logits, ids = (split.take(t, n) for t in (rows, logits, ids))
    pending = active_connector().start_exchange(
        rows, exchange_index, current_microbatch_id(), logits, token_ids=ids
    )
    yield_now()
    out = pending.wait()
    return out if split is None else split.gather(out, n)


def _make_impls():
    # torch's schema inference needs real annotations: defined with torch imported
    import torch

    def ffn_exchange(
        hidden_states: torch.Tensor,
        exchange_index: int,
        router_logits: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return exchange(hidden_states, exchange_index, router_logits, token_ids)

    def ffn_exchange_fake(
        hidden_states: torch.Tensor,
        exchange_index: int,
        router_logits: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.empty_like(hidden_states)

    return ffn_exchange, ffn_exchange_fake


def is_registered() -> bool:
    import torch

    return hasattr(getattr(torch.ops, NAMESPACE), OP_NAME)


def register_exchange_op() -> bool:
    """Register the op once per process; True if this call registered it. One
    implementation for every device (CompositeExplicitAutograd): it only calls Python."""
    global _library
    from torch.library import Library, infer_schema

    with _lock:
        if is_registered():
            return False
        impl, fake = _make_impls()
        _library = Library(NAMESPACE, "FRAGMENT")
        _library.define(OP_NAME + infer_schema(impl, mutates_args=()))
        _library.impl(OP_NAME, impl, "CompositeExplicitAutograd")
        _library._register_fake(OP_NAME, fake)
        return True


def ffn_exchange_op():
    """The registered op (registering it first if this process has not)."""
    import torch

    if not is_registered():
        register_exchange_op()
    return getattr(getattr(torch.ops, NAMESPACE), OP_NAME)

"""The DBO yield point: `torch.ops.vllm.manual_dbo_yield(x)`.

The attention-side FFN proxy calls it between sending a layer's hidden states and
receiving the FFN output, so that with two micro-batches one micro-batch's attention runs
while the other's FFN is computed remotely. It is registered as a custom op that mutates
its argument: torch.compile and CUDA-graph capture then keep it as an ordered, opaque node
instead of dropping or reordering a call that returns nothing.

It hands the baton to AFD's own micro-batch executor (afd_core.step.microbatch) when the
calling thread runs one of its micro-batches, else to vLLM's ubatching (UBatchWrapper, CUDA)
when that is active, else it does nothing.
"""

import threading

OP_NAME = "manual_dbo_yield"
_lock = threading.Lock()


def _make_impls():
    # Defined with torch imported, because torch's schema inference needs real annotations
    # (this module must import without torch).
    import torch

    def manual_dbo_yield(x: torch.Tensor) -> None:
        yield_now()

    def manual_dbo_yield_fake(x: torch.Tensor) -> None:
        return None

    return manual_dbo_yield, manual_dbo_yield_fake


def is_registered() -> bool:
    import torch

    return hasattr(torch.ops.vllm, OP_NAME)


def register_dbo_yield_custom_op() -> bool:
    """Register the op once per process; True if this call registered it."""
    import torch  # noqa: F401 - torch.ops must exist before the check
    from vllm.utils.torch_utils import direct_register_custom_op

    with _lock:
        if is_registered():
            return False
        impl, fake = _make_impls()
        direct_register_custom_op(op_name=OP_NAME, op_func=impl, mutates_args=["x"], fake_impl=fake)
        return True


_NO_VLLM = object()  # vLLM's ubatching could not be imported (tried once per process)
_ubatching = None


def _vllm_ubatching():
    """vLLM's ubatching module, or None where vLLM is not installed (tests/gpu/check.py
    runs the exchange op on a machine without it). A failed import is remembered: it runs
    at every exchange, and a failed import is not cached by Python (~180 µs each)."""
    global _ubatching
    if _ubatching is None:
        try:
            from vllm.v1.worker import ubatching
        except ImportError:
            ubatching = _NO_VLLM
        _ubatching = ubatching
    return None if _ubatching is _NO_VLLM else _ubatching


# Set while a step split by vLLM's UBatchWrapper has a failed micro-batch (one step runs at
# a time per process). vLLM's threads hand the baton over unconditionally: a micro-batch
# that yields to one that has ended waits forever. So once one has failed, the others stop
# at their next yield instead (afd_core.step.vllm_ubatch clears and sets it).
_vllm_split_failed = threading.Event()


def fail_vllm_split(failed: bool = True) -> None:
    """Mark the running vLLM-split step as failed (False: a new step starts)."""
    if failed:
        _vllm_split_failed.set()
    else:
        _vllm_split_failed.clear()


def yield_now() -> None:
    """Hand the baton to the next micro-batch: AFD's executor when the calling thread runs
    one of its micro-batches, else vLLM's ubatching when active, else nothing."""
    from afd_core.step.microbatch import yield_to_next_microbatch

    if yield_to_next_microbatch():
        return
    ubatching = _vllm_ubatching()
    if ubatching is not None and ubatching.dbo_enabled():
        _raise_if_vllm_split_failed()  # the next micro-batch may have ended
        ubatching.dbo_yield()
        _raise_if_vllm_split_failed()  # it failed while this one waited


def _raise_if_vllm_split_failed() -> None:
    if _vllm_split_failed.is_set():
        from afd_core.step.microbatch import MicrobatchAborted

        raise MicrobatchAborted("micro-batch released: another micro-batch of the step failed")


def current_microbatch_id() -> int:
    """The micro-batch the calling thread computes: AFD's executor first, then vLLM's
    ubatching, else 0 (an unsplit step)."""
    from afd_core.step.microbatch import current_microbatch

    mb = current_microbatch()
    if mb is not None:
        return mb
    ubatching = _vllm_ubatching()
    return ubatching.dbo_current_ubatch_id() if ubatching is not None else 0


def dbo_yield(x) -> None:
    """Call the registered op (registering it first if this process has not)."""
    import torch

    if not is_registered():
        register_dbo_yield_custom_op()
    torch.ops.vllm.manual_dbo_yield(x)

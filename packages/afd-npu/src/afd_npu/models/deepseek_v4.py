"""Ascend DeepSeek-V4 AFD wrapper: NOT IMPLEMENTED in this release."""

from __future__ import annotations


class AFDDeepseekV4ForCausalLM:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "AFDDeepseekV4ForCausalLM (Ascend) is not implemented in this afd-npu release"
        )

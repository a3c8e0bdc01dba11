"""Qwen3.5-MoE AFD wrapper: not in this release."""

from afd_models.not_implemented import not_implemented_model

AFDQwen3_5MoeForConditionalGeneration = not_implemented_model(
    "AFDQwen3_5MoeForConditionalGeneration", "Qwen3.5-MoE comes with the remaining model families"
)

"""Qwen3.5-MoE AFD wrapper: not in this release."""

from afd_models.not_implemented import not_implemented_model

AFDQwen3_5MoeForConditionalGeneration = not_implemented_model(
    "AFDQwen3_5MoeForConditionalGeneration",
    (
        "not in this release (vLLM's qwen3_5 module also needs torchvision, through the "
        "Qwen-VL image processor)"
    ),
)

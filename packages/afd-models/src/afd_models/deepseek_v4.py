"""DeepSeek-V4 (GPU/CPU) AFD wrapper: not in this release."""

from afd_models.not_implemented import not_implemented_model

AFDDeepseekV4ForCausalLM = not_implemented_model(
    "AFDDeepseekV4ForCausalLM", "DeepSeek-V4 comes with the remaining model families"
)

"""DeepSeek-V4 (GPU/CPU) AFD wrapper: not in this release."""

from afd_models.not_implemented import not_implemented_model

AFDDeepseekV4ForCausalLM = not_implemented_model(
    "AFDDeepseekV4ForCausalLM",
    (
        "its hash-routed MoE layers route by token id, so the layer exchange has to carry "
        "the token ids (not in this release)"
    ),
)

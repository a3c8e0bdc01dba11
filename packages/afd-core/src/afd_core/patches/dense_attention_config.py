"""The ModelConfig of an async-DP attention server: vLLM's own, answering `is_moe` False.

Imported only where vLLM is (async_dp_engine, and any process that unpickles such a
config). A subclass at module level, so pickle finds it by name in every process.
"""

from __future__ import annotations

from vllm.config.model import ModelConfig


class AFDAttentionModelConfig(ModelConfig):
    """An AFD attention server's model config: the model is MoE, but this server runs no
    MoE layer (the FFN servers do), so vLLM's engine treats its DP ranks as a dense
    model's: independent."""

    @property
    def is_moe(self) -> bool:
        return False


def dense_model_config(model_config: ModelConfig) -> ModelConfig:
    """The same object, of the subclass (every field, the HF config included, unchanged)."""
    if not isinstance(model_config, AFDAttentionModelConfig):
        model_config.__class__ = AFDAttentionModelConfig
    return model_config

"""A MoE model's sizes, as the planner needs them: from an HF config.json or a preset.

Only shapes, never weights: parameter counts per layer for each role, the KV-cache bytes a
token adds per layer, and the attention core's work per token of context. Attention is
either grouped-query (q/k/v/o projections) or DeepSeek's MLA (latent KV cache of
kv_lora_rank + qk_rope_head_dim per token, computed in the absorbed form).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from afd_core.planner.errors import PlanInputError

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1, "int8": 1}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_dense_layers: int  # leading layers with a dense MLP instead of experts
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int  # all shared experts of a layer together; 0 if none
    dense_intermediate_size: int
    vocab_size: int
    num_heads: int
    # grouped-query attention (0 for MLA)
    num_kv_heads: int = 0
    head_dim: int = 0
    # DeepSeek MLA (kv_lora_rank > 0)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    weight_bytes: float = 2.0  # per parameter (1 for FP8 checkpoints)
    kv_bytes: float = 2.0  # per cached element
    wire_bytes: float = 2.0  # per hidden element exchanged between the roles

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int | float) and not isinstance(v, bool) and v < 0:
                raise PlanInputError(f"model {self.name}: {f.name}={v} must be >= 0")
        for name in ("hidden_size", "num_layers", "num_experts", "top_k", "num_heads"):
            if getattr(self, name) <= 0:
                raise PlanInputError(f"model {self.name}: {name}={getattr(self, name)} must be > 0")
        if self.top_k > self.num_experts:
            raise PlanInputError(
                f"model {self.name}: top_k={self.top_k} is more than num_experts={self.num_experts}"
            )
        if self.num_dense_layers > self.num_layers:
            raise PlanInputError(
                f"model {self.name}: num_dense_layers={self.num_dense_layers} is more than "
                f"num_layers={self.num_layers}"
            )
        if not self.is_mla and (self.num_kv_heads <= 0 or self.head_dim <= 0):
            raise PlanInputError(
                f"model {self.name}: attention needs num_kv_heads and head_dim > 0 (or the "
                "MLA fields kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)"
            )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    # -- parameters per layer -------------------------------------------------------------

    @property
    def attention_params(self) -> int:
        h, n = self.hidden_size, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank else h * n * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_b = self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv_a + kv_b + n * self.v_head_dim * h
        d = self.head_dim
        return h * n * d + 2 * h * self.num_kv_heads * d + n * d * h

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size  # gate, up, down

    @property
    def shared_params(self) -> int:
        return 3 * self.hidden_size * self.shared_intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def ffn_params_total(self) -> int:
        """Everything the FFN role holds: experts, shared experts, routers, dense MLPs."""
        moe = self.num_experts * self.expert_params + self.shared_params + self.router_params
        return self.num_moe_layers * moe + self.num_dense_layers * self.dense_mlp_params

    @property
    def attention_params_total(self) -> int:
        """Everything the attention role holds: attention layers, embedding and LM head."""
        return self.num_layers * self.attention_params + 2 * self.vocab_size * self.hidden_size

    # -- attention work per token -------------------------------------------------------------

    @property
    def kv_bytes_per_token_layer(self) -> float:
        if self.is_mla:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes
        return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes

    def attention_core_flops(self, context: int) -> float:
        """Flops of one query token attending over `context` cached tokens (QK^T and PV)."""
        if self.is_mla:  # absorbed: scores over the latent + rope part, values in the latent
            return 2.0 * self.num_heads * context * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 4.0 * self.num_heads * self.head_dim * context

    def with_bytes(self, weight_bytes: float | None = None, kv_bytes: float | None = None):
        return replace(
            self,
            weight_bytes=self.weight_bytes if weight_bytes is None else weight_bytes,
            kv_bytes=self.kv_bytes if kv_bytes is None else kv_bytes,
        )


PRESETS: dict[str, ModelShape] = {
    # deepseek-ai/DeepSeek-V3 config.json (FP8 weights, 3 dense layers, 1 shared expert)
    "deepseek-v3": ModelShape(
        "deepseek-v3",
        hidden_size=7168,
        num_layers=61,
        num_dense_layers=3,
        num_experts=256,
        top_k=8,
        moe_intermediate_size=2048,
        shared_intermediate_size=2048,
        dense_intermediate_size=18432,
        vocab_size=129280,
        num_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        weight_bytes=1.0,
    ),
    # Qwen/Qwen3-235B-A22B config.json (bf16, every layer MoE, no shared expert)
    "qwen3-235b-a22b": ModelShape(
        "qwen3-235b-a22b",
        hidden_size=4096,
        num_layers=94,
        num_dense_layers=0,
        num_experts=128,
        top_k=8,
        moe_intermediate_size=1536,
        shared_intermediate_size=0,
        dense_intermediate_size=12288,
        vocab_size=151936,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
    ),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": ModelShape(
        "qwen3-30b-a3b",
        hidden_size=2048,
        num_layers=48,
        num_dense_layers=0,
        num_experts=128,
        top_k=8,
        moe_intermediate_size=768,
        shared_intermediate_size=0,
        dense_intermediate_size=6144,
        vocab_size=151936,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
    ),
    # zai-org/GLM-4.5 config.json (bf16, 3 dense layers, 1 shared expert)
    "glm-4.5": ModelShape(
        "glm-4.5",
        hidden_size=5120,
        num_layers=92,
        num_dense_layers=3,
        num_experts=160,
        top_k=8,
        moe_intermediate_size=1536,
        shared_intermediate_size=1536,
        dense_intermediate_size=12288,
        vocab_size=151552,
        num_heads=96,
        num_kv_heads=8,
        head_dim=128,
    ),
}


def _need(cfg: dict, key: str, source: str):
    if key not in cfg or cfg[key] is None:
        raise PlanInputError(f"model config {source}: field {key!r} is missing")
    return cfg[key]


def _first(cfg: dict, keys: tuple[str, ...], source: str):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise PlanInputError(
        f"model config {source}: none of the fields {', '.join(map(repr, keys))} is present"
    )


def from_hf_config(cfg: dict, source: str = "<dict>") -> ModelShape:
    """The shape of a MoE model from its HF config (a multimodal config's text_config is
    used). DeepSeek-V2/V3, GLM-4.x MoE and Qwen2/3-MoE field names are understood."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k == "name"}}
    layers = int(_need(cfg, "num_hidden_layers", source))
    experts = int(_first(cfg, ("n_routed_experts", "num_experts", "num_local_experts"), source))
    moe_inter = int(_need(cfg, "moe_intermediate_size", source))
    if "first_k_dense_replace" in cfg:
        dense = int(cfg["first_k_dense_replace"] or 0)
    else:  # Qwen: mlp_only_layers / decoder_sparse_step
        only = cfg.get("mlp_only_layers") or []
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = len(only) + sum(1 for i in range(layers) if i not in only and (i + 1) % step)
    if cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * moe_inter
    else:
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    quant = cfg.get("quantization_config") or {}
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    wbytes = 1.0 if "fp8" in str(quant.get("quant_method", "")) else _DTYPE_BYTES.get(dtype, 2)
    kw = {}
    if cfg.get("kv_lora_rank"):
        kw = dict(
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(_need(cfg, "qk_nope_head_dim", source)),
            qk_rope_head_dim=int(_need(cfg, "qk_rope_head_dim", source)),
            v_head_dim=int(_need(cfg, "v_head_dim", source)),
        )
    else:
        heads = int(_need(cfg, "num_attention_heads", source))
        kw = dict(
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(_need(cfg, "hidden_size", source)) // heads),
        )
    return ModelShape(
        name=str(cfg.get("name") or cfg.get("model_type") or source),
        hidden_size=int(_need(cfg, "hidden_size", source)),
        num_layers=layers,
        num_dense_layers=dense,
        num_experts=experts,
        top_k=int(_first(cfg, ("num_experts_per_tok", "moe_topk", "top_k"), source)),
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=shared,
        dense_intermediate_size=int(cfg.get("intermediate_size") or 0),
        vocab_size=int(_need(cfg, "vocab_size", source)),
        num_heads=int(_need(cfg, "num_attention_heads", source)),
        weight_bytes=float(wbytes),
        kv_bytes=float(_DTYPE_BYTES.get(dtype, 2)),
        wire_bytes=float(_DTYPE_BYTES.get(dtype, 2)),
        **kw,
    )


def load_model(spec: str) -> ModelShape:
    """A preset name, a config.json path, or a checkpoint folder holding config.json."""
    if spec.lower() in PRESETS:  # as hardware presets: DeepSeek-V3 is deepseek-v3
        return PRESETS[spec.lower()]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanInputError(
            f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
            "config.json file or a checkpoint folder holding one"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PlanInputError(f"model config {path}: not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise PlanInputError(f"model config {path}: expected a JSON object")
    return from_hf_config(cfg, str(path))

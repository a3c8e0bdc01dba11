"""A MoE model's sizes, as the planner needs them: from an HF config.json or a preset.

Only shapes, never weights: parameter counts per layer for each role, the KV-cache bytes a
token adds per layer, and the attention core's work per token of context. Attention is
either grouped-query (q/k/v/o projections) or DeepSeek's MLA (latent KV cache of
kv_lora_rank + qk_rope_head_dim per token, computed in the absorbed form). A hybrid model
(Qwen3-Next, Qwen3.5) has linear-attention layers (Gated DeltaNet) between its full ones:
their state per request is fixed-size (a short convolution window and one d_k x d_v matrix
per value head), it does not grow with the context. Sliding-window layers (GPT-OSS, a
config's `sliding_window`) attend over, and cache, at most the window's last tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from afd_core.planner.errors import PlanInputError

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1, "int8": 1}

# What a config's integer fields may hold: (min, max), inclusive. Each must be a JSON integer
# (not a float, not true/false). The upper bounds are generous (far above any published
# model) but bounded, so a typo fails at once instead of planning for hours.
_DIM = 1 << 16  # a head count or head dimension
_WIDTH = 1 << 20  # an MLP width
RANGES: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 4 * 65536),
    "vocab_size": (1, 10**7),
    "n_routed_experts": (1, 65536),
    "num_experts": (1, 65536),
    "num_local_experts": (1, 65536),
    "num_experts_per_tok": (1, 65536),
    "moe_topk": (1, 65536),
    "top_k": (1, 65536),
    "moe_intermediate_size": (1, _WIDTH),
    "intermediate_size": (0, _WIDTH),
    "shared_expert_intermediate_size": (0, _WIDTH),
    "n_shared_experts": (0, 1024),
    "first_k_dense_replace": (0, 1024),
    "decoder_sparse_step": (1, 1024),
    "mlp_only_layers": (0, 1023),  # each entry, also < num_hidden_layers
    "full_attention_interval": (1, 1024),
    "num_attention_heads": (1, _DIM),
    "num_key_value_heads": (1, _DIM),
    "head_dim": (1, _DIM),
    "q_lora_rank": (0, _DIM),
    "kv_lora_rank": (0, _DIM),
    "qk_nope_head_dim": (1, _DIM),
    "qk_rope_head_dim": (0, _DIM),
    "v_head_dim": (1, _DIM),
    "linear_num_key_heads": (1, _DIM),
    "linear_num_value_heads": (1, _DIM),
    "linear_key_head_dim": (1, _DIM),
    "linear_value_head_dim": (1, _DIM),
    "linear_conv_kernel_dim": (1, 1024),
    "sliding_window": (0, 1 << 24),  # 0: no sliding window (vLLM reads 0 as disabled)
}
# ModelShape's own fields bounded by the same table (a preset or a hand-built shape)
_SHAPE_RANGES = {
    "hidden_size": RANGES["hidden_size"],
    "num_layers": RANGES["num_hidden_layers"],
    "num_experts": RANGES["num_experts"],
    "top_k": RANGES["num_experts_per_tok"],
    "vocab_size": RANGES["vocab_size"],
    "num_heads": RANGES["num_attention_heads"],
    "moe_intermediate_size": RANGES["moe_intermediate_size"],
    "dense_intermediate_size": RANGES["intermediate_size"],
}


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
    # per routed-expert parameter where only the experts are quantized (MXFP4: 4.25 bits);
    # 0: weight_bytes
    expert_weight_bytes: float = 0.0
    kv_bytes: float = 2.0  # per cached element (and per linear-attention state element)
    wire_bytes: float = 2.0  # per hidden element exchanged between the roles
    # a sigmoid gate on the attention output, projected with q (Qwen3-Next, Qwen3.5)
    attention_output_gate: bool = False
    # hybrid models: layers with linear attention (Gated DeltaNet) instead of full attention
    num_linear_attention_layers: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # layers that attend over the last `sliding_window` tokens only (GPT-OSS's every other)
    num_sliding_window_layers: int = 0
    sliding_window: int = 0

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if kind in ("int", "float") and (
                isinstance(v, bool) or not isinstance(v, int if kind == "int" else int | float)
            ):
                raise PlanInputError(
                    f"model {self.name}: {f.name}={v!r} is invalid; allowed: "
                    f"{'an integer' if kind == 'int' else 'a number'}"
                )
            if kind in ("int", "float") and v < 0:
                raise PlanInputError(f"model {self.name}: {f.name}={v} must be >= 0")
        for name, (_, hi) in _SHAPE_RANGES.items():
            if getattr(self, name) > hi:
                raise PlanInputError(
                    f"model {self.name}: {name}={getattr(self, name)} must be <= {hi}"
                )
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
        if self.num_linear_attention_layers > self.num_layers:
            raise PlanInputError(
                f"model {self.name}: num_linear_attention_layers="
                f"{self.num_linear_attention_layers} is more than num_layers={self.num_layers}"
            )
        if self.num_linear_attention_layers + self.num_sliding_window_layers > self.num_layers:
            raise PlanInputError(
                f"model {self.name}: num_linear_attention_layers="
                f"{self.num_linear_attention_layers} and num_sliding_window_layers="
                f"{self.num_sliding_window_layers} are more than num_layers={self.num_layers}"
            )
        if self.num_sliding_window_layers and self.sliding_window <= 0:
            raise PlanInputError(
                f"model {self.name}: sliding-window layers need sliding_window > 0"
            )
        linear = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim")
        linear += ("linear_value_head_dim", "linear_conv_kernel_dim")
        if self.num_linear_attention_layers and any(getattr(self, n) <= 0 for n in linear):
            raise PlanInputError(
                f"model {self.name}: linear-attention layers need {', '.join(linear)} > 0"
            )

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def num_softmax_attention_layers(self) -> int:
        """Layers with q/k/v attention and a KV cache: full and sliding-window ones."""
        return self.num_layers - self.num_linear_attention_layers

    @property
    def num_full_attention_layers(self) -> int:
        """Layers attending over the whole context."""
        return self.num_softmax_attention_layers - self.num_sliding_window_layers

    def attended_tokens(self, context: float) -> float:
        """How many cached tokens a sliding-window layer reads at `context`."""
        return min(context, self.sliding_window) if self.num_sliding_window_layers else context

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
        gate = h * n * d if self.attention_output_gate else 0
        return h * n * d + gate + 2 * h * self.num_kv_heads * d + n * d * h

    @property
    def _linear_conv_dim(self) -> int:  # the q, k and v channels the short convolution sees
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def linear_attention_params(self) -> int:
        """One Gated DeltaNet layer (vLLM's qwen_gdn_linear_attn): in_proj_qkvz, in_proj_ba,
        the depthwise conv1d and out_proj; the per-head A_log, dt_bias and the norm are
        left out as the full layers' norms are."""
        h, v = self.hidden_size, self.linear_num_value_heads * self.linear_value_head_dim
        qkvz = h * (self._linear_conv_dim + v)
        ba = h * 2 * self.linear_num_value_heads
        return qkvz + ba + self.linear_conv_kernel_dim * self._linear_conv_dim + v * h

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
    def routed_expert_bytes(self) -> float:
        """Bytes per parameter of a routed expert."""
        return self.expert_weight_bytes or self.weight_bytes

    @property
    def attention_weight_bytes_total(self) -> float:
        """The attention role's weights in bytes (no routed expert there)."""
        return self.attention_params_total * self.weight_bytes

    @property
    def ffn_weight_bytes_total(self) -> float:
        """The FFN role's weights in bytes, the routed experts at their own width."""
        routed = self.num_moe_layers * self.num_experts * self.expert_params
        rest = self.ffn_params_total - routed
        return routed * self.routed_expert_bytes + rest * self.weight_bytes

    @property
    def ffn_params_total(self) -> int:
        """Everything the FFN role holds: experts, shared experts, routers, dense MLPs."""
        moe = self.num_experts * self.expert_params + self.shared_params + self.router_params
        return self.num_moe_layers * moe + self.num_dense_layers * self.dense_mlp_params

    @property
    def attention_params_total(self) -> int:
        """Everything the attention role holds: attention layers, embedding and LM head."""
        layers = self.num_softmax_attention_layers * self.attention_params
        layers += self.num_linear_attention_layers * self.linear_attention_params
        return layers + 2 * self.vocab_size * self.hidden_size

    # -- attention work per token -------------------------------------------------------------

    @property
    def kv_bytes_per_token_layer(self) -> float:
        if self.is_mla:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_bytes
        return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes one token of context adds over the full-attention layers (a
        sliding-window layer stops growing at its window, a linear one holds a fixed state)."""
        return self.num_full_attention_layers * self.kv_bytes_per_token_layer

    def kv_bytes_per_request(self, context: float) -> float:
        """A request's cache at `context` tokens over every layer: the full layers' KV, the
        sliding-window layers' KV of at most the window (vLLM frees the blocks that left
        it), and the linear layers' fixed state."""
        window = self.num_sliding_window_layers * self.attended_tokens(context)
        return (
            context * self.kv_bytes_per_token
            + window * self.kv_bytes_per_token_layer
            + self.state_bytes_per_request
        )

    @property
    def linear_state_bytes_layer(self) -> float:
        """A request's fixed-size state in one linear-attention layer, as vLLM's
        gated_delta_net_state_shape: the conv window (kernel - 1 columns of q, k, v) and
        the recurrent state (value heads x d_v x d_k)."""
        conv = (self.linear_conv_kernel_dim - 1) * self._linear_conv_dim
        recurrent = (
            self.linear_num_value_heads * self.linear_value_head_dim * self.linear_key_head_dim
        )
        return (conv + recurrent) * self.kv_bytes

    @property
    def state_bytes_per_request(self) -> float:
        """The fixed-size state a request holds over all linear-attention layers (0 if none)."""
        if not self.num_linear_attention_layers:
            return 0.0
        return self.num_linear_attention_layers * self.linear_state_bytes_layer

    @property
    def linear_attention_core_flops(self) -> float:
        """Flops of one decode token in one linear-attention layer beyond its projections:
        the conv (2 x kernel per channel) and the delta rule on each value head's d_k x d_v
        state, about 7 flops per state element (decay, the read S k, the rank-1 write, the
        output S q). Independent of the context."""
        state = self.linear_num_value_heads * self.linear_value_head_dim * self.linear_key_head_dim
        return 2.0 * self.linear_conv_kernel_dim * self._linear_conv_dim + 7.0 * state

    def attention_core_flops(self, context: int) -> float:
        """Flops of one query token attending over `context` cached tokens (QK^T and PV)."""
        if self.is_mla:  # absorbed: scores over the latent + rope part, values in the latent
            return 2.0 * self.num_heads * context * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        return 4.0 * self.num_heads * self.head_dim * context

    def with_bytes(self, weight_bytes: float | None = None, kv_bytes: float | None = None):
        """`weight_bytes` overrides every weight's width, the experts' included."""
        if weight_bytes is None:
            weights = {}
        else:
            weights = {"weight_bytes": weight_bytes, "expert_weight_bytes": 0.0}
        return replace(self, **weights, kv_bytes=self.kv_bytes if kv_bytes is None else kv_bytes)


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


def _bad(source: str, key: str, value, allowed: str) -> PlanInputError:
    shown = json.dumps(value)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    return PlanInputError(
        f"model config {source}: field {key!r} = {shown} is invalid; allowed: {allowed}"
    )


def _check_int(value, key: str, source: str, lo: int, hi: int) -> int:
    """`value` if it is a JSON integer in [lo, hi], else a PlanInputError naming it all."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(source, key, value, f"an integer in [{lo}, {hi}]")
    return value


def _int(cfg: dict, key: str, source: str, default: int | None = None) -> int:
    """Integer field `key`, in its RANGES; `default` when absent or null (missing: an error
    if there is no default)."""
    if cfg.get(key) is None:
        if default is None:
            raise PlanInputError(f"model config {source}: field {key!r} is missing")
        return default
    return _check_int(cfg[key], key, source, *RANGES[key])


def _first_int(cfg: dict, keys: tuple[str, ...], source: str) -> int:
    for k in keys:
        if cfg.get(k) is not None:
            return _int(cfg, k, source)
    raise PlanInputError(
        f"model config {source}: none of the fields {', '.join(map(repr, keys))} is present"
    )


_EXPERT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")
# Qwen3-Next and Qwen3.5: hybrid attention, a full layer every 4th when the config gives
# neither layer_types nor full_attention_interval (the HF config classes' default), and an
# output gate on full attention (vLLM's Qwen3NextAttention default)
_HYBRID_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_LAYER_TYPES = ("full_attention", "linear_attention", "sliding_attention")
# GPT-OSS without layer_types: a sliding window on every even layer (the HF config's default,
# vLLM's gpt_oss.py)
_ALTERNATING_SLIDING_TYPES = ("gpt_oss",)


def _dense_layers(cfg: dict, layers: int, source: str) -> int:
    """Layers with a dense MLP instead of experts: DeepSeek/GLM's first_k_dense_replace or
    Qwen's mlp_only_layers and decoder_sparse_step (a layer i is MoE when (i+1) % step == 0)."""
    if "first_k_dense_replace" in cfg:
        return _int(cfg, "first_k_dense_replace", source, 0)
    only = cfg.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list):
        raise _bad(source, "mlp_only_layers", only, "a list of layer indices")
    hi = min(RANGES["mlp_only_layers"][1], layers - 1)
    only = {_check_int(i, "mlp_only_layers", source, 0, hi) for i in only}
    step = _int(cfg, "decoder_sparse_step", source, 1)
    return len(only) + sum(1 for i in range(layers) if i not in only and (i + 1) % step)


def _attention_layer_kinds(cfg: dict, layers: int, source: str) -> tuple[int, int, int]:
    """(linear-attention layers, sliding-window layers, the window), as vLLM 0.32 builds
    them. With layer_types: its counts, and `sliding_window` the window of its
    "sliding_attention" entries. Without: linear layers from full_attention_interval, else
    the Qwen3-Next/3.5 default of one full layer in four, else none; and `sliding_window`
    (unless `use_sliding_window` is false, as HF's Qwen configs read it) applies to every
    other layer, or to every layer but linear ones (vLLM's CacheConfig.sliding_window).
    A window of 0 or null is no window."""
    use = cfg.get("use_sliding_window", True)
    if not isinstance(use, bool):
        raise _bad(source, "use_sliding_window", use, "true or false")
    window = _int(cfg, "sliding_window", source, 0) if use else 0
    types = cfg.get("layer_types")
    if types is not None:
        if (
            not isinstance(types, list)
            or len(types) != layers
            or any(t not in _LAYER_TYPES for t in types)
        ):
            allowed = f"a list of num_hidden_layers ({layers}) entries, each one of "
            raise _bad(source, "layer_types", types, allowed + ", ".join(_LAYER_TYPES))
        sliding = types.count("sliding_attention")
        if sliding and cfg.get("sliding_window") is None:
            raise PlanInputError(
                f"model config {source}: field 'sliding_window' is missing; layer_types has "
                f"{sliding} 'sliding_attention' layers"
            )
        return types.count("linear_attention"), sliding if window else 0, window
    default = 4 if cfg.get("model_type") in _HYBRID_TYPES else 0
    interval = _int(cfg, "full_attention_interval", source, default)
    linear = 0 if interval == 0 else sum(1 for i in range(layers) if (i + 1) % interval)
    if not window:
        return linear, 0, 0
    if cfg.get("model_type") in _ALTERNATING_SLIDING_TYPES:
        return linear, (layers + 1) // 2, window
    return linear, layers - linear, window


# MXFP4: 4-bit values with one 8-bit scale per block of 32 (the OCP microscaling format)
MXFP4_BYTES = (4 + 8 / 32) / 8


def _weight_bytes(quant: dict, dtype: str, source: str) -> tuple[float, float]:
    """(bytes per weight, bytes per routed-expert weight or 0 for the same) of a checkpoint's
    quantization_config, as vLLM 0.32 loads it."""
    plain = float(_DTYPE_BYTES.get(dtype, 2))
    if not quant:
        return plain, 0.0
    method = str(quant.get("quant_method", ""))
    if "fp8" in method.lower():
        return 1.0, 0.0
    if method.lower() == "mxfp4":
        # vLLM's Mxfp4Config quantizes the routed experts only; linear and attention layers
        # load unquantized (model_executor/layers/quantization/mxfp4.py)
        return plain, MXFP4_BYTES
    raise PlanInputError(
        f"model config {source}: quantization_config.quant_method={method!r} is not known "
        "to the planner; known: 'fp8' (1 byte per weight), 'mxfp4' (the routed experts at "
        f"{MXFP4_BYTES * 8:g} bits); pass --weight-bytes to give the bytes per weight"
    )


def from_hf_config(
    cfg: dict, source: str = "<dict>", weight_bytes: float | None = None
) -> ModelShape:
    """The shape of a MoE model from its HF config (a multimodal config's text_config is
    used, with the outer name, dtype and quantization where it has none). DeepSeek-V2/V3,
    GLM-4.x MoE, Qwen2/3-MoE, Qwen3-Next/3.5 (hybrid attention) and Mixtral-style
    (num_local_experts, the expert width in intermediate_size) field names are understood.
    Every integer field is checked against RANGES. `weight_bytes`: every weight's width,
    instead of what the dtype and quantization_config say."""
    if isinstance(cfg.get("text_config"), dict):
        outer = {k: cfg[k] for k in ("quantization_config", "torch_dtype", "dtype") if k in cfg}
        cfg = {**outer, **cfg["text_config"], **{k: v for k, v in cfg.items() if k == "name"}}
    if all(cfg.get(k) is None or type(cfg[k]) is int and cfg[k] == 0 for k in _EXPERT_FIELDS):
        raise PlanInputError(
            f"model config {source}: not a MoE model (no routed experts: none of the fields "
            f"{', '.join(map(repr, _EXPERT_FIELDS))} is present); AFD splits MoE models"
        )
    layers = _int(cfg, "num_hidden_layers", source)
    hidden = _int(cfg, "hidden_size", source)
    experts = _first_int(cfg, _EXPERT_FIELDS, source)
    mixtral = cfg.get("model_type") == "mixtral" or (
        cfg.get("moe_intermediate_size") is None and cfg.get("num_local_experts") is not None
    )
    if mixtral:  # every layer MoE, no shared expert, the expert width in intermediate_size
        moe_inter, dense, shared, dense_inter = _int(cfg, "intermediate_size", source), 0, 0, 0
    else:
        moe_inter = _int(cfg, "moe_intermediate_size", source)
        dense = _dense_layers(cfg, layers, source)
        shared = _int(cfg, "n_shared_experts", source, 0) * moe_inter
        if not shared:
            shared = _int(cfg, "shared_expert_intermediate_size", source, 0)
        dense_inter = _int(cfg, "intermediate_size", source, 0)
    quant = cfg.get("quantization_config")
    quant = {} if quant is None or weight_bytes is not None else quant
    if not isinstance(quant, dict):
        raise _bad(source, "quantization_config", quant, "an object")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if weight_bytes is None:
        wbytes, expert_bytes = _weight_bytes(quant, dtype, source)
    else:
        wbytes, expert_bytes = weight_bytes, 0.0
    heads = _int(cfg, "num_attention_heads", source)
    if _int(cfg, "kv_lora_rank", source, 0):
        kw = dict(
            q_lora_rank=_int(cfg, "q_lora_rank", source, 0),
            kv_lora_rank=_int(cfg, "kv_lora_rank", source),
            qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", source),
            qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", source),
            v_head_dim=_int(cfg, "v_head_dim", source),
        )
    else:
        kw = dict(
            num_kv_heads=_int(cfg, "num_key_value_heads", source, heads),
            head_dim=_int(cfg, "head_dim", source, hidden // heads),
        )
    linear, sliding, window = _attention_layer_kinds(cfg, layers, source)
    if linear:
        for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim"):
            kw[k] = _int(cfg, k, source)
        for k in ("linear_value_head_dim", "linear_conv_kernel_dim"):
            kw[k] = _int(cfg, k, source)
    gate = cfg.get("attn_output_gate", cfg.get("model_type") in _HYBRID_TYPES)
    if not isinstance(gate, bool):
        raise _bad(source, "attn_output_gate", gate, "true or false")
    top_k = _first_int(cfg, ("num_experts_per_tok", "moe_topk", "top_k"), source)
    vocab = _int(cfg, "vocab_size", source)
    try:
        return ModelShape(
            name=str(cfg.get("name") or cfg.get("model_type") or source),
            hidden_size=hidden,
            num_layers=layers,
            num_dense_layers=dense,
            num_experts=experts,
            top_k=top_k,
            moe_intermediate_size=moe_inter,
            shared_intermediate_size=shared,
            dense_intermediate_size=dense_inter,
            vocab_size=vocab,
            num_heads=heads,
            weight_bytes=float(wbytes),
            expert_weight_bytes=expert_bytes,
            kv_bytes=float(_DTYPE_BYTES.get(dtype, 2)),
            wire_bytes=float(_DTYPE_BYTES.get(dtype, 2)),
            attention_output_gate=gate,
            num_linear_attention_layers=linear,
            num_sliding_window_layers=sliding,
            sliding_window=window,
            **kw,
        )
    except PlanInputError as exc:  # a check across fields (top_k > experts): name the file
        raise PlanInputError(f"model config {source}: {exc}") from None


def load_model(spec: str, weight_bytes: float | None = None) -> ModelShape:
    """A preset name, a config.json path, or a checkpoint folder holding config.json;
    `weight_bytes` overrides the width of every weight."""
    if weight_bytes is not None and not weight_bytes > 0:
        raise PlanInputError(f"weight bytes={weight_bytes} is invalid; allowed: > 0")
    if spec.lower() in PRESETS:  # as hardware presets: DeepSeek-V3 is deepseek-v3
        preset = PRESETS[spec.lower()]
        return preset if weight_bytes is None else preset.with_bytes(weight_bytes=weight_bytes)
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
    return from_hf_config(cfg, str(path), weight_bytes)

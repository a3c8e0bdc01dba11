"""Tiny, deterministic random-weight MoE checkpoints, built locally in seconds.

Used by `afd demo` and the tests: nothing is downloaded. Each checkpoint is a directory
with config.json, model.safetensors (float32) and a byte-level BPE tokenizer trained on a
few sentences. Sizes respect what vLLM's CPU kernels accept: attention head sizes from 32
up, and for MLA a latent of kv_lora_rank 512 + qk_rope_head_dim 64 (the only one CPU MLA
supports). Checkpoints are cached by their parameters under the cache directory.

    python -m afd_models.tiny deepseek_v2 --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from afd_core import envs

FACTORY_VERSION = 2
ARCHITECTURES = (
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
    "glm_moe_dsa",
    "qwen3_moe",
    "qwen3_5_moe",
)
ARCH_CLASS = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
# V3's MoE with the V3.2 sparse-attention indexer (GLM-MoE-DSA is built from the same code)
SPARSE_MLA = ("deepseek_v32", "glm_moe_dsa")
CORPUS = [
    "Attention and the feed-forward network run on separate ranks.",
    "The quick brown fox jumps over the lazy dog.",
    "Mixture of experts models route every token to a few experts.",
    "Disaggregated serving scales each half of the model on its own.",
    "Hello world, this is a tiny model for tests.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols + - * / = ( ) .",
]


@dataclass(frozen=True)
class TinySpec:
    arch: str = "deepseek_v2"
    num_layers: int = 3  # layer 0 dense, the others MoE
    num_experts: int = 16
    top_k: int = 2
    hidden_size: int = 64
    # Qwen3-MoE attention heads and MLP widths (benchmarks build larger models); DeepSeek's
    # MLA shapes are fixed by what vLLM's CPU MLA kernels accept
    num_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    vocab_size: int = 512
    seed: int = 0
    # A wide init spreads the logits: greedy decoding then has no near-ties that float
    # rounding (a different batch composition) could flip.
    initializer_range: float = 0.05
    # Random weights give almost flat next-token distributions, where the batch composition
    # (float rounding) can flip a greedy choice. A larger LM head makes them peaked, so
    # greedy tokens are a stable, exact comparison between deployments.
    logit_scale: float = 10.0

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"tiny checkpoint: arch={self.arch!r} is unknown; allowed: {', '.join(ARCHITECTURES)}"
            )
        if self.num_layers < 2:
            raise ValueError(
                f"tiny checkpoint: num_layers={self.num_layers}; need >= 2 (dense + MoE)"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"tiny checkpoint: top_k={self.top_k} must be in 1..num_experts={self.num_experts}"
            )

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "v": FACTORY_VERSION}, sort_keys=True).encode()
        return f"{self.arch}-{hashlib.sha256(blob).hexdigest()[:12]}"


# The benchmarks' model: big enough that per-layer compute dominates Python and thread
# switches on a CPU (hidden 1024, 16 experts), small enough to build in seconds.
BENCHMARK_MOE = TinySpec(
    "qwen3_moe",
    num_layers=4,
    num_experts=16,
    top_k=2,
    hidden_size=1024,
    num_heads=8,
    head_dim=128,
    intermediate_size=2048,
    moe_intermediate_size=512,
)


def default_cache_dir() -> Path:
    root = os.environ.get(envs.AFD_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "afd"
    )
    return Path(root) / "tiny"


def _hf_config(spec: TinySpec):
    import transformers

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        max_position_embeddings=1024,
        initializer_range=spec.initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if spec.arch in ("deepseek_v2", "deepseek_v3", *SPARSE_MLA):
        mla = dict(
            num_key_value_heads=4,
            moe_intermediate_size=spec.moe_intermediate_size,
            first_k_dense_replace=1,
            n_routed_experts=spec.num_experts,
            n_shared_experts=1,
            num_experts_per_tok=spec.top_k,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_group=1,
            topk_group=1,
        )
        if spec.arch == "deepseek_v2":
            return transformers.DeepseekV2Config(
                **common, **mla, q_lora_rank=None, topk_method="greedy"
            )
        v3 = dict(
            q_lora_rank=32,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
        )
        if spec.arch == "deepseek_v3":
            return transformers.DeepseekV3Config(**common, **mla, **v3)
        # the indexer: vLLM switches V3.2 on by index_topk; 512 is what its kernels take.
        # topk_method and scoring_func are not in these configs' signatures: kept as extra
        # attributes, which vLLM reads (noaux_tc builds the routing bias)
        indexer = dict(index_topk=512, index_head_dim=128, index_n_heads=4)
        cls = (
            transformers.DeepseekV32Config
            if spec.arch == "deepseek_v32"
            else transformers.GlmMoeDsaConfig
        )
        return cls(**common, **mla, **v3, **indexer)
    if spec.arch == "qwen3_5_moe":
        return _qwen3_5_config(spec)
    return transformers.Qwen3MoeConfig(
        **common,
        num_key_value_heads=2,
        head_dim=spec.head_dim,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
    )


def _qwen3_5_config(spec: TinySpec):
    """Qwen3.5-MoE with a one-block vision tower: layers 0, 1 linear attention (Gated
    DeltaNet; vLLM's CPU kernels take head dims 64/128 and bf16), every third full
    attention; hidden 128 so that M-RoPE's sections fit the rotary dims. num_layers,
    num_experts, top_k and the vocabulary apply."""
    import transformers

    vocab = spec.vocab_size
    text = dict(
        vocab_size=vocab,
        hidden_size=128,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=2 * spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        max_position_embeddings=1024,
        layer_types=[
            "full_attention" if i % 3 == 2 else "linear_attention" for i in range(spec.num_layers)
        ],
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=spec.initializer_range,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=128,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
    )
    # the last four ids of the vocabulary mark images and videos (never in our prompts)
    return transformers.Qwen3_5MoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=vocab - 4,
        video_token_id=vocab - 3,
        vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1,
    )


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(str(path))


# DeepSeek-V4: vLLM reads its own config class (model_type deepseek_v4, DeepSeek-native
# field and tensor names), and its CPU kernels fix the sizes: bf16, 64 routed experts (its
# routing kernels take 64/128/256/384), top 6, head dim 512 with rope 64. num_layers and
# seed apply; layer i compresses its KV by V4_COMPRESS[i % 3] (0: sliding window only, 4:
# compressor and indexer, 128: compressor), layer 0 routes by token id (hash table).
V4_COMPRESS = (0, 4, 128)
V4 = dict(
    hidden_size=256,
    experts=64,
    top_k=6,
    moe_intermediate_size=32,
    heads=4,
    head_dim=512,
    rope_dim=64,
    q_lora_rank=128,
    o_lora_rank=128,
    o_groups=2,
    hc_mult=4,
    index_heads=8,
    index_head_dim=128,
)


def _v4_config(spec: TinySpec) -> dict:
    v = V4
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": spec.vocab_size,
        "hidden_size": v["hidden_size"],
        "moe_intermediate_size": v["moe_intermediate_size"],
        "num_hidden_layers": spec.num_layers,
        "num_hash_layers": 1,
        "num_attention_heads": v["heads"],
        "num_key_value_heads": 1,
        "head_dim": v["head_dim"],
        "qk_rope_head_dim": v["rope_dim"],
        "q_lora_rank": v["q_lora_rank"],
        "o_lora_rank": v["o_lora_rank"],
        "o_groups": v["o_groups"],
        "n_routed_experts": v["experts"],
        "n_shared_experts": 1,
        "num_experts_per_tok": v["top_k"],
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "compress_ratios": [V4_COMPRESS[i % 3] for i in range(spec.num_layers)],
        "sliding_window": 128,
        "hc_eps": 1e-6,
        "hc_mult": v["hc_mult"],
        "hc_sinkhorn_iters": 20,
        "index_head_dim": v["index_head_dim"],
        "index_n_heads": v["index_heads"],
        "index_topk": 512,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _v4_tensors(spec: TinySpec, cfg: dict) -> dict:
    """Random tensors under the DeepSeek-native names vLLM's V4 loader maps."""
    import torch

    v, g = V4, torch.Generator().manual_seed(spec.seed)
    h, hd, hc = v["hidden_size"], v["head_dim"], v["hc_mult"]
    mix = (2 + hc) * hc

    def rand(*shape, dtype=torch.bfloat16, std=spec.initializer_range):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def ones(*shape, dtype=torch.bfloat16):
        return torch.ones(*shape, dtype=dtype)

    f32 = torch.float32
    t = {
        "embed.weight": rand(spec.vocab_size, h, std=1.0),
        "norm.weight": ones(h),
        "head.weight": rand(spec.vocab_size, h, std=spec.initializer_range * spec.logit_scale),
        "hc_head_fn": rand(hc, hc * h, dtype=f32),
        "hc_head_base": rand(hc, dtype=f32),
        "hc_head_scale": ones(1, dtype=f32),
    }

    def compressor(prefix: str, ratio: int, dim: int) -> None:
        width = (2 if ratio == 4 else 1) * dim
        t[f"{prefix}.wkv.weight"] = rand(width, h)
        t[f"{prefix}.wgate.weight"] = rand(width, h)
        t[f"{prefix}.ape"] = rand(ratio, width, dtype=f32)
        t[f"{prefix}.norm.weight"] = ones(dim)

    for i in range(spec.num_layers):
        p = f"layers.{i}"
        for side in ("attn", "ffn"):
            t[f"{p}.hc_{side}_fn"] = rand(mix, hc * h, dtype=f32)
            t[f"{p}.hc_{side}_base"] = rand(mix, dtype=f32)
            t[f"{p}.hc_{side}_scale"] = ones(3, dtype=f32)
        t[f"{p}.attn_norm.weight"] = ones(h)
        t[f"{p}.ffn_norm.weight"] = ones(h)
        a = f"{p}.attn"
        t[f"{a}.attn_sink"] = rand(v["heads"], dtype=f32)
        t[f"{a}.wq_a.weight"] = rand(v["q_lora_rank"], h)
        t[f"{a}.wkv.weight"] = rand(hd, h)
        t[f"{a}.q_norm.weight"] = ones(v["q_lora_rank"])
        t[f"{a}.kv_norm.weight"] = ones(hd)
        t[f"{a}.wq_b.weight"] = rand(v["heads"] * hd, v["q_lora_rank"])
        groups = v["o_groups"]
        t[f"{a}.wo_a.weight"] = rand(groups * v["o_lora_rank"], v["heads"] * hd // groups)
        t[f"{a}.wo_b.weight"] = rand(h, groups * v["o_lora_rank"])
        ratio = cfg["compress_ratios"][i]
        if ratio > 1:
            compressor(f"{a}.compressor", ratio, hd)
        if ratio == 4:
            heads, dim = v["index_heads"], v["index_head_dim"]
            t[f"{a}.indexer.wq_b.weight"] = rand(heads * dim, v["q_lora_rank"])
            t[f"{a}.indexer.weights_proj.weight"] = rand(heads, h)
            compressor(f"{a}.indexer.compressor", ratio, dim)
        f, e, k, inter = f"{p}.ffn", v["experts"], v["top_k"], v["moe_intermediate_size"]
        t[f"{f}.gate.weight"] = rand(e, h)
        if i < cfg["num_hash_layers"]:
            table = [torch.randperm(e, generator=g)[:k] for _ in range(spec.vocab_size)]
            t[f"{f}.gate.tid2eid"] = torch.stack(table).to(torch.int32)
        else:
            t[f"{f}.gate.bias"] = rand(e, dtype=f32, std=0.01)
        for x in range(e):
            t[f"{f}.experts.{x}.w1.weight"] = rand(inter, h)
            t[f"{f}.experts.{x}.w3.weight"] = rand(inter, h)
            t[f"{f}.experts.{x}.w2.weight"] = rand(h, inter)
        for w, shape in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
            t[f"{f}.shared_experts.{w}.weight"] = rand(*shape)
    return t


def _build_deepseek_v4(spec: TinySpec, out_dir: Path) -> None:
    from safetensors.torch import save_file

    cfg = _v4_config(spec)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(_v4_tensors(spec, cfg), str(out_dir / "model.safetensors"))


def build(spec: TinySpec, out_dir: Path) -> Path:
    """Write the checkpoint into out_dir (created; must not exist or be empty)."""
    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    if spec.arch == "deepseek_v4":  # no transformers class vLLM reads: written by hand
        _build_deepseek_v4(spec, out_dir)
        _save_tokenizer(out_dir, spec.vocab_size)
        (out_dir / "afd_tiny.json").write_text(json.dumps(asdict(spec), indent=2))
        return out_dir
    config = _hf_config(spec)
    model_cls = getattr(transformers, ARCH_CLASS[spec.arch])
    # Qwen3.5's linear attention runs only in bf16 on vLLM's CPU build
    dtype = torch.bfloat16 if spec.arch == "qwen3_5_moe" else torch.float32
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        model = model_cls(config).to(dtype)
        with torch.no_grad():
            model.lm_head.weight.mul_(spec.logit_scale)
        if spec.arch in ("deepseek_v3", *SPARSE_MLA):  # a non-zero bias: noaux_tc routing
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.data.uniform_(-0.01, 0.01)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _save_tokenizer(out_dir, spec.vocab_size)
    (out_dir / "afd_tiny.json").write_text(json.dumps(asdict(spec), indent=2))
    return out_dir


def tiny_checkpoint(spec: TinySpec | None = None, cache_dir: Path | None = None) -> Path:
    """The cached checkpoint for spec, built on first use (atomically: safe across processes)."""
    spec = spec or TinySpec()
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / spec.key()
    if (target / "afd_tiny.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.key()}-", dir=root))
    try:
        build(spec, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "afd_tiny.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m afd_models.tiny", description=__doc__.split("\n")[0]
    )
    p.add_argument("arch", choices=ARCHITECTURES)
    p.add_argument("--out", type=Path, help="directory to write (default: the cache)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    spec = TinySpec(a.arch, num_layers=a.layers, num_experts=a.experts, seed=a.seed)
    path = build(spec, a.out) if a.out else tiny_checkpoint(spec)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

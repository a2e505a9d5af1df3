"""Tiny random-weight causal LMs of many architectures, built in-process from transformers' config classes.

Every model has 4 layers, hidden size 128, 4 query heads and 2 KV heads where the architecture has
grouped-query attention, a sliding window (or attention chunk) of ``WINDOW`` tokens where it has one,
and the embedded model's vocabulary (so the embedded tokenizer serves them all). Weights are random (seeded): no hub, no
downloads. ``ARCHITECTURES`` names each one; ``build(name)`` returns the model in eval mode. The tests'
architecture matrix and the benchmarks on windowed models build from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers as tf

VOCAB = 49152  # the embedded SmolLM2 tokenizer's
WINDOW = 32  # small, so that a short prompt runs past it (the matrix stays fast)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def _common(**over) -> dict:
    return {**COMMON, **over}


# multi-head latent attention (DeepSeek-V2/V3): keys of 32 + 16 rotary dimensions, values of 32, K/V on every head
MLA = dict(
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    moe_intermediate_size=64,
)


def _deepseek(**over) -> object:
    """A tiny DeepSeek-V3 (``MLA``; RoPE as cos and sin)."""
    return tf.DeepseekV3Config(**_common(**{**MLA, **over}))


def _deepseek_v2(**over) -> object:
    """A tiny DeepSeek-V2: the same latent attention, with complex (``torch.polar``) RoPE angles."""
    return tf.DeepseekV2Config(**_common(**{**MLA, **over}))


SWITCH = 64  # the tiny Phi-3's original_max_position_embeddings: its longrope switches factors past it


def _phi3_longrope(switch: int = SWITCH, **over) -> object:
    """A tiny Phi-3 with longrope: short factors up to ``switch`` tokens, long ones (4x slower) past it."""
    rotary = 128 // 4 // 2  # hidden 128 over 4 heads: 16 rotated pairs
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * rotary,
        "long_factor": [4.0] * rotary,
        "original_max_position_embeddings": switch,
    }
    return tf.Phi3Config(
        **_common(pad_token_id=0, original_max_position_embeddings=switch, rope_parameters=rope, **over)
    )


def mpt_config(alibi: bool = True) -> object:
    """A tiny MPT: its attention adds an ALiBi bias (``attn_config.alibi``) unless ``alibi`` is off."""
    return tf.MptConfig(
        vocab_size=VOCAB, d_model=128, n_heads=4, n_layers=4, max_seq_len=2048, attn_config={"alibi": alibi}
    )


# each takes the window (or attention chunk) in tokens
CONFIGS: dict[str, Callable[[int], tuple[type, object]]] = {
    "llama": lambda w: (tf.LlamaForCausalLM, tf.LlamaConfig(**_common())),
    "llama-mha": lambda w: (tf.LlamaForCausalLM, tf.LlamaConfig(**_common(num_key_value_heads=4))),
    "mistral": lambda w: (tf.MistralForCausalLM, tf.MistralConfig(**_common(sliding_window=w))),
    "qwen2": lambda w: (tf.Qwen2ForCausalLM, tf.Qwen2Config(**_common())),
    "qwen3": lambda w: (tf.Qwen3ForCausalLM, tf.Qwen3Config(**_common(head_dim=32))),
    "phi3": lambda w: (tf.Phi3ForCausalLM, tf.Phi3Config(**_common(pad_token_id=0))),
    # longrope: the RoPE factors switch past SWITCH tokens (the matrix's prompt is past it)
    "phi3-longrope": lambda w: (tf.Phi3ForCausalLM, _phi3_longrope()),
    # a window applied through the mask alone (the attention call is not told)
    "phimoe": lambda w: (
        tf.PhimoeForCausalLM,
        tf.PhimoeConfig(**_common(sliding_window=w, num_local_experts=4, num_experts_per_tok=2)),
    ),
    "gpt-neox": lambda w: (
        tf.GPTNeoXForCausalLM,
        tf.GPTNeoXConfig(**_common(rotary_pct=0.25, tie_word_embeddings=False)),
    ),
    "mixtral": lambda w: (
        tf.MixtralForCausalLM,
        tf.MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2)),
    ),
    "smollm3": lambda w: (tf.SmolLM3ForCausalLM, tf.SmolLM3Config(**_common(pad_token_id=0))),
    "gemma2": lambda w: (
        tf.Gemma2ForCausalLM,
        tf.Gemma2Config(**_common(head_dim=32, sliding_window=w, attn_logit_softcapping=50.0)),
    ),
    "gemma3": lambda w: (
        tf.Gemma3ForCausalLM,
        tf.Gemma3TextConfig(**_common(head_dim=32, sliding_window=w, sliding_window_pattern=2)),
    ),
    # three local layers to one global, each kind with its own RoPE parameters (Olmo 3 scales the global ones)
    "olmo3": lambda w: (
        tf.Olmo3ForCausalLM,
        tf.Olmo3Config(
            **_common(
                sliding_window=w,
                eos_token_id=0,
                pad_token_id=0,
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
                },
            )
        ),
    ),
    "gpt-oss": lambda w: (
        tf.GptOssForCausalLM,
        tf.GptOssConfig(**_common(head_dim=32, sliding_window=w, num_local_experts=4, num_experts_per_tok=2)),
    ),
    "opt": lambda w: (
        tf.OPTForCausalLM,
        tf.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            ffn_dim=256,
            word_embed_proj_dim=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=2048,
        ),
    ),
    "deepseek-v3": lambda w: (tf.DeepseekV3ForCausalLM, _deepseek()),
    "deepseek-v2": lambda w: (tf.DeepseekV2ForCausalLM, _deepseek_v2()),
    # num_key_value_heads that the model ignores: multi-head latent attention expands K/V to every head
    "deepseek-v3-kv2": lambda w: (tf.DeepseekV3ForCausalLM, _deepseek(num_key_value_heads=2, v_head_dim=48)),
    # chunked attention (blocks of w positions) on three layers with RoPE, global without RoPE on the fourth
    "llama4": lambda w: (
        tf.Llama4ForCausalLM,
        tf.Llama4TextConfig(
            **_common(
                head_dim=32,
                intermediate_size_mlp=256,
                num_local_experts=2,
                num_experts_per_tok=1,
                attention_chunk_size=w,
            )
        ),
    ),
    "falcon": lambda w: (
        tf.FalconForCausalLM,
        tf.FalconConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            max_position_embeddings=2048,
        ),
    ),
}
ARCHITECTURES = tuple(CONFIGS)


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, window: int = WINDOW) -> torch.nn.Module:
    """The tiny ``name`` model with seeded random weights and a ``window``-token window or chunk where it has
    one, in eval mode (sdpa attention)."""
    cls, config = CONFIGS[name](window)
    return instantiate(cls, config, "sdpa" if name not in ("gemma2", "gpt-oss") else "eager", seed, dtype)


def instantiate(
    cls: type, config, attn: str = "sdpa", seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """``cls(config)`` with seeded random weights (spread for clear greedy margins), in eval mode."""
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    # random init leaves tiny logits; a larger spread gives the greedy tokens a clear margin
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
    return model


# Random architectures (tests/test_random_architectures.py): a family's model class and config class, the
# config's keyword arguments drawn per family. ``random_model(family, **kwargs)`` rebuilds any draw.
FAMILIES: dict[str, tuple[type, type, str]] = {
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig, "sdpa"),
    "mistral": (tf.MistralForCausalLM, tf.MistralConfig, "sdpa"),
    "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config, "sdpa"),
    "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, "sdpa"),
    "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config, "eager"),
    "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig, "sdpa"),
    "phi3": (tf.Phi3ForCausalLM, tf.Phi3Config, "sdpa"),
    "gpt-neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig, "sdpa"),
    "olmo3": (tf.Olmo3ForCausalLM, tf.Olmo3Config, "sdpa"),
    "gpt-oss": (tf.GptOssForCausalLM, tf.GptOssConfig, "eager"),
    "deepseek-v3": (tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config, "sdpa"),
    "deepseek-v2": (tf.DeepseekV2ForCausalLM, tf.DeepseekV2Config, "sdpa"),
    "falcon": (tf.FalconForCausalLM, tf.FalconConfig, "sdpa"),
    "llama4": (tf.Llama4ForCausalLM, tf.Llama4TextConfig, "sdpa"),
    "phimoe": (tf.PhimoeForCausalLM, tf.PhimoeConfig, "sdpa"),
    "mpt": (tf.MptForCausalLM, tf.MptConfig, "eager"),
}


def random_model(family: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    """``family``'s model built from its config class with ``kwargs`` (as drawn), seeded random weights, eval mode."""
    cls, config_cls, attn = FAMILIES[family]
    return instantiate(cls, config_cls(**kwargs), attn, seed)

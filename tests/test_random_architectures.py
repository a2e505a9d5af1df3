"""Architectures drawn at random: tiny 2-layer models whose configurations Hypothesis draws per family.

Per family (``tiny_models.FAMILIES``) the draw covers what the family can vary: head size, grouped-query
ratio, sliding window size and which layers use it (PhiMoE: through its mask alone), partial rotary, Phi-3's
longrope and the length where it switches factors, attention logit soft-capping, attention biases, attention
sinks (gpt-oss), the ranks of multi-head latent attention (DeepSeek-V2 with complex RoPE, DeepSeek-V3), Llama 4's
chunk size and layers without RoPE, MPT with or without ALiBi. Each draw is either refused by the load path in
one line (ModelLoadError, no newline), or its run refused before it starts in one line (a prompt and new
tokens that would cross the RoPE switch), or: ``exact`` with a float32 cache generates the model's own greedy
``generate`` tokens on a prompt past every window, and snapkv and streaming at budget 0.5 hold their budget
with no health flag.

A failing draw prints as ``tiny_models.random_model(family, **kwargs)``: anyone can rebuild it.
The short run (fixed seed, a few draws per family) is part of ``make test``; the long one (200 draws over all
families, random seed; ``KVLAB_RANDOM_DRAWS`` changes the count) is marked ``acceptance``.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from bench.tiny_models import FAMILIES, random_model
from kvlab.core.budgets import TOLERANCE, Budget, exact_bytes
from kvlab.core.model import ModelLoadError
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import from_model
from kvlab.engine.specs import GenerationSettings, InputError, RunSpec
from kvlab.measure.health import HealthProbe

PROMPT_TOKENS = 40  # past every drawn window (at most 16)
NEW_TOKENS = 4
# the embedded tokenizer's first 1,024 ids (its full 49,152 make each draw ten times slower); the prompt keeps to them
VOCAB = 1024
METHODS = ("snapkv", "streaming")
SHORT_DRAWS = 3  # per family, in `make test`
LONG_DRAWS = int(os.environ.get("KVLAB_RANDOM_DRAWS", "200"))  # the acceptance run's draws

HEAD_DIMS = st.sampled_from([8, 16, 32])
WINDOWS = st.sampled_from([4, 8, 16])
SOFTCAPS = st.sampled_from([None, 20.0, 50.0])


def _layer_types(draw) -> list[str]:
    """Which of the 2 layers are local: any of the four patterns."""
    return draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]), min_size=2, max_size=2))


@st.composite
def _heads(draw, gqa: bool = True) -> dict:
    """Query heads and KV heads (their ratio drawn among the divisors)."""
    n = draw(st.sampled_from([1, 2, 4]))
    if not gqa:
        return {"num_attention_heads": n}
    kv = draw(st.sampled_from([d for d in (1, 2, 4) if n % d == 0]))
    return {"num_attention_heads": n, "num_key_value_heads": kv}


def _base(draw, gqa: bool = True, head_dim_field: bool = True) -> dict:
    heads = draw(_heads(gqa))
    hd = draw(HEAD_DIMS)
    # families without a head_dim field split hidden_size evenly across the query heads
    hidden = 64 if head_dim_field else heads["num_attention_heads"] * hd
    out = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        **heads,
    )
    if head_dim_field:
        out["head_dim"] = hd
    return out


@st.composite
def config_kwargs(draw, family: str) -> dict:
    """Keyword arguments for ``family``'s config class (``tiny_models.FAMILIES``)."""
    if family == "llama":
        return {**_base(draw), "attention_bias": draw(st.booleans()), "mlp_bias": draw(st.booleans())}
    if family == "mistral":
        return {**_base(draw), "sliding_window": draw(st.one_of(st.none(), WINDOWS))}
    if family == "qwen2":  # q/k/v biases always on; a window on the layers from max_window_layers on
        kw = _base(draw, head_dim_field=False)
        if draw(st.booleans()):
            kw.update(use_sliding_window=True, sliding_window=draw(WINDOWS), max_window_layers=draw(st.integers(0, 2)))
        return kw
    if family == "qwen3":
        kw = {**_base(draw), "attention_bias": draw(st.booleans())}
        if draw(st.booleans()):
            kw.update(use_sliding_window=True, sliding_window=draw(WINDOWS), max_window_layers=draw(st.integers(0, 2)))
        return kw
    if family in ("gemma2", "gemma3"):
        kw = _base(draw)
        kw.update(
            sliding_window=draw(WINDOWS),
            attn_logit_softcapping=draw(SOFTCAPS),
            final_logit_softcapping=draw(st.sampled_from([None, 30.0])),
            query_pre_attn_scalar=draw(st.sampled_from([kw["head_dim"], 64])),
            attention_bias=draw(st.booleans()),
        )
        if family == "gemma2":  # alternating (its default: local, global) or drawn
            if draw(st.booleans()):
                kw["layer_types"] = _layer_types(draw)
        else:
            kw["layer_types"] = _layer_types(draw)
        return kw
    if family == "phi3":  # fused qkv, partial rotary, optional window on every layer, longrope switching factors
        kw = _base(draw, head_dim_field=False)
        partial = draw(st.sampled_from([0.25, 0.5, 1.0]))
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
        if draw(st.booleans()):  # the switch before the prompt's end, inside its decoding (refused), or after it
            switch = draw(st.sampled_from([16, PROMPT_TOKENS, PROMPT_TOKENS + 1, 64]))
            pairs = int(kw["hidden_size"] // kw["num_attention_heads"] * partial) // 2
            rope.update(
                rope_type="longrope",
                short_factor=[1.0] * pairs,
                long_factor=[draw(st.sampled_from([2.0, 8.0]))] * pairs,
                original_max_position_embeddings=switch,
            )
            kw["original_max_position_embeddings"] = switch
        kw.update(pad_token_id=0, sliding_window=draw(st.one_of(st.none(), WINDOWS)), rope_parameters=rope)
        return kw
    if family == "phimoe":  # a window through the mask alone, mixture of experts
        kw = _base(draw, head_dim_field=False)
        kw.update(
            sliding_window=draw(st.one_of(st.none(), WINDOWS)),
            attention_bias=draw(st.booleans()),
            num_local_experts=4,
            num_experts_per_tok=2,
        )
        return kw
    if family == "llama4":  # chunked attention on the layers with RoPE, global without; qk norm, temperature
        kw = _base(draw)
        kw.update(
            intermediate_size_mlp=128,
            attention_chunk_size=draw(WINDOWS),
            no_rope_layers=draw(st.lists(st.sampled_from([0, 1]), min_size=2, max_size=2)),
            use_qk_norm=draw(st.booleans()),
            attn_temperature_tuning=draw(st.booleans()),
            interleave_moe_layer_step=draw(st.sampled_from([1, 2])),
            num_local_experts=2,
            num_experts_per_tok=1,
        )
        return kw
    if family == "mpt":  # ALiBi in attn_config (refused), or none: hand-written attention (refused too)
        heads = draw(_heads(gqa=False))
        return dict(
            vocab_size=VOCAB,
            d_model=heads["num_attention_heads"] * draw(HEAD_DIMS),
            n_heads=heads["num_attention_heads"],
            n_layers=2,
            max_seq_len=512,
            attn_config={"alibi": draw(st.booleans())},
        )
    if family == "gpt-neox":  # multi-head only, partial rotary, optional biases
        kw = _base(draw, gqa=False, head_dim_field=False)
        kw.update(
            tie_word_embeddings=False,
            attention_bias=draw(st.booleans()),
            use_parallel_residual=draw(st.booleans()),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": draw(st.sampled_from([0.25, 0.5, 1.0])),
            },
        )
        return kw
    if family == "olmo3":
        kw = _base(draw, head_dim_field=False)
        kw.update(
            eos_token_id=0,
            pad_token_id=0,
            sliding_window=draw(WINDOWS),
            layer_types=_layer_types(draw),
            attention_bias=draw(st.booleans()),
        )
        return kw
    if family == "gpt-oss":  # attention sinks on every layer, biases, MoE
        kw = _base(draw)
        kw.update(
            sliding_window=draw(WINDOWS),
            layer_types=_layer_types(draw),
            attention_bias=draw(st.booleans()),
            num_local_experts=4,
            num_experts_per_tok=2,
        )
        return kw
    if family in ("deepseek-v3", "deepseek-v2"):  # multi-head latent attention: ranks and head sizes drawn
        kw = _base(draw, head_dim_field=False)
        kw.pop("num_key_value_heads")
        n = kw["num_attention_heads"]
        kw.update(
            num_key_value_heads=n,
            q_lora_rank=draw(st.sampled_from([None, 16, 32])),
            kv_lora_rank=draw(st.sampled_from([8, 16, 32])),
            qk_rope_head_dim=draw(st.sampled_from([8, 16])),
            qk_nope_head_dim=draw(st.sampled_from([8, 16, 32])),
            v_head_dim=draw(st.sampled_from([8, 16, 32])),
            attention_bias=draw(st.booleans()),
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=draw(st.integers(0, 2)),
            moe_intermediate_size=32,
        )
        return kw
    if family == "falcon":  # new decoder architecture (grouped KV) or multi-query, rotary
        heads = draw(_heads())
        hd = draw(HEAD_DIMS)
        new = draw(st.booleans())
        kw = dict(
            vocab_size=VOCAB,
            hidden_size=heads["num_attention_heads"] * hd,
            num_hidden_layers=2,
            num_attention_heads=heads["num_attention_heads"],
            max_position_embeddings=512,
            bias=draw(st.booleans()),
            new_decoder_architecture=new,
        )
        if new:
            kw["num_kv_heads"] = heads["num_key_value_heads"]
        else:
            kw.update(multi_query=draw(st.booleans()), parallel_attn=draw(st.booleans()))
        return kw
    raise KeyError(family)


@pytest.fixture(scope="module")
def prompt(lm, long_text):
    ids = [int(i) for i in lm.tokenizer(long_text)["input_ids"] if i < VOCAB][:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return ids


def _generate(model, ids, n):
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()


def check_draw(family: str, kwargs: dict, lm, prompt) -> None:
    """Refused in one line, or exact equals ``generate`` and METHODS hold budget 0.5 with no health flag."""
    note(f"rebuild: tiny_models.random_model({family!r}, **{kwargs!r})")
    try:
        model = random_model(family, **kwargs)
    except (ValueError, TypeError) as exc:  # transformers itself rejects the config: not kvlab's to judge
        event(f"{family}: config rejected by transformers")
        note(f"transformers: {exc}")
        return
    try:
        loaded = from_model(model, lm.tokenizer, family).with_cache_dtype("float32")
    except ModelLoadError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, f"refusal not one line: {msg!r}"
        event(f"{family}: refused")
        note(f"refused: {msg}")
        return
    event(f"{family}: loaded")
    runs = [RunSpec("exact")] + [RunSpec(m, Budget.parse("0.5")) for m in METHODS]
    gen = GenerationSettings(max_new_tokens=NEW_TOKENS)
    if loaded.info.switch_crossed(len(prompt), len(prompt) + NEW_TOKENS - 1) is not None:
        with pytest.raises(InputError, match="where this model's RoPE switches") as info:
            Engine(loaded).compare(prompt, runs, gen)
        assert "\n" not in str(info.value)
        event(f"{family}: run refused (crosses the RoPE switch)")
        return
    res = Engine(loaded).compare(prompt, runs, gen, probes=[HealthProbe()])
    exact = res.runs[0]
    assert not exact.error, exact.error
    expected = _generate(model, prompt, NEW_TOKENS)
    assert exact.token_ids == expected, f"exact {exact.token_ids} != generate {expected}"
    assert exact.health == [], exact.health
    for r in res.runs[1:]:
        assert not r.error, f"{r.method}: {r.error}"
        assert r.health == [], f"{r.method}: {r.health}"
        # the budget's base: the exact cache as transformers holds it (a chunked layer's whole block; the exact run
        # keeps only the part of it its newest query sees)
        base = exact_bytes(loaded.info, len(prompt))
        assert r.kv_bytes <= 0.5 * base * (1 + TOLERANCE), f"{r.method}: {r.kv_bytes} of {base}"
        assert r.token_ids, r.method


_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]  # each draw builds and runs a model


@pytest.mark.parametrize("family", FAMILIES)
@settings(derandomize=True, max_examples=SHORT_DRAWS, deadline=None, database=None, suppress_health_check=_SUPPRESS)
@given(data=st.data())
def test_random_architecture(family, data, lm, prompt):
    check_draw(family, data.draw(config_kwargs(family), label="kwargs"), lm, prompt)


@st.composite
def _any_family(draw) -> tuple[str, dict]:
    family = draw(st.sampled_from(list(FAMILIES)))
    return family, draw(config_kwargs(family))


@pytest.mark.acceptance
@settings(max_examples=LONG_DRAWS, deadline=None, database=None, suppress_health_check=_SUPPRESS)
@given(draw=_any_family())
def test_random_architectures_long(draw, lm, prompt):
    check_draw(*draw, lm, prompt)

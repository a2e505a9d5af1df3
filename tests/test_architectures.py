"""The architecture matrix: tiny random-weight models of 20 configurations, built in-process (no hub).

For each (``tiny_models``): the load path (attention semantics read from the model, the self-check
against its own forward) accepts it; ``exact`` with a float32 cache generates ``generate``'s tokens
on a prompt longer than its sliding window; every registered method runs at budget 0.5 in the same
comparison, holds its budget in bytes and raises no health flag. Also: the self-check refuses a broken attention
path, unsupported architectures (MPT's ALiBi among them) are refused in one line and exit status 2, a run
that would cross the length where Phi-3's longrope switches factors is refused before it starts, RoPE is read
as each model applies it (complex angles, latent attention's rotated part, layers without RoPE), PhiMoE's
window is read from its config, and bf16 on the CPU stays exact.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.mpt.configuration_mpt import MptAttentionConfig

from bench import tiny_models
from bench.tiny_models import ARCHITECTURES, WINDOW, build, instantiate
from kvlab.cli import main
from kvlab.core import semantics as sm
from kvlab.core.budgets import TOLERANCE, Budget, exact_bytes
from kvlab.core.model import ModelLoadError
from kvlab.core.rope import HALF, INTERLEAVED, SameToken, model_rotary
from kvlab.engine import attention as attn
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import from_model, load_model, refuse_unsupported, uses_alibi, verdict_of
from kvlab.engine.prefill import ExactExtension, prefill
from kvlab.engine.selfcheck import divergence, probe_ids, self_check
from kvlab.engine.specs import GenerationSettings, InputError, RunSpec
from kvlab.methods import names
from kvlab.methods.engine_flags import FLAGS
from kvlab.methods.exact import Exact
from kvlab.methods.handover import PrefillNeeds

PROMPT_TOKENS = 3 * WINDOW  # past every window
NEW_TOKENS = 6
# families with sliding-window or chunked layers
LOCAL = {"mistral", "gemma2", "gemma3", "olmo3", "gpt-oss", "llama4", "phimoe"}
# an engine's cache type is a fixed format: below its bytes it refuses the budget, naming the smallest it honours
FIXED_FORMAT = {f.name for f in FLAGS} | {"ggml", "vllm-turboquant"}
# refused on a model without a rotary embedding kvlab can read (per layer)
NEEDS_ROPE = {
    "expected-attention",
    "ada-expected-attention",
    "lukv-expected-attention",
    "duoattention",
    "capkv",
    "leverage",
    "compactor",
}


@pytest.fixture(scope="module")
def prompt(lm, long_text):
    return [int(i) for i in lm.tokenizer(long_text)["input_ids"][:PROMPT_TOKENS]]


def _generate(model, ids, n):
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_architecture(arch, lm, prompt):
    model = build(arch)
    loaded = from_model(model, lm.tokenizer, arch).with_cache_dtype("float32")  # self-check on
    info = loaded.info
    assert (arch in LOCAL) == info.semantics.has_local
    methods = [m for m in names() if m != "exact"]
    runs = [RunSpec("exact")] + [RunSpec(m, Budget.parse("0.5")) for m in methods]
    res = Engine(loaded).compare(prompt, runs, GenerationSettings(max_new_tokens=NEW_TOKENS))
    exact = res.runs[0]
    assert exact.token_ids == _generate(model, prompt, NEW_TOKENS)
    # a local layer's exact cache holds its window only
    assert exact.kv_bytes == exact_bytes(info, len(prompt))
    held = sum(min(len(prompt), s.span or len(prompt)) for s in info.semantics.layers)
    assert exact.kv_bytes == info.n_kv_heads * held * (info.head_dim + info.v_head_dim) * 4
    for r in res.runs[1:]:
        if r.method in NEEDS_ROPE and info.rope is None:  # refused in one line, the reason named
            assert "rotary position embedding" in r.error and not r.token_ids, f"{arch} / {r.method}: {r.error}"
            continue
        if r.method in FIXED_FORMAT and "the smallest budget it can honour here is" in r.error:
            continue  # an engine's fixed cache type larger than half the cache here (vLLM's 16-bit boundary layers)
        if r.method in FIXED_FORMAT and any(d % 32 or d & (d - 1) for d in (info.head_dim, info.v_head_dim)):
            # ggml's blocks of 32 numbers, vLLM's Hadamard matrix of a power-of-two size: head size 48 refused
            assert "cannot run on a model with head size" in r.error and not r.token_ids, f"{arch} / {r.method}"
            continue
        assert not r.error, f"{arch} / {r.method}: {r.error}"
        assert r.health == [], f"{arch} / {r.method}: {r.health}"
        assert r.kv_bytes <= 0.5 * exact.kv_bytes * (1 + TOLERANCE), f"{arch} / {r.method}"
        assert len(r.token_ids) == NEW_TOKENS


def test_head_counts_come_from_the_tensors(lm, prompt):
    """A DeepSeek-V3 config whose num_key_value_heads (2) is not its heads (4): latent attention expands K/V
    to every head whatever the field says. With values smaller than keys, transformers' own forward repeats
    K/V by the field and fails; the self-check says so in one line. kvlab reads the heads from the tensors:
    on the same weights its exact path generates what the model with an honest config generates."""
    lying = instantiate(tf.DeepseekV3ForCausalLM, tiny_models._deepseek(num_key_value_heads=2))
    honest = instantiate(tf.DeepseekV3ForCausalLM, tiny_models._deepseek())
    assert all(torch.equal(a, b) for a, b in zip(lying.state_dict().values(), honest.state_dict().values()))
    with pytest.raises(ModelLoadError, match="own forward fails in transformers") as info:
        from_model(lying, lm.tokenizer, "deepseek-v3-kv2")
    assert "\n" not in str(info.value)
    loaded = from_model(lying, lm.tokenizer, "deepseek-v3-kv2", check=False).with_cache_dtype("float32")
    assert (loaded.info.n_heads, loaded.info.n_kv_heads, loaded.info.v_head_dim) == (4, 4, 32)
    runs = [RunSpec("exact"), RunSpec("snapkv", Budget.parse("0.5"))]
    res = Engine(loaded).compare(prompt, runs, GenerationSettings(max_new_tokens=NEW_TOKENS))
    assert res.runs[0].token_ids == _generate(honest, prompt, NEW_TOKENS)
    assert not res.runs[1].error and res.runs[1].health == []


def _mistral(lm):
    return build("mistral"), lm.tokenizer


def test_self_check_refuses_a_dropped_window(lm, monkeypatch):
    """The old fault: the attention function ignores ``sliding_window``. The load check names it."""
    real = sm.from_call

    def no_window(module, q, k, v, scaling, kw, config):
        return real(module, q, k, v, scaling, {**kw, "sliding_window": None}, None)

    monkeypatch.setattr(sm, "from_call", no_window)
    with pytest.raises(ModelLoadError, match="differs from the model's own forward") as info:
        from_model(*_mistral(lm), "mistral")
    assert "\n" not in str(info.value) and "docs/models.md" in str(info.value)
    monkeypatch.undo()
    from_model(*_mistral(lm), "mistral")  # the same model, honoured, loads


def test_chunked_attention_is_read_and_checked(lm, monkeypatch):
    """Llama 4's chunked layers: a query sees only the keys of its own block of ``attention_chunk_size``
    positions. kvlab reads the blocks from the config (the model passes only a mask, which kvlab does not
    use); read as global attention instead, the self-check refuses the model past the first block."""
    assert not refuse_unsupported(build("llama4").config, "llama4")
    monkeypatch.setattr(sm, "_config_chunk", lambda config, layer: None)
    with pytest.raises(ModelLoadError, match="differs from the model's own forward"):
        from_model(build("llama4"), lm.tokenizer, "llama4")
    monkeypatch.undo()
    info = from_model(build("llama4"), lm.tokenizer, "llama4").info
    assert [s.chunk for s in info.semantics.layers] == [WINDOW, WINDOW, WINDOW, None]
    assert "chunked attention (32-token blocks) on 3 of 4 layers" in info.semantics.features()
    s = info.semantics[0]
    assert [s.visible_from(p) for p in (0, 31, 32, 40, 95)] == [0, 0, 32, 32, 64]


@pytest.mark.parametrize("arch", ["gemma3", "olmo3"])
def test_rope_is_each_layers_own(lm, arch):
    """Local and global layers that rotate with different RoPE parameters: ``ModelInfo.rope.layer(i)`` is
    layer i's. The first layer's query before RoPE depends on the token alone (its input is the token's
    embedding), so a token seen twice un-rotates to one query with its layer's rotation, not the other kind's."""
    loaded = from_model(build(arch), lm.tokenizer, arch, check=False)
    rope, layers = loaded.info.rope, loaded.info.semantics.layers
    assert rope is not None and rope.shared is None
    far = next(rope.layer(i) for i, s in enumerate(layers) if s.is_local != layers[0].is_local)
    assert far is not None and far is not rope.layer(0)
    ids = list(range(1000, 1040))
    ids[30] = ids[3]
    state, _ = prefill(loaded, ids, PrefillNeeds(query_window=len(ids)))
    pos = torch.arange(len(ids))
    pre = rope.unrotate(state.queries.float(), pos)  # [L, Hq, n, d]: each layer's own rotation undone
    own = rope.layer(0).unrotate(state.queries[0].float(), pos)
    torch.testing.assert_close(pre[0], own, rtol=0, atol=0)
    torch.testing.assert_close(own[:, 30], own[:, 3], rtol=0, atol=1e-4)
    wrong = far.unrotate(state.queries[0].float(), pos)
    assert (wrong[:, 30] - wrong[:, 3]).abs().max() > 1e-2


class _OffByFivePercent(Exact):
    """An exact cache whose decode attention is 5% off: the fault of a broken decode handler."""

    attend_many = None  # overrides ``attend``: every row through it

    def attend(self, layer, q):
        return super().attend(layer, q) * 1.05


def test_self_check_refuses_a_broken_decode_path(lm):
    """A decode path whose attention is off by a little is caught and located."""
    loaded = from_model(build("llama"), lm.tokenizer, "llama", check=False)
    assert self_check(loaded).largest < 1e-3  # the model itself passes
    with pytest.raises(ModelLoadError, match="at decode step 1"):
        self_check(loaded, through=_OffByFivePercent)


def test_self_check_is_on_by_default_and_cheap(lm):
    """load_model runs it (the embedded model passed it); the probe is the window + 8 tokens, then 5 decode steps."""
    from kvlab.engine.selfcheck import divergence

    errs, prefix = divergence(lm)
    assert max(errs) < 1e-4 and prefix == 24 and len(errs) == 6  # plain attention: a 24-token prefill


@pytest.mark.parametrize(
    "config, why",
    [
        (tf.T5Config(), "encoder-decoder"),
        (tf.MambaConfig(), "state-space"),
        (tf.FalconConfig(alibi=True), "ALiBi"),
        (tiny_models.mpt_config(True), "ALiBi"),
        (tf.BloomConfig(), "ALiBi"),
        (tf.Qwen3NextConfig(), "not softmax attention"),
    ],
)
def test_unsupported_architectures_refused_in_one_line(config, why):
    with pytest.raises(ModelLoadError, match=why) as info:
        refuse_unsupported(config, "x")
    assert "\n" not in str(info.value) and "docs/models.md" in str(info.value)


@pytest.mark.slow
def test_bfloat16_cpu_exact_equals_generate(lm):
    """The GPU's 16-bit path, on the CPU: a bf16 model with a bf16 cache generates generate's tokens."""
    bf = load_model("embedded", dtype="bfloat16", cache_dtype="bfloat16")
    assert bf.info.dtype == "bfloat16" and bf.info.cache_dtype == "bfloat16"
    ids = bf.encode("Name three rivers of Europe and the seas they flow into.")
    res = Engine(bf).compare(ids, [RunSpec("exact")], GenerationSettings(max_new_tokens=16))
    assert res.runs[0].token_ids == _generate(bf.model, ids, 16)


@pytest.mark.parametrize("alibi", [True, False])
def test_mpt_is_refused_in_one_line_with_status_2(alibi, lm, tmp_path, capsys):
    """MPT keeps ALiBi in ``attn_config.alibi``: refused from its config. Without ALiBi its hand-written attention
    calls neither transformers' interface nor SDPA, and reading it fails inside the model's own code: that too is
    a one-line refusal naming the cause, never a traceback. From the command line: status 2, one line."""
    model = instantiate(tf.MptForCausalLM, tiny_models.mpt_config(alibi), "eager")
    why = "ALiBi" if alibi else "reading its attention failed (AttributeError"
    with pytest.raises(ModelLoadError, match=why.replace("(", r"\(")) as info:
        from_model(model, lm.tokenizer, "mpt")
    assert "\n" not in str(info.value) and "docs/models.md" in str(info.value)
    folder = tmp_path / "mpt"
    model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    capsys.readouterr()
    code = main(["compare", "--prompt", "hi", "--model", str(folder), "--max-new-tokens", "2", "--quiet"])
    lines = [x for x in capsys.readouterr().err.splitlines() if x and "Loading weights" not in x]  # the bar: not ours
    assert code == 2 and len(lines) == 1 and "kvlab cannot run" in lines[0] and why in lines[0], lines


def test_alibi_is_read_wherever_families_keep_it():
    assert uses_alibi(tf.FalconConfig(alibi=True)) and not uses_alibi(tf.FalconConfig())
    assert uses_alibi(tiny_models.mpt_config(True)) and not uses_alibi(tiny_models.mpt_config(False))
    assert uses_alibi(tf.MptConfig(attn_config=MptAttentionConfig(alibi=True)))  # an object, not a dict
    assert uses_alibi(tf.BloomConfig())  # BLOOM always adds it; no field says so


def test_a_run_crossing_the_rope_switch_is_refused(lm):
    """Phi-3's longrope rotates every position with short factors up to ``original_max_position_embeddings``
    tokens and with long ones past it; transformers' ``generate`` re-encodes the whole sequence at the crossing.
    kvlab finds the switch in the model's rotary module, probes past it at load, runs what stays on one side
    (exact == generate) and refuses, before any work, a run that would cross it."""
    model = build("phi3-longrope")
    loaded = from_model(model, lm.tokenizer, "phi3-longrope").with_cache_dtype("float32")
    switch = tiny_models.SWITCH
    assert loaded.info.rope_switches == (switch,)
    assert verdict_of(loaded).past_switches == (switch + 1,)
    ids = probe_ids(loaded, switch + 16)
    engine, runs = Engine(loaded), [RunSpec("exact"), RunSpec("snapkv", Budget.parse("0.5"))]
    with pytest.raises(InputError, match=f"would run past {switch} tokens") as info:
        engine.compare(ids[: switch - 4], runs, GenerationSettings(max_new_tokens=8))
    assert f"at most {switch + 1} tokens" in str(info.value) and "\n" not in str(info.value)
    below = ids[: switch - 8]  # prompt + new tokens fed: exactly up to the switch
    res = engine.compare(below, runs, GenerationSettings(max_new_tokens=9))
    assert res.runs[0].token_ids == _generate(model, below, 9) and not res.runs[1].error
    # the refusal is needed: decoding across the switch, kvlab's cache keeps keys of the short factors
    errs, _ = divergence(loaded, prefix=switch - 2)
    assert max(errs[3:]) > 1e-2


def test_kvzip_reconstructs_within_the_rope_switch(lm, monkeypatch):
    """KVzip runs the prompt again after itself to score it; on a prompt within the switch that forward stays
    within it too (past it, its queries would turn with other factors than the prompt's keys)."""
    loaded = from_model(build("phi3-longrope"), lm.tokenizer, "phi3-longrope", check=False)
    reached: list[int] = []
    real = ExactExtension.extend

    def extend(self, ids, observe):
        reached.append(self.keys.shape[-2] + len(ids))
        return real(self, ids, observe)

    monkeypatch.setattr(ExactExtension, "extend", extend)
    ids, gen = probe_ids(loaded, 40), GenerationSettings(max_new_tokens=2)
    res = Engine(loaded).compare(ids, [RunSpec("kvzip", Budget.parse("0.5"))], gen)
    assert not res.runs[0].error and reached and max(reached) <= tiny_models.SWITCH


def test_complex_rope_and_its_placement_are_the_models(lm):
    """DeepSeek-V2 and Llama 4 give complex angles (``torch.polar``), rotating neighbouring pairs; latent
    attention rotates the last 16 of 48 key numbers; Llama 4's global layer and SmolLM3's every fourth apply no
    RoPE. On the first layer's keys of one token at positions 2 and 30 (its input is the token alone), kvlab's
    rotation turns one into the other; a placement the keys contradict is not read (the rotation is None)."""
    cases = {"deepseek-v2": (INTERLEAVED, 32, [0, 1, 2, 3]), "llama4": (INTERLEAVED, 0, [0, 1, 2])}
    cases |= {"deepseek-v3": (HALF, 32, [0, 1, 2, 3]), "smollm3": (HALF, 0, [0, 1, 2])}
    for arch, (pairing, offset, with_rope) in cases.items():
        model = build(arch)
        rope = from_model(model, lm.tokenizer, arch, check=False).info.rope
        assert rope is not None, arch
        assert [i for i, r in enumerate(rope.layers) if r is not None] == with_rope, arch
        r = rope.layer(0)
        assert (r.pairing, r.offset) == (pairing, offset), arch
        rec = sm.Recorder()
        ids = list(range(100, 131))
        ids[30] = ids[2]
        with torch.inference_mode(), attn.active(model, rec):
            model(input_ids=torch.tensor([ids]), use_cache=False)
        k = rec.first_keys
        assert k is not None
        moved = r.rotate(r.unrotate(k[:, 2:3].float(), torch.tensor([2])), torch.tensor([30]))
        torch.testing.assert_close(moved, k[:, 30:31].float(), rtol=0, atol=1e-4 * float(k.abs().max()))
        assert (k[:, 30] - k[:, 2]).abs().max() > 1e-2  # RoPE did turn them
    # keys that no rotation relates: nothing is read
    noise = SameToken(torch.randn(2, 48), torch.randn(2, 48), (0, 3), 4)
    assert model_rotary(build("deepseek-v2"), 48, 4, noise) is None


def test_phimoe_window_is_read_from_its_config(lm, monkeypatch):
    """PhiMoE applies ``config.sliding_window`` through its mask alone: the attention call is not told. kvlab
    reads it from the config (no ``layer_types``), and the self-check, whose probe runs past it, confirms it;
    read as global attention instead, the self-check refuses the model."""
    info = from_model(build("phimoe"), lm.tokenizer, "phimoe").info
    assert [s.window for s in info.semantics.layers] == [WINDOW] * 4
    monkeypatch.setattr(sm, "_config_window", lambda config, layer: None)
    with pytest.raises(ModelLoadError, match="differs from the model's own forward"):
        from_model(build("phimoe"), lm.tokenizer, "phimoe")

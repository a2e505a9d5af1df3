"""The engine against references computed independently on the real embedded model."""

import pytest
import torch
from transformers import DynamicCache

from kvlab.core.budgets import Budget, exact_bytes
from kvlab.engine.prefill import prefill
from kvlab.engine.probe import Probe
from kvlab.engine.specs import GenerationSettings, InputError, RunSpec, expand_runs

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
]


class LogitsProbe(Probe):
    attends = True

    def __init__(self):
        self.logits = {}

    def on_prefill(self, state, logits, comps):
        self.state = state

    def on_attend(self, layer, row, q, out):
        pass

    def on_step(self, step, rows, logits):
        for r, i in enumerate(rows):
            self.logits.setdefault(i, []).append(logits[r].clone())

    def finish(self, runs):
        pass


def _generate(lm, ids, n):
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_exact_equals_generate(engine32, lm, prompt):
    """With float32 caches the exact cache is transformers' own attention: the same tokens."""
    ids = lm.encode(prompt)
    res = engine32.compare(ids, [RunSpec("exact")], GenerationSettings(max_new_tokens=24))
    assert res.model["cache_dtype"] == "float32"
    assert res.runs[0].token_ids == _generate(lm, ids, 24)


def test_exact_fp16_cache_teacher_forced_kl(engine, lm, long_text):
    """With the default float16 cache (fp32 compute on the CPU), exact's next-token distribution
    along ``generate``'s tokens stays within KL(generate || exact) <= 1e-4 nats at every step and
    <= 1e-5 on average (measured: max ~2e-6, mean ~3e-7 on this 715-token prompt)."""
    ids = lm.encode(long_text[:3000])
    probe = LogitsProbe()
    res = engine.compare(ids, [RunSpec("exact")], GenerationSettings(max_new_tokens=24), probes=[probe])
    assert res.model["cache_dtype"] == "float16" and lm.info.dtype == "float32"
    assert res.runs[0].kv_bytes == exact_bytes(lm.info, len(ids))
    ref = _generate(lm, ids, 24)
    with torch.no_grad():
        full = lm.model(torch.tensor([ids + ref])).logits[0].float()
    toks = res.runs[0].token_ids
    same = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref))
    # step s's logits follow tokens 0..s-1; while they equal generate's, this is teacher forcing
    steps = range(1, min(len(probe.logits[0]), same) + 1)
    assert len(steps) >= 8
    kls = []
    for s in steps:
        lp = torch.log_softmax(full[len(ids) - 1 + s], -1)
        lq = torch.log_softmax(probe.logits[0][s - 1].float(), -1)
        kls.append(float((lp.exp() * (lp - lq)).sum()))
    assert max(kls) <= 1e-4
    assert sum(kls) / len(kls) <= 1e-5


@pytest.mark.slow
def test_exact_equals_generate_long_prompt(engine32, lm, long_text):
    ids = lm.encode(long_text[:7000])
    assert len(ids) > 1500
    res = engine32.compare(
        ids, [RunSpec("exact"), RunSpec("streaming", Budget.parse("0.25"))], GenerationSettings(max_new_tokens=12)
    )
    assert res.runs[0].token_ids == _generate(lm, ids, 12)
    stream = res.runs[1]
    target = 0.25 * exact_bytes(engine32.info, len(ids))
    assert abs(stream.kv_bytes - target) / target < 0.02
    assert stream.token_ids and stream.finish_reason in ("eos", "length")


def test_streaming_full_budget_equals_exact(engine, lm):
    ids = lm.encode(PROMPTS[1])
    res = engine.compare(
        ids, [RunSpec("exact"), RunSpec("streaming", Budget.parse("1.0"))], GenerationSettings(max_new_tokens=16)
    )
    assert res.runs[0].token_ids == res.runs[1].token_ids
    assert res.runs[0].kv_bytes == res.runs[1].kv_bytes


def test_exact_bytes_reported(engine, lm):
    ids = lm.encode(PROMPTS[0])
    res = engine.compare(ids, [RunSpec("exact")], GenerationSettings(max_new_tokens=5))
    r = res.runs[0]
    n = len(ids)
    info = lm.info
    assert info.cache_dtype == "float16" and info.dtype_bytes == 2
    # layers x KV heads x tokens x head_dim x 2 (K and V) x 2 bytes (16-bit cache)
    assert r.kv_bytes == info.n_layers * info.n_kv_heads * n * info.head_dim * 2 * 2
    # one more token per decode step, for the method and for the exact reference
    assert (
        r.kv_bytes_per_step
        == [exact_bytes(lm.info, n + k) for k in range(len(r.token_ids))][: len(r.kv_bytes_per_step)]
    )
    assert r.kv_bytes_per_step == r.exact_kv_bytes_per_step


def test_streaming_holds_budget_while_decoding(engine, lm, long_text):
    ids = lm.encode(long_text[:1500])
    res = engine.compare(ids, [RunSpec("streaming", Budget.parse("0.25"))], GenerationSettings(max_new_tokens=10))
    r = res.runs[0]
    assert len(set(r.kv_bytes_per_step)) == 1  # constant: evicts one token per new token
    assert r.kv_bytes_per_step[-1] < r.exact_kv_bytes_per_step[-1] * 0.26


def test_positions_after_eviction(engine32, lm, long_text):
    """A compressed row's logits equal a reference forward over the kept tokens at their true positions.

    Run with float32 caches: the reference DynamicCache holds the model's float32 K/V (the new token's
    included), so a 16-bit cache would differ from it by rounding alone (~4e-3), not by positions."""
    engine = engine32
    ids = lm.encode(long_text[:1200])
    n = len(ids)
    probe = LogitsProbe()
    res = engine.compare(
        ids, [RunSpec("streaming", Budget.parse("0.3"))], GenerationSettings(max_new_tokens=2), probes=[probe]
    )
    sink, window = res.runs[0].params["n_sink"], res.runs[0].params["window"]
    # the cache holds sink + window tokens *including* the new one: it evicts on arrival
    keep = list(range(sink)) + list(range(n - window + 1, n))
    # Reference: an ordinary DynamicCache holding the kept K/V of the exact prefill, SDPA attention,
    # the first generated token at its true position n.
    state, logits0 = prefill(lm, ids)
    cache = _kept_cache(state, keep, lm)
    first = res.runs[0].token_ids[0]
    with torch.inference_mode():
        ref = lm.model(
            input_ids=torch.tensor([[first]]), position_ids=torch.tensor([[n]]), past_key_values=cache
        ).logits[0, -1]
        wrong = lm.model(
            input_ids=torch.tensor([[first]]),
            position_ids=torch.tensor([[len(keep)]]),
            past_key_values=_kept_cache(state, keep, lm),
        ).logits[0, -1]
    got = probe.logits[0][0]
    assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (got - ref).abs().max()
    assert not torch.allclose(got, wrong, atol=2e-3)  # positions from the cache length would differ


def _kept_cache(state, keep, lm):
    cache = DynamicCache()
    for layer in range(lm.info.n_layers):
        cache.update(state.keys[layer, :, keep].unsqueeze(0), state.values[layer, :, keep].unsqueeze(0), layer)
    return cache


def test_lockstep_rows_equal_separate_runs(engine, lm):
    ids = lm.encode(PROMPTS[0] + " Then name three French rivers.")
    specs = [RunSpec("exact"), RunSpec("streaming", Budget.parse("0.5")), RunSpec("streaming", Budget.parse("12t"))]
    gen = GenerationSettings(max_new_tokens=16)
    together = engine.compare(ids, specs, gen)
    for spec, run in zip(specs, together.runs):
        alone = engine.compare(ids, [spec], gen).runs[0]
        assert alone.token_ids == run.token_ids, spec.label


def test_seeded_sampling_is_reproducible(engine, lm):
    ids = lm.encode(PROMPTS[1])
    gen = GenerationSettings(max_new_tokens=12, do_sample=True, temperature=1.0, seed=7)
    a = engine.compare(ids, [RunSpec("exact")], gen).runs[0].token_ids
    b = engine.compare(ids, [RunSpec("exact")], gen).runs[0].token_ids
    c = (
        engine.compare(ids, [RunSpec("exact")], GenerationSettings(max_new_tokens=12, do_sample=True, seed=8))
        .runs[0]
        .token_ids
    )
    assert a == b and a != c


def test_progress_events(engine, lm):
    ids = lm.encode(PROMPTS[0])
    kinds = [e.kind for e in engine.stream(ids, [RunSpec("exact")], GenerationSettings(max_new_tokens=4))]
    assert kinds[0] == "prefill" and kinds[-1] == "done" and "step" in kinds and "run_done" in kinds


def test_bad_inputs(engine, lm):
    with pytest.raises(InputError, match="allowed"):
        expand_runs(["nope"], [])
    with pytest.raises(InputError, match="unknown parameter"):
        expand_runs(["streaming"], [Budget.parse("0.5")], {"streaming": {"bogus": 1}})
    with pytest.raises(InputError, match="empty"):
        engine.compare([], [RunSpec("exact")])
    with pytest.raises(InputError, match="context"):
        engine.compare([1] * 5000, [RunSpec("exact")], GenerationSettings(max_new_tokens=4096))


def test_expand_runs_exact_once():
    specs = expand_runs(["exact", "streaming"], [Budget.parse("0.5"), Budget.parse("0.25")])
    assert [s.label for s in specs] == ["exact", "streaming@0.5", "streaming@0.25"]

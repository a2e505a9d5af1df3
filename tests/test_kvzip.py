"""KVzip (``kvlab/methods/kvzip.py``) on the embedded model.

* Its scores, computed from the queries and keys the prefill hand-over's ``extend`` observes,
  equal the maxima read off the model's own attention (transformers' eager forward over prompt +
  reconstruction input, attention weights returned): one chunk, and several chunks (each
  renormalised over the keys it scores).
* It holds its budget in bytes with ragged per-head counts, and its per-head attention equals
  dense attention over the same pairs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from kv_samples import new_token, planned

from kvlab.core import semantics as sm
from kvlab.core.budgets import TOLERANCE, exact_bytes, per_token_bytes
from kvlab.engine.prefill import prefill
from kvlab.methods.handover import PrefillNeeds
from kvlab.methods.kvzip import reconstruction_inputs, reconstruction_scores, template


@contextlib.contextmanager
def eager(model):
    cfg = model.config
    old = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        yield
    finally:
        cfg._attn_implementation = old


@torch.inference_mode()
def reference_scores(lm, prompt: list[int], sink: int, chunks) -> torch.Tensor:
    """[L, Hkv, n] from the model's own attention weights: per chunk, the reconstruction rows' weights
    on (template prefix, chunk, reconstruction) renormalised to sum to 1, max over rows and each group
    (the prefix: max over the chunks too)."""
    info, n = lm.info, len(prompt)
    out = torch.zeros(info.n_layers, info.n_kv_heads, n)
    for start, end, ids in chunks:
        with eager(lm.model):
            res = lm.model(input_ids=torch.tensor([prompt + ids]), output_attentions=True, logits_to_keep=1)
        sub = torch.cat([torch.arange(sink), torch.arange(start, end), torch.arange(n, n + len(ids))])
        for layer, a in enumerate(res.attentions):
            p = a[0, :, n:, sub].float()  # [Hq, c, m]
            p = p / p.sum(-1, keepdim=True)
            best = p[..., : sink + end - start].amax(1).view(info.n_kv_heads, info.group_size, -1).amax(1)
            out[layer, :, :sink] = torch.maximum(out[layer, :, :sink], best[:, :sink])
            out[layer, :, start:end] = best[:, sink:]
    return out


@pytest.fixture(scope="module")
def short(lm, long_text):
    """A real ~120-token prefill (chat template included) with the model's access for KVzip."""
    state, _ = prefill(lm, lm.encode(long_text[:400]), PrefillNeeds(model_access=True))
    return state


@pytest.mark.parametrize("chunk", [2000, 48])
def test_scores_equal_the_models_attention(lm, short, chunk):
    access = short.model
    opening, closing = template(access)
    sink = len(opening)
    assert sink > 0 and closing  # the prompt is in the chat template
    chunks = reconstruction_inputs(access, sink, chunk, closing)
    assert len(chunks) == (1 if chunk == 2000 else -(-(len(access.prompt_ids) - sink) // chunk))
    got = reconstruction_scores(access, lm.info.semantics, lm.info.n_kv_heads, chunk, lm.info.max_positions)
    ref = reference_scores(lm, access.prompt_ids, sink, chunks)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-3)
    assert float(got[..., sink:].amax()) > 0.5  # the copy heads do attend to the context
    with pytest.raises(ValueError, match="no room for its reconstruction"):  # prompt + input must fit
        reconstruction_scores(access, lm.info.semantics, lm.info.n_kv_heads, chunk, len(access.prompt_ids) + 20)


@pytest.mark.parametrize("allocation", ["global", "uniform"])
def test_budget_in_bytes_with_ragged_heads(lm, short, allocation):
    info, n = lm.info, short.n_tokens
    comp, knobs = planned(lm, "kvzip", "0.25", n, allocation=allocation)
    comp.compress(short)
    target = 0.25 * exact_bytes(info, n)
    assert 0.9 * target <= comp.nbytes() <= target * (1 + TOLERANCE), (comp.nbytes(), target, knobs)
    counts = torch.tensor([[s.n for s in heads] for heads in comp.heads])  # [L, Hkv]
    assert int(counts.sum()) == knobs["capacity"] * info.n_layers * info.n_kv_heads
    if allocation == "global":
        assert len(set(counts.view(-1).tolist())) > 1  # ragged: the ranking spans heads and layers
    else:
        assert bool((counts == knobs["capacity"]).all())
    before = comp.nbytes()
    for layer in range(info.n_layers):  # one decode step: each head's attention over its own pairs
        k, v = new_token(short, layer, 0)
        comp.append(layer, k, v, n)
        q = short.keys[layer].repeat_interleave(info.group_size, 0)[:, -1:] * 0.5  # a plausible query
        kept = torch.zeros(info.n_kv_heads, n + 1, dtype=torch.bool)
        for h, store in enumerate(comp.heads[layer]):
            kept[h, store.views()[2][0].long()] = True
        cd = info.torch_cache_dtype
        ref = sm.attend(
            q,
            torch.cat([short.keys[layer], k], -2).to(cd),
            torch.cat([short.values[layer], v], -2).to(cd),
            info.semantics[layer],
            torch.zeros(kept.shape).masked_fill_(~kept, float("-inf")),
        )
        torch.testing.assert_close(comp.attend(layer, q), ref, atol=1e-5, rtol=1e-4)
    per_token = per_token_bytes(info) + 4  # K, V and an int32 position
    assert comp.nbytes() - before == info.n_layers * info.n_kv_heads * per_token


def test_one_reconstruction_serves_every_budget(lm, short, monkeypatch):
    """Two budgets of one prompt keep different pairs but pay for the reconstruction once."""
    access, n = short.model, short.n_tokens
    calls = []
    extend = access.extend
    monkeypatch.setattr(access, "extend", lambda ids, observe: calls.append(len(ids)) or extend(ids, observe))
    kept = []
    for budget in ("0.25", "0.5"):
        comp, _ = planned(lm, "kvzip", budget, n, chunk=64)  # a chunk size no other test scores with
        comp.compress(short)
        kept.append(sum(s.n for heads in comp.heads for s in heads))
    assert len(calls) == len(reconstruction_inputs(access, len(template(access)[0]), 64, template(access)[1]))
    assert kept[0] < kept[1]


def test_the_template_opening_is_never_evicted(lm, short):
    """As in the authors' code, the chat template's opening is kept in every layer and KV head (and paid for
    from the budget); with ``keep_template`` off it competes, and at a small budget some of it goes."""
    info, n = lm.info, short.n_tokens
    prefix = len(template(short.model)[0])
    assert 0 < prefix < n // 4

    def kept(**params):
        comp, knobs = planned(lm, "kvzip", "0.25", n, **params)
        comp.compress(short)
        held = torch.zeros(info.n_layers, info.n_kv_heads, n, dtype=torch.bool)
        for layer, heads in enumerate(comp.heads):
            for h, store in enumerate(heads):
                held[layer, h, store.views()[2][0].long()] = True
        assert int(held.sum()) == knobs["capacity"] * info.n_layers * info.n_kv_heads  # the same total
        return held

    for allocation in ("global", "uniform"):
        assert bool(kept(allocation=allocation)[..., :prefix].all()), allocation
    assert not bool(kept(keep_template=False)[..., :prefix].all())

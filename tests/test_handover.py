"""The prefill hand-over on the real embedded model: each need a method declares is met, from one
prefill for every method; RoPE read from the model's own rotary embedding; query statistics before
RoPE; the model's extension of the exact prompt equals a prefill of the concatenation."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import Tensor

from kvlab.core.budgets import Budget
from kvlab.core.rope import HALF
from kvlab.engine import prefill as prefill_mod
from kvlab.engine.prefill import MergedNeeds, prefill
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.methods import PrefillNeeds, PrefillState, registry
from kvlab.methods.exact import Exact

PROMPT = "The cat sat on the mat because the mat was warm. The dog slept by the door. Where did the cat sit?"
LAYER = 7  # the layer whose queries are rebuilt from the model's own projection


class _Counting:
    """A window observer that counts the query rows it was shown, per layer."""

    def __init__(self, rows: int, n_layers: int):
        self.rows, self.seen = rows, [0] * n_layers

    def __call__(self, layer: int, probs: Tensor, first_pos: int) -> None:
        self.seen[layer] += probs.shape[-2]
        self.last = probs if layer == LAYER else getattr(self, "last", None)


class _Needy(Exact):
    """The exact cache that asks the prefill for ``wants`` and keeps the state it was handed."""

    wants: ClassVar[dict] = {}
    got: ClassVar[list[PrefillState]] = []

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        obs = _Counting(self.wants["observer"], self.info.n_layers) if "observer" in self.wants else None
        self.observer = obs
        return PrefillNeeds(**{k: v for k, v in self.wants.items() if k != "observer"}, observer=obs)

    def compress(self, state: PrefillState) -> None:
        type(self).got.append(state)
        if state.model is not None:  # a forward of its own, inside the comparison
            seen: list[int] = []
            state.model.extend(state.model.encode(" The cat"), lambda layer, q, k: seen.append(layer))
            assert seen == list(range(self.info.n_layers))
        super().compress(state)


def _needy(name: str, **wants: object) -> type[_Needy]:
    return type(name.replace("-", "_"), (_Needy,), {"name": name, "wants": wants, "got": []})


NEEDY = [
    _needy("needs-window", query_window=5),
    _needy("needs-acc", acc_attn=True),
    _needy("needs-observer", query_window=3, observer=3),
    _needy("needs-stats", query_stats=12),
    _needy("needs-model", model_access=True),
    _needy("needs-proj", out_proj=True),
    _needy("needs-nothing"),
]


@pytest.fixture(scope="module")
def needy_methods():
    for cls in NEEDY:
        registry.register(cls)
    yield
    for cls in NEEDY:
        registry.unregister(cls.name)


def test_one_prefill_meets_every_need(engine, lm, needy_methods, monkeypatch):
    calls = []
    real = prefill_mod.prefill
    monkeypatch.setattr(prefill_mod, "prefill", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    ids = lm.encode(PROMPT)
    n, info = len(ids), lm.info
    runs = [RunSpec(cls.name, Budget(fraction=1.0)) for cls in NEEDY] + [RunSpec("h2o", Budget(fraction=0.5))]
    result = engine.compare(ids, runs, GenerationSettings(max_new_tokens=2))
    assert all(not r.error for r in result.runs), [r.error for r in result.runs]
    assert len(calls) == 1  # one prefill for the whole mix
    states = {cls.name: cls.got[-1] for cls in NEEDY}
    assert len({id(s) for s in states.values()}) == 1  # and every method got that one state
    state = states["needs-window"]
    assert state.queries.shape == (info.n_layers, info.n_heads, 5, info.head_dim)  # the largest window asked
    assert state.acc_attn is not None and state.acc_attn.shape == (info.n_layers, info.n_heads, n)
    assert state.query_stats is not None and state.query_stats.n == 12 and state.query_stats.first_pos == n - 12
    assert state.model is not None and state.model.prompt_ids == ids
    assert state.out_proj is not None and len(state.out_proj) == info.n_layers  # read once, a view per layer
    assert state.out_proj[0].shape == (lm.model.config.hidden_size, info.n_heads, info.v_head_dim)  # [hidden, Hq, dv]


def test_observer_sees_its_rows_and_nothing_asked_costs_nothing(lm):
    ids = lm.encode(PROMPT)
    obs = _Counting(4, lm.info.n_layers)
    state, logits = prefill(lm, ids, PrefillNeeds(observer=obs, query_window=4))
    assert obs.seen == [4] * lm.info.n_layers
    # what the observer saw is the attention of the last 4 queries, causal, from the captured q and k
    q, k = state.queries[LAYER].float(), state.keys[LAYER].float()
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    x = torch.matmul(q, k.transpose(-1, -2)) * state.scaling
    n = k.shape[-2]
    x[..., n - 4 :].masked_fill_(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(obs.last, torch.softmax(x, -1), rtol=1e-4, atol=1e-6)
    bare, bare_logits = prefill(lm, ids, PrefillNeeds())
    assert bare.queries.shape[-2] == 0 and bare.acc_attn is None
    assert bare.query_stats is None and bare.model is None and bare.out_proj is None
    assert torch.equal(logits, bare_logits)  # observing changes nothing: the model's own attention computes
    assert torch.equal(state.keys, bare.keys)  # every row's output, observed or not


def test_accumulated_attention_from_the_prefills_own_attention(lm):
    """The attention each key received, taken from SDPA's row normalisers, equals the column sums of an
    explicit causal softmax over the same queries and keys, and leaves the prefill's numbers as they are."""
    from kvlab.engine.attention import accumulated_attention

    ids = lm.encode(PROMPT)
    state, logits = prefill(lm, ids, PrefillNeeds(acc_attn=True, query_window=len(ids)))
    for layer in (0, LAYER):
        ref = accumulated_attention(state.queries[layer], state.keys[layer], lm.info.semantics[layer])
        torch.testing.assert_close(state.acc_attn[layer], ref, rtol=1e-4, atol=1e-5)
    assert torch.allclose(state.acc_attn.sum(-1), torch.tensor(float(len(ids))), rtol=1e-4)  # one per query
    _, bare_logits = prefill(lm, ids, PrefillNeeds())
    assert torch.equal(logits, bare_logits)


def test_merged_needs():
    a, b = _Counting(3, 1), _Counting(5, 1)
    merged = MergedNeeds.of(
        [
            PrefillNeeds(query_window=4, observer=a),
            PrefillNeeds(acc_attn=True, query_stats=9, observer=b),
            PrefillNeeds(query_window=7, model_access=True, query_stats=5),
            PrefillNeeds(query_stats=9),
        ]
    )
    assert merged == MergedNeeds(7, True, (a, b), (5, 9), True)  # each distinct statistics window, once
    assert MergedNeeds.of([]) == MergedNeeds()
    with pytest.raises(ValueError, match="must be >= 0"):
        PrefillNeeds(query_window=-1)


def _pre_rope_queries(lm, ids: list[int]) -> Tensor:
    """Layer ``LAYER``'s queries before RoPE [Hq, n, d], from its own q_proj on the hidden states it gets."""
    attn_module = lm.model.model.layers[LAYER].self_attn
    seen: list[Tensor] = []
    hook = attn_module.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs.get("hidden_states", args[0] if args else None)),
        with_kwargs=True,
    )
    try:
        with torch.inference_mode():
            lm.model(input_ids=torch.tensor([ids]))
    finally:
        hook.remove()
    h, info = seen[0][0], lm.info  # [n, hidden]
    with torch.inference_mode():
        q = attn_module.q_proj(h)
    return q.view(h.shape[0], info.n_heads, info.head_dim).transpose(0, 1).float()


def test_rope_is_the_models_and_query_stats_are_pre_rope(lm):
    rope = lm.info.rope
    assert rope is not None and rope.pairing == HALF
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 6, lm.info.head_dim, generator=g)
    pos = torch.arange(40, 46)
    torch.testing.assert_close(rope.rotate(rope.unrotate(x, pos), pos), x, rtol=0, atol=1e-5)
    assert not torch.allclose(rope.rotate(x, pos), x, atol=1e-2)  # it does turn them
    ids = lm.encode(PROMPT)
    n, w = len(ids), 16
    state, _ = prefill(lm, ids, PrefillNeeds(query_window=w, query_stats=w))
    pre = _pre_rope_queries(lm, ids)[:, n - w :]  # [Hq, w, d] before RoPE, from the model's own projection
    # the queries the prefill captured are exactly these, rotated (the model's convention)
    torch.testing.assert_close(
        state.queries[LAYER].float(), rope.rotate(pre, torch.arange(n - w, n)), rtol=0, atol=1e-4
    )
    stats = state.query_stats
    assert stats is not None and stats.mean.dtype == torch.float32 and stats.cov.shape[-2:] == (64, 64)
    centred = pre - pre.mean(-2, keepdim=True)
    torch.testing.assert_close(stats.mean[LAYER], pre.mean(-2), rtol=0, atol=1e-4)
    torch.testing.assert_close(stats.cov[LAYER], centred.transpose(-1, -2) @ centred / w, rtol=1e-4, atol=1e-3)


def test_each_statistics_window_gets_its_own_statistics(lm):
    """Two methods asking for statistics over different windows in one prefill: each window is computed
    on its own (never the larger one's handed to both), and a window nobody asked for is refused."""
    ids = lm.encode(PROMPT)
    n = len(ids)
    state, _ = prefill(lm, ids, PrefillNeeds(query_stats=16), PrefillNeeds(query_stats=6))
    pre = _pre_rope_queries(lm, ids)  # [Hq, n, d]
    assert sorted(state.query_stats_by_window) == [6, 16] and state.query_stats.n == 16
    for w in (6, 16):
        stats = state.stats_over(w)
        assert (stats.n, stats.first_pos) == (w, n - w)
        torch.testing.assert_close(stats.mean[LAYER], pre[:, n - w :].mean(-2), rtol=0, atol=1e-4)
    assert not torch.allclose(state.stats_over(6).mean, state.stats_over(16).mean, atol=1e-3)
    with pytest.raises(LookupError, match="last 10 prompt queries"):
        state.stats_over(10)


def test_extend_equals_a_prefill_of_the_concatenation(lm):
    ids = lm.encode(PROMPT)
    more = lm.encode("It sat on the mat.", chat=False)
    n, c = len(ids), len(more)
    state, _ = prefill(lm, ids, PrefillNeeds(model_access=True))
    assert state.model is not None
    keys_before = state.keys.clone()
    seen: dict[int, tuple[Tensor, Tensor]] = {}
    state.model.extend(more, lambda layer, q, k: seen.__setitem__(layer, (q.clone(), k.clone())))
    assert torch.equal(state.keys, keys_before)  # the exact prefill cache is left as it was
    ref, _ = prefill(lm, ids + more, PrefillNeeds(query_window=c))
    assert sorted(seen) == list(range(lm.info.n_layers))
    for layer, (q, k) in seen.items():
        assert q.shape == (lm.info.n_heads, c, lm.info.head_dim) and k.shape[-2] == n + c
        torch.testing.assert_close(q, ref.queries[layer], rtol=0, atol=1e-4)
        torch.testing.assert_close(k, ref.keys[layer], rtol=0, atol=1e-4)


def test_chat_wrap_and_encode_rebuild_the_models_prompt(lm):
    state, _ = prefill(lm, lm.encode("Hi"), PrefillNeeds(model_access=True))
    access = state.model
    assert access is not None
    text = "Tell me about the cat."
    before, after = access.chat_wrap(text)
    assert before and after
    assert before + access.encode(text) + after == lm.encode(text)


def test_a_calibration_prefill_is_the_engines_prefill_of_that_text(lm):
    """``ModelAccess.prefill`` (LU-KV's calibration) runs another text exactly as a prompt's prefill, with the
    needs it is given; ``owner`` is the loaded model, the same for every prefill of it."""
    state, _ = prefill(lm, lm.encode(PROMPT), PrefillNeeds(model_access=True))
    other = lm.encode("A second text, to calibrate on.")
    got = state.model.prefill(other, PrefillNeeds(query_window=3))
    ref, _ = prefill(lm, other, PrefillNeeds(query_window=3))
    assert torch.equal(got.keys, ref.keys) and torch.equal(got.queries, ref.queries) and got.model is None
    again, _ = prefill(lm, other, PrefillNeeds(model_access=True))
    assert state.model.owner is again.model.owner is lm.model

"""LagKV against its own maths: every partition of the real prefill scored against the next one by a plain loop
(min-max by the reference's range, standard deviation of the channels, softmax, keys and values averaged, rank in
the partition); the sinks and the tail kept; a prompt too short for a reference keeps its sinks and last tokens."""

import torch
from kv_samples import compressed

from kvlab.methods.lagkv import lagkv_scores


def loop_reference(keys: torch.Tensor, values: torch.Tensor, n_sink: int, lag: int) -> torch.Tensor:
    """[n] LagKV scores of one layer and head (float32, as the method), one partition at a time."""
    n = keys.shape[0]
    out = torch.ones(n)
    parts = (n - n_sink) // lag
    for p in range(parts - 1):
        s, e = n_sink + p * lag, n_sink + (p + 1) * lag
        total = torch.zeros(lag)
        for x in (keys.float(), values.float()):
            ref = x[e : e + lag]
            low, high = ref.min(0).values, ref.max(0).values
            total += torch.softmax(((x[s:e] - low) / (high - low)).std(-1), 0)
        ranks = torch.empty(lag)
        ranks[(total / 2).argsort()] = torch.arange(lag, dtype=torch.float32)
        out[s:e] = ranks / lag
    return out


def test_real_prefill_scores_match_the_partition_loop(lm, prefill_state):
    state, lag = prefill_state, 64
    n = state.n_tokens
    comp, knobs = compressed(lm, state, "lagkv", "0.25", lag_size=lag)
    got = comp.scores(state)
    parts = (n - 4) // lag
    assert parts >= 4
    for layer in (0, lm.info.n_layers // 2, lm.info.n_layers - 1):
        for head in range(lm.info.n_kv_heads):
            want = loop_reference(state.keys[layer, head], state.values[layer, head], 4, lag)
            torch.testing.assert_close(got[layer, head], want, atol=0, rtol=0)
        kept = comp.kept_positions(layer).long()
        tail = n - (4 + (parts - 1) * lag)  # the last whole partition and the remainder
        assert kept.shape[-1] == knobs["capacity"] and knobs["capacity"] > 4 + tail
        assert (kept[:, :4] == torch.arange(4)).all() and (kept[:, -tail:] == torch.arange(n - tail, n)).all()
        # the rest comes from every scored partition in about equal shares (the paper's per-partition top-k)
        per_part = [((kept >= 4 + p * lag) & (kept < 4 + (p + 1) * lag)).sum(-1) for p in range(parts - 1)]
        counts = torch.stack(per_part)  # [partitions, Hkv]
        assert (counts.max(0).values - counts.min(0).values <= 1).all(), counts


def test_a_prompt_without_a_reference_partition_keeps_sinks_and_the_last_tokens(lm, prefill_state):
    keys, values = prefill_state.keys[:, :, :100], prefill_state.values[:, :, :100]
    scores = lagkv_scores(keys.float(), values.float(), 4, 128, cross=False)  # 100 < 4 + 2 x 128
    keep = scores[0, 0].topk(30).indices.sort().values
    assert keep.tolist() == list(range(4)) + list(range(74, 100))


def test_cross_scoring_keeps_the_raw_scores(lm, prefill_state):
    keys, values = prefill_state.keys.float(), prefill_state.values.float()
    ranked = lagkv_scores(keys, values, 4, 64, cross=False)
    raw = lagkv_scores(keys, values, 4, 64, cross=True)
    middle = slice(4, 4 + 64)
    assert torch.equal(raw[..., middle].argsort(-1), ranked[..., middle].argsort(-1))
    torch.testing.assert_close(raw[..., middle].sum(-1), torch.ones(raw.shape[:2]), atol=1e-5, rtol=0)


def test_a_capacity_below_the_sinks_and_tail_keeps_the_sinks_then_the_newest(lm, prefill_state):
    n = prefill_state.n_tokens
    tail = 4 + ((n - 4) // 128 - 1) * 128  # the last whole partition and the remainder: all of score 1
    assert 4 + n - tail > 100
    comp, knobs = compressed(lm, prefill_state, "lagkv", "100t")
    assert knobs["capacity"] == 100
    assert comp.kept_positions(3).tolist() == [list(range(4)) + list(range(n - 96, n))] * lm.info.n_kv_heads

"""DropKV against its own maths on the real prefill: the closed form of a single eviction's perturbation checked
by actually removing a token from a query's softmax, and the method's scores against the direct sum
sum_i (p_ij / (1 - p_ij))^2 ||v_j - o_i||^2 over the window's queries, head by head, pooled by hand."""

import torch
from kv_samples import compressed

WINDOW = 32


def test_the_closed_form_is_the_output_change_of_one_eviction(prefill_state):
    state, layer, head = prefill_state, 7, 2
    probs = state.window_probs(1)[layer, head, 0].double()  # the last query's attention [n]
    v = state.values[layer, head // 3].double()
    out = probs @ v
    for j in (0, 50, state.n_tokens // 2):
        kept = torch.ones(state.n_tokens, dtype=torch.bool)
        kept[j] = False
        renorm = probs[kept] / probs[kept].sum()
        moved = renorm @ v[kept] - out
        torch.testing.assert_close(moved, probs[j] / (1 - probs[j]) * (out - v[j]))


def test_scores_match_the_direct_sum_and_keep_the_window(lm, prefill_state):
    state, info = prefill_state, lm.info
    n, group = state.n_tokens, info.n_heads // info.n_kv_heads
    comp, knobs = compressed(lm, state, "dropkv", "0.25")
    got = comp.scores(state).double()
    probs = state.window_probs(WINDOW).double()  # [L, Hq, w, n]
    for layer in (0, info.n_layers - 1):
        raw = torch.zeros(info.n_kv_heads, n, dtype=torch.float64)
        for h in range(info.n_heads):
            p, v = probs[layer, h], state.values[layer, h // group].double()
            out = p @ v  # [w, dv]
            dist = ((v[None, :, :] - out[:, None, :]) ** 2).sum(-1)  # [w, n]
            raw[h // group] += ((p / (1 - p + 1e-6)) ** 2 * dist).sum(0) / group
        padded = torch.nn.functional.pad(raw, (3, 3))
        want = torch.stack([padded[:, j : j + 7].sum(-1) / 7 for j in range(n)], -1)  # zeros counted at the edges
        torch.testing.assert_close(got[layer], want, rtol=1e-3, atol=1e-6)
        kept = comp.kept_positions(layer).long()
        cap = knobs["capacity"]
        assert knobs["window"] == WINDOW and kept.shape[-1] == cap
        assert (kept[:, -WINDOW:] == torch.arange(n - WINDOW, n)).all()
        prefix = want[:, : n - WINDOW]
        bound = prefix.sort(-1, descending=True).values[:, cap - WINDOW - 1 : cap - WINDOW]
        assert (prefix.gather(-1, kept[:, :-WINDOW]) >= bound * (1 - 1e-4)).all()

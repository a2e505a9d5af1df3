"""DapQ against its own maths on the embedded model: its pseudo queries are those of an exact prefill of the
prompt followed by the pseudo tokens (positions n .. n + 31), and its scores are their attention votes for the
prompt's tokens, summed over the window, max-pooled over 7 and summed over each KV group, computed here plainly."""

import pytest
import torch
from kv_samples import compressed

from kvlab.engine.prefill import prefill
from kvlab.methods.dapq import pseudo_ids
from kvlab.methods.handover import PrefillNeeds

N = 32


@pytest.fixture(scope="module")
def state(lm, long_text):
    ids = lm.encode(long_text[:900])
    st, _ = prefill(lm, ids, PrefillNeeds(query_window=8, model_access=True))
    return st


def test_pseudo_tokens_come_from_the_prompt():
    prompt = list(range(100, 150))
    assert pseudo_ids(prompt, 6, "head-tail") == [100, 101, 102, 147, 148, 149]
    assert pseudo_ids(prompt, 5, "head-tail") == [100, 101, 102, 148, 149]
    assert pseudo_ids(prompt, 4, "tail") == [146, 147, 148, 149]
    assert pseudo_ids([7, 8, 9], 7, "head-tail") == [7, 8, 9, 7, 8, 9, 7]


def test_scores_are_the_votes_of_the_pseudo_queries_of_an_exact_prefill(lm, state):
    info, n = lm.info, state.n_tokens
    prompt = list(state.model.prompt_ids)
    longer, _ = prefill(lm, prompt + pseudo_ids(prompt, N, "head-tail"), PrefillNeeds(query_window=N))
    torch.testing.assert_close(longer.keys[:, :, :n], state.keys, rtol=1e-4, atol=1e-4)
    q, k = longer.queries.double(), longer.keys.double()  # [L, Hq, 32, d] at positions n..n+31; [L, Hkv, n+32, d]
    group = info.n_heads // info.n_kv_heads
    logits = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * info.head_dim**-0.5
    causal = torch.arange(n + N)[None, :] > torch.arange(n, n + N)[:, None]
    votes = torch.softmax(logits.masked_fill(causal, -torch.inf), -1)[..., :n].sum(-2)  # [L, Hq, n]
    pooled = torch.nn.functional.max_pool1d(votes.flatten(0, 1)[:, None], 7, stride=1, padding=3)[:, 0]
    want = pooled.view(info.n_layers, info.n_kv_heads, group, n).sum(2)
    comp, knobs = compressed(lm, state, "dapq", "0.25")
    got = comp.scores(state).double()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-4)
    cap = knobs["capacity"]
    for layer in (0, info.n_layers - 1):
        kept = comp.kept_positions(layer).long()
        assert kept.shape[-1] == cap and (kept < n).all()
        bound = want[layer].sort(-1, descending=True).values[:, cap - 1 : cap]
        assert (want[layer].gather(-1, kept) >= bound * (1 - 1e-3)).all()

"""Expected Attention: prompt tokens scored by the attention future queries are expected to pay them.

Devoto, Jeblick, Jégou. "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", 2025, https://arxiv.org/abs/2510.00636 — Sec. 3, and its reference
implementation, ``ExpectedAttentionPress`` in NVIDIA's kvpress:

1. The pre-RoPE queries of the prompt (all but the first ``n_sink``, whose outlier activations
   would distort the statistics) are modelled as a Gaussian N(mu, Sigma) per query head.
2. A future query at position t is R_t q (RoPE's rotation). The rotation is averaged over the next
   ``n_future`` positions n .. n + T - 1: Rbar = mean_t R_t, and the future query is modelled as
   Rbar q ~ N(Rbar mu, Rbar Sigma Rbar^T). Each layer's own rotation (none on a layer without RoPE), in
   the model's convention: halves or neighbouring pairs, complex angles (DeepSeek-V2, Llama 4), the
   rotated dimensions after latent attention's unrotated ones (DeepSeek-V2/V3).
3. The expected unnormalised attention of a (post-RoPE) key k is then the Gaussian's moment
   generating function at s k (s = the attention scaling, 1/sqrt(d)):
   E[exp(s q.k)] = exp(s (Rbar mu).k + s^2/2 k^T (Rbar Sigma Rbar^T) k)
   (the covariance term only with ``use_covariance``).
4. Normalised over the keys (a softmax of the expected logits) and averaged over the query heads
   of each KV group, the expected attention a_i is multiplied by the value's norm,
   (a_i + epsilon) * ||v_i|| (with ``use_vnorm``): the size of the token's expected contribution
   to the residual stream, which the paper's score approximates with ||v_i|| for ||W_o v_i||.
5. The first ``n_sink`` tokens are always kept; of the others, the top ``capacity - n_sink`` per
   (layer, KV head) are kept, in position order. Prefill-only: generated tokens are all kept.

Defaults are the reference implementation's: T = 512, n_sink = 4, covariance and value norms on,
epsilon = 0.

Deviations:

* The scaling is the model's own attention scaling s (1/sqrt(d) in the paper; the same on every
  model that does not set another), so the covariance term is s^2/2 rather than 1/(2d).
* A soft-capped model's logits are capped after q.k; the expectation is taken of the uncapped
  logit (the cap is monotone, so a single query's ranking is unchanged; the expectation is not
  exactly the capped one's).
* On a model whose RoPE switches factors at S tokens (Phi-3's longrope), a prompt of at most S tokens
  averages over the positions before S only: a run never crosses S (``Engine.check_prompt``).
* ``stats_window`` (default: every prompt query after the sinks, as the paper's prefill) can
  restrict the statistics to the last prompt queries, as the paper's decoding-time buffer does.
* The paper also compresses while decoding (statistics from a buffer of recent queries); here the
  method is prefill-only, like SnapKV; ``decoding-expected-attention`` (``kvlab.methods.decoding``)
  re-applies it every N decode steps, with the statistics of the queries it holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.core import semantics as sm
from kvlab.core.attention_ops import pool_heads
from kvlab.core.model import ModelInfo
from kvlab.core.rope import Rotary
from kvlab.methods.dense import DenseCompressor, Ranking
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param

CHUNK = 1 << 24  # numbers of the largest intermediate ([layers, Hq, n, d]) scored at once: 64 MiB of float32


def require_rope(method: str, rope: Rotary | None, why: str) -> None:
    """Refuse (``UnsupportedAttention``, one line) a model without a rotary position embedding kvlab can
    read, for a method that needs it (``why``: what the method does with it)."""
    if rope is None:
        raise sm.UnsupportedAttention(
            f"{method} cannot run on a model without a rotary position embedding kvlab can read: {why}"
        )


def mean_rotation(rotate, positions: Tensor, head_dim: int) -> Tensor:
    """Rbar [d, d]: RoPE's rotation matrix averaged over ``positions`` [T].

    ``rotate(x [..., P, d], positions [P])`` applies the model's RoPE (pre -> post) at those
    positions; applied to the basis vectors it gives each R_t's columns, so the model's own
    convention (half split or interleaved, scaled frequencies) is what is averaged.
    """
    t = positions.shape[0]
    basis = torch.eye(head_dim, device=positions.device).unsqueeze(1).expand(head_dim, t, head_dim)
    cols = rotate(basis, positions)  # [j, t, :] = R_t e_j
    return cols.float().mean(1).T  # [i, j] = mean_t R_t[i, j]


def mean_rotations(rope: Rotary, positions: Tensor, head_dim: int) -> Tensor:
    """Rbar of every layer: [d, d] when the layers share one rotation, else [L, d, d], each layer's own
    (the identity on a layer without RoPE)."""
    if rope.shared is not None:
        return mean_rotation(rope.shared.rotate, positions, head_dim)
    by_rotation: dict[int, Tensor] = {}
    out = []
    for r in rope.layers:
        if r is None:
            out.append(torch.eye(head_dim, device=positions.device))
            continue
        if id(r) not in by_rotation:
            by_rotation[id(r)] = mean_rotation(r.rotate, positions, head_dim)
        out.append(by_rotation[id(r)])
    return torch.stack(out)


def future_query_stats(mean: Tensor, cov: Tensor | None, rbar: Tensor) -> tuple[Tensor, Tensor | None]:
    """Pre-RoPE Gaussian N(mean [.., H, d], cov [.., H, d, d]) -> that of Rbar q: (Rbar mean, Rbar cov Rbar^T).
    rbar [d, d], or [L, d, d] for mean [L, H, d] (each layer's)."""
    mu = mean.float() @ rbar.transpose(-1, -2)
    r = rbar if rbar.dim() == 2 else rbar.unsqueeze(-3)  # [L, 1, d, d] against cov [L, H, d, d]
    return mu, None if cov is None else r @ cov.float() @ r.transpose(-1, -2)


def future_queries(
    method: str,
    state: PrefillState,
    info: ModelInfo,
    window: int,
    n_future: int,
    covariance: bool,
) -> tuple[Tensor, Tensor | None]:
    """The Gaussian of the future queries, (Rbar mean, Rbar cov Rbar^T or None): the pre-RoPE statistics of the
    last ``window`` prompt queries (exactly that window's, ``state.stats_over``), Rbar RoPE averaged over the
    ``n_future`` positions after the next token's (``state.next_pos``; up to a RoPE switch, which a run never
    crosses). ``info.rope``: the model's (a method refuses a model without one)."""
    try:  # its own window's statistics, never those of another method's window in the same prefill
        stats = state.stats_over(window)
    except LookupError as exc:
        raise RuntimeError(f"{method}: {exc}") from None
    rope = info.rope
    assert rope is not None  # check_semantics refused a model without one
    nxt = state.next_pos  # the next token's true position (n after a prefill)
    end = nxt + n_future
    switch = info.switch_crossed(nxt, end)
    future = torch.arange(nxt, end if switch is None else max(nxt + 1, switch), device=state.keys.device)
    rbar = mean_rotations(rope, future, stats.mean.shape[-1]).to(state.keys.device)
    return future_query_stats(stats.mean, stats.cov if covariance else None, rbar)


def expected_logits(keys: Tensor, mean: Tensor, cov: Tensor | None, scaling: float | Tensor) -> Tensor:
    """log E[exp(s q.k)] for q ~ N(mean, cov), per query head and key: [.., Hq, n].

    keys [.., Hkv, n, d] (post-RoPE); mean [.., Hq, d] and cov [.., Hq, d, d] (None: the mean
    alone) of the future queries; query head h reads KV head h // (Hq / Hkv); scaling s a number
    or one per leading index [..] (e.g. per layer).
    The Gaussian's moment generating function: s mean.k + s^2 / 2 k^T cov k.
    """
    hkv, hq = keys.shape[-3], mean.shape[-2]
    g = hq // hkv
    k = keys.float()
    s = torch.as_tensor(scaling, dtype=torch.float32, device=k.device)
    s = s.reshape(*s.shape, 1, 1, 1)  # against [.., Hkv, G, n]
    mu = mean.reshape(*mean.shape[:-2], hkv, g, mean.shape[-1])  # [.., Hkv, G, d]
    out = s * (mu @ k.transpose(-1, -2))  # [.., Hkv, G, n]
    if cov is not None:
        c = cov.reshape(*cov.shape[:-3], hkv, g, *cov.shape[-2:])  # [.., Hkv, G, d, d]
        kk = k.unsqueeze(-3)  # [.., Hkv, 1, n, d]
        out = out + 0.5 * s * s * ((kk @ c) * kk).sum(-1)
    return out.reshape(*out.shape[:-3], hq, out.shape[-1])


def expected_attention_scores(
    keys: Tensor,
    values: Tensor,
    mean: Tensor,
    cov: Tensor | None,
    scaling: float | Tensor,
    epsilon: float = 0.0,
    use_vnorm: bool = True,
) -> Tensor:
    """The paper's score of every key: (expected attention + epsilon) * ||v||, [.., Hkv, n].

    keys [.., Hkv, n, d], values [.., Hkv, n, dv]; mean / cov: the future queries' Gaussian
    (``future_query_stats``); scaling as in ``expected_logits``. The expected attention is the
    softmax over the n keys of the expected logits, averaged over each KV group's query heads.
    """
    probs = torch.softmax(expected_logits(keys, mean, cov, scaling), dim=-1)  # [.., Hq, n]
    attn = pool_heads(probs, keys.shape[-3], head_dim=-2, reduce="mean")  # [.., Hkv, n]
    return (attn + epsilon) * values.float().norm(dim=-1) if use_vnorm else attn


class ExpectedAttention(DenseCompressor):
    name = "expected-attention"
    title = "Expected Attention"
    group = "recent"
    paper = (
        "Devoto, Jeblick, Jégou, Expected Attention: KV Cache Compression by Estimating Attention from Future "
        "Queries Distribution, 2025 (arXiv:2510.00636)"
    )
    summary = (
        "Keeps the prompt tokens future queries are expected to attend to most (Gaussian queries, RoPE averaged "
        "over the next positions), weighted by value norm, plus the first tokens."
    )
    params = (
        Param("n_future", 512, "future positions T the RoPE rotation is averaged over", minimum=1),
        Param("n_sink", 4, "first tokens left out of the query statistics and always kept", minimum=0),
        Param("use_covariance", True, "the queries' covariance term in the expected logit (off: the mean query)"),
        Param("use_vnorm", True, "scale the expected attention by the value's norm"),
        Param("epsilon", 0.0, "added to the expected attention before the value-norm scaling", minimum=0.0),
        Param(
            "stats_window",
            None,
            "last prompt queries the statistics use (none: all after the sinks)",
            minimum=1,
            kind=int,
        ),
    )

    capacity: int  # set by plan: tokens per layer and KV head kept (sinks included)
    sinks: int  # set by plan: first tokens always kept (n_sink, fewer when the capacity is smaller)
    full: bool  # set by plan: no budget, every token kept

    def check_semantics(self) -> None:
        super().check_semantics()
        require_rope(self.name, self.info.rope, "it averages each layer's RoPE over the next positions")

    def stats_queries(self, n_prompt: int) -> int:
        """How many of the last prompt queries the statistics use: all after the sinks, or ``stats_window``."""
        after_sinks = max(1, n_prompt - int(self.cfg["n_sink"]))
        w = self.cfg["stats_window"]
        return after_sinks if w is None else min(int(w), after_sinks)

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        return PrefillNeeds(query_stats=self.stats_queries(n_prompt))

    def plan_tokens(self, n_prompt: int) -> dict:
        self.full = self.is_full
        self.capacity = self.tokens_for_budget(n_prompt)
        self.sinks = min(int(self.cfg["n_sink"]), self.capacity, n_prompt)
        return {"capacity": self.capacity, "sinks": self.sinks, "stats_queries": self.stats_queries(n_prompt)}

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n - n_sink] the paper's score of every token after the sinks."""
        c, n = self.cfg, state.n_tokens
        mean, cov = future_queries(
            self.name, state, self.info, self.stats_queries(n), int(c["n_future"]), bool(c["use_covariance"])
        )
        first = min(int(c["n_sink"]), n - 1)
        keys, values = state.keys[:, :, first:], state.values[:, :, first:]
        scaling = torch.tensor([self.sem[i].scaling for i in range(keys.shape[0])], device=keys.device)  # [L]
        # layers in chunks of at most CHUNK numbers of [Hq, n, d] (the covariance term's k^T C)
        step = max(1, CHUNK // (mean.shape[1] * keys.shape[-2] * keys.shape[-1]))
        return torch.cat(
            [
                expected_attention_scores(
                    keys[lo : lo + step],
                    values[lo : lo + step],
                    mean[lo : lo + step],
                    None if cov is None else cov[lo : lo + step],
                    scaling[lo : lo + step],
                    float(c["epsilon"]),
                    bool(c["use_vnorm"]),
                )
                for lo in range(0, keys.shape[0], step)
            ]
        )

    ranks_prompt = True

    def ranking(self, state: PrefillState) -> Ranking | None:
        """After ``plan``: every head keeps the sinks; the tokens after them are ranked by the paper's score."""
        n = state.n_tokens
        if self.full or self.capacity >= n:
            return None
        scores = self.scores(state)  # [L, Hkv, n - first]
        return Ranking(scores, n - scores.shape[-1], [c - self.sinks for c in self.layer_capacity(n)], head=self.sinks)

    def layer_capacity(self, n: int) -> list[int]:
        """After ``plan``: tokens kept per layer and KV head (the capacity, spread over the layers as they can
        hold them: ``spread_over_layers``)."""
        return self.spread_over_layers(n, [self.capacity] * self.info.n_layers)

    def select(self, state: PrefillState):
        n, n_layers = state.n_tokens, state.keys.shape[0]
        if self.full or self.capacity >= n:
            return [None] * n_layers
        scores = self.scores(state)  # [L, Hkv, n - first]
        first = n - scores.shape[-1]
        caps = self.layer_capacity(n)
        top = torch.topk(scores, min(max(caps) - self.sinks, scores.shape[-1]), dim=-1).indices + first  # best first
        sinks = torch.arange(self.sinks, device=top.device).expand(*top.shape[:-1], self.sinks)
        if len(set(caps)) == 1:
            return torch.cat([sinks, top.sort(-1).values], -1)
        return [torch.cat([sinks[i], top[i, :, : c - self.sinks].sort(-1).values], -1) for i, c in enumerate(caps)]

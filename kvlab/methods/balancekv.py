"""BalanceKV: KV-cache compression by discrepancy-theoretic halving of the prompt's middle tokens.

Han, Kochetkova, Kapralov, Sheth, Zandieh. "BalanceKV: KV Cache Compression through Discrepancy
Theory", arXiv:2502.07861 (2025), https://arxiv.org/abs/2502.07861.

What is implemented (the prefill-only form the paper evaluates, Sec. 4.1 / 4.2):

* SoftmaxBalance (Algorithm 2): a self-balancing walk signs the tokens of a set one after another
  so that, for any query q, sum_+ exp(<k,q>/sqrt(d)) v ~ sum_- exp(<k,q>/sqrt(d)) v. The walk only
  needs the kernel exp(<k_i,k_j>/sqrt(d)) <v_i,v_j> (the inner product of the embeddings
  phi(k) (x) v of Sec. 3.4). Token j gets +1 with probability p = 1/2 - step * y^T eta, clipped to
  [0, 1], where y^T eta is the signed kernel sum against the tokens already signed. Two forms of
  the step are available: the public reference code's ``gamma`` (default 4, keys centred per
  block; used by default) and the paper's 1 / (2 c R^2) with R^2 the block's largest
  ||phi(k) (x) v||^2 (set ``c`` > 0; the paper FAILs when |y^T eta| > c R^2, here p is clipped).
* Softmax normalisation: instead of a separate walk on (k, 1) (Algorithm 1, line 14) the value is
  extended by a constant coordinate sqrt(``denom_weight``), so one walk balances numerator and
  denominator together (kernel: exp(<k_i,k_j>/sqrt(d)) (<v_i,v_j> + denom_weight)).
* Exact halving (Sec. 4, "we strictly select n/2 embeddings"): along the signed block, at the
  first position c where one sign has b/2 tokens, the other (smaller) side of the prefix [0, c]
  is kept with doubled weight and the unbalanced rest (c, b) is kept with its weight unchanged;
  this keeps exactly b/2 tokens per block so every block, head and layer advances together.
* Blocks and rounds (Sec. 4; the offline form of MergeAndReduce, Algorithm 3 / proof of Thm 3.3):
  the middle tokens are cut into blocks of ``block_size`` and halved in parallel; the survivors,
  in position order, are cut into blocks again (each new block merges two halved neighbours) and
  halved again, T rounds in all (rate 2^-T). Round r+1 balances the weighted embeddings
  w_i phi(k_i) (x) v_i, w_i the weight from earlier rounds.
* The first and last tokens are kept exactly (Sec. 4.1: 256 + 256); kept middle tokens carry
  log(weight) on their logits at decode time (about log 2^T). Generated tokens are kept
  (prefill-only, Sec. 4.2).
* ``balancekv-stream`` also runs MergeAndReduce (Algorithm 3) online over the generated tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvlab.core.budgets import exact_bytes
from kvlab.methods.dense import DenseCompressor, _Growable
from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param

MAX_ROUNDS = 14


# ----- SoftmaxBalance, vectorized over blocks ----------------------------------------------------
@dataclass(frozen=True)
class WalkConfig:
    """The walk's knobs: reference-code step ``gamma``, or the paper's ``c`` (> 0 selects it)."""

    gamma: float = 4.0
    c: float = 0.0
    denom_weight: float = 0.025
    center: bool = True


def algorithm2_config(block: int, denom_weight: float, c: float = 0.0, delta: float = 0.01) -> WalkConfig:
    """Algorithm 2's own step (line 3: c = 30 log(n / delta) for a block of n tokens; line 8:
    p = 1/2 - y^T eta / (2 c R^2)), on keys as they are (no centring). ``c`` > 0 replaces line 3's."""
    return WalkConfig(0.0, c if c > 0 else 30.0 * math.log(max(2, block) / delta), denom_weight, False)


def block_kernel(k: Tensor, v: Tensor, logw: Tensor | None, cfg: WalkConfig) -> tuple[Tensor, Tensor]:
    """Kernel of the weighted embeddings w phi(k) (x) (v, sqrt(lambda)) within each block.

    k, v: [..., b, d]; logw: [..., b] log token weights (None: all weights 1). The kernel
    w_i w_j exp(<k_i,k_j>/sqrt(d)) (<v_i,v_j> + denom_weight) overflows float32 for real keys, so it
    is returned as (kern [..., b, b] float32, log_scale [..., 1]): the true kernel is
    kern * exp(log_scale), with the largest exponent of each block shifted to 0. Built in place.
    """
    k, v = k.float(), v.float()
    if cfg.center:
        k = k - k.mean(-2, keepdim=True)
    k = k * k.shape[-1] ** -0.25
    kern = k @ k.transpose(-1, -2)  # <k_i, k_j> / sqrt(d)
    if logw is not None:
        lw = logw.float()
        kern.add_(lw.unsqueeze(-1)).add_(lw.unsqueeze(-2))
    log_scale = kern.flatten(-2).amax(-1, keepdim=True)
    kern.sub_(log_scale.unsqueeze(-1)).exp_()
    kern.mul_((v @ v.transpose(-1, -2)).add_(cfg.denom_weight))
    return kern, log_scale


def walk_step(kern: Tensor | None, log_scale: Tensor, cfg: WalkConfig) -> Tensor:
    """The walk's step per block for the shifted kernel, [..., 1].

    Reference form: gamma * exp(log_scale) (capped at e^80: p is clipped to 0 or 1 long before).
    Paper form: 1 / (2 c R^2) with R^2 the block's largest diagonal entry, which is scale-free.
    """
    if cfg.c <= 0:
        if cfg.gamma <= 0:  # no feedback: independent fair signs
            return torch.zeros_like(log_scale)
        return torch.exp((math.log(cfg.gamma) + log_scale).clamp(max=80.0))
    if kern is None:
        raise ValueError("the paper form of the walk's step (c > 0) needs the block's kernel")
    r2 = torch.diagonal(kern, dim1=-2, dim2=-1).amax(-1, keepdim=True)
    return 1.0 / (2.0 * cfg.c * r2.clamp_min(1e-30))


def balance_signs(
    kern: Tensor, log_scale: Tensor, cfg: WalkConfig, generator: torch.Generator, chunk: int = 16
) -> Tensor:
    """Self-balancing walk (Algorithm 2, lines 4-11) in every block at once.

    kern, log_scale: from ``block_kernel`` ([..., b, b], [..., 1]). Returns signs [..., b] in {-1, +1}.
    Token i is +1 when u_i < p_i = 1/2 - step * y^T eta, u_i ~ U[0, 1) (comparing with the
    unclipped p is the same as clipping it to [0, 1]). The loop runs over the b positions only; all
    blocks, heads and layers advance together. Positions go in chunks: the pull of the tokens signed
    before a chunk is one batched product, so each sequential step only touches ``chunk`` columns.
    """
    b = kern.shape[-1]
    step = walk_step(kern, log_scale, cfg)
    room = 0.5 - torch.rand(kern.shape[:-1], generator=generator).to(kern.device)  # 1/2 - u
    signs = kern.new_zeros(kern.shape[:-1])
    for a in range(0, b, chunk):
        e = min(a + chunk, b)
        y_eta = (kern[..., a:e, :a] @ signs[..., :a, None]).squeeze(-1)  # [..., e - a]
        sub = kern[..., a:e, a:e].contiguous()
        part = signs[..., a:e]
        for i in range(e - a):
            y = y_eta[..., i : i + 1] + (sub[..., i, :] * part).sum(-1, keepdim=True)  # unsigned tokens are 0
            part[..., i : i + 1] = torch.where(step * y < room[..., a + i : a + i + 1], 1.0, -1.0)
    return signs


def balance_blocks(
    k: Tensor, v: Tensor, logw: Tensor | None, cfg: WalkConfig, generator: torch.Generator, chunk: int = 16
) -> Tensor:
    """``balance_signs(*block_kernel(k, v, logw, cfg), cfg, generator)`` without the [..., b, b] kernels.

    k, v: [..., b, d]; logw: [..., b] or None. Returns signs [..., b]. The walk only reads the kernel
    rows of a chunk of positions against the positions before them, so those rows ([..., chunk, e])
    are made when the chunk comes up: half the products and exponentials of the full kernel, and
    every block of every layer walks together in one pass. The shift is the block's largest
    diagonal exponent, which is its largest exponent (<k_i, k_j> + w_i + w_j <= (K_ii + K_jj) / 2),
    so the kernel and the step equal ``block_kernel``'s up to float rounding.
    """
    k, v = k.float(), v.float()
    if cfg.center:
        k = k - k.mean(-2, keepdim=True)
    k = k * k.shape[-1] ** -0.25
    lw = torch.zeros(k.shape[:-1], device=k.device) if logw is None else logw.float()
    diag = (k * k).sum(-1) + 2 * lw  # K_ii = <k_i, k_i> / sqrt(d) + 2 log w_i
    log_scale = diag.amax(-1, keepdim=True)
    if cfg.c > 0:  # R^2: the largest diagonal entry of the shifted kernel
        r2 = (torch.exp(diag - log_scale) * ((v * v).sum(-1) + cfg.denom_weight)).amax(-1, keepdim=True)
        step = 1.0 / (2.0 * cfg.c * r2.clamp_min(1e-30))
    else:
        step = walk_step(None, log_scale, cfg)
    b = k.shape[-2]
    room = 0.5 - torch.rand(k.shape[:-1], generator=generator).to(k.device)  # 1/2 - u
    signs = k.new_zeros(k.shape[:-1])
    shifted = lw - log_scale
    for a in range(0, b, chunk):
        e = min(a + chunk, b)
        rows = torch.matmul(k[..., a:e, :], k[..., :e, :].transpose(-1, -2))  # [..., e - a, e]
        rows.add_(lw[..., a:e, None]).add_(shifted[..., None, :e]).exp_()
        rows.mul_(torch.matmul(v[..., a:e, :], v[..., :e, :].transpose(-1, -2)).add_(cfg.denom_weight))
        y_eta = (rows[..., :a] @ signs[..., :a, None]).squeeze(-1)  # [..., e - a]
        sub = rows[..., a:e].contiguous()
        part = signs[..., a:e]
        for i in range(e - a):
            y = y_eta[..., i : i + 1] + (sub[..., i, :] * part).sum(-1, keepdim=True)  # unsigned tokens are 0
            part[..., i : i + 1] = torch.where(step * y < room[..., a + i : a + i + 1], 1.0, -1.0)
    return signs


def halve(signs: Tensor) -> tuple[Tensor, Tensor]:
    """Keep exactly b/2 tokens of each signed block, with their weight multipliers.

    signs: [..., b]. Let c be the first position where one sign reaches b/2 tokens: the other sign's
    tokens in [0, c] are kept with weight 2 (they stand for the balanced prefix), the tokens after c
    with weight 1. Returns (keep [..., b/2] positions in increasing order, mult [..., b/2] in {1, 2}).
    """
    b = signs.shape[-1]
    half = b // 2
    pos, neg = (signs > 0).cumsum(-1), (signs < 0).cumsum(-1)
    c = ((pos >= half) | (neg >= half)).to(torch.int8).argmax(-1, keepdim=True)
    majority = signs.gather(-1, c)  # the token at c is the one that filled its side
    prefix = torch.arange(b, device=signs.device) <= c
    keep = ~prefix | (signs != majority)
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :half]
    mult = torch.where(prefix, 2.0, 1.0).to(signs.dtype).gather(-1, order)
    return order, mult


def _halve_blocks(k: Tensor, v: Tensor, logw: Tensor, idx: Tensor, cfg: WalkConfig, gen: torch.Generator):
    """One round over equal blocks: k, v [..., nb, b, d], logw/idx [..., nb, b] -> the kept half of each."""
    order, mult = halve(balance_blocks(k, v, logw, cfg, gen))
    return idx.gather(-1, order), logw.gather(-1, order) + mult.log()


def balance_round(
    keys: Tensor, values: Tensor, idx: Tensor, logw: Tensor, block: int, cfg: WalkConfig, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Halve the tokens ``idx`` [..., m] (weights ``logw`` [..., m] float64) of keys/values [..., n, d].

    The tokens, in position order, are cut into blocks of ``block`` plus one shorter last block (even
    length), each halved by SoftmaxBalance; when m is odd the last token passes through unchanged
    (like the unbalanced tail of a block). Returns the kept (idx, logw), [..., ceil(m/2)] each.
    """
    m, d = idx.shape[-1], keys.shape[-1]
    lead = idx.shape[:-1]
    even = m - m % 2
    full = even // block * block
    spans = [(0, full, block)] if full else []
    if even > full:
        spans.append((full, even, even - full))
    out_i, out_w = [], []
    for a, e, bs in spans:
        ix = idx[..., a:e]
        gi = ix.unsqueeze(-1).expand(*ix.shape, d)
        shape = (*lead, (e - a) // bs, bs)
        k = keys.gather(-2, gi).reshape(*shape, d)
        dv = values.shape[-1]  # the value head size (multi-head latent attention: not the key's)
        v = values.gather(-2, ix.unsqueeze(-1).expand(*ix.shape, dv)).reshape(*shape, dv)
        i2, w2 = _halve_blocks(k, v, logw[..., a:e].reshape(shape), ix.reshape(shape), cfg, gen)
        out_i.append(i2.reshape(*lead, -1))
        out_w.append(w2.reshape(*lead, -1))
    out_i.append(idx[..., even:])
    out_w.append(logw[..., even:])
    return torch.cat(out_i, -1), torch.cat(out_w, -1)


def balance_kv(
    keys: Tensor, values: Tensor, rounds: int, block: int, cfg: WalkConfig, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """T rounds of blockwise SoftmaxBalance on keys/values [..., m, d].

    Returns the kept token indices [..., ceil(m / 2^T)] (increasing) and their log-weights (float32).
    All layers, heads and blocks walk together (``balance_blocks`` makes only a chunk of kernel rows
    at a time, so nothing of size [b, b] per block is held).
    """
    m = keys.shape[-2]
    idx = torch.arange(m, device=keys.device).expand(*keys.shape[:-2], m)
    logw = torch.zeros(idx.shape, dtype=torch.float64, device=keys.device)
    for _ in range(rounds):
        idx, logw = balance_round(keys, values, idx, logw, block, cfg, gen)
    return idx, logw.float()


# ----- budget -> layout ------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Which prompt tokens go where: [0, n_sink) exact, n_middle halved T times, the rest exact."""

    n_tokens: int
    n_sink: int
    n_middle: int
    rounds: int

    @property
    def n_recent(self) -> int:
        return self.n_tokens - self.n_sink - self.n_middle

    @property
    def kept(self) -> int:
        return self.n_sink + self.n_recent + -(-self.n_middle >> self.rounds)  # ceil(n_middle / 2^T)


def make_layout(n: int, sink: int, recent: int, rounds: int) -> Layout:
    """The middle is what the sink and recent windows leave."""
    sink = min(sink, n)
    return Layout(n, sink, n - sink - min(recent, n - sink), rounds)


def fit_layout(n: int, cap: int, sink_max: int, recent_max: int, rounds: int = 0) -> Layout:
    """Map a token capacity ``cap`` onto (sink, recent, T) for an n-token prompt.

    Sink and recent windows are the paper's sizes scaled down so that each takes at most a quarter of
    the capacity; T is the smallest number of rounds that fits (or the given ``rounds``); capacity
    left over widens the recent window. Never keeps more than ``cap`` tokens when any T fits.
    """
    if cap >= n:
        return Layout(n, n, 0, 0)
    sink, recent = min(sink_max, cap // 4), min(recent_max, cap // 4)
    if rounds:  # T fixed (the paper's T = 2): the windows shrink, equally, until the halved middle fits
        while (sink or recent) and make_layout(n, sink, recent, rounds).kept > cap:
            sink, recent = max(0, sink - 1), max(0, recent - 1)
    if not rounds:
        fits = [t for t in range(1, MAX_ROUNDS + 1) if make_layout(n, sink, recent, t).kept <= cap]
        if not fits:  # even the deepest halving is over: drop the windows
            return make_layout(n, 0, 0, MAX_ROUNDS)
        rounds = fits[0]
    scale = 1.0 - 2.0**-rounds
    wide = max(recent, int((cap - sink - (n - sink) / 2**rounds) / scale))
    while wide > recent and make_layout(n, sink, wide, rounds).kept > cap:
        wide -= 1
    return make_layout(n, sink, wide, rounds)


# ----- the compressor --------------------------------------------------------------------------
class BalanceKV(DenseCompressor):
    name = "balancekv"
    title = "BalanceKV"
    group = "paper"
    window_capped = True  # one capacity; a window keeps less of it, the global layers more
    summarizes = True  # the halved-away tokens stand in the kept ones' weights (2^T)
    paper = (
        "Han, Kochetkova, Kapralov, Sheth, Zandieh. BalanceKV: KV Cache Compression through Discrepancy "
        "Theory, arXiv:2502.07861 (2025), https://arxiv.org/abs/2502.07861"
    )
    summary = (
        "Keeps first and recent tokens; halves the middle T times with a self-balancing walk under the "
        "softmax kernel (SoftmaxBalance), kept tokens weighted ~2^T on their logits."
    )
    params = (
        Param(
            "T",
            0,
            "halving rounds (rate 2^-T on the middle tokens); 0: chosen from the budget",
            minimum=0,
            maximum=MAX_ROUNDS,
        ),
        Param(
            "block_size",
            256,
            "tokens per block of the parallel walk (paper Sec. 4.2: b = 256; reference code 128)",
            minimum=2,
        ),
        Param("n_sink", 256, "first tokens kept exactly (paper Sec. 4.1); at most a quarter of the budget", minimum=0),
        Param(
            "n_recent",
            256,
            "last prompt tokens kept exactly (paper Sec. 4.1); capped like n_sink, then widened "
            "by capacity the halving leaves over",
            minimum=0,
        ),
        Param("gamma", 4.0, "walk step: p = 1/2 - gamma * y^T eta (reference code)", minimum=0.0),
        Param("c", 0.0, "if > 0, the paper's step p = 1/2 - y^T eta / (2 c R^2) replaces gamma (Alg. 2)", minimum=0.0),
        Param("denom_weight", 0.025, "constant added to <v_i, v_j>: balances the softmax denominator too", minimum=0.0),
        Param("center", True, "centre keys per block before the kernel (reference code)"),
        Param(
            "step",
            "reference",
            "the walk's step: the reference code's (gamma, centre) or Algorithm 2's randomised step "
            "p = 1/2 - y^T eta / (2 c R^2) with c = 30 log(b / delta), delta = 0.01, keys not centred",
            choices=("reference", "algorithm2"),
        ),
    )

    def walk_config(self) -> WalkConfig:
        c = self.cfg
        if c["step"] == "algorithm2":
            return algorithm2_config(int(c["block_size"]), float(c["denom_weight"]), float(c["c"]))
        return WalkConfig(float(c["gamma"]), float(c["c"]), float(c["denom_weight"]), bool(c["center"]))

    def plan_tokens(self, n_prompt: int) -> dict:
        if self.is_full:
            self.layout = Layout(n_prompt, n_prompt, 0, 0)
        else:
            cap = self.tokens_for_budget(n_prompt, with_logw=True)
            self.layout = self.layout_for(n_prompt, cap)
            if self.sem.has_local:  # a window keeps fewer: the largest layout whose bytes still fit
                lo, hi = cap, n_prompt
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if self._fits_with(n_prompt, mid) else (lo, mid - 1)
                self._fits_with(n_prompt, lo)
        return self.layout_knobs()

    def _fits_with(self, n_prompt: int, cap: int) -> bool:
        """Take the layout for ``cap`` kept tokens; whether it holds the budget."""
        self.layout = self.layout_for(n_prompt, cap)
        ratio = self.budget_ratio(n_prompt)
        return ratio is not None and ratio <= 1.0

    def layout_for(self, n_prompt: int, cap: int) -> Layout:
        c = self.cfg
        return fit_layout(n_prompt, cap, c["n_sink"], c["n_recent"], c["T"])

    def layout_knobs(self) -> dict:
        """Set the walk's block for ``self.layout``; the knobs shown with the run."""
        lay = self.layout
        self.block = max(2, min(self.cfg["block_size"], lay.n_middle >> 1 << 1) // 2 * 2)
        return {
            "T": lay.rounds,
            "n_sink": lay.n_sink,
            "n_recent": lay.n_recent,
            "n_middle": lay.n_middle,
            "block_size": self.block,
            "kept_tokens": lay.kept,
        }

    def planned_tokens(self, n_prompt: int) -> int:
        return self.layout.kept

    def planned_logw(self) -> bool:
        return self.layout.rounds > 0 and self.layout.n_middle > 0

    def select(self, state: PrefillState):
        lay = self.layout
        n_layers = state.keys.shape[0]
        if lay.rounds == 0 or lay.n_middle == 0:
            self._logw = None
            return [None] * n_layers
        a, e, n = lay.n_sink, lay.n_sink + lay.n_middle, state.n_tokens
        mid, lw = balance_kv(
            state.keys[:, :, a:e], state.values[:, :, a:e], lay.rounds, self.block, self.walk_config(), self.generator
        )
        lead = mid.shape[:-1]
        dev = mid.device
        idx = torch.cat(
            [
                torch.arange(a, device=dev).expand(*lead, a),
                mid + a,
                torch.arange(e, n, device=dev).expand(*lead, n - e),
            ],
            -1,
        )
        self._logw = torch.cat([lw.new_zeros(*lead, a), lw, lw.new_zeros(*lead, n - e)], -1)
        return idx

    def log_weights(self, state: PrefillState, idx) -> list[Tensor] | None:
        return None if self._logw is None else list(self._logw)


# ----- streaming: MergeAndReduce over generated tokens -------------------------------------------
class BalanceKVStream(BalanceKV):
    """BalanceKV whose generated tokens are compressed too, by MergeAndReduce (Algorithm 3, online).

    Each layer's cache ends with levels 0..T-1 of the merge tree, each a contiguous run of tokens
    (level 0 last). A new token joins level 0; when a level holds ``block_size`` tokens it is halved
    by SoftmaxBalance and its survivors join the next level, which sits right before it; survivors of
    level T-1 are final. The cache then grows by about 2^-T per generated token, plus at most
    T * block_size buffered tokens.
    """

    name = "balancekv-stream"
    plain_feed = False  # its own append (and attend)
    title = "BalanceKV (streaming)"
    summary = (
        "BalanceKV on the prompt, then MergeAndReduce over generated tokens: every block_size new "
        "tokens are halved by the balancing walk, level by level, up to T times."
    )
    streaming = True

    def plan_tokens(self, n_prompt: int) -> dict:
        self.batch = max(2, int(self.cfg["block_size"]) // 2 * 2)
        self.rounds = int(self.cfg["T"])
        knobs = super().plan_tokens(n_prompt)
        self.rounds = self.layout.rounds or int(self.cfg["T"])
        if not self.is_full and self.budget_ratio(n_prompt) > 1.0:
            knobs = self._fit_stream(n_prompt)
        return {**knobs, "stream_T": self.rounds, "stream_block": self.batch}

    def _fit_stream(self, n_prompt: int) -> dict:
        """Hold the budget while decoding: generated tokens wait at full precision until a block of
        ``batch`` is halved, so first the stream's block halves (when ``block_size`` is not given, down
        to 2), then the prompt keeps fewer tokens (the largest capacity that fits, by bisection)."""
        while "block_size" not in self.params_given and self.batch > 2 and self.budget_ratio(n_prompt) > 1.0:
            self.batch = max(2, self.batch // 4 * 2)
        lo, hi = 1, self.layout.kept
        while lo < hi:  # the largest prompt capacity that fits (1 when none does: refused)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._fits_with(n_prompt, mid) else (lo, mid - 1)
        self._fits_with(n_prompt, lo)
        return self.layout_knobs()

    def _fits_with(self, n_prompt: int, cap: int) -> bool:
        self.layout = self.layout_for(n_prompt, cap)
        self.rounds = self.layout.rounds or int(self.cfg["T"])  # the stream's merge tree as deep as the layout's
        return self.budget_ratio(n_prompt) <= 1.0

    def planned_logw(self) -> bool:
        return True  # compress gives every token a log-weight (decoding halves generated tokens)

    def budget_ratio(self, n_prompt: int) -> float:
        """The prompt's kept tokens plus the generated ones still held after j steps (each level holds
        under ``batch``; level l has halved floor(j / (batch 2^l)) times), over the allowance, j <= horizon."""
        j = torch.arange(self.horizon(n_prompt) + 1, dtype=torch.float64)
        held = j.clone()
        for level in range(self.rounds):
            held -= self.batch // 2 * torch.floor(j / (self.batch * 2**level))
        per_token = self.info.n_layers * self.info.n_kv_heads * self.per_token_bytes(True)
        seen, b = n_prompt + j, self.budget  # streaming: the budget's share of every token seen
        assert b is not None  # a compressing plan's
        if self.sem.has_local:  # a local layer holds what compression kept (``local_held``); the others grow
            n_local = sum(s.is_local for s in self.sem.layers)
            tokens = self.info.n_layers * self.layout.kept + (self.info.n_layers - n_local) * held
            allowed = torch.tensor([b.allowed_bytes(self.info, n_prompt, int(i), True) for i in j], dtype=torch.float64)
            return float((tokens * per_token / self.info.n_layers / allowed.clamp_min(1.0)).max())
        allowed = exact_bytes(self.info, 1) * (
            seen.clamp(max=b.tokens) if b.tokens is not None else b.as_fraction * seen
        )
        return float(((self.layout.kept + held) * per_token / allowed.clamp_min(1.0)).max())

    def compress_tokens(self, state: PrefillState) -> None:
        super().compress_tokens(state)
        for layer in self.layers:  # decoding halves generated tokens: every token needs a log-weight
            if layer.logw is None:
                layer.logw = _Growable(torch.zeros((*layer.positions().shape, 1), device=layer.pos.buf.device))
        self.levels = [[0] * self.rounds for _ in self.layers]
        # a local layer's allowance stops growing once its window is full: it then holds what it held
        # after compression, its oldest tokens making room for new ones (``hold_local``)
        self.local_held = {i: layer.n for i, layer in enumerate(self.layers) if self.sem[i].is_local}

    def append(self, layer: int, k: Tensor, v: Tensor, pos: int) -> None:
        cache, counts = self.layers[layer], self.levels[layer]
        cache.append(k, v, pos)
        if self.rounds:
            counts[0] += 1
            lvl = 0
            while lvl < self.rounds and counts[lvl] == self.batch:
                self._reduce_tail(cache)
                counts[lvl] = 0
                if lvl + 1 < self.rounds:
                    counts[lvl + 1] += self.batch // 2
                lvl += 1
        if self.hold_local(layer, pos + k.shape[-2] - 1):  # the oldest went first: shorten the oldest levels
            over = sum(counts) - cache.n
            for lvl in reversed(range(self.rounds)):
                cut = min(over, counts[lvl])
                counts[lvl] -= cut
                over -= cut

    def _reduce_tail(self, cache) -> None:
        """Halve the last ``batch`` tokens of one layer (all heads at once), in place."""
        k, v, _, lw = cache.views()
        n, t = cache.n, self.batch
        h = k.shape[0]
        cfg = self.walk_config()
        tail_lw = lw[:, n - t :].double()
        signs = balance_signs(
            *block_kernel(k[:, None, n - t :], v[:, None, n - t :], tail_lw[:, None], cfg), cfg, self.generator
        )
        keep, mult = halve(signs)
        keep, mult = keep[:, 0], mult[:, 0]
        head = torch.arange(n - t, device=k.device).expand(h, n - t)
        cache.keep(torch.cat([head, keep + (n - t)], -1))
        cache.logw.buf[:, n - t : n - t // 2, 0] += mult.log().to(cache.logw.buf.dtype)

"""SimLayerKV: "lazy" layers keep their first and last tokens only, the others everything.

Zhang, Du, Pang, Liu, Gao, Lin. "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction",
ICLR 2025 workshop, https://arxiv.org/abs/2410.13846 — Sec. 3: some layers put nearly all the attention of
the last token(s) on the initial and the most recent tokens whatever the prompt ("lazy" layers); their
cache keeps just those (``n_sink`` initial, ``n_recent`` recent), every other layer keeps all of it. The
prefill variant judges a layer by the attention of the last ``n_last`` prompt queries, averaged over heads
and queries: the share of it on the tokens a lazy layer would keep. kvpress's ``SimLayerKVPress`` does
the same with n_sink 4, n_recent 1024 and n_last 1 (its defaults, and here).

The paper calls a layer lazy when that share passes a threshold tuned per model (kvpress: 0.9 for Llama 3,
0.65 for Llama 2; it defaults to 1.0, which compresses nothing); the cache it leaves then follows the prompt.
Here the budget decides how many layers are lazy (``sink_recent.SinkRecentSplit``): layers are made lazy in
order of that share, the laziest first, until the cache fits; the threshold's ranking is the paper's, its
cut is the budget's.

Deviations:

* The number of lazy layers comes from the byte budget, not from a threshold (above; ``lazy_threshold``
  restores the paper's rule, the budget then a cap: more layers turn lazy, in order, only if it binds, and
  the lazy windows are not widened, so that kvpress's press is matched where the budget does not bind); on a prompt too
  short for the paper's 4 + 1024 tokens the lazy window shrinks (sinks and recent in proportion) to at most
  ``window_share`` of a layer's even share, and the share is measured on that window. What the last lazy
  layer leaves of the budget widens the lazy layers' recent windows.
* kvpress keeps ``n_recent - n_last`` recent tokens in a lazy layer; here ``n_recent``.
* Prefill only, as kvpress's press (the paper's decode variant re-judges the layers while generating):
  generated tokens are all kept. The cache holds each KV head's count (an int32, counted) as the other
  methods whose heads or layers keep different counts do (``ragged``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.sink_recent import SHARE, SinkRecentSplit


def lazy_share(probs: Tensor, sink: int, recent: int) -> Tensor:
    """Per layer, the attention of the last queries on the first ``sink`` and last ``recent`` tokens: [L].

    probs [L, Hq, w, n]: the attention of the last w prompt queries (causal); averaged over heads and queries.
    """
    mean = probs.float().mean((1, 2))  # [L, n]
    n = mean.shape[-1]
    mask = torch.zeros(n, dtype=torch.bool, device=mean.device)
    mask[: min(sink, n)] = True
    if recent:
        mask[max(0, n - recent) :] = True
    return (mean * mask).sum(-1)


class SimLayerKV(SinkRecentSplit):
    name = "simlayerkv"
    title = "SimLayerKV"
    group = "recent"
    paper = "Zhang et al., SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction, 2024 (arXiv:2410.13846)"
    summary = (
        "Lazy layers (the last query's attention on the first and last tokens) keep only those, the others "
        "everything; the budget sets how many layers are lazy, laziest first."
    )
    params = (
        Param("n_sink", 4, "initial tokens a lazy layer keeps (kvpress's n_initial)", minimum=0),
        Param("n_recent", 1024, "recent tokens a lazy layer keeps (kvpress's; shrunk to fit the budget)", minimum=1),
        Param(
            "n_last",
            1,
            "last prompt queries that judge a layer's laziness (kvpress's, as the paper's decode)",
            minimum=1,
        ),
        SHARE,
        Param(
            "lazy_threshold",
            None,
            "a layer whose share passes it is lazy, as in the paper (none: the budget alone decides; given, the "
            "budget caps and lazy windows are not widened)",
            minimum=0.0,
            maximum=1.0,
            kind=float,
        ),
    )

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        return replace(super().prefill_needs(n_prompt), query_window=min(n_prompt, int(self.cfg["n_last"])))

    def stream_order(self, state: PrefillState) -> tuple[Tensor, int]:
        """Layers by their lazy share, largest first; with ``lazy_threshold``, those above it are lazy."""
        w = min(state.n_tokens, int(self.cfg["n_last"]))
        share = lazy_share(state.window_probs(w), self.sink, self.recent)
        self.lazy_shares = share
        threshold = self.cfg["lazy_threshold"]
        lazy = 0 if threshold is None else int((share > float(threshold)).sum())
        return torch.sort(share, descending=True, stable=True).indices, lazy

"""DapQ: SnapKV's observation window made of pseudo-queries at the positions the answer will take.

Tian, Su, Li, Zhang. "Where Matters More Than What: Decoding-aligned KV Cache Compression via
Position-aware Pseudo Queries", 2026, https://arxiv.org/abs/2603.11564 — an observation window of
the prompt's own last queries sits at positions the answer never takes; the paper finds that a
query's position (its RoPE) shapes its attention more than its content. So:

1. ``n_pseudo`` pseudo tokens are run after the prompt at positions n .. n + N - 1, the positions
   of the first N generated tokens, over the exact prefill cache (their content matters little in
   the paper: here the prompt's first and last N/2 tokens, ``content``);
2. their queries vote for the prompt's tokens with their attention (softmax over the prompt and
   the pseudo tokens before them, causal), summed over the window, pooled along the tokens
   (``kernel``, ``pooling``) and summed over each KV group, as SnapKV's votes;
3. each KV head keeps the prompt tokens of most votes; the pseudo tokens' keys and values are
   discarded and decoding starts at position n, as without them.

Defaults: N = 32 (the paper's ablation finds about 32 best; fewer see too little of the answer's
context, more reach positions too far ahead); pooling as kvlab's SnapKV (max over 7). The paper's
pooling kernel, and which pseudo content its main results use, are not taken from its text here
(it compares the prompt's head and tail concatenated, random tokens and a fixed sentence, with
about 1% variation); ``content`` offers the head-and-tail concatenation and the prompt's tail.

Deviations: the paper's observation window is its only scoring; ``window`` (kvlab's, default 0)
can also keep the prompt's last tokens whatever their votes. The pseudo tokens run through the
model's own forward over the exact cache (``PrefillNeeds.model_access``, one forward of N tokens
per scoring); a prompt that leaves fewer than N positions in the model's context uses the
positions left, and none left is an error. Prefill-only: generated tokens are all kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.core.attention_ops import causal_window_probs
from kvlab.methods.handover import PrefillNeeds, PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored
from kvlab.methods.snapkv import window_votes


def pseudo_ids(prompt: list[int], count: int, content: str) -> list[int]:
    """``count`` token ids for the pseudo queries, from the prompt: ``head-tail``, its first ceil(count / 2)
    and last floor(count / 2) tokens; ``tail``, its last ``count``. A shorter prompt is repeated."""
    if not prompt or count <= 0:
        return []
    if len(prompt) < count:
        return (prompt * (count // len(prompt) + 1))[:count]
    if content == "tail":
        return prompt[-count:]
    head = (count + 1) // 2
    return prompt[:head] + prompt[len(prompt) - (count - head) :]


class DapQ(PromptScored):
    name = "dapq"
    title = "DapQ"
    group = "recent"
    paper = (
        "Tian, Su, Li, Zhang, Where Matters More Than What: Decoding-aligned KV Cache Compression via "
        "Position-aware Pseudo Queries, 2026 (arXiv:2603.11564)"
    )
    summary = (
        "Keeps the prompt tokens that 32 pseudo-queries placed at the answer's positions attend to most "
        "(SnapKV's votes, window discarded)."
    )
    params = (
        Param("n_pseudo", 32, "pseudo tokens after the prompt, the observation window (paper: ~32 best)", minimum=1),
        Param(
            "content",
            "head-tail",
            "the pseudo tokens: the prompt's head and tail concatenated, or its tail",
            choices=("head-tail", "tail"),
        ),
        Param("kernel", 7, "1-D pooling kernel over the votes (1: no pooling)", minimum=1),
        Param("pooling", "max", "pooling of the votes", choices=("max", "avg")),
        Param("window", 0, "last prompt tokens kept whatever their votes (paper: none)", minimum=0),
    )

    def prefill_needs(self, n_prompt: int) -> PrefillNeeds:
        """The model, to run the pseudo tokens after the prompt (unless every token is kept)."""
        return PrefillNeeds(model_access=not (self.full or self.capacity >= n_prompt))

    def pseudo_queries(self, state: PrefillState) -> tuple[Tensor, Tensor]:
        """The pseudo tokens' queries [L, Hq, c, d] (post-RoPE, at positions n..n+c-1) and every key they see,
        the prompt's then theirs: [L, Hkv, n + c, d]."""
        model, n = state.model, state.n_tokens
        if model is None:
            raise RuntimeError(f"{self.name} needs the model's forward (PrefillNeeds.model_access); none was given")
        room = self.info.max_positions - n
        count = min(int(self.cfg["n_pseudo"]), room)
        if count < 1:
            raise ValueError(
                f"{self.name}: a prompt of {n} tokens leaves no position for pseudo queries in the model's "
                f"context of {self.info.max_positions} tokens"
            )
        ids = pseudo_ids(list(model.prompt_ids), count, self.cfg["content"])
        queries: dict[int, Tensor] = {}
        keys: dict[int, Tensor] = {}

        def observe(layer: int, q: Tensor, k: Tensor) -> None:
            queries[layer], keys[layer] = q.float(), k.float()

        model.extend(ids, observe)
        layers = range(self.info.n_layers)
        return torch.stack([queries[i] for i in layers]), torch.stack([keys[i] for i in layers])

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n - window]: the pseudo window's votes for the prompt's tokens before ``window``."""
        c = self.cfg
        prefix, kernel, pooling = state.n_tokens - self.window, int(c["kernel"]), c["pooling"]

        def compute() -> Tensor:
            q, k = self.pseudo_queries(state)
            probs = causal_window_probs(q, k.to(q.device), state.semantics or state.scaling)  # [L, Hq, c, n + c]
            return window_votes(probs, prefix, kernel, pooling, self.info.n_kv_heads)

        return self.shared(state, (int(c["n_pseudo"]), c["content"], prefix, kernel, pooling), compute)

"""KeyDiff: keep the prompt keys least similar to the mean key direction.

Park, Jones, Morse, Goel, Lee, Lott. "KeyDiff: Key Similarity-Based KV Cache Eviction for
Long-Context LLM Inference in Resource-Constrained Environments", arXiv:2504.15364 (2025):
keys that differ from the others in direction tend to draw high attention, so the cache keeps the
most diverse keys. Selecting the N keys of least total pairwise cosine similarity is relaxed to
a per-key score against one anchor, the mean of the cache's normalized keys,
``anchor = mean_i k_i / |k_i|``, and the tokens with the N largest ``-cos(anchor, k_i)`` are kept
(per layer and KV head), with no attention weight involved.

Deviations:

* The paper evicts while it prefills, block by block (each block's forward already sees a
  compressed cache), to bound the prefill's memory; kvlab compresses once after the exact prefill,
  so the anchor is the mean over all the prompt's normalized keys and the later prompt tokens' keys
  come from an exact forward.
* Prefill-only: generated tokens are all kept.
* Scores are computed on the keys as cached (post-RoPE), in float32.
* ``window`` (default 0, none in the paper) optionally keeps the prompt's last tokens whatever their score.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from kvlab.methods.handover import PrefillState
from kvlab.methods.params import Param
from kvlab.methods.scored import PromptScored


def keydiff_scores(keys: Tensor) -> Tensor:
    """keys [..., n, d] -> [..., n]: minus each key's cosine similarity to the mean normalized key."""
    keys = keys.float()
    anchor = F.normalize(keys, dim=-1).mean(-2, keepdim=True)  # [..., 1, d]
    return -F.cosine_similarity(keys, anchor, dim=-1)


class KeyDiff(PromptScored):
    name = "keydiff"
    title = "KeyDiff"
    group = "recent"
    paper = (
        "Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference "
        "in Resource-Constrained Environments (arXiv:2504.15364)"
    )
    summary = "Keeps the prompt tokens whose keys are least similar (cosine) to the mean key direction."
    params = (Param("window", 0, "last prompt tokens kept whatever their score (paper: none)", minimum=0),)

    def scores(self, state: PrefillState) -> Tensor:
        """[L, Hkv, n]: minus each key's cosine similarity to its layer and head's anchor."""
        return keydiff_scores(state.keys)

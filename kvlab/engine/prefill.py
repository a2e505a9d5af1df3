"""The one exact prefill every method of a comparison shares, and what it hands each method.

Each compressor declares what it needs (``Compressor.prefill_needs``, a ``handover.PrefillNeeds``).
``prefill_for`` merges every compressor's needs (``MergedNeeds``: the largest query window, every
distinct query-statistics window, accumulated attention and model access if any asks, every
observer) and runs ONE forward of the prompt through the model with kvlab's attention function
(``attention.PrefillCapture``). Everything beyond the exact keys and values is computed only when
some method asked for it:

* ``state.queries``: the last w prompt queries, post-RoPE, as attention saw them;
* ``state.acc_attn``: the attention each key received, summed over every prompt query;
* observers see the prefill's attention of the last queries as it is computed;
* ``state.query_stats`` (``QueryStats``): mean and covariance (float32) of the last w prompt
  queries before RoPE, the captured post-RoPE queries turned back with the model's own rotary
  embedding (``ModelInfo.rope``; None on a model without one); one per distinct window asked
  (``state.stats_over(w)``), so two methods asking for different windows each get their own;
* ``state.model`` (``ExactExtension``): the model, for a method that runs tokens of its own after
  the prompt on the exact prefill cache (KVzip's reconstruction of the context), or the exact prefill
  of a calibration text (LU-KV's profile of the model);
* ``state.out_proj``: each layer's attention output projection W_o, a view of the model's weight
  (``output_projections``; CriticalKV's ||W_o v||_1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from kvlab.core import semantics as sm
from kvlab.core.model import LoadedModel
from kvlab.core.rope import Rotary
from kvlab.engine import attention as attn
from kvlab.engine.cache import PrefillCache, RoutedCache
from kvlab.methods.base import Compressor
from kvlab.methods.handover import PrefillNeeds, PrefillState, QueryStats, WindowObserver

USER_MARKER = "KVLAB_USER_TURN_7f3a"  # stands for a user's text the chat template does not keep as it is


@dataclass(frozen=True)
class MergedNeeds:
    """What one prefill computes for all the methods it serves (see ``PrefillNeeds``)."""

    query_window: int = 0
    acc_attn: bool = False
    observers: tuple[WindowObserver, ...] = ()
    query_stats: tuple[int, ...] = ()  # every distinct statistics window asked, ascending
    model_access: bool = False
    out_proj: bool = False

    @classmethod
    def of(cls, needs: Iterable[PrefillNeeds]) -> MergedNeeds:
        """The largest query window, every distinct statistics window, any of the flags, every observer."""
        needs = list(needs)
        return cls(
            query_window=max((x.query_window for x in needs), default=0),
            acc_attn=any(x.acc_attn for x in needs),
            observers=tuple(x.observer for x in needs if x.observer is not None),
            query_stats=tuple(sorted({x.query_stats for x in needs if x.query_stats})),
            model_access=any(x.model_access for x in needs),
            out_proj=any(x.out_proj for x in needs),
        )


@torch.inference_mode()
def prefill(lm: LoadedModel, ids: list[int], *needs: PrefillNeeds) -> tuple[PrefillState, Tensor]:
    """Exact prefill of one prompt with what ``needs`` ask for (merged). Returns the state every
    compressor starts from and the last logits [V]."""
    want = MergedNeeds.of(needs)
    model, info, n, dev = lm.model, lm.info, len(ids), lm.device
    window = min(n, max((want.query_window, *want.query_stats)))
    capture = attn.PrefillCapture(info.n_layers, window, want.acc_attn, observers=want.observers)
    with attn.active(model, capture):
        out = model(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.arange(n, device=dev).unsqueeze(0),
            past_key_values=PrefillCache(info.n_layers),
            use_cache=True,
            logits_to_keep=1,
        )
    keys, values = capture.stacked()
    if capture.window:
        captured = torch.stack(cast(list[Tensor], capture.queries))  # [L, Hq, window, d]
    else:
        captured = keys.new_zeros(info.n_layers, info.n_heads, 0, info.head_dim)
    qw = min(n, want.query_window)
    queries = captured if qw == window else captured[..., window - qw :, :].contiguous()
    by_window: dict[int, QueryStats] = {}
    if info.rope is not None:
        for asked in want.query_stats:  # each distinct window on its own: never one window's for another's
            w = min(n, asked)
            if w not in by_window:
                by_window[w] = query_stats(captured[..., window - w :, :], info.rope, n - w)
    stats = by_window[max(by_window)] if by_window else None
    sem = info.semantics
    assert sem is not None  # ModelInfo sets it
    state = PrefillState(
        keys,
        values,
        queries,
        scaling=sem[0].scaling,
        acc_attn=torch.stack(cast(list[Tensor], capture.acc)).float() if want.acc_attn else None,
        semantics=sem,
        query_stats=stats,
        model=ExactExtension(lm, list(ids), keys, values) if want.model_access else None,
        query_stats_by_window=by_window,
        out_proj=output_projections(lm) if want.out_proj else None,
    )
    return state, out.logits[0, -1]


def prefill_for(lm: LoadedModel, ids: list[int], comps: Sequence[Compressor]) -> tuple[PrefillState, Tensor, float]:
    """The exact prefill with what ``comps`` need (each compressor's ``prefill_needs``, after its plan);
    returns the state, the last logits [V] and the prefill's seconds."""
    t0 = time.perf_counter()
    state, logits = prefill(lm, ids, *(c.prefill_needs(len(ids)) for c in comps))
    return state, logits, time.perf_counter() - t0


def query_stats(queries: Tensor, rope: Rotary, first_pos: int) -> QueryStats:
    """Statistics of w queries before RoPE: ``queries`` [L, Hq, w, d] post-RoPE at positions
    first_pos..first_pos+w-1 -> mean [L, Hq, d] and covariance [L, Hq, d, d] (float32, normalised by w)."""
    w = queries.shape[-2]
    pre = rope.unrotate(queries.float(), torch.arange(first_pos, first_pos + w, device=queries.device))
    mean = pre.mean(dim=-2)
    centred = pre - mean.unsqueeze(-2)
    cov = centred.transpose(-1, -2) @ centred / w
    return QueryStats(mean=mean, cov=cov, n=w, first_pos=first_pos)


OUT_PROJ_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "wo")  # an attention module's output projection


def output_projections(lm: LoadedModel) -> tuple[Tensor, ...] | None:
    """Each layer's attention output projection, as a view of the model's weight: [hidden, Hq, dv] per layer
    (the block of query head h is [:, h]; bias left out). Found as the linear child named as transformers'
    models name it (``OUT_PROJ_NAMES``) whose input is the Hq x dv attention output, one per layer in module
    order; None when the model does not have exactly one per layer (the method then says so)."""
    info = lm.info
    width = info.n_heads * info.v_head_dim
    found = []
    for module in lm.model.modules():
        for name in OUT_PROJ_NAMES:
            child = getattr(module, name, None)
            if isinstance(child, torch.nn.Linear) and child.in_features == width and hasattr(module, "layer_idx"):
                found.append(child.weight)
                break
    if len(found) != info.n_layers:
        return None
    return tuple(w.detach().view(w.shape[0], info.n_heads, info.v_head_dim) for w in found)


class ExactExtension:
    """``handover.ModelAccess`` over one exact prefill: the model runs tokens after the prompt, attending
    over the prompt's exact keys and values (never changed) and causally inside the chunk."""

    def __init__(self, lm: LoadedModel, prompt_ids: list[int], keys: Tensor, values: Tensor):
        self.lm, self.prompt_ids = lm, prompt_ids
        self.keys, self.values = keys, values  # [L, Hkv, n, d]: the prefill's, read only

    @property
    def owner(self) -> object:
        return self.lm.model

    def prefill(self, ids: list[int], needs: PrefillNeeds) -> PrefillState:
        return prefill(self.lm, ids, needs)[0]

    def encode(self, text: str) -> list[int]:
        tok: Any = self.lm.tokenizer
        return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]

    def chat_wrap(self, user: str) -> tuple[list[int], list[int]]:
        tok: Any = self.lm.tokenizer
        if not getattr(tok, "chat_template", None):
            return [], []
        for content in (user, USER_MARKER):  # the marker when the template changes the text (trims it)
            text = str(
                tok.apply_chat_template(
                    [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
                )
            )
            at = text.rfind(content) if content else -1  # the user turn comes after any system prompt
            if at >= 0:
                return self.encode(text[:at]), self.encode(text[at + len(content) :])
        return [], []

    @torch.inference_mode()
    def extend(self, ids: list[int], observe: Callable[[int, Tensor, Tensor], None]) -> None:
        n, c = self.keys.shape[-2], len(ids)
        if not c:
            return
        info, dev = self.lm.info, self.lm.device
        if n + c > info.max_positions:
            raise ValueError(
                f"the prompt ({n} tokens) + {c} more exceeds the model's context of {info.max_positions} tokens"
            )
        with attn.active(self.lm.model, _Extend(self.keys, self.values, observe)):
            self.lm.model(
                input_ids=torch.tensor([ids], device=dev),
                position_ids=torch.arange(n, n + c, device=dev).unsqueeze(0),
                past_key_values=RoutedCache(info.n_layers, n),
                use_cache=True,
                logits_to_keep=1,
            )


class _Extend:
    """Attention handler of ``ExactExtension.extend``: a chunk of c queries over the prompt's n exact
    keys/values and the chunk's own (causal, with the layer's window, soft-cap and sinks)."""

    def __init__(self, keys: Tensor, values: Tensor, observe: Callable[[int, Tensor, Tensor], None]):
        self.keys, self.values, self.observe = keys, values, observe

    def __call__(
        self, module: Any, query: Tensor, key: Tensor, value: Tensor, mask: object, sem: sm.LayerSemantics, **kw: Any
    ) -> tuple[Tensor, None]:
        layer = module.layer_idx  # the attention module (or ``attention._LayerStub``)
        k = torch.cat((self.keys[layer].to(key.dtype), key[0]), dim=-2)  # [Hkv, n + c, d]
        v = torch.cat((self.values[layer].to(value.dtype), value[0]), dim=-2)
        q = query[0]  # [Hq, c, d]
        self.observe(layer, q, k)
        c, total = q.shape[-2], k.shape[-2]
        bias = sm.window_bias(
            sem, torch.arange(total - c, total, device=q.device), torch.arange(total, device=q.device)
        )
        out = sm.attend(q, k, v, sem, bias=bias)  # [Hq, c, dv]
        return out.transpose(0, 1)[None], None


__all__ = ["ExactExtension", "MergedNeeds", "prefill", "prefill_for", "query_stats"]

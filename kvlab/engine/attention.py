"""The ``kvlab`` attention function registered with transformers' ``AttentionInterface``.

The model's code is not patched. While the engine runs, ``config._attn_implementation`` is
``"kvlab"`` and a context (a ContextVar, so concurrent threads don't mix) says what to do:

* ``PrefillCapture``: exact causal attention (SDPA), recording the last prompt queries and, when
  asked, the attention each key receives summed over all queries;
* ``LockstepDecode``: row i of the batch attends through compressor i's cache (with one query per
  row, the rows of a class that attends several rows at once do so in one call:
  ``kvlab.engine.batched_attention``).
* ``LockstepChunk``: row i feeds a chunk of new tokens (a question asked after compression)
  through compressor i's ``feed``, causally inside the chunk.

With no context active the function is plain SDPA, so the same model object also serves
``model.generate``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from kvlab.core import semantics as sm
from kvlab.core.semantics import LayerSemantics, window_bias
from kvlab.engine import faults
from kvlab.engine.batched_attention import RowAttention, attend_rows
from kvlab.engine.few_rows import torch_functions_plain
from kvlab.methods.handover import WindowObserver

NAME = "kvlab"
_ACTIVE: ContextVar[Callable[..., Tensor] | None] = ContextVar("kvlab_attention", default=None)


class PrefillCapture:
    """Records, per layer, the last ``window`` queries [Hq, w, d] and optionally acc_attn [Hq, n].

    ``observers`` (``handover.WindowObserver``s) see the attention of the last prompt queries as the prefill
    computes it: those rows are attended in blocks of at most ``BLOCK_BYTES`` of probabilities
    (``semantics.attend``, float32) instead of by SDPA, and each block's probabilities [Hq, rows, e]
    go to every observer whose window holds them. The rows before run through SDPA as usual. So a
    method that ranks the prompt by this attention (Scissorhands) needs no second pass over it.
    """

    BLOCK_BYTES = 4 * 2**20

    def __init__(
        self, n_layers: int, window: int, acc_attn: bool, chunk: int = 256, observers: Sequence[WindowObserver] = ()
    ):
        self.window, self.want_acc, self.chunk = window, acc_attn, chunk
        self.queries: list[Tensor | None] = [None] * n_layers
        self.acc: list[Tensor | None] = [None] * n_layers
        self.keys: list[Tensor | None] = [None] * n_layers  # [Hkv, n, d] as attention sees them
        self.values: list[Tensor | None] = [None] * n_layers  # [Hkv, n, dv]
        self.observers = list(observers)

    def __call__(self, module, query: Tensor, key: Tensor, value: Tensor, mask, sem: LayerSemantics, **kw):
        layer = module.layer_idx
        n = query.shape[-2]
        self.keys[layer], self.values[layer] = key[0], value[0]
        if self.window:
            self.queries[layer] = query[0, :, max(0, n - self.window) :, :].detach().clone()
        rows = min(n, max((o.rows for o in self.observers), default=0))
        head = n - rows
        if sem.plain:  # plain causal attention: SDPA for every row; the observers get probabilities alone
            lse = None
            if (self.want_acc or rows) and query.device.type == "cpu" and key.shape[-1] == value.shape[-1]:
                # SDPA's row normalisers (its CPU flash kernel wants one head size) give the column sums and
                # the observed rows' probabilities: exp(q.k * scaling - lse), no second softmax
                out, lse = sdpa_with_lse(query, key, value, sem.scaling)
            else:
                out = sdpa(module, query, key, value, None, sem.scaling)[0]
            if self.want_acc:
                self.acc[layer] = (
                    accumulated_attention(query[0], key[0], sem, self.chunk)
                    if lse is None
                    else accumulated_from_lse(query[0], key[0], lse[0], sem.scaling, self.chunk)
                )
            if rows:
                self._observe(layer, query[0], key[0], head, n, sem, None if lse is None else lse[0])
            return out, None
        if self.want_acc:
            self.acc[layer] = accumulated_attention(query[0], key[0], sem, self.chunk)
        outs = []
        if head:
            outs.append(
                self._rows(layer, query[0], key[0], value[0], 0, head, sem, observe=False).transpose(0, 1)[None]
            )
        if rows:
            outs.append(self._rows(layer, query[0], key[0], value[0], head, n, sem).transpose(0, 1)[None])
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None

    def _blocks(self, q: Tensor, first: int, last: int) -> Iterator[tuple[int, int]]:
        """Row blocks [s, e) of queries first..last-1 whose float32 probabilities fit ``BLOCK_BYTES``."""
        step = max(1, self.BLOCK_BYTES // (q.shape[0] * q.shape[-2] * 4))
        for s in range(first, last, step):
            yield s, min(last, s + step)

    def _feed(self, layer: int, probs: Tensor, s: int, e: int, n: int) -> None:
        """Rows s..e-1's probabilities [Hq, e - s, e] to every observer whose window holds some of them."""
        for obs in self.observers:
            lo = max(s, n - obs.rows)
            if lo < e:
                obs(layer, probs[:, lo - s :], lo)

    def _observe(
        self, layer: int, q: Tensor, k: Tensor, first: int, last: int, sem: LayerSemantics, lse: Tensor | None
    ) -> None:
        """The probabilities of queries first..last-1 (q [Hq, n, d], k [Hkv, n, d]; plain causal attention),
        without the values' product: SDPA gives the layer's output. With ``lse`` [Hq, n] (the rows'
        log-sum-exp, ``sdpa_with_lse``) they are exp(logits - lse), without a softmax's passes."""
        n = q.shape[-2]
        for s, e in self._blocks(q, first, last):
            x = sm.mask_future(sm.logits(q[:, s:e].float(), k[:, :e].float(), sem), e - s)
            probs = sm.softmax(x, sem) if lse is None else x.sub_(lse[:, s:e, None].float()).exp_()
            self._feed(layer, probs, s, e, n)

    def _rows(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, first: int, last: int, sem: LayerSemantics, observe=True
    ) -> Tensor:
        """Attention of queries ``first``..last-1 (q [Hq, n, d], k/v [Hkv, n, d]) in row blocks with the
        layer's semantics; when ``observe``, each block's probabilities go to the observers: returns
        out [Hq, last - first, dv]."""
        n = q.shape[-2]
        outs = []
        for s, e in self._blocks(q, first, last):
            bias = window_bias(sem, torch.arange(s, e, device=q.device), torch.arange(e, device=q.device))
            out, probs = sm.attend(q[:, s:e], k[:, :e], v[:, :e], sem, bias=bias, return_probs=True)
            if observe:
                self._feed(layer, probs, s, e, n)
            outs.append(out)
        return torch.cat(outs, dim=1)

    def stacked(self) -> tuple[Tensor, Tensor]:
        """[L, Hkv, n, d] keys and [L, Hkv, n, dv] values of the single prompt (post-RoPE)."""
        return torch.stack(_filled(self.keys)), torch.stack(_filled(self.values))


def sdpa_with_lse(query: Tensor, key: Tensor, value: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """Causal SDPA on the CPU that also returns each row's log-sum-exp: query [1, Hq, n, d], key/value
    [1, Hkv, n, d] -> (out [1, n, Hq, dv] as ``sdpa_attention_forward`` returns it, lse float32 [1, Hq, n]).

    The same kernel (flash attention for the CPU) and numbers as SDPA's own causal call."""
    g = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(g, dim=1) if g > 1 else t for t in (key, value))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, True, scale=scaling)[:2]
    return out.transpose(1, 2).contiguous(), lse


def accumulated_from_lse(q: Tensor, k: Tensor, lse: Tensor, scaling: float, chunk: int = 256) -> Tensor:
    """``accumulated_attention`` of plain causal attention from the rows' log-sum-exp [Hq, n] (``sdpa_with_lse``):
    sum_i exp(q_i.k_j * scaling - lse_i), one product and one exp per query chunk, no second softmax.
    q [Hq, n, d], k [Hkv, n, d] -> float32 [Hq, n]."""
    n, g = q.shape[-2], q.shape[0] // k.shape[0]
    q, k = q.float(), (k.repeat_interleave(g, dim=0) if g > 1 else k).float()
    acc = torch.zeros(q.shape[0], n, dtype=torch.float32, device=q.device)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        x = torch.baddbmm(-lse[:, s:e, None].float(), q[:, s:e], k[:, :e].transpose(-1, -2), alpha=scaling)
        acc[:, :e] += sm.mask_future(x, e - s).exp_().sum(-2)
    return acc


def accumulated_attention(q: Tensor, k: Tensor, scaling: LayerSemantics | float, chunk: int = 256) -> Tensor:
    """Causal attention each key receives, summed over all queries: q [Hq, n, d], k [Hkv, n, d] -> [Hq, n].

    Computed in query chunks so memory stays O(chunk x n); a chunk of queries [s, e) only scores
    the keys [0, e) it can see (half the work of scoring every key and masking). ``scaling`` a
    ``LayerSemantics``: with the layer's window, soft-cap and sinks.
    """
    n = q.shape[-2]
    acc = torch.zeros(q.shape[0], n, dtype=torch.float32, device=q.device)
    kpos = torch.arange(n, device=q.device)
    sem = sm.as_semantics(scaling, q)
    q, k = q.float(), k.float()
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        logits = sm.logits(q[:, s:e], k[:, :e], sem)  # [Hq, e - s, e]
        bias = window_bias(sem, kpos[s:e], kpos[:e])
        acc[:, :e] += sm.softmax(logits if bias is None else logits + bias, sem).sum(-2)
    return acc


class LockstepDecode:
    """Routes batch row i to ``compressors[i]``; ``observers`` see (layer, row, q, out) for probes.

    ``layer_observers`` see the whole batch once per layer: (layer, q [B, Hq, 1, d], k, v
    [B, Hkv, 1, d] the new token's key/value, out [B, Hq, 1, d]).
    """

    def __init__(
        self,
        compressors: list,
        positions: list[int],
        observers: list[Callable] | None = None,
        layer_observers: list[Callable] | None = None,
        row_attention: RowAttention = attend_rows,
    ):
        self.compressors = compressors
        self.positions = positions  # row i's new token's true position
        self.observers = observers or []
        self.layer_observers = layer_observers or []
        # how the rows attend (``DecodePaths.row_attention``): the rows of a class with ``attend_many``
        # in one call (``attend_rows``), or each alone (``attend_each``, the reference path)
        self.row_attention = row_attention

    def __call__(self, module, query: Tensor, key: Tensor, value: Tensor, mask, sem: LayerSemantics, **kw):
        with torch_functions_plain():  # the model's torch-function modes (few_rows) are not for us
            for row, comp in enumerate(self.compressors):  # the new token's key/value as attention sees them
                faults.append(row, comp, module.layer_idx, key[row], value[row], self.positions[row])
            return self.attend(module.layer_idx, query, key, value)

    def attend(self, layer: int, query: Tensor, key: Tensor, value: Tensor):
        """Every row's attention output for its one query (query [B, Hq, 1, d]), seen by the observers.
        A row that raises gets zeros (``faults.attend``); the engine then ends its run."""
        outs = self.row_attention(self.compressors, layer, query, faults.guard, faults.attend)
        for row, out in enumerate(outs):
            for obs in self.observers:
                obs(layer, row, query[row], out)
        out = torch.stack(outs)  # [B, Hq, 1, d]
        for obs in self.layer_observers:
            obs(layer, query, key, value, out)
        return out.transpose(1, 2).contiguous(), None


class LockstepChunk:
    """Row i of a [B, c] forward feeds its c new tokens through ``compressors[i].feed`` at true position ``pos``.

    ``observers`` see the whole batch once per layer: (layer, q [B, Hq, c, d], k, v [B, Hkv, c, d]
    the chunk's keys/values, out [B, Hq, c, d]). Used with a ``cache.RoutedCache``, which
    leaves the appending to the compressors' ``feed``.
    """

    def __init__(self, compressors: list, pos: int, observers: list[Callable] | None = None):
        self.compressors, self.pos = compressors, pos
        self.observers = observers or []

    def __call__(self, module, query: Tensor, key: Tensor, value: Tensor, mask, sem: LayerSemantics, **kw):
        layer = module.layer_idx
        with torch_functions_plain():
            out = torch.stack(
                [
                    faults.feed(r, comp, layer, query[r], key[r], value[r], self.pos)
                    for r, comp in enumerate(self.compressors)
                ]
            )  # [B, Hq, c, d]
            for obs in self.observers:
                obs(layer, query, key, value, out)
        return out.transpose(1, 2).contiguous(), None


def _filled(xs: list[Tensor | None]) -> list[Tensor]:
    """Every layer's captured tensor (a prefill captures every layer)."""
    out = [x for x in xs if x is not None]
    assert len(out) == len(xs), "a layer's keys or values were not captured"
    return out


def kvlab_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The attention function transformers calls. Every keyword argument is read into the layer's
    ``LayerSemantics`` (``semantics.from_call``: an unknown one raises ``UnsupportedAttention``) and
    the handler computes with it. With no handler active, the model's own maths (``semantics.attend``
    over the causal window; SDPA when the layer is plain)."""
    if scaling is None:
        scaling = module.head_dim**-0.5
    sem = sm.from_call(module, query, key, value, scaling, {"dropout": dropout, **kwargs}, _config(module))
    handler = _ACTIVE.get() or _reference
    return handler(module, query, key, value, attention_mask, sem=sem)


def _config(module):
    return getattr(module, "config", None)


def _reference(module, query: Tensor, key: Tensor, value: Tensor, mask, sem: LayerSemantics, **kw):
    """Attention as the model computes it, for a forward with no kvlab handler: SDPA when the layer is
    plain, else ``semantics.reference_attention`` (causal, with the window, soft-cap and sinks)."""
    if sem.plain:
        return sdpa(module, query, key, value, mask, sem.scaling)
    return sm.reference_attention(query, key, value, sem), None


class _Groups:
    """What ``sdpa_attention_forward`` reads of an attention module, with the query heads per KV head
    taken from the tensors (``num_key_value_groups``) instead of the module's config-derived field."""

    def __init__(self, module, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = getattr(module, "is_causal", True)
        self.layer_idx = getattr(module, "layer_idx", None)


def sdpa(module, query: Tensor, key: Tensor, value: Tensor, mask, scaling: float) -> tuple[Tensor, None]:
    """transformers' SDPA attention with the grouping of query heads read from the tensors: query
    [B, Hq, t, d], key/value [B, Hkv, n, d|dv]. A module's ``num_key_value_groups`` comes from its config,
    which a model may not follow (DeepSeek-V3's latent attention expands K/V to every query head
    whatever ``num_key_value_heads`` says)."""
    groups = _Groups(module, query.shape[1] // key.shape[1])
    return sdpa_attention_forward(cast(torch.nn.Module, groups), query, key, value, mask, scaling=scaling)


def _no_mask(*args, **kwargs):
    """kvlab masks by itself: causality and each layer's window come from its ``LayerSemantics``
    (``semantics.window_bias``); rows are never padded."""
    return None


AttentionInterface.register(NAME, kvlab_attention)
AttentionMaskInterface.register(NAME, _no_mask)


SDPA_ROUTE = "sdpa"  # ``model._kvlab_route``: the model's attention calls torch's SDPA itself (Falcon)


class _LayerStub:
    """What ``kvlab_attention`` reads of an attention module, for a layer reached through ``_SdpaRoute``."""

    def __init__(self, layer_idx: int, head_dim: int):
        self.layer_idx, self.head_dim = layer_idx, head_dim


class _SdpaRoute(TorchFunctionMode):
    """Routes a model whose attention modules call ``F.scaled_dot_product_attention`` themselves (not
    transformers' attention interface) to ``kvlab_attention``: the forward's i-th SDPA call is layer
    i mod L. Only an unmasked or causal call is routed; an additive bias (ALiBi) raises, as kvlab
    does not compute it (``refuse_unsupported`` refuses such models at load)."""

    def __init__(self, n_layers: int):
        super().__init__()
        self.n_layers, self.calls = n_layers, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if mask is not None and mask.dtype != torch.bool:
            raise sm.UnsupportedAttention("the model adds a bias to its attention logits (e.g. ALiBi)")
        layer = self.calls % self.n_layers
        self.calls += 1
        scale = kwargs.get("scale")
        out, _ = kvlab_attention(_LayerStub(layer, q.shape[-1]), q, k, v, None, scaling=scale)
        return out.transpose(1, 2)  # [B, Hq, t, dv], as SDPA returns


@contextlib.contextmanager
def active(model, handler):
    """Run ``model`` with the kvlab attention function and ``handler`` in charge."""
    cfg = model.config
    old = cfg._attn_implementation
    token = _ACTIVE.set(handler)
    routed = getattr(model, "_kvlab_route", None) == SDPA_ROUTE
    cfg._attn_implementation = "sdpa" if routed else NAME
    mode = _SdpaRoute(cfg.get_text_config().num_hidden_layers) if routed else contextlib.nullcontext()
    try:
        with mode:
            yield handler
    finally:
        cfg._attn_implementation = old
        _ACTIVE.reset(token)


__all__ = [
    "LockstepChunk",
    "LockstepDecode",
    "PrefillCapture",
    "accumulated_attention",
    "active",
]

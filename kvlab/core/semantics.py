"""The model's attention semantics, per layer, and the maths every attention path shares.

transformers calls an attention function with the query, key and value states and keyword
arguments that change what attention computes: ``scaling``, ``sliding_window`` (a local layer:
a query at position p sees keys at positions > p - window), ``softcap`` (logits become
``softcap * tanh(logits / softcap)``, Gemma 2), ``s_aux`` (one learned sink logit per query head
that joins every softmax's normaliser but has no value, gpt-oss). The value head size may differ
from the key head size (multi-head latent attention, DeepSeek-V3). Chunked attention (Llama 4's
``chunked_attention`` layers) is told by the config and the model's mask alone: a query at position
p sees only the keys of its own block of ``attention_chunk_size`` positions (p - p % chunk .. p).

``record`` reads these from one forward of the model (``Recorder``); ``ModelSemantics`` holds one
``LayerSemantics`` per layer. Every path that computes attention (prefill, lockstep decode per row
and batched, question chunks, the probes' shadow attention, the decode kernels' references and
the methods that estimate attention) goes through ``logits`` / ``softmax`` / ``attend`` here, so
no method re-implements soft-capping, sinks or windows.

A keyword argument transformers passes that is not in ``HONOURED`` or ``INERT`` makes ``record``
raise ``UnsupportedAttention``: none is silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kernels.tensor_ops import group_queries, ungroup

HONOURED = ("scaling", "sliding_window", "softcap", "s_aux", "dropout")
# arguments that carry no attention maths (bookkeeping transformers forwards to every attention function)
INERT = (
    "position_ids",
    "cache_position",
    "use_cache",
    "past_key_values",
    "past_key_value",
    "output_attentions",
    "position_embeddings",
    "is_causal",
    "layer_idx",
    "output_router_logits",
    "output_hidden_states",
    "return_dict",
)


class UnsupportedAttention(RuntimeError):
    """The model's attention uses something kvlab does not compute; the message says what, in one line."""


@dataclass(frozen=True)
class LayerSemantics:
    """What one layer's attention computes.

    scaling: the factor on q.k; window: sliding window in tokens (None: none); chunk: block-local
    attention in blocks of this many positions (None: none); softcap: logit soft-cap (None: none);
    sinks: [Hq] float32 sink logits (None: none); k_dim / v_dim: key and value head sizes. A layer
    with a window or a chunk is local: its exact cache holds at most ``span`` tokens.
    """

    scaling: float
    k_dim: int
    v_dim: int
    window: int | None = None
    softcap: float | None = None
    sinks: Tensor | None = field(default=None, compare=False, repr=False)
    chunk: int | None = None

    @property
    def is_local(self) -> bool:
        """A sliding window or chunked attention: a query sees only recent keys."""
        return self.window is not None or self.chunk is not None

    @property
    def span(self) -> int | None:
        """The most tokens this layer's exact cache holds (the window, or the chunk); None on a global layer."""
        spans = [x for x in (self.window, self.chunk) if x is not None]
        return min(spans) if spans else None

    @property
    def plain(self) -> bool:
        """Softmax(q.k * scaling) over every key: no window, chunk, cap or sinks (SDPA computes it)."""
        return not self.is_local and self.softcap is None and self.sinks is None

    def visible_from(self, pos: int) -> int:
        """The first key position a query at position ``pos`` sees (0 on a global layer): the window's
        first (pos - window + 1) or its chunk's first (pos - pos % chunk), whichever is later."""
        first = 0
        if self.window is not None:
            first = max(first, pos - self.window + 1)
        if self.chunk is not None:
            first = max(first, pos - pos % self.chunk)
        return first

    @property
    def nonlinear(self) -> bool:
        """Soft-cap or sinks: the logits or the normaliser differ from plain softmax attention."""
        return self.softcap is not None or self.sinks is not None

    def held(self, n_tokens: int) -> int:
        """Tokens the exact cache of this layer holds after ``n_tokens`` tokens: min(n, span) on a local layer
        (a chunked layer counts a whole chunk, as transformers' cache holds it)."""
        span = self.span
        return n_tokens if span is None else min(n_tokens, span)

    def sees_many(self, n_tokens: Tensor) -> Tensor:
        """``sees`` of every count in ``n_tokens`` (an integer tensor of counts >= 1)."""
        last = n_tokens - 1
        first = torch.zeros_like(last)
        if self.window is not None:
            first = torch.maximum(first, last - self.window + 1)
        if self.chunk is not None:
            first = torch.maximum(first, last - last % self.chunk)
        return n_tokens - first

    def sees(self, n_tokens: int) -> int:
        """Keys the query of the ``n_tokens``-th token (at position n_tokens - 1) sees: ``held`` on a global or
        sliding-window layer; on a chunked layer only its block's, fewer than ``held`` inside a block."""
        return n_tokens - self.visible_from(n_tokens - 1) if n_tokens > 0 else 0

    def reach(self, n_tokens: int, steps: int = 0) -> int:
        """The most tokens a cache that keeps only what this layer's queries see may need on it, from the
        ``n_tokens``-th token through ``steps`` more, beyond what the exact cache's own growth pays for (a
        budget allows a prefill-only method's generated tokens as the exact cache holds them): the largest
        ``sees(m) - (held(m) - held(n))`` for m in n .. n + steps. ``held(n)`` on a global or sliding-window
        layer (their queries see what their exact cache holds); on a chunked layer the most its queries see
        until the horizon: a whole block when one ends before it, else the last query's view."""
        if self.chunk is None:
            return self.held(n_tokens)
        return max(self.sees(m) - (self.held(m) - self.held(n_tokens)) for m in self._marks(n_tokens, steps))

    def most_seen(self, n_tokens: int, steps: int = 0) -> int:
        """The most keys a query sees from the ``n_tokens``-th token through ``steps`` more: the largest
        ``sees(m)`` for m in n .. n + steps (the last query's view on a global or sliding-window layer; on a
        chunked layer a whole block when one ends before the last)."""
        return max(self.sees(m) for m in self._marks(n_tokens, steps))

    def _marks(self, n_tokens: int, steps: int) -> set[int]:
        """The token counts in n .. n + steps where ``sees`` peaks: both ends and, on a chunked layer, the
        first block end at or after n (``sees`` grows by one a token inside a block)."""
        last = n_tokens + steps
        if self.chunk is None:
            return {n_tokens, last}
        ends = -(-n_tokens // self.chunk) * self.chunk
        return {n_tokens, last} | ({ends} if ends <= last else set())

    def cap(self, logits: Tensor) -> Tensor:
        """Soft-capped logits (unchanged when the layer has no cap)."""
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def sink_logits(self, hq: int, device) -> Tensor | None:
        """[Hq, 1, 1] sink logits in float32, or None."""
        if self.sinks is None:
            return None
        return self.sinks.to(device=device, dtype=torch.float32).reshape(hq, 1, 1)


def as_semantics(sem: LayerSemantics | float, q: Tensor, v: Tensor | None = None) -> LayerSemantics:
    """``sem`` itself, or plain semantics with ``sem`` as the scaling (a float, for callers with no model)."""
    if isinstance(sem, LayerSemantics):
        return sem
    d = q.shape[-1]
    return LayerSemantics(scaling=float(sem), k_dim=d, v_dim=d if v is None else v.shape[-1])


class ScoredKeys:
    """Keys that attention reads through a score linear in the query, with no dense key tensor: QJL's
    sign sketches, whose estimate sqrt(pi/2)/m ||k|| <S q, sign(S k)> costs m per key and query where a
    dense k_hat = sqrt(pi/2)/m ||k|| S^T sign(S k) would cost m x d per key to build.

    ``shape``: the [.., Hkv, n, d] of the keys they stand for; ``scores(qg)``: grouped queries qg
    [.., Hkv, R, d] (``group_queries``, already scaled) -> [.., Hkv, R, n] float32, the logits before
    the soft-cap. ``float()`` returns the object itself (the scores are float32), so the attention
    paths take either keys or scored keys.
    """

    shape: torch.Size

    def scores(self, qg: Tensor) -> Tensor:
        raise NotImplementedError

    def float(self) -> ScoredKeys:
        return self


Keys = Tensor | ScoredKeys  # what attention reads its keys from


def logits(q: Tensor, k: Keys, sem: LayerSemantics | float, logw: Tensor | None = None) -> Tensor:
    """Attention logits of every query head against its KV group's keys, as the model computes them.

    q: [..., Hq, t, d]; k: [..., Hkv, n, d] (or ``ScoredKeys`` standing for them); logw: [..., Hkv, n] added
    after the soft-cap (a kept token standing for exp(logw) tokens; -inf: a key the query must not see).
    Returns [..., Hq, t, n].
    """
    s = as_semantics(sem, q)
    hq, hkv = q.shape[-3], k.shape[-3]
    qg = group_queries(q * s.scaling, hkv)  # scale the small operand
    out = k.scores(qg) if isinstance(k, ScoredKeys) else torch.matmul(qg, k.transpose(-1, -2))
    out = s.cap(out)
    if logw is not None:
        out = out + logw.unsqueeze(-2).to(out.dtype)
    return ungroup(out, hq)


def softmax(x: Tensor, sem: LayerSemantics | float, dim: int = -1) -> Tensor:
    """Softmax of logits x [..., Hq, t, n] along keys, with the layer's sinks in the normaliser."""
    s = sem if isinstance(sem, LayerSemantics) else None
    if s is None or s.sinks is None:
        return torch.softmax(x, dim=dim)
    return torch.exp(x - log_normaliser(x, s, dim).unsqueeze(dim))


def log_normaliser(x: Tensor, sem: LayerSemantics | float, dim: int = -1) -> Tensor:
    """log(sum exp(x) + exp(sink)) over ``dim`` of x [..., Hq, t, n]: [..., Hq, t]."""
    lse = torch.logsumexp(x, dim=dim)
    s = sem if isinstance(sem, LayerSemantics) else None
    if s is None or s.sinks is None:
        return lse
    hq = x.shape[-3]
    sink = s.sinks.to(device=x.device, dtype=x.dtype).reshape(hq, 1)
    return torch.logaddexp(lse, sink.expand_as(lse))


def hidden(sem: LayerSemantics, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """True where a key is outside a query's window or chunk (not where it is in its future).

    q_pos: [t] or [Hkv, t]; k_pos: [n] or [Hkv, n] (token positions). Returns bool [.., t, n]."""
    qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    hide = torch.zeros(torch.broadcast_shapes(qp.shape, kp.shape), dtype=torch.bool, device=kp.device)
    if sem.window is not None:
        hide = hide | (kp <= qp - sem.window)
    if sem.chunk is not None:
        hide = hide | (
            torch.div(kp, sem.chunk, rounding_mode="floor") != torch.div(qp, sem.chunk, rounding_mode="floor")
        )
    return hide


def window_bias(sem: LayerSemantics, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
    """-inf where a key lies outside a query's window or chunk or in its future, else 0.

    q_pos: [t] or [Hkv, t]; k_pos: [n] or [Hkv, n] (token positions). Returns [.., t, n] float32, or
    None on a global layer when no key is in a query's future."""
    qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    hide = kp > qp
    if sem.is_local:
        hide = hide | hidden(sem, q_pos, k_pos)
    if not bool(hide.any()):
        return None
    return torch.zeros(hide.shape, dtype=torch.float32, device=hide.device).masked_fill_(hide, float("-inf"))


def mask_future(logits: Tensor, c: int) -> Tensor:
    """Causal mask for c queries that are the last c keys' tokens: logits [..., c, n]; query i gets
    -inf on the keys after its own (n - c + i). In place; returns ``logits``."""
    if c > 1:
        future = torch.ones(c, c, dtype=torch.bool, device=logits.device).triu(1)
        logits[..., logits.shape[-1] - c :].masked_fill_(future, float("-inf"))
    return logits


def attend(
    q: Tensor,
    k: Keys,
    v: Tensor,
    sem: LayerSemantics | float,
    logw: Tensor | None = None,
    return_probs: bool = False,
    bias: Tensor | None = None,
    causal_tail: int = 0,
):
    """The one softmax attention of kvlab: q [.., Hq, t, d] over k [.., Hkv, n, d] / v [.., Hkv, n, dv],
    in float32, as the layer computes it (scaling, soft-cap, sinks of ``sem``; a bare float: plain).

    logw [.., Hkv, n]: per-key log-weights (a kept token standing for exp(logw) tokens; -inf hides
    it); bias [.., t, n] or [.., Hkv, t, n]: added to every query head's logits (-inf hides a key:
    windows, causality); ``causal_tail`` = t: the t queries are the last t keys' tokens and query i
    does not see the keys after its own (a chunk of new tokens attending causally). Returns out
    [.., Hq, t, dv] in q's dtype (and probs [.., Hq, t, n] when ``return_probs``)."""
    hq, hkv = q.shape[-3], k.shape[-3]
    x = logits(q.float(), k.float(), sem, logw)
    if bias is not None:
        if bias.dim() >= 3 and bias.shape[-3] == hkv and hkv != hq:
            bias = bias.repeat_interleave(hq // hkv, dim=-3)
        x = x + bias
    probs = softmax(mask_future(x, causal_tail), sem)
    if bias is not None:  # a bias may hide every key of a query (only with sinks off): that query gets 0
        probs = torch.nan_to_num(probs, nan=0.0)
    out = ungroup(torch.matmul(group_queries(probs, hkv), v.float()), hq).to(q.dtype)
    return (out, probs) if return_probs else out


def grouped_softmax(x: Tensor, sem: LayerSemantics | float, hq: int, n_seen: int | None = None, t: int = 1) -> Tensor:
    """Attention probabilities from logits in grouped layout, as the layer computes them.

    x: [.., Hkv, g*t, n] scaled logits (exact or estimated: QJL's sketched scores, KIVI's dequantized
    keys), rows ordered (query head in group, query) as ``group_queries`` lays them out; the keys are
    the tokens at positions n_seen-n .. n_seen-1 in order, the t queries the last t of them (n_seen
    None: n). Applies the soft-cap, hides keys outside each query's window and adds the sinks to
    the normaliser. Returns [.., Hkv, g*t, n] float32 (a causal mask inside the chunk is the caller's)."""
    if not isinstance(sem, LayerSemantics) or sem.plain:
        return torch.softmax(x, dim=-1)
    hkv, rows, n = x.shape[-3:]
    g = hq // hkv
    x = sem.cap(x.float())
    if sem.is_local:
        last = (n if n_seen is None else n_seen) - 1
        kpos = torch.arange(last - n + 1, last + 1, device=x.device)
        qpos = torch.arange(last - t + 1, last + 1, device=x.device).repeat(g)  # [g*t]
        bias = window_bias(sem, qpos, kpos)
        if bias is not None:
            x = x + bias
    if sem.sinks is None:
        return torch.softmax(x, dim=-1)
    sink = sem.sinks.to(device=x.device, dtype=x.dtype).reshape(hkv, g, 1).repeat_interleave(t, dim=1)
    log_z = torch.logaddexp(torch.logsumexp(x, dim=-1, keepdim=True), sink)
    return torch.exp(x - log_z)


def with_sinks(log_z: Tensor, sem: LayerSemantics | float, hq: int) -> Tensor:
    """A normaliser log(sum exp) in grouped layout [Hkv, g*t] (or [.., Hkv, g*t, 1]) with the layer's
    sink logits added (``log(exp(log_z) + exp(sink))``); unchanged without sinks. For methods that
    estimate the normaliser (SubGen's tau)."""
    if not isinstance(sem, LayerSemantics) or sem.sinks is None:
        return log_z
    keep = log_z.dim() >= 3 and log_z.shape[-1] == 1
    z = log_z.squeeze(-1) if keep else log_z
    hkv, rows = z.shape[-2:]
    g = hq // hkv
    sink = sem.sinks.to(device=z.device, dtype=z.dtype).reshape(hkv, g, 1).repeat_interleave(rows // g, 1)
    out = torch.logaddexp(z, sink.reshape(hkv, rows))
    return out.unsqueeze(-1) if keep else out


def cap(x: Tensor, sem: LayerSemantics | float) -> Tensor:
    """Soft-capped logits (exact or estimated), unchanged when the layer has no cap."""
    return sem.cap(x) if isinstance(sem, LayerSemantics) else x


@dataclass(frozen=True)
class ModelSemantics:
    """One ``LayerSemantics`` per layer, as one forward of the model showed them."""

    layers: tuple[LayerSemantics, ...]

    def __getitem__(self, layer: int) -> LayerSemantics:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def plain(self) -> bool:
        return all(s.plain for s in self.layers)

    @property
    def has_local(self) -> bool:
        return any(s.is_local for s in self.layers)

    @property
    def nonlinear(self) -> bool:
        return any(s.nonlinear for s in self.layers)

    @property
    def smallest_window(self) -> int | None:
        """The smallest window or chunk of any layer (None: every layer is global)."""
        return min((s.span for s in self.layers if s.span is not None), default=None)

    @property
    def v_dim(self) -> int:
        return self.layers[0].v_dim

    def features(self) -> list[str]:
        """Short names of what differs from plain attention (for docs, refusals and the model card)."""
        out = []
        windows = [s.window for s in self.layers if s.window is not None]
        if windows:
            out.append(f"sliding window {min(windows)} on {len(windows)} of {len(self.layers)} layers")
        chunks = [s.chunk for s in self.layers if s.chunk is not None]
        if chunks:
            out.append(f"chunked attention ({min(chunks)}-token blocks) on {len(chunks)} of {len(self.layers)} layers")
        if any(s.softcap is not None for s in self.layers):
            out.append("logit soft-cap")
        if any(s.sinks is not None for s in self.layers):
            out.append("attention sinks")
        if self.layers and self.layers[0].v_dim != self.layers[0].k_dim:
            out.append(f"value head {self.layers[0].v_dim} != key head {self.layers[0].k_dim}")
        return out

    def to_json(self) -> dict:
        return {
            "windows": [s.window for s in self.layers],
            "chunks": [s.chunk for s in self.layers],
            "softcap": self.layers[0].softcap if self.layers else None,
            "sinks": any(s.sinks is not None for s in self.layers),
            "scaling": self.layers[0].scaling if self.layers else None,
            "k_dim": self.layers[0].k_dim if self.layers else None,
            "v_dim": self.layers[0].v_dim if self.layers else None,
        }


def plain_semantics(n_layers: int, head_dim: int, scaling: float | None = None) -> ModelSemantics:
    """Plain attention on every layer (scaling head_dim**-0.5 unless given)."""
    s = LayerSemantics(scaling=head_dim**-0.5 if scaling is None else scaling, k_dim=head_dim, v_dim=head_dim)
    return ModelSemantics(tuple([s] * n_layers))


def reference_attention(query: Tensor, key: Tensor, value: Tensor, sem: LayerSemantics) -> Tensor:
    """Causal attention as the layer computes it (the last t of m positions query): query [B, Hq, t, d],
    key/value [B, Hkv, m, d|dv] -> [B, t, Hq, dv] (the layout attention functions return)."""
    t, m = query.shape[-2], key.shape[-2]
    bias = window_bias(sem, torch.arange(m - t, m, device=query.device), torch.arange(m, device=query.device))
    out = torch.stack([attend(query[b], key[b], value[b], sem, bias=bias) for b in range(query.shape[0])])
    return out.transpose(1, 2).contiguous()


class Recorder:
    """An attention handler that records each layer's semantics (and head counts) while computing
    ``reference_attention``: one forward of the model tells kvlab what its attention is."""

    def __init__(self):
        self.layers: dict[int, LayerSemantics] = {}
        self.heads: tuple[int, int] | None = None  # (query heads, KV heads) the attention function sees
        self.first_keys: Tensor | None = None  # [Hkv, m, d]: the first layer's keys, as its attention sees them

    def __call__(self, module, query: Tensor, key: Tensor, value: Tensor, mask, sem: LayerSemantics, **kw):
        self.layers[module.layer_idx] = sem
        self.heads = (query.shape[1], key.shape[1])
        if module.layer_idx == 0:
            self.first_keys = key[0].detach().clone()
        return reference_attention(query, key, value, sem), None

    def semantics(self, n_layers: int) -> ModelSemantics:
        missing = [i for i in range(n_layers) if i not in self.layers]
        if missing:
            raise UnsupportedAttention(
                f"{len(missing)} of {n_layers} layers do not call transformers' attention interface, so kvlab "
                "cannot route their attention"
            )
        return ModelSemantics(tuple(self.layers[i] for i in range(n_layers)))


def from_call(module, query: Tensor, key: Tensor, value: Tensor, scaling: float, kw: dict, config) -> LayerSemantics:
    """One layer's semantics from the arguments of one attention call (``UnsupportedAttention`` if any is unknown)."""
    unknown = sorted(k for k, v in kw.items() if k not in HONOURED and k not in INERT and v is not None)
    if unknown:
        raise UnsupportedAttention(
            f"the model's attention passes {', '.join(unknown)}, which kvlab does not compute "
            f"(it computes {', '.join(HONOURED)})"
        )
    if kw.get("dropout"):
        raise UnsupportedAttention("the model applies attention dropout at inference")
    window = kw.get("sliding_window")
    if window is None:
        window = _config_window(config, module.layer_idx)
    chunk = _config_chunk(config, module.layer_idx)
    sinks = kw.get("s_aux")
    softcap = kw.get("softcap")
    return LayerSemantics(
        scaling=float(scaling),
        k_dim=key.shape[-1],
        v_dim=value.shape[-1],
        window=int(window) if window else None,
        chunk=chunk,
        softcap=float(softcap) if softcap else None,
        sinks=None if sinks is None else sinks.detach().float().reshape(-1),
    )


def _config_window(config, layer: int) -> int | None:
    """The window of ``layer`` when the model does not pass it: from config.layer_types, or, on a config
    without them, its ``sliding_window`` (PhiMoE applies it through the mask alone, on every layer; the
    load-time self-check, whose probe runs past that window, confirms it)."""
    types = getattr(config, "layer_types", None)
    if types:
        if layer < len(types) and types[layer] == "sliding_attention":
            return getattr(config, "sliding_window", None)
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


def _config_chunk(config, layer: int) -> int | None:
    """The block size of ``layer`` when config.layer_types makes it chunked attention (Llama 4): the model
    passes no argument for it, only a mask, which kvlab builds itself."""
    types = getattr(config, "layer_types", None)
    if types and layer < len(types) and types[layer] == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
        if not chunk:
            raise UnsupportedAttention("a chunked-attention layer without an attention_chunk_size")
        return int(chunk)
    return None


__all__ = [
    "HONOURED",
    "INERT",
    "LayerSemantics",
    "ModelSemantics",
    "Recorder",
    "UnsupportedAttention",
    "attend",
    "cap",
    "grouped_softmax",
    "hidden",
    "log_normaliser",
    "logits",
    "plain_semantics",
    "reference_attention",
    "softmax",
    "window_bias",
    "with_sinks",
]

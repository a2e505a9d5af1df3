"""The load-time self-check: kvlab's exact path must reproduce the model's own forward.

A short probe (longer than the model's smallest sliding window) is fed two ways: through
transformers' own forward (the model's attention implementation, teacher-forced logits at every
position), and through kvlab's exact path (the prefill, then one lockstep decode step per token
through the ``exact`` cache stored in float32). Their logits must agree within the floating-point
bound of the model's dtype; otherwise the model is refused before any comparison runs, with one
line that says where they part and what the model's attention uses. An architecture nobody tested
then cannot give silently wrong results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from kvlab.core.model import MODELS_DOC, LoadedModel, ModelLoadError
from kvlab.engine.prefill import prefill
from kvlab.engine.rows import feed_stepwise
from kvlab.methods import Compressor
from kvlab.methods.registry import get

DECODE_STEPS = 6  # probe tokens after the prefill: the last prompt logits, then 5 decode steps
PLAIN_PREFIX = 24  # probe prefill length when the model has no sliding window
# largest |logit difference| / (largest |logit|) allowed, by the model's compute dtype
BOUNDS = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 6e-2}


def probe_ids(lm: LoadedModel, n: int) -> list[int]:
    """``n`` token ids of plain English (repeated as needed), from the model's own tokenizer."""
    text = (
        "The river bends east past the old mill, where children fish in summer and the ice is thick in "
        "winter. Each year the town counts its bridges, its boats and the birds that return in spring. "
    )
    ids: list[int] = []
    while len(ids) < n:
        ids += [int(i) for i in lm.tokenizer(text)["input_ids"]]
    weight = cast(torch.Tensor, lm.model.get_input_embeddings().weight)  # torch types it Tensor | Module
    vocab = weight.shape[0]
    return [i % vocab for i in ids[:n]]


def probe_window(lm: LoadedModel) -> int | None:
    """The smallest sliding window or attention chunk the model's attention calls or its config name (None:
    none): the probe runs past it even when a window or chunk went unseen."""
    cfg = lm.model.config.get_text_config() if hasattr(lm.model.config, "get_text_config") else lm.model.config
    chunked = "chunked_attention" in (getattr(cfg, "layer_types", None) or ())
    chunk = getattr(cfg, "attention_chunk_size", None) if chunked else None
    windows = [w for w in (lm.info.semantics.smallest_window, getattr(cfg, "sliding_window", None), chunk) if w]
    return min(windows, default=None)


def probe_prefixes(lm: LoadedModel) -> list[int]:
    """The prefill length of each probe: past the smallest window or chunk (``PLAIN_PREFIX`` without one), and,
    where the model's RoPE switches factors at S tokens within its context (``ModelInfo.rope_switches``), one
    just past each switch (S + 1 tokens: every position with the new factors; a run that would cross S is
    refused before it starts, ``Engine.check_prompt``)."""
    window = probe_window(lm)
    out = [window + 8 if window else PLAIN_PREFIX]
    out += [s + 1 for s in lm.info.rope_switches if s + 1 + DECODE_STEPS <= lm.info.max_positions]
    return out


@torch.inference_mode()
def divergence(
    lm: LoadedModel, through: type[Compressor] | None = None, prefix: int | None = None
) -> tuple[list[float], int]:
    """The relative logit difference (largest |difference| / largest |logit|) at the prefill's last token,
    then after each decode step; and the prefill length (``prefix``; None: the first of ``probe_prefixes``).
    The decode steps run through ``through``'s cache (None: exact; another class puts that path on trial the
    same way, as a test of the check does)."""
    if prefix is None:
        prefix = probe_prefixes(lm)[0]
    ids = probe_ids(lm, prefix + DECODE_STEPS)
    dev = lm.device
    try:
        theirs = lm.model(input_ids=torch.tensor([ids], device=dev)).logits[0, prefix - 1 : -1].float()
    except Exception as exc:  # noqa: BLE001 - the model's own forward is the reference: without it, nothing to check
        raise ModelLoadError(
            f"kvlab cannot run {lm.info.id!r}: the model's own forward fails in transformers "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}), so kvlab's exact path has nothing to "
            f"be checked against; supported families are listed in {MODELS_DOC}"
        ) from exc
    lm32 = lm.with_cache_dtype("float32")
    state, last = prefill(lm32, ids[:prefix])
    exact = (through or get("exact"))(lm32.info)
    exact.plan(prefix)
    exact.compress(state)
    ours = [last]
    for i, t in enumerate(ids[prefix:-1]):
        ours.append(feed_stepwise(lm32, [exact], prefix + i, [t])[0])
    ours_t = torch.stack(ours).float()
    diff = (ours_t - theirs).abs().amax(-1) / theirs.abs().amax(-1).clamp_min(1e-6)
    return diff.tolist(), prefix


@dataclass(frozen=True)
class Verdict:
    """What a passed self-check measured: the largest relative logit difference over the probe and its bound."""

    largest: float  # largest |logit difference| / largest |logit|, over the prefill's last token and every step
    bound: float  # the largest allowed for the model's dtype (``BOUNDS``)
    dtype: str  # the model's compute dtype
    prefill_tokens: int
    decode_steps: int
    past_switches: tuple[int, ...] = ()  # prefill lengths of the probes past a RoPE switch (``probe_prefixes``)

    def summary(self) -> str:
        """One line, e.g. "self-check passed: kvlab's exact path equals the model's own forward (...)"."""
        past = "".join(f" and a {n}-token one past its RoPE switch" for n in self.past_switches)
        return (
            f"self-check passed: kvlab's exact path equals the model's own forward (largest |Δlogit| / "
            f"largest |logit| = {self.largest:.1e}, bound {self.bound:g} in {self.dtype}; a "
            f"{self.prefill_tokens}-token prefill{past}, then {self.decode_steps} decode steps)"
        )


def self_check(lm: LoadedModel, through: type[Compressor] | None = None) -> Verdict:
    """Raise ModelLoadError (one line) when kvlab's exact path does not reproduce the model's forward;
    else return what was measured (``Verdict``). ``through``: as in ``divergence``. Every probe of
    ``probe_prefixes`` runs: past the smallest window, and past each length where the model's RoPE switches."""
    bound = BOUNDS.get(lm.info.dtype, 6e-2)
    prefixes = probe_prefixes(lm)
    largest = 0.0
    for k, prefix in enumerate(prefixes):
        try:
            errs, _ = divergence(lm, through, prefix)
        except ModelLoadError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the exact path refuses the model in one line
            raise ModelLoadError(
                f"kvlab cannot run {lm.info.id!r}: its exact path fails on this model "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); supported families are listed in "
                f"{MODELS_DOC}"
            ) from exc
        first = next((i for i, e in enumerate(errs) if not e <= bound), None)
        if first is not None:
            err = errs[first]
            where = "in the prefill" if first == 0 else f"at decode step {first}"
            if k:
                where += f" of a {prefix}-token probe past its RoPE switch at {prefix - 1} tokens"
            features = ", ".join(lm.info.semantics.features()) or "plain softmax attention"
            raise ModelLoadError(
                f"kvlab cannot run {lm.info.id!r}: its exact attention differs from the model's own forward "
                f"{where} (logits differ by {err:.2g} of their range, bound {bound:g}; the model's attention: "
                f"{features}); supported families are listed in {MODELS_DOC}"
            )
        largest = max(largest, *errs)
    return Verdict(largest, bound, lm.info.dtype, prefixes[0], DECODE_STEPS - 1, tuple(prefixes[1:]))

"""The second embedded model, Gemma 3 270M (a base model with 15 sliding-window layers of 512 tokens and
3 global ones), where it adds to what the SmolLM2 tests show: loading from its packages, the raw-text
prompts of a model without a chat template, and the sliding-window path on real weights (exact ==
``generate`` past the window; every method within its budget). Prompts stay short: one ~700-token
prompt, a few new tokens."""

from __future__ import annotations

import functools
import hashlib

import pytest
import torch

from kvlab.cli import method_names
from kvlab.core.budgets import Budget
from kvlab.core.model import ModelLoadError
from kvlab.engine import embedded
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import load_model, spec_of, verdict_of
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure import health
from kvlab.methods import get
from kvlab.tasks.base import split_ids, turn_ids

WINDOW = 512
NEW = 6


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def past_window(gemma, long_text):
    """~700 prompt tokens of CPython's manual: past every sliding window of 512."""
    ids = gemma.encode(long_text[:3200])
    assert WINDOW + 100 < len(ids) < 900
    return ids


def test_gemma_loads_from_its_packages_and_passes_the_self_check(gemma):
    info = gemma.info
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim) == (18, 4, 1, 256)
    windows = [s.window for s in info.semantics.layers]
    assert windows == ([WINDOW] * 5 + [None]) * 3  # five local layers, then a global one
    assert spec_of(gemma) == "gemma3-270m" and info.id == embedded.GEMMA3.display
    verdict = verdict_of(gemma)
    assert verdict is not None and verdict.largest <= verdict.bound


def test_smollm2_answers_to_its_alias(lm):
    assert load_model("smollm2-135m") is lm and spec_of(lm) == "embedded"


def test_a_base_model_reads_raw_text_with_the_answer_prefix_after_a_blank_line(gemma):
    """No chat template: one BOS at the start, the answer prefix after a blank line, and the
    query-agnostic split gives back exactly the full prompt's ids."""
    assert not getattr(gemma.tokenizer, "chat_template", None)
    bos = gemma.tokenizer.bos_token_id
    ids = turn_ids(gemma, "Some text. What is it?", "Answer:")
    assert ids.count(bos) == 1 and ids[0] == bos
    assert gemma.tokenizer.decode(ids, skip_special_tokens=True) == "Some text. What is it?\n\nAnswer:"
    context, rests = split_ids(gemma, "Some text.", ["What is it?"], ["Answer:"])
    assert context + rests[0] == turn_ids(gemma, "Some text.\n\nWhat is it?", "Answer:")


def test_a_wrong_file_is_refused_by_its_sha256(tmp_path, monkeypatch):
    """A GGUF whose bytes are not the pinned ones is refused in one line, before it is converted."""
    fake = tmp_path / embedded.GEMMA3.gguf_file
    fake.write_bytes(b"not a model")

    class Package:
        @staticmethod
        def assemble(path, overwrite):
            return fake

    monkeypatch.setattr("importlib.import_module", lambda name: Package)
    with pytest.raises(ModelLoadError, match="sha256") as err:
        embedded.GEMMA3.gguf_path(tmp_path)
    assert "\n" not in str(err.value) and hashlib.sha256(b"not a model").hexdigest()[:12] in str(err.value)


def test_exact_equals_generate_past_the_sliding_window(gemma, past_window):
    """With float32 caches, exact through kvlab's sliding-window path gives ``generate``'s tokens on a
    prompt longer than the window, and its cache holds 512 tokens on the local layers."""
    engine = Engine(gemma.with_cache_dtype("float32"))
    res = engine.compare(past_window, [RunSpec("exact")], GenerationSettings(max_new_tokens=NEW))
    ref = gemma.model.generate(torch.tensor([past_window]), max_new_tokens=NEW, do_sample=False)
    assert res.runs[0].token_ids == ref[0, len(past_window) :].tolist()
    n, per_token = len(past_window), 2 * 256 * 4  # K and V, one KV head of 256, float32
    assert res.runs[0].kv_bytes_per_step[0] == (15 * WINDOW + 3 * n) * per_token


@functools.cache
def _budget_runs(methods: tuple[str, ...], ids: tuple[int, ...]) -> dict:
    engine = Engine(load_model("gemma3-270m"))
    specs = [RunSpec(m, Budget.parse(b)) for m in methods for b in ("0.25", "0.5", "0.99")]
    return {r.label: r for r in engine.compare(list(ids), specs, GenerationSettings(max_new_tokens=NEW)).runs}


def _holds(method: str, ids: list[int], methods: tuple[str, ...]) -> None:
    runs = _budget_runs(methods, tuple(ids))
    for b in ("0.25", "0.5"):
        r = runs[f"{method}@{b}"]
        assert not r.error and not r.health, f"{r.label}: {r.error or r.health}"
        limits = health.budget_limits(r, len(ids), get(method).streaming)
        peak = max(h / a for h, a in zip(r.kv_bytes_per_step, limits))
        roomy = runs[f"{method}@0.99"]
        saturated = max(roomy.kv_bytes_per_step) <= max(r.kv_bytes_per_step) * 1.001
        assert peak <= 1.05, f"{r.label}: holds {peak:.3f} of its budget"
        assert peak >= 0.85 or saturated, f"{r.label}: uses {peak:.3f} of its budget, and more at 0.99"


FEW = ("snapkv", "streaming", "kivi", "balancekv", "scissorhands")  # one of each kind, in the default run


@pytest.mark.parametrize("method", FEW)
def test_a_few_methods_hold_their_budget_on_the_real_windowed_model(method, past_window):
    _holds(method, past_window, FEW)


@pytest.mark.acceptance
@pytest.mark.parametrize("method", [m for m in method_names("all") if m != "exact"])
def test_every_method_holds_its_budget_on_gemma(method, past_window):
    _holds(method, past_window, tuple(m for m in method_names("all") if m != "exact"))

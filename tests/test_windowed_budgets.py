"""Every method on the matrix's windowed models (sliding windows, chunked attention, local and global
layers mixed) and on latent attention (DeepSeek-V2: value heads smaller than key heads) holds its budget
and uses it: at 0.25 and 0.5, peak bytes over the decode steps within [0.85, 1.05] of what the budget
allows (``health.budget_limits``), no health flag, no refusal of the budget (a method that cannot
compute the model's attention says so and is left out). A run below 0.85 passes only when the method
cannot hold more: its bytes at budget 0.99 are the same (a composition at fixed bits, say, that
already holds every token its layers can see).

The tiny random-weight models of ``tiny_models`` (32-token window or chunk), a 160-token prompt of
CPython's reference manual (168 on Llama 4: it ends 8 tokens into a chunk, so a chunked layer's queries
see far less than its exact cache's whole block; 520 on DeepSeek-V2), 6 decode steps; one comparison per
model, every method at 0.25, 0.5 and 0.99. Mistral and Llama 4 run in ``make test``; the other families
in ``make test-all``. ``GAPS`` lists what does not hold yet, each as a strict expected failure with its
reason.
"""

from __future__ import annotations

import functools

import pytest

from bench import tiny_models
from kvlab.cli import method_names
from kvlab.core.budgets import Budget
from kvlab.engine.comparison import Engine
from kvlab.engine.loader import from_model
from kvlab.engine.specs import GenerationSettings, RunSpec
from kvlab.measure import health
from kvlab.methods import get
from kvlab.methods.engine_flags import FLAGS

PROMPT, NEW, BUDGETS, ROOMY = 160, 6, ("0.25", "0.5"), "0.99"
# Llama 4: past a whole chunk by 8 tokens (160 ends with one). DeepSeek-V2: KIVI's residual moves its bytes a group
# of 32 tokens at a time, which 160 tokens at 0.25 leave 0.73 of the budget short (0.95 on 520)
PROMPTS = {"llama4": 168, "deepseek-v2": 520}
FAMILIES = ("mistral", "llama4", "gemma3", "gemma2", "olmo3", "gpt-oss", "phimoe", "deepseek-v2")
DEFAULT_RUN = ("mistral", "llama4")  # in ``make test``; the others in ``make test-all``
METHODS = [m for m in method_names("all") if m != "exact"]
# an engine's cache type stores a fixed format (vLLM's boundary layers in 16 bits, its codes at fixed bits): below
# that format's bytes it refuses the budget, naming the smallest it can honour
FIXED_FORMAT = {f.name for f in FLAGS} | {"vllm-turboquant"}
GAPS: dict[tuple[str, str], str] = {}  # (family, method) -> why it does not hold yet (strict xfail)


@functools.cache
def _runs(family: str, tokenizer, text: str) -> dict:
    loaded = from_model(tiny_models.build(family), tokenizer, family, check=False)
    sem = loaded.info.semantics
    assert sem.has_local or sem.v_dim != sem[0].k_dim, family
    ids = [int(i) for i in tokenizer(text)["input_ids"][: PROMPTS.get(family, PROMPT)]]
    specs = [RunSpec(m, Budget.parse(b)) for m in METHODS for b in (*BUDGETS, ROOMY)]
    result = Engine(loaded).compare(ids, specs, GenerationSettings(max_new_tokens=NEW))
    return {r.label: r for r in result.runs}


def _cases():
    for family in FAMILIES:
        for method in METHODS:
            marks = [] if family in DEFAULT_RUN else [pytest.mark.acceptance]
            if (family, method) in GAPS:
                marks.append(pytest.mark.xfail(reason=GAPS[family, method], strict=True))
            yield pytest.param(family, method, marks=marks, id=f"{family}-{method}")


@pytest.mark.parametrize(("family", "method"), list(_cases()))
def test_holds_and_uses_its_budget(family, method, lm, long_text):
    runs = _runs(family, lm.tokenizer, long_text)
    for b in BUDGETS:
        r = runs[f"{method}@{b}"]
        if r.error and "cannot run on a model" in r.error:  # refused for the attention, not the budget
            continue
        if r.error and method in FIXED_FORMAT and "the smallest budget it can honour here is" in r.error:
            smallest = float(r.error.rsplit(" ", 1)[-1])
            assert smallest > float(b) and not runs[f"{method}@{ROOMY}"].error, r.error
            continue
        assert not r.error and not r.health, f"{r.label}: {r.error or r.health}"
        limits = health.budget_limits(r, PROMPTS.get(family, PROMPT), get(method).streaming)
        peak = max(h / a for h, a in zip(r.kv_bytes_per_step, limits))
        roomy = runs[f"{method}@{ROOMY}"]
        saturated = not roomy.error and max(roomy.kv_bytes_per_step) <= max(r.kv_bytes_per_step) * 1.001
        assert peak <= 1.05, f"{r.label}: holds {peak:.3f} of its budget"
        assert peak >= 0.85 or saturated, f"{r.label}: uses {peak:.3f} of its budget, and more at {ROOMY}"


@pytest.mark.parametrize("method", ["kivi", "qjl"])
def test_quantizers_price_values_at_their_own_size(method, lm, long_text):
    """DeepSeek-V2's latent attention: keys of 48 numbers, values of 32. KIVI and QJL price a quantized value
    at the value head size, so they use their budget (pricing values as keys, they held 0.63-0.85 of it)."""
    loaded = from_model(tiny_models.build("deepseek-v2"), lm.tokenizer, "deepseek-v2", check=False)
    n = PROMPTS["deepseek-v2"]
    ids = [int(i) for i in lm.tokenizer(long_text)["input_ids"][:n]]
    runs = [RunSpec(method, Budget.parse(b)) for b in BUDGETS]
    for r in Engine(loaded).compare(ids, runs, GenerationSettings(max_new_tokens=NEW)).runs:
        assert not r.error and not r.health, f"{r.label}: {r.error or r.health}"
        peak = max(h / a for h, a in zip(r.kv_bytes_per_step, health.budget_limits(r, n, get(method).streaming)))
        assert 0.85 <= peak <= 1.05, f"{r.label}: holds {peak:.3f} of its budget"

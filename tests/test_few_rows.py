"""few_rows: F.linear for a few CPU rows computed as W @ x^T, on the embedded model's weights."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from kvlab.engine import few_rows
from kvlab.engine.few_rows import few_row_linears, linear_transposed, torch_functions_plain


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 8, 13])
def test_linear_transposed_equals_linear(lm, rows):
    layer = lm.model.model.layers[3]
    g = torch.Generator().manual_seed(rows)
    for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
        x = torch.randn(rows, 1, lin.in_features, generator=g)
        bias = torch.randn(lin.out_features, generator=g)
        got = linear_transposed(x, lin.weight, bias)
        assert got.shape == (rows, 1, lin.out_features) and got.is_contiguous()
        assert torch.allclose(got, F.linear(x, lin.weight, bias), atol=1e-5, rtol=1e-5)


def test_rerouted_only_for_few_cpu_rows():
    for rows, device in ((1, "cpu"), (few_rows.MAX_ROWS + 1, "cpu"), (5, "cuda"), (5, "meta")):
        assert isinstance(few_row_linears(rows, device), contextlib.nullcontext), (rows, device)
    assert not isinstance(few_row_linears(5, "cpu"), contextlib.nullcontext)


def test_mode_reroutes_linear_and_plain_blocks_it(lm, monkeypatch):
    calls = []
    real = few_rows.linear_transposed
    monkeypatch.setattr(few_rows, "linear_transposed", lambda *a: calls.append(a[0].shape) or real(*a))
    w = lm.model.model.layers[0].mlp.up_proj.weight
    x = torch.randn(5, 1, w.shape[1])
    with few_row_linears(5, "cpu"):
        F.linear(x, w)
        F.linear(x[:1], w)  # one row: MKL's own kernel is fine
        F.linear(torch.randn(few_rows.MAX_ROWS + 1, w.shape[1]), w)  # many rows: MKL's kernel
        with torch_functions_plain():  # kvlab's own code inside the forward is not rerouted
            F.linear(x, w)
    assert calls == [(5, 1, w.shape[1])]


def test_batched_forward_same_logits(lm):
    """The model's 5-row decode forward under the mode gives the plain forward's logits and argmax."""
    ids = torch.tensor([[lm.encode(t)[-1]] for t in ("Paris", "The cat", "Hello", "1 2 3", "def f():")])
    with torch.inference_mode():
        plain = lm.model(input_ids=ids, use_cache=False).logits[:, -1]
        with few_row_linears(len(ids), lm.device):
            rerouted = lm.model(input_ids=ids, use_cache=False).logits[:, -1]
    assert torch.allclose(plain, rerouted, atol=1e-3, rtol=1e-4), (plain - rerouted).abs().max()
    assert torch.equal(plain.argmax(-1), rerouted.argmax(-1))

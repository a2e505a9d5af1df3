"""FP8 against torch's own float8 cast: the stored bytes are torch.float8_e4m3fn of x / scale, scales
per head (from the prompt) or per token, saturation instead of NaN, one byte per number plus the
scales, refusal below what FP8 holds, and attention read from the codes."""

import pytest
import torch
from kv_samples import compressed, planned

from kvlab.core.budgets import BudgetRefused, exact_bytes
from kvlab.core.semantics import attend
from kvlab.methods.fp8 import FP8_MAX, to_fp8, token_scales


def test_codes_are_torchs_own_cast(lm, prefill_state):
    """Per-head scales: amax over the prompt / 448; the codes equal torch's cast of x / scale bit for bit."""
    comp, knobs = compressed(lm, prefill_state, "fp8", "0.5", residual=0)
    layer, st = 4, comp.layers[4]
    k = prefill_state.keys[layer].float()
    scale = k.abs().amax((-2, -1)) / 448.0
    torch.testing.assert_close(st.extra["key_scales"], scale)
    want = (k / scale[:, None, None]).to(torch.float8_e4m3fn)
    assert st.codes["keys"].dtype == torch.float8_e4m3fn
    assert torch.equal(st.codes["keys"].view(torch.uint8), want.view(torch.uint8))
    k_hat, v_hat = comp.dequantize(st)
    torch.testing.assert_close(k_hat, want.float() * scale[:, None, None])
    assert ((k_hat - k).abs() <= k.abs() / 16 + scale[:, None, None] * 2**-9).all()  # e4m3: 3 mantissa bits


def test_per_token_scales_and_saturation():
    x = torch.tensor([[[1.0, -2.0, 0.5], [1000.0, 3.0, -4.0]]])
    assert to_fp8(x * 1000, torch.tensor(1.0)).float().abs().max() == FP8_MAX  # saturates, no NaN
    s = token_scales(x)
    assert s.dtype == torch.float16 and s.shape == (1, 2)
    codes = to_fp8(x, s[..., None])
    torch.testing.assert_close(codes.float().abs().amax(-1), torch.full((1, 2), FP8_MAX), rtol=2e-3, atol=0)


def test_bytes_are_one_per_number_plus_scales(lm, prefill_state):
    n, info = prefill_state.n_tokens, lm.info
    comp, _ = compressed(lm, prefill_state, "fp8", "0.5", residual=0)
    by = comp.nbytes_by_kind()
    assert by["keys"] == by["values"] == info.n_layers * info.n_kv_heads * n * info.head_dim
    assert by["key_scales"] == info.n_layers * info.n_kv_heads * 4
    assert abs(comp.nbytes() / exact_bytes(info, n) - 0.5) < 1e-3
    tok, _ = compressed(lm, prefill_state, "fp8", "0.55", scales="token", residual=0)
    assert tok.nbytes_by_kind()["key_scales"] == info.n_layers * info.n_kv_heads * n * 2
    with pytest.raises(BudgetRefused) as exc:
        planned(lm, "fp8", "0.25", n)
    assert 0.45 < exc.value.smallest.fraction <= 0.5


@pytest.mark.parametrize("scales", ["head", "token"])
def test_attention_reads_the_codes(lm, prefill_state, scales):
    """attend over the codes equals exact attention over the dequantized keys and values; and is close to
    attention over the real ones."""
    state, info = prefill_state, lm.info
    comp, _ = compressed(lm, state, "fp8", "0.6", scales=scales, residual=0)
    for layer in (0, 17):
        q = state.queries[layer, :, -1:]
        k_hat, v_hat = comp.dequantize(comp.layers[layer])
        torch.testing.assert_close(
            comp.attend(layer, q), attend(q, k_hat, v_hat, info.semantics[layer]), atol=1e-5, rtol=1e-4
        )
        ref = attend(q.float(), state.keys[layer].half(), state.values[layer].half(), info.semantics[layer])
        assert ((comp.attend(layer, q) - ref).norm() / ref.norm()) < 0.2


def test_window_above_half_and_streaming(lm, prefill_state):
    """Above 0.5 the spare budget keeps recent tokens in 16 bits; decoding casts the window's oldest."""
    n = prefill_state.n_tokens
    comp, knobs = compressed(lm, prefill_state, "fp8", "0.75")
    assert knobs["residual"] > 0.4 * n
    st = comp.layers[0]
    coded = st.n_coded
    k, v = prefill_state.keys[0, :, -1:], prefill_state.values[0, :, -1:]
    comp.append(0, k, v, n)
    assert st.n_coded == coded + 1 and st.res_k.shape[1] == knobs["residual"]

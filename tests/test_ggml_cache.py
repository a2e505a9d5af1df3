"""llama.cpp's cache types: ggml's q8_0 / q5_0 / q4_0 blocks equal the ``gguf`` package's own quantizer and
dequantizer bit for bit on the model's real keys; the Hadamard rotation is llama.cpp's (block sizes, H H = I);
attention reads the blocks as llama.cpp's kernels do; the bytes held are the layout's."""

import numpy as np
import pytest
import torch
from kv_samples import compressed, planned

from kernels.ggml_blocks import TYPES, ggml_dequantize, ggml_quantize, round_away
from kernels.hadamard import block_rotate, fwht, hadamard
from kvlab.core import semantics as sm
from kvlab.core.budgets import BudgetRefused, exact_bytes
from kvlab.core.semantics import attend
from kvlab.methods.ggml_cache import key_rotation_block, round_query

gguf = pytest.importorskip("gguf")
GGUF_TYPES = {"q8_0": "Q8_0", "q5_0": "Q5_0", "q4_0": "Q4_0"}


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("rotated", [False, True])
def test_blocks_equal_gguf_bit_for_bit_on_real_keys(prefill_state, kind, rotated):
    """Real post-RoPE keys and values of five layers (and, rotated, as llama.cpp stores them): our bytes are
    gguf.quants.quantize's, our numbers gguf.quants.dequantize's, to the bit."""
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[kind])
    for x in (prefill_state.keys[::7], prefill_state.values[::7]):
        rows = x.float().reshape(-1, x.shape[-1])
        if rotated:
            rows = block_rotate(rows, key_rotation_block(rows.shape[-1]))
        ours = ggml_quantize(rows, kind)
        ref = gguf.quants.quantize(rows.numpy(), qtype)
        assert ours.shape == ref.shape == (rows.shape[0], rows.shape[1] // 32 * TYPES[kind].block_bytes)
        assert np.array_equal(ours.numpy(), ref)
        assert np.array_equal(ggml_dequantize(ours, kind).numpy(), gguf.quants.dequantize(ref, qtype))


def test_edge_blocks_equal_gguf():
    """A block of zeros, exact ties (x / d = k + 0.5), the largest magnitude negative and repeated."""
    x = torch.zeros(4, 64)
    x[1, :32] = torch.arange(32) * 0.5 - 8  # ties for q8_0 and halves for q4_0
    x[2, :32] = torch.tensor([3.0, -3.0] * 16)  # |max| tied: the first one (3.0) sets the sign
    x[3] = torch.linspace(-7, 2, 64)
    for kind, name in GGUF_TYPES.items():
        qtype = getattr(gguf.GGMLQuantizationType, name)
        assert np.array_equal(ggml_quantize(x, kind).numpy(), gguf.quants.quantize(x.numpy(), qtype)), kind
    assert round_away(torch.tensor([0.5, 1.5, -2.5, 0.49999997])).tolist() == [1.0, 2.0, -3.0, 0.0]


def test_hadamard_is_llamas_and_its_own_inverse():
    h = hadamard(64)
    assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(64), atol=1e-6)
    assert h[0, 0] == h[5, 0] == 1 / 8 and h[3, 5] == -h[3, 4]  # (-1)^popcount(i & j) / sqrt(n): 3 & 5 = 1
    x = torch.randn(7, 256)
    torch.testing.assert_close(fwht(x), x @ hadamard(256), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(block_rotate(block_rotate(x, 64), 64), x, atol=1e-5, rtol=1e-5)
    assert [key_rotation_block(d) for d in (64, 128, 192, 256, 320)] == [64, 128, 64, 256, 64]


@pytest.mark.parametrize("name", ["ggml-q4_0", "ggml-q4_0-rot", "ggml-q8_0-rot"])
def test_attention_is_llamas_reading_of_the_blocks(lm, prefill_state, name):
    """attend equals attention written plainly: (rotated) keys and values through gguf's own round trip, the
    query rotated and rounded to q8_0, the output rotated back."""
    comp, _ = compressed(lm, prefill_state, name, "0.6")
    rotate, kind = comp.cfg["rotate"], comp.k_type
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[kind])
    d = lm.info.head_dim
    for layer in (0, 21):
        sem = lm.info.semantics[layer]
        k, v = prefill_state.keys[layer].float(), prefill_state.values[layer].float()
        rk = block_rotate(k, key_rotation_block(d)) if rotate else k
        rv = block_rotate(v, 64) if rotate else v

        def trip(x):
            flat = x.reshape(-1, d).numpy()
            return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(flat, qtype), qtype)).reshape(x.shape)

        q = prefill_state.queries[layer, :, -1:].float()
        qs = q * sem.scaling
        qs = block_rotate(qs, key_rotation_block(d)) if rotate else qs
        qs = round_query(qs)
        logits = torch.matmul(qs.reshape(3, -1, d), trip(rk).transpose(-1, -2))  # [Hkv, g, n]
        p = torch.softmax(logits, -1)
        out = torch.matmul(p, trip(rv))
        want = (block_rotate(out, 64) if rotate else out).reshape(q.shape)
        torch.testing.assert_close(comp.attend(layer, q).float(), want, atol=2e-5, rtol=1e-4)
        exact = attend(q, prefill_state.keys[layer].half(), prefill_state.values[layer].half(), sem)
        assert (comp.attend(layer, q).float() - exact).norm() / exact.norm() < (0.05 if kind == "q8_0" else 0.35)


def test_bytes_are_the_layout_and_keys_and_values_take_their_own_type(lm, prefill_state):
    """(d / 32) x block bytes for the key type plus the value type, per token, layer and KV head; nothing else."""
    info, n = lm.info, prefill_state.n_tokens
    per_head = info.n_layers * info.n_kv_heads * n
    for name, k, v in (("ggml-q8_0", "q8_0", "q8_0"), ("ggml-q4_0-rot", "q4_0", "q4_0"), ("ggml-q5_0", "q5_0", "q5_0")):
        comp, knobs = compressed(lm, prefill_state, name, "0.6")
        assert (knobs["cache_type_k"], knobs["cache_type_v"]) == (k, v)
        by = comp.nbytes_by_kind()
        assert by["keys"] == per_head * TYPES[k].row_bytes(info.head_dim)
        assert by["values"] == per_head * TYPES[v].row_bytes(info.head_dim)
        assert comp.nbytes() == by["keys"] + by["values"] + by["residual_keys"] + by["residual_values"]
        assert by["residual_keys"] == 0  # llama.cpp keeps no window
    comp, knobs = compressed(lm, prefill_state, "ggml", "0.6", kbits=8, vbits=4)
    assert (knobs["cache_type_k"], knobs["cache_type_v"]) == ("q8_0", "q4_0")
    assert abs(comp.nbytes() / exact_bytes(info, n) - (34 + 18) / 128) < 1e-6
    with pytest.raises(BudgetRefused) as exc:
        planned(lm, "ggml-q8_0", "0.5", n)  # 8.5 bits a number: 0.53 of a 16-bit cache
    assert 0.5 < exc.value.smallest.fraction <= 0.54


def test_budget_picks_the_types_that_fill_it(lm, prefill_state):
    """Only a budget: the pair of types holding the most bytes that fit (auto split: q8_0 keys first)."""
    n = prefill_state.n_tokens
    _, knobs = planned(lm, "ggml", "0.45", n)  # q8_0 + q5_0 = 56 bytes of 128 a block: 0.4375
    assert (knobs["cache_type_k"], knobs["cache_type_v"]) == ("q8_0", "q5_0")
    _, knobs = planned(lm, "ggml", "0.45", n, split="values")
    assert (knobs["cache_type_k"], knobs["cache_type_v"]) == ("q5_0", "q8_0")
    _, knobs = planned(lm, "ggml", "0.45", n, split="equal")
    assert (knobs["cache_type_k"], knobs["cache_type_v"]) == ("q5_0", "q5_0")


def test_rotation_only_where_llama_cpp_rotates_and_ggml_blocks_divide_the_head():
    """As llama.cpp: a head size that is a multiple of 32 but not of 64 is stored unrotated by the rotating
    names too; one that is not a multiple of 32 is refused (ggml's blocks)."""
    from kvlab.core.budgets import Budget
    from kvlab.core.model import ModelInfo
    from kvlab.methods import get

    def made(name, d):
        m = get(name)(ModelInfo("synthetic", 2, 6, 2, d, "float32", "cpu", 4096), Budget.parse("0.5"), {})
        m.check_semantics()
        return m

    assert made("ggml-q4_0-rot", 128).rotating and not made("ggml-q4_0", 128).rotating
    assert not made("ggml-q4_0-rot", 96).rotating  # 96 = 3 x 32: llama.cpp does not rotate it
    assert made("ggml-q4_0-rot", 96).pick(64)["rotation"] == "none"
    with pytest.raises(sm.UnsupportedAttention, match="cannot run on a model with head size 48"):
        made("ggml-q4_0", 48)

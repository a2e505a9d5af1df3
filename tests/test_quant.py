"""Bit packing and group quantization (kernels/quant.py) on real random tensors."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import (
    cat_groups,
    dequantize_groups,
    group_error_bound,
    pack_codes,
    pack_signs,
    quantize_groups,
    unpack_codes,
    unpack_signs,
    weighted_token_sum,
)


def test_pack_signs_layout_is_lsb_first():
    x = torch.tensor([[1.0, -1, -1, -1, -1, -1, -1, -1, -2, 0, -3, -3, -3, -3, -3, 5]])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 2)
    # element 0 -> bit 0 of byte 0; element 9 (zero counts as >= 0) -> bit 1 of byte 1; element 15 -> bit 7.
    assert packed.tolist() == [[0b00000001, 0b10000010]]


def test_sign_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g)
    bits = pack_signs(x)
    assert bits.shape == (3, 5, 8)
    assert torch.equal(unpack_signs(bits, 64), torch.where(x >= 0, 1.0, -1.0))
    for dtype in (torch.bfloat16, torch.float16):  # 8 signs per 16-byte word: the same signs, cut at m
        got = unpack_signs(bits, 61, dtype)
        assert got.dtype == dtype and torch.equal(got.float(), torch.where(x >= 0, 1.0, -1.0)[..., :61])


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_code_round_trip_and_size(bits):
    g = torch.Generator().manual_seed(bits)
    n = 37
    codes = torch.randint(0, 1 << bits, (4, 6, n), generator=g)
    packed = pack_codes(codes, bits)
    assert packed.shape == (4, 6, -(-n * bits // 8))  # ceil(n bits / 8): 3-bit codes cost 3 bits
    assert torch.equal(unpack_codes(packed, bits, n), codes.to(torch.uint8))


def test_pack_codes_layout():
    assert pack_codes(torch.tensor([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack_codes(torch.tensor([5, 12]), 4).tolist() == [5 | 12 << 4]


def test_three_bit_codes_pack_eight_in_three_bytes():
    """8 codes in one 24-bit little-endian word; a row of 11 codes takes ceil(33 / 8) = 5 bytes."""
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0, 6, 5, 3])
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes[:8]))
    tail = sum(int(c) << (3 * i) for i, c in enumerate(codes[8:]))
    packed = pack_codes(codes, 3)
    assert packed.tolist() == [word & 255, word >> 8 & 255, word >> 16, tail & 255, tail >> 8]
    assert torch.equal(unpack_codes(packed, 3, 11), codes.to(torch.uint8))


@pytest.mark.parametrize("group", [32, 20, 7])
def test_three_bit_groups_cost_three_bits(group):
    """KIVI-3 and QJL's 3-bit values: the codes held cost 3 bits a number (plus the fp16 scale and minimum)."""
    x = torch.randn(2, 40, 64)
    q3, q4 = quantize_groups(x, 3, group, -1), quantize_groups(x, 4, group, -1)
    n_groups = -(-64 // group)
    assert q3.codes.shape[-1] == -(-group * 3 // 8) and q4.codes.shape[-1] == -(-group * 4 // 8)
    assert q3.nbytes() == 2 * 40 * n_groups * (-(-group * 3 // 8) + 4) < q4.nbytes()
    ref = torch.stack([unpack_codes(pack_codes(c, 3), 3, group) for c in unpack_codes(q3.codes, 3, group)])
    assert torch.equal(ref, unpack_codes(q3.codes, 3, group))
    assert (dequantize_groups(q3) - x).abs().le(group_error_bound(q3)).all()


@pytest.mark.parametrize("bits", [1, 3, 4])
def test_a_minimum_rounded_up_past_the_maximum_leaves_no_negative_scale(bits):
    """1.04542 rounds up to 1.0459 in float16: its one-value group keeps scale 0 and stays within the bound."""
    x = torch.ones(2, 8)
    x[:, 7] = 1.04542
    q = quantize_groups(x, bits, 7, -1)
    assert q.scale.float().ge(0).all() and q.scale[:, 1].float().eq(0).all()
    assert (dequantize_groups(q) - x).abs().le(group_error_bound(q)).all()


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dim,group", [(-1, 32), (1, 32), (-1, 16), (1, 7)])
def test_group_quantization_error_within_bound(bits, dim, group):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, 64, generator=g) * 3 + 0.5
    q = quantize_groups(x, bits, group, dim)
    y = dequantize_groups(q)
    assert y.shape == x.shape
    err = (x - y).abs()
    bound = group_error_bound(q)
    assert (err <= bound).all()
    # The bound is about half a step: range / (2^b - 1) / 2 of each group, so error shrinks with bits.
    span = x.amax().item() - x.amin().item()
    assert err.max().item() <= span / ((1 << bits) - 1) / 2 * 1.01 + 1e-3


@pytest.mark.parametrize("magnitude", [1e-4, 1e-3, 1e3])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_bound_holds_where_float16_scales_are_subnormal(bits, magnitude):
    """At 1e-3, 8-bit steps (about 2e-5) fall below float16's normal range (2^-14): the scale's rounding
    is absolute there (2^-25), and the bound says so; at 1e3 the float32 arithmetic's own rounding counts."""
    x = torch.randn(4, 40, 64, generator=torch.Generator().manual_seed(7)) * magnitude
    for group in (7, 20, 32):
        q = quantize_groups(x, bits, group, -1)
        assert (dequantize_groups(q) - x).abs().le(group_error_bound(q)).all()


def test_more_bits_less_error():
    x = torch.randn(2, 50, 64, generator=torch.Generator().manual_seed(2))
    errs = [(dequantize_groups(quantize_groups(x, b, 32)) - x).pow(2).mean().item() for b in (1, 2, 4, 8)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-4


def test_constant_group_is_exact():
    x = torch.full((2, 64), 0.75)
    assert torch.equal(dequantize_groups(quantize_groups(x, 2, 32)), x)


def test_layout_and_bytes():
    x = torch.randn(3, 40, 64)
    q = quantize_groups(x, 2, 32, dim=-1)  # per token: 2 groups of 32 along head_dim
    assert q.codes.shape == (3, 40, 2, 8) and q.scale.shape == (3, 40, 2)
    assert q.scale.dtype == torch.float16 and q.minimum.dtype == torch.float16
    assert q.nbytes() == 3 * 40 * (64 * 2 // 8 + 2 * 2 * 2)
    qk = quantize_groups(x, 2, 32, dim=1)  # per channel: groups of 32 tokens (40 -> 2 groups, padded)
    assert qk.codes.shape == (3, 64, 2, 8) and qk.scale.shape == (3, 64, 2)


def test_cat_groups_matches_quantizing_whole():
    x = torch.randn(3, 40, 64)
    parts = [quantize_groups(x[:, :15], 4, 32), quantize_groups(x[:, 15:], 4, 32)]
    joined = cat_groups(parts, dim=1)
    assert torch.equal(dequantize_groups(joined), dequantize_groups(quantize_groups(x, 4, 32)))
    with pytest.raises(ValueError):
        cat_groups([parts[0], quantize_groups(x[:, 15:], 2, 32)], dim=1)


def test_unsupported_bits_rejected():
    with pytest.raises(ValueError):
        pack_codes(torch.zeros(8), 5)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("d,group", [(64, 32), (50, 16), (64, 12)])
def test_weighted_token_sum_equals_weights_times_dequantized(bits, d, group):
    x = torch.randn(3, 70, d) * 2 + 0.5
    q = quantize_groups(x, bits, group, dim=-1)
    w = torch.softmax(torch.randn(3, 4, 70), -1)
    got = weighted_token_sum(w, q)
    assert got.shape == (3, 4, d)
    torch.testing.assert_close(got, w @ dequantize_groups(q), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        weighted_token_sum(w.transpose(-1, -2), quantize_groups(x, bits, group, dim=1))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_float_codes_read_by_pairs_equal_the_code_table(bits):
    """Codes read two bytes at a time (as one bfloat16 word for 2- and 4-bit codes) equal a byte-by-byte read."""
    from kernels.quant import _float_codes, code_table

    codes = torch.randint(0, 256, (3, 2, 50, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.functional.embedding(codes.int(), code_table(bits, "cpu").float()).reshape(3, 2, 50, -1)
    got = _float_codes(codes, bits)
    assert got.dtype == torch.float32 and torch.equal(got, ref)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dim,group", [(-1, 32), (1, 32), (1, 7)])
def test_dequantize_equals_min_plus_scale_times_unpacked_codes(bits, dim, group):
    """``dequantize_groups`` reads its codes as floats (by pairs where it can): the same numbers as
    minimum + scale * code from the byte-by-byte unpacking, in float32 and float16."""
    x = torch.randn(3, 37, 64, generator=torch.Generator().manual_seed(3)) * 2
    q = quantize_groups(x, bits, group, dim)
    for dtype in (torch.float32, torch.float16):
        codes = unpack_codes(q.codes, bits, group).to(dtype)
        ref = q.minimum.to(dtype).unsqueeze(-1) + q.scale.to(dtype).unsqueeze(-1) * codes
        ref = ref.reshape(*ref.shape[:-2], -1)[..., : q.length].movedim(-1, q.dim)
        got = dequantize_groups(q, dtype)
        assert got.dtype == dtype and torch.equal(got, ref)

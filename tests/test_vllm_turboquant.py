"""vLLM's TurboQuant presets: the codebook is Lloyd-Max for N(0, 1/d), the bytes are vLLM's slot sizes, the
keys are Hadamard-rotated Lloyd-Max codes (norm-corrected in the _nc presets) or e4m3, the values uniform per
token with vLLM's rounding, the boundary layers stay 16-bit, and attention reads all of it as written here."""

import math

import pytest
import torch
from kv_samples import compressed, planned

from kernels.hadamard import hadamard
from kvlab.core.budgets import Budget, exact_bytes
from kvlab.core.model import ModelInfo
from kvlab.core.semantics import attend
from kvlab.methods import get
from kvlab.methods.vllm_turboquant import gaussian_codebook, uniform_values

PRESETS = ["vllm-k8v4", "vllm-4bit-nc", "vllm-k3v4-nc", "vllm-3bit-nc"]
# vLLM's TurboQuantConfig.slot_size: key bytes + value bytes per token and head
SLOTS = {64: [64 + 36, 34 + 36, 26 + 36, 26 + 28], 256: [256 + 132, 130 + 132, 98 + 132, 98 + 100]}


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("dim", [64, 256])
def test_codebook_is_lloyd_max_for_the_gaussian(dim, bits):
    """Each centroid is its cell's conditional mean under N(0, 1/d) (closed form), the boundaries the
    midpoints; symmetric about 0."""
    c, b = gaussian_codebook(dim, bits)
    s = 1 / math.sqrt(dim)
    edges = [-math.inf, *b, math.inf]
    pdf = lambda x: 0.0 if math.isinf(x) else math.exp(-0.5 * (x / s) ** 2) / (s * math.sqrt(2 * math.pi))  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / (s * math.sqrt(2))))  # noqa: E731
    for i, ci in enumerate(c):
        lo, hi = edges[i], edges[i + 1]
        mean = s * s * (pdf(lo) - pdf(hi)) / (cdf(hi) - cdf(lo))
        assert abs(ci - mean) < 1e-6 * s
    assert len(c) == 2**bits and abs(c + c[::-1]).max() < 1e-9
    assert all(abs(bi - (c[i] + c[i + 1]) / 2) < 1e-12 for i, bi in enumerate(b))


@pytest.mark.parametrize("dim", [64, 256])
def test_bytes_are_vllms_slot_sizes(dim):
    info = ModelInfo("synthetic", 8, 8, 2, dim, "float32", "cpu", 4096)
    for name, slot in zip(PRESETS, SLOTS[dim]):
        comp = get(name)(info, Budget.parse("0.9"), {})
        comp.plan(100)
        assert comp.token_bytes() == slot, name
        assert sorted(comp.full_layers()) == [0, 1, 6, 7]  # vLLM's boundary layers: first 2 and last 2


def test_held_bytes_are_the_slots_plus_the_boundary_layers(lm, prefill_state):
    info, n = lm.info, prefill_state.n_tokens
    full = 2 * info.head_dim * 2  # a 16-bit key and value
    for name, slot in zip(PRESETS, SLOTS[64]):
        comp, knobs = compressed(lm, prefill_state, name, "0.6")
        assert knobs["skipped_layers"] == [0, 1, 28, 29] and knobs["slot_bytes"] == slot
        want = info.n_kv_heads * n * (26 * slot + 4 * full)
        assert comp.nbytes() == want, name
        assert comp.layers[0].n_coded == 0 and comp.layers[5].n_coded == n  # boundary layer 16-bit, the rest coded
    comp, _ = compressed(lm, prefill_state, "vllm-3bit-nc", "0.6", skip_layers=0)
    assert comp.nbytes() == info.n_layers * info.n_kv_heads * n * SLOTS[64][3]
    assert abs(comp.nbytes() / exact_bytes(info, n) - 54 / 256) < 1e-9


def test_values_are_uniform_per_token_with_vllms_rounding():
    v = torch.tensor([[0.0, 1.0, 2.5, 3.0, -1.5, 0.7, 2.25, -0.75]])
    codes, scale, lo = uniform_values(v, 3)
    s = (3.0 + 1.5) / 7
    assert lo.item() == -1.5 and scale.dtype == torch.float16 and abs(scale.item() - s) < 1e-3
    assert codes.tolist() == [[int((x + 1.5) / s + 0.5) for x in v[0].tolist()]]  # floor(x / s + 0.5)
    flat = torch.full((1, 8), 2.0)
    codes, scale, _ = uniform_values(flat, 4)
    assert codes.max() == 0 and scale.item() == 0.0  # the 1e-8 floor on the scale is below float16's smallest


@pytest.mark.parametrize("name", PRESETS)
def test_attention_is_vllms_reading_of_the_slot(lm, prefill_state, name):
    """attend equals attention written plainly from vLLM's algorithm: keys ||k|| (c / ||c||) H or e4m3, values
    code x fp16 scale + fp16 minimum; and stays near exact attention."""
    comp, knobs = compressed(lm, prefill_state, name, "0.6")
    d, h = lm.info.head_dim, hadamard(lm.info.head_dim)
    layer = 9
    k, v = prefill_state.keys[layer].float(), prefill_state.values[layer].float()
    if knobs["kbits"] == 8:
        k_hat = k.to(torch.float8_e4m3fn).float()
    else:
        c, b = (torch.tensor(x).float() for x in gaussian_codebook(d, knobs["kbits"]))
        norm = k.norm(dim=-1, keepdim=True)
        idx = torch.bucketize((k / (norm + 1e-8)) @ h, b, right=True)
        rows = c[idx]
        if knobs["norm_correction"]:
            rows = rows / rows.norm(dim=-1, keepdim=True)
        k_hat = (rows @ h) * norm.half().float()
    codes, scale, lo = uniform_values(v, knobs["vbits"])
    v_hat = codes.float() * scale.float().unsqueeze(-1) + lo.float().unsqueeze(-1)
    q = prefill_state.queries[layer, :, -1:]
    sem = lm.info.semantics[layer]
    torch.testing.assert_close(comp.attend(layer, q).float(), attend(q, k_hat, v_hat, sem), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(comp.decoded(layer, comp.layers[layer], "key"), k_hat, atol=1e-4, rtol=1e-4)
    exact = attend(q.float(), k.half(), v.half(), sem)
    assert (comp.attend(layer, q).float() - exact).norm() / exact.norm() < 0.3


def test_a_decoded_token_is_coded_before_it_is_attended(lm, prefill_state):
    comp, _ = compressed(lm, prefill_state, "vllm-k3v4-nc", "0.6")
    n = prefill_state.n_tokens
    k, v = prefill_state.keys[5, :, -1:], prefill_state.values[5, :, -1:]
    comp.append(5, k, v, n)
    comp.append(0, prefill_state.keys[0, :, -1:], prefill_state.values[0, :, -1:], n)
    assert comp.layers[5].n_coded == n + 1 and comp.layers[5].res_k.shape[1] == 0
    assert comp.layers[0].n_coded == 0 and comp.layers[0].res_k.shape[1] == n + 1  # a boundary layer


def test_budget_picks_key_and_value_bits(lm, prefill_state):
    n = prefill_state.n_tokens
    _, knobs = planned(lm, "vllm-turboquant", "0.36", n)  # 4-bit keys + 3-bit values: 62 of 256 bytes
    assert (knobs["kbits"], knobs["vbits"]) == (4, 3)
    _, knobs = planned(lm, "vllm-turboquant", "0.36", n, split="values")
    assert (knobs["kbits"], knobs["vbits"]) == (3, 4)
    _, knobs = planned(lm, "vllm-turboquant", "0.6", n)
    assert (knobs["kbits"], knobs["vbits"]) == (8, 4)

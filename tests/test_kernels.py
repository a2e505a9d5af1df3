"""The Triton kernels against their torch references, under Triton's interpreter on the CPU.

How the interpreter is set up (robustly): Triton decides when ``triton.language`` is first imported
whether its library functions are compiled or interpreted, and other tests in the same pytest run may
have imported triton already. So the kernel cases run in ONE child process started with
``TRITON_INTERPRET=1`` (``python tests/test_kernels.py --cases``, which prints JSON); each pytest
test below asserts on its case's numbers. Nothing in the pytest process sets the variable.
The references themselves are checked in-process against independent maths (exact attention,
the QJL estimator's unbiasedness).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab.core import semantics as sm
from kvlab.methods import budget_search

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# ----- the cases run by the interpreted child -------------------------------------------------
# (name, kwargs); shapes are small: the interpreter runs every program in Python.
QUANT_CASES = [
    ("quant_d64_m128", dict(hkv=2, n=77, d=64, m=128)),
    ("quant_d128_m256_out", dict(hkv=2, n=45, d=128, m=256, m_out=128, n_out=8)),
    ("quant_d64_m72_out", dict(hkv=1, n=33, d=64, m=72, m_out=64, n_out=4)),
]
SCORE_CASES = [
    (f"scores_g{g}_d{d}{'_out' if out else ''}", dict(g=g, d=d, n=n, outliers=out, t=t))
    for g, d, n, out, t in [
        (1, 64, 77, False, 1),
        (3, 64, 65, True, 1),
        (4, 128, 130, False, 1),
        (8, 128, 33, True, 1),
        (3, 64, 40, False, 2),
    ]
]
ATTN_CASES = [
    ("attn_dense_g1_d64", dict(g=1, d=64, n=77, kind="dense")),
    ("attn_dense_g3_d128_splits", dict(g=3, d=128, n=200, kind="dense", splits=3)),
    ("attn_logw_g4_d64", dict(g=4, d=64, n=131, kind="logw")),
    ("attn_index_g8_d64", dict(g=8, d=64, n=150, kind="index")),
    ("attn_qjl_2bit_g3_d64", dict(g=3, d=64, n=97, kind="qjl", bits=2)),
    ("attn_qjl_out_4bit_g4_d128", dict(g=4, d=128, n=90, kind="qjl_out", bits=4)),
    ("attn_qjl_3bit_g8_d128", dict(g=8, d=128, n=70, kind="qjl", bits=3, splits=2)),
    ("attn_qjl_1bit_g1_d64_t2", dict(g=1, d=64, n=66, kind="qjl", bits=1, t=2)),
    (
        "attn_qjl_2bit_group18_g3_d64",
        dict(g=3, d=64, n=50, kind="qjl", bits=2, value_group=18),
    ),  # groups not byte-aligned
    ("attn_qjl_8bit_g4_d64", dict(g=4, d=64, n=40, kind="qjl", bits=8)),
    ("attn_qjl_3bit_group20_g3_d64", dict(g=3, d=64, n=45, kind="qjl", bits=3, value_group=20)),  # codes span bytes
]

# TurboQuant: one instance (channels m, bits, keys prod or mse), the method's own encoding; Hkv = 2
TQ_CASES = [
    (
        f"tq_{'prod' if prod else 'mse'}_b{bits}_m{m}_g{g}" + (f"_t{t}" if t > 1 else ""),
        dict(m=m, bits=bits, prod=prod, g=g, n=n, t=t),
    )
    for m, bits, prod, g, n, t in [
        (64, 3, True, 3, 80, 1),  # 3-bit keys: 2-bit codes + QJL residual
        (64, 2, True, 3, 80, 1),  # 2-bit keys: 1-bit codes + QJL residual
        (32, 4, True, 3, 80, 1),  # 3.5 bits on d = 64: the outlier instance, 3-bit codes
        (48, 2, True, 4, 77, 1),  # 2.25 bits on d = 64: 48 channels (not a power of two)
        (36, 3, True, 8, 45, 1),  # 36 channels: the sign bits end mid-byte
        (64, 1, True, 1, 80, 2),  # 1-bit keys: QJL of the unit key alone, two query tokens
        (64, 3, False, 3, 80, 1),  # keys=mse and values: 3-bit codes
        (64, 2, False, 3, 200, 1),
        (32, 4, False, 4, 80, 1),
        (48, 1, False, 3, 131, 1),
        (128, 4, False, 1, 70, 1),
    ]
]
TQ_HADAMARD_CASES = [  # vLLM's presets: a Walsh-Hadamard Pi made in the kernel, norm correction
    (f"tq_hadamard_b{bits}_m{m}" + ("_nc" if nc else ""), dict(m=m, bits=bits, nc=nc, g=g, n=n))
    for m, bits, nc, g, n in [(64, 3, True, 3, 80), (64, 4, False, 3, 77), (256, 4, True, 4, 70), (128, 3, True, 1, 65)]
]
TQ_COMPRESSOR_BITS = (2.0, 3.0, 3.5)  # d = 64, Hkv = 2, g = 3: 3.5 splits 32 outlier channels off


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _sketch(m, d, seed):
    """One layer's QJL sketch [m, d] from ``seed``."""
    from kernels.qjl import make_sketch

    return make_sketch(1, m, d, torch.Generator().manual_seed(seed))[0]


def _case_quant(hkv, n, d, m, m_out=None, n_out=None):
    from kernels import qjl as K
    from kernels.quant import unpack_signs

    keys = _rand(hkv, n, d, seed=n) * 2
    s, so = _sketch(m, d, 1), (_sketch(m_out, d, 2) if m_out else None)
    idx = K.outlier_channels(keys, 32, n_out) if n_out else None
    ref = K.qjl_quantize_torch(keys, s, so, idx, 32)
    got = K._qjl_quantize_triton(keys, s, so, idx, 32)
    proj = keys @ s.T if idx is None else keys.masked_fill(K.outlier_mask(idx, d, 32, n), 0) @ s.T
    clear = proj.abs() > 1e-4  # signs of near-zero projections may differ by summation order
    agree = unpack_signs(got.bits, m) == unpack_signs(ref.bits, m)
    out = {
        "sign_agree_clear": agree[clear].float().mean().item(),
        "sign_agree_all": agree.float().mean().item(),
        "norm_err": (got.norms.float() - ref.norms.float()).abs().max().item(),
        "shapes_ok": got.bits.shape == ref.bits.shape and got.bits.dtype == torch.uint8,
    }
    if idx is not None:
        out["out_agree"] = (got.out_bits == ref.out_bits).float().mean().item()
        out["out_norm_err"] = (got.out_norms.float() - ref.out_norms.float()).abs().max().item()
    return out


def _qjl_keys(hkv, n, d, m, outliers, seed):
    from kernels import qjl as K

    keys = _rand(hkv, n, d, seed=seed)
    if not outliers:
        return keys, K.qjl_quantize_torch(keys, _sketch(m, d, seed))
    idx = K.outlier_channels(keys, 32, 4)
    return keys, K.qjl_quantize_torch(keys, _sketch(m, d, seed), _sketch(64, d, seed + 1), idx, 32)


def _case_scores(g, d, n, outliers, t, hkv=2):
    from kernels import qjl as K

    _, qk = _qjl_keys(hkv, n, d, 2 * d, outliers, seed=g * 100 + n)
    q = _rand(hkv * g, t, d, seed=7)
    ref, got = K.qjl_scores_torch(q, qk), K._qjl_scores_triton(q, qk)
    return {"rel_err": ((got - ref).abs().max() / ref.abs().max()).item(), "shape_ok": got.shape == ref.shape}


def _segments(kind, hkv, d, n, bits, seed, value_group=32):
    from kernels.formats import Segment
    from kernels.quant import quantize_groups

    keys, values = _rand(hkv, n, d, seed=seed), _rand(hkv, n, d, seed=seed + 1)
    if kind == "dense":
        return [Segment(keys=keys, values=values)]
    if kind == "logw":
        return [Segment(keys=keys, values=values, log_weights=torch.rand(hkv, n) * 3)]
    if kind == "index":
        idx = torch.stack(
            [torch.randperm(n, generator=torch.Generator().manual_seed(h))[: n // 2 + 1] for h in range(hkv)]
        )
        return [Segment(keys=keys, values=values, index=idx, log_weights=torch.rand(hkv, n))]
    _, qk = _qjl_keys(hkv, n, d, 2 * d, kind == "qjl_out", seed)
    recent = Segment(keys=_rand(hkv, 5, d, seed=seed + 2), values=_rand(hkv, 5, d, seed=seed + 3))
    return [Segment(qjl=qk, qvalues=quantize_groups(values, bits, value_group, -1)), recent]


def _case_attn(g, d, n, kind, bits=2, splits=None, t=1, hkv=2, value_group=32):
    from kernels import decode_attention as A

    segs = _segments(kind, hkv, d, n, bits, seed=n + g, value_group=value_group)
    q = _rand(hkv * g, t, d, seed=3) * 2
    ref = A.decode_attention_torch(q, segs, d**-0.5)
    got = A.decode_attention_triton(q, segs, d**-0.5, splits)
    return {"rel_err": ((got - ref).abs().max() / ref.abs().max()).item(), "shape_ok": got.shape == q.shape}


def _case_dispatch():
    """In the interpreted child, the switch sends CPU calls to Triton only when forced."""
    import kernels
    from kernels import qjl as K

    _, qk = _qjl_keys(1, 20, 64, 64, False, seed=5)
    q = _rand(2, 1, 64, seed=1)
    calls = []
    orig = K._qjl_scores_triton
    K._qjl_scores_triton = lambda *a: calls.append("triton") or orig(*a)
    try:
        with kernels.using("auto"):
            kernels.qjl_scores(q, qk)
        auto_calls = len(calls)
        with kernels.using("triton"):
            forced = kernels.qjl_scores(q, qk)
        with kernels.using("torch"):
            ref = kernels.qjl_scores(q, qk)
    finally:
        K._qjl_scores_triton = orig
    return {
        "auto_triton_calls": auto_calls,
        "forced_triton_calls": len(calls) - auto_calls,
        "err": (forced - ref).abs().max().item(),
    }


def _case_qjl_compressor():
    """The QJL compressor's decode attention with its scores forced through the kernel vs the torch path."""
    import kernels
    from kvlab.core.budgets import Budget
    from kvlab.core.model import ModelInfo
    from kvlab.methods.handover import PrefillState
    from kvlab.methods.qjl import QJL

    info = ModelInfo("synthetic", 2, 12, 3, 64, "float32", "cpu", 4096)  # GQA group 4
    state = PrefillState(_rand(2, 3, 160, 64, seed=1), _rand(2, 3, 160, 64, seed=2), _rand(2, 12, 4, 64, seed=3), 0.125)
    comp = QJL(info, Budget.parse("0.2"), {"products": "float32"}, seed=0)  # the kernel's arithmetic
    budget_search.planned(comp, 160)
    comp.compress(state)
    q = _rand(12, 1, 64, seed=4)
    with kernels.using("triton"):
        got = [comp.attend(layer, q) for layer in range(2)]
    with kernels.using("torch"):
        ref = [comp.attend(layer, q) for layer in range(2)]
    err = max((g - r).abs().max().item() for g, r in zip(got, ref))
    return {"err": err, "n_quantized": comp.layers[0].n_quantized}


def _case_dense_compressor():
    """A dense (eviction-family) compressor's attend forced through the fused kernel vs its torch path."""
    import kernels
    from kvlab.core.budgets import Budget
    from kvlab.core.model import ModelInfo
    from kvlab.methods.handover import PrefillState
    from kvlab.methods.registry import get

    info = ModelInfo("synthetic", 2, 9, 3, 64, "float32", "cpu", 4096)  # GQA group 3
    state = PrefillState(_rand(2, 3, 90, 64, seed=5), _rand(2, 3, 90, 64, seed=6), _rand(2, 9, 8, 64, seed=7), 0.125)
    comp = get("streaming")(info, Budget.parse("40t"), {}, seed=0)
    budget_search.planned(comp, 90)
    comp.compress(state)
    comp.append(0, _rand(3, 1, 64, seed=8), _rand(3, 1, 64, seed=9), 90)
    q = _rand(9, 1, 64, seed=10)
    with kernels.using("triton"):
        got = comp.attend(0, q)
    with kernels.using("torch"):
        ref = comp.attend(0, q)
    return {"err": (got - ref).abs().max().item(), "kept": comp.layers[0].n}


def _tq_instance(m, bits, prod, seed):
    """A TurboQuant instance of the method (one "layer": its rotation, sketch and codebook)."""
    import numpy as np

    from kernels.qjl import make_sketch
    from kvlab.methods.turboquant import Instance, beta_codebook

    g = torch.Generator().manual_seed(seed)
    rot = make_sketch(1, m, m, g, orthogonalize=True) / math.sqrt(m)
    sk = make_sketch(1, m, m, g, orthogonalize=False) if prod else None
    cb = bits - 1 if prod else bits
    c, b = beta_codebook(m, cb) if cb else (np.zeros(1), np.zeros(0))
    return Instance("key", m, bits, prod, rot, sk, torch.tensor(c).float(), torch.tensor(b).float())


def _case_tq(m, bits, prod, g, n, t, hkv=2):
    """One instance's logits (and, for mse, weighted values) through the kernels vs the references."""
    from kernels import turboquant as T

    inst = _tq_instance(m, bits, prod, seed=m + 10 * bits)
    x = _rand(1, hkv, n, m, seed=n) * (1 + torch.rand(1, hkv, n, 1, generator=torch.Generator().manual_seed(1)))
    codes = {k: v[0] for k, v in inst.encode(slice(0, 1), x).items()}
    part = inst.part(0, codes)
    qg = _rand(hkv, g * t, m, seed=7) * 2
    ref, got = T.turboquant_logits_torch(qg, part), T.turboquant_logits_triton(qg, part)
    out = {"rel_err": ((got - ref).abs().max() / ref.abs().max()).item(), "shape_ok": got.shape == ref.shape}
    if not prod:
        p = torch.softmax(_rand(hkv, g * t, n, seed=8) * 3, -1)
        ref_v = T.turboquant_values_torch(p, part)
        for splits in (None, 3):
            got_v = T.turboquant_values_triton(p, part, splits)
            err = ((got_v - ref_v).abs().max() / ref_v.abs().max()).item()
            out["values_rel_err"] = max(out.get("values_rel_err", 0.0), err)
        out["values_shape_ok"] = got_v.shape == (hkv, g * t, m)
    return out


def _tq_hadamard_codes(m, bits, nc, n, hkv=2, seed=3):
    """One layer of vLLM-style key codes: random indices of the Gaussian codebook, float16 norms, Hadamard Pi."""
    from kernels.formats import TurboQuantCodes
    from kernels.hadamard import hadamard
    from kernels.quant import pack_codes
    from kvlab.methods.vllm_turboquant import gaussian_codebook

    g = torch.Generator().manual_seed(seed)
    c, _ = gaussian_codebook(m, bits)
    idx = torch.randint(0, 1 << bits, (hkv, n, m), generator=g)
    norms = (torch.rand(hkv, n, generator=g) * 4 + 0.5).half()
    return TurboQuantCodes(
        norms, hadamard(m), torch.tensor(c).float(), bits, pack_codes(idx, bits), hadamard=True, norm_correction=nc
    )


def _case_tq_hadamard(m, bits, nc, g, n, hkv=2):
    """The logits kernel's Hadamard path (H q made in the kernel, norm correction) vs the torch reference."""
    from kernels import turboquant as T

    part = _tq_hadamard_codes(m, bits, nc, n, hkv)
    qg = _rand(hkv, g, m, seed=17) * 2
    ref, got = T.turboquant_logits_torch(qg, part), T.turboquant_logits_triton(qg, part)
    return {"rel_err": ((got - ref).abs().max() / ref.abs().max()).item(), "shape_ok": got.shape == ref.shape}


def _case_vllm_compressor():
    """vLLM's k3v4_nc preset attending through the Hadamard kernel vs the torch references; the kernel ran."""
    import kernels
    from kernels import turboquant as T
    from kvlab.core.budgets import Budget
    from kvlab.core.model import ModelInfo
    from kvlab.methods.handover import PrefillState
    from kvlab.methods.registry import get

    info = ModelInfo("synthetic", 2, 6, 2, 64, "float32", "cpu", 4096)
    state = PrefillState(_rand(2, 2, 80, 64, seed=21), _rand(2, 2, 80, 64, seed=22), _rand(2, 6, 4, 64, seed=23), 0.125)
    comp = get("vllm-k3v4-nc")(info, Budget.parse("0.5"), {"skip_layers": 0}, seed=0)
    budget_search.planned(comp, 80)
    comp.compress(state)
    calls = []
    orig = T.turboquant_logits_triton
    T.turboquant_logits_triton = lambda *a: calls.append("logits") or orig(*a)
    q = _rand(6, 1, 64, seed=24) * 2
    try:
        with kernels.using("triton"):
            got = [comp.attend(layer, q) for layer in range(2)]
        with kernels.using("torch"):
            ref = [comp.attend(layer, q) for layer in range(2)]
    finally:
        T.turboquant_logits_triton = orig
    err = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref))
    return {"rel_err": err, "calls": len(calls), "n_coded": comp.layers[1].n_coded}


def _case_tq_compressor(bits):
    """The TurboQuant compressor's decode attention (prefill codes, one streamed token, outliers at 3.5 bits)
    forced through the kernels vs the torch references; and that the kernels really ran."""
    import kernels
    from kernels import turboquant as T
    from kvlab.core.budgets import Budget
    from kvlab.core.model import ModelInfo
    from kvlab.methods.handover import PrefillState
    from kvlab.methods.registry import get

    info = ModelInfo("synthetic", 2, 6, 2, 64, "float32", "cpu", 4096)  # GQA group 3
    keys = _rand(2, 2, 80, 64, seed=11)
    keys[..., 5] *= 8  # loud channels, as real keys have (picked as outliers)
    state = PrefillState(keys, _rand(2, 2, 80, 64, seed=12), _rand(2, 6, 4, 64, seed=13), 0.125)
    comp = get("turboquant")(info, Budget.parse("0.5"), {"bits": bits, "residual": 4}, seed=0)
    budget_search.planned(comp, 80)
    comp.compress(state)
    comp.append(1, _rand(2, 1, 64, seed=14), _rand(2, 1, 64, seed=15), 80)  # a streamed token: coded too
    calls = []
    orig = T.turboquant_logits_triton, T.turboquant_values_triton
    T.turboquant_logits_triton = lambda *a: calls.append("logits") or orig[0](*a)
    T.turboquant_values_triton = lambda *a: calls.append("values") or orig[1](*a)
    q = _rand(6, 1, 64, seed=16) * 2
    try:
        with kernels.using("triton"):
            got = [comp.attend(layer, q) for layer in range(2)]
        with kernels.using("torch"):
            ref = [comp.attend(layer, q) for layer in range(2)]
    finally:
        T.turboquant_logits_triton, T.turboquant_values_triton = orig
    err = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref))
    return {"rel_err": err, "n_coded": comp.layers[1].n_coded, "calls": len(calls), "outliers": comp.k_split[1]}


def run_cases() -> dict:
    """Run every case (in a process with TRITON_INTERPRET=1); errors are reported, not raised."""
    torch.set_num_threads(1)
    results = {}
    jobs = [(n, _case_quant, kw) for n, kw in QUANT_CASES] + [(n, _case_scores, kw) for n, kw in SCORE_CASES]
    jobs += [(n, _case_attn, kw) for n, kw in ATTN_CASES] + [("dispatch", _case_dispatch, {})]
    jobs += [("qjl_compressor", _case_qjl_compressor, {}), ("dense_compressor", _case_dense_compressor, {})]
    jobs += [(n, _case_tq, kw) for n, kw in TQ_CASES]
    jobs += [(n, _case_tq_hadamard, kw) for n, kw in TQ_HADAMARD_CASES]
    jobs += [("vllm_compressor", _case_vllm_compressor, {})]
    jobs += [(f"tq_compressor_{b}", _case_tq_compressor, {"bits": b}) for b in TQ_COMPRESSOR_BITS]
    for name, fn, kw in jobs:
        try:
            results[name] = fn(**kw)
        except Exception as e:  # noqa: BLE001 - reported to the parent test
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    return results


# ----- pytest side ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "KVLAB_KERNELS": "auto"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--cases"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _result(interpreted, name):
    r = interpreted[name]
    assert "error" not in r, r.get("error")
    return r


@pytest.mark.parametrize("name", [c[0] for c in QUANT_CASES])
def test_qjl_quantize_kernel_matches_reference(interpreted, name):
    r = _result(interpreted, name)
    assert r["shapes_ok"]
    assert r["sign_agree_clear"] == 1.0
    assert r["sign_agree_all"] > 0.999
    assert r["norm_err"] < 2e-3
    if "out_agree" in r:
        assert r["out_agree"] > 0.999 and r["out_norm_err"] < 2e-3


@pytest.mark.parametrize("name", [c[0] for c in SCORE_CASES])
def test_qjl_scores_kernel_matches_reference(interpreted, name):
    r = _result(interpreted, name)
    assert r["shape_ok"]
    assert r["rel_err"] < 1e-5


@pytest.mark.parametrize("name", [c[0] for c in ATTN_CASES])
def test_decode_attention_kernel_matches_reference(interpreted, name):
    r = _result(interpreted, name)
    assert r["shape_ok"]
    assert r["rel_err"] < 1e-5


def test_dispatch_switch_in_interpreter(interpreted):
    r = _result(interpreted, "dispatch")
    assert r["auto_triton_calls"] == 0  # auto: CPU tensors go to the reference
    assert r["forced_triton_calls"] == 1  # forced: the kernel runs (interpreted)
    assert r["err"] < 1e-4


def test_qjl_compressor_scores_through_kernel(interpreted):
    r = _result(interpreted, "qjl_compressor")
    assert r["n_quantized"] > 0  # the quantized store (not only the window) was attended
    assert r["err"] < 1e-5


def test_dense_compressor_attends_through_kernel(interpreted):
    r = _result(interpreted, "dense_compressor")
    assert r["kept"] == 40
    assert r["err"] < 1e-5


@pytest.mark.parametrize("name", [c[0] for c in TQ_CASES])
def test_turboquant_kernels_match_reference(interpreted, name):
    r = _result(interpreted, name)
    assert r["shape_ok"]
    assert r["rel_err"] < 1e-5
    if "values_rel_err" in r:
        assert r["values_shape_ok"]
        assert r["values_rel_err"] < 1e-5


@pytest.mark.parametrize("name", [c[0] for c in TQ_HADAMARD_CASES])
def test_turboquant_hadamard_path_matches_reference(interpreted, name):
    r = _result(interpreted, name)
    assert r["shape_ok"]
    assert r["rel_err"] < 1e-5


def test_vllm_preset_attends_through_the_hadamard_kernel(interpreted):
    r = _result(interpreted, "vllm_compressor")
    assert r["n_coded"] == 80 and r["calls"] == 2  # the logits of both layers through the kernel
    assert r["rel_err"] < 1e-5


def test_hadamard_reference_is_the_dense_rotation_with_unit_centroid_rows():
    """The torch reference of the Hadamard path: (q H) . (c[idx] / ||c[idx]||) x ||k||, as a dense matmul."""
    from kernels.quant import unpack_codes
    from kernels.turboquant import turboquant_logits_torch

    part = _tq_hadamard_codes(64, 3, True, 40)
    qg = _rand(2, 3, 64, seed=5)
    rows = part.centroids[unpack_codes(part.codes, 3, 64).long()]
    rows = rows / rows.norm(dim=-1, keepdim=True)
    want = torch.matmul(qg @ part.rotation, rows.transpose(-1, -2)) * part.norms.float().unsqueeze(-2)
    torch.testing.assert_close(turboquant_logits_torch(qg, part), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", TQ_COMPRESSOR_BITS)
def test_turboquant_compressor_attends_through_kernels(interpreted, bits):
    r = _result(interpreted, f"tq_compressor_{bits}")
    assert r["n_coded"] == 77  # 80 - 4 + 1 streamed - the 4-token window: the codes were attended
    assert r["calls"] == 2 * (2 if r["outliers"] else 1) * 2  # logits + values per instance, 2 layers
    assert (r["outliers"] > 0) == (bits % 1 > 0)
    assert r["rel_err"] < 1e-5


# ----- in-process checks of the references and the switch (no Triton launch) ------------------
def test_backend_switch(monkeypatch):
    import kernels

    monkeypatch.setenv("KVLAB_KERNELS", "torch")
    assert kernels.backend() == "torch" and not kernels.use_triton(torch.device("cuda"))
    monkeypatch.setenv("KVLAB_KERNELS", "auto")
    assert not kernels.use_triton(torch.device("cpu"))
    assert kernels.use_triton(torch.device("cuda")) == kernels.HAVE_TRITON
    with kernels.using("torch"):
        assert kernels.backend() == "torch"
    assert kernels.backend() == "auto"
    monkeypatch.setenv("KVLAB_KERNELS", "fast")
    with pytest.raises(ValueError):
        kernels.backend()


def test_forced_triton_on_cpu_without_interpreter_says_why():
    import kernels
    from kernels import _runtime

    if not kernels.HAVE_TRITON or _runtime.interpreting():
        pytest.skip("needs triton imported without the interpreter")
    _, qk = _qjl_keys(1, 8, 64, 64, False, seed=1)
    with kernels.using("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.qjl_scores(_rand(1, 1, 64, seed=2), qk)


def test_packed_format_is_lsb_first_and_sketch_orthogonal():
    from kernels import qjl as K

    s = _sketch(128, 64, 0)
    gram = s[:64] @ s[:64].T
    assert torch.allclose(gram, 64 * torch.eye(64), atol=1e-3)  # rows orthogonal, scaled by sqrt(d)
    keys = torch.zeros(1, 1, 64)
    keys[0, 0, 0] = 1.0  # S k = first column of S
    qk = K.qjl_quantize_torch(keys, s)
    col = s[:, 0]
    assert int(qk.bits[0, 0, 0]) == sum(int(col[j] >= 0) << j for j in range(8))


def test_qjl_reference_estimate_is_unbiased():
    """Averaged over independent sketches the estimate approaches <q, k> (Lemma 3.2)."""
    from kernels import qjl as K

    d, trials = 64, 200
    keys, q = _rand(1, 4, d, seed=11), _rand(1, 1, d, seed=12)
    exact = (q @ keys.transpose(-1, -2))[0, 0]
    est = torch.stack(
        [K.qjl_scores_torch(q, K.qjl_quantize_torch(keys, _sketch(64, d, s)))[0, 0] for s in range(trials)]
    )
    # norms are float16; the spread of one estimate is ~ sqrt(pi/2 - 1) ||q|| ||k|| / sqrt(m)
    spread = math.sqrt(math.pi / 2 - 1) * q.norm() * keys[0].norm(dim=-1) / math.sqrt(64)
    assert ((est.mean(0) - exact).abs() < 4 * spread / math.sqrt(trials)).all()
    assert (est.std(0) > 0.3 * spread).all()  # and a single estimate really is noisy


def test_outlier_split_partitions_each_key():
    from kernels import qjl as K

    keys = _rand(2, 70, 64, seed=3)
    keys[:, :, 5] *= 20  # a loud channel must be picked as an outlier in every group
    idx = K.outlier_channels(keys, 32, 4)
    assert idx.shape == (2, 3, 4) and (idx == 5).any(-1).all()
    qk = K.qjl_quantize_torch(keys, _sketch(64, 64, 0), _sketch(32, 64, 1), idx, 32)
    total = qk.norms.float() ** 2 + qk.out_norms.float() ** 2
    assert torch.allclose(total, keys.norm(dim=-1) ** 2, rtol=2e-3)


@pytest.mark.parametrize("group,m,m_out,t", [(32, 72, 72, 1), (8, 144, 64, 5)])
def test_split_pair_equals_both_split_estimates(group, m, m_out, t):
    """The fused CPU path of the split estimate equals the masked references of both parts summed."""
    from kernels import qjl as K

    hkv, g, n, d = 3, 3, 4 * group, 64
    keys = _rand(hkv, n, d, seed=21)
    idx = K.outlier_channels(keys, group, 4)
    s, so = _sketch(m, d, 22), _sketch(m_out, d, 23)
    qk = K.qjl_quantize_torch(keys, s, so, idx, group)
    qg = _rand(hkv, g * t, d, seed=24)
    sq_in, sq_out = K.split_query_parts(qg, s, so, idx)
    torch.testing.assert_close(sq_in, K.split_sketch_queries(qg, s, idx, False), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sq_out, K.split_sketch_queries(qg, so, idx, True), rtol=1e-5, atol=1e-4)
    ref = K.qjl_estimate_split_grouped(qg, s, qk.bits, qk.norms, idx, group, False)
    ref = ref + K.qjl_estimate_split_grouped(qg, so, qk.out_bits, qk.out_norms, idx, group, True)
    got = K.qjl_estimate_split_pair(qg, s, qk.bits, qk.norms, so, qk.out_bits, qk.out_norms, idx, group)
    assert got.shape == (hkv, g * t, n)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_split_pair_bfloat16_products_error_is_far_below_the_estimators():
    """QJL's default CPU products (bfloat16 S q, exact ±1 signs) move the estimate by a small fraction of
    the estimator's own error against the exact scores <q, k>."""
    from kernels import qjl as K

    hkv, g, group, d, m = 3, 3, 32, 64, 128
    keys = _rand(hkv, 8 * group, d, seed=31)
    keys[:, :, 7] *= 10  # an outlier channel, as real keys have
    idx = K.outlier_channels(keys, group, 4)
    s, so = _sketch(m, d, 32), _sketch(m, d, 33)
    qk = K.qjl_quantize_torch(keys, s, so, idx, group)
    qg = _rand(hkv, g, d, seed=34)
    args = (qg, s, qk.bits, qk.norms, so, qk.out_bits, qk.out_norms, idx, group)
    f32 = K.qjl_estimate_split_pair(*args, torch.float32)
    bf16 = K.qjl_estimate_split_pair(*args, torch.bfloat16)
    exact = torch.matmul(qg, keys.transpose(-1, -2))  # [Hkv, R, n]
    rounding, estimator = (bf16 - f32).abs().mean(), (f32 - exact).abs().mean()
    assert 0 < rounding < 0.02 * estimator


def test_attention_reference_matches_exact_dense_attention():
    from kernels.decode_attention import decode_attention_torch
    from kernels.formats import Segment

    k, v, q = _rand(3, 50, 64, seed=1), _rand(3, 50, 64, seed=2), _rand(9, 1, 64, seed=3)
    lw = torch.rand(3, 50)
    want = sm.attend(q, k, v, 0.125, lw)
    parts = [
        Segment(keys=k[:, :20], values=v[:, :20], log_weights=lw[:, :20]),
        Segment(keys=k[:, 20:], values=v[:, 20:], log_weights=lw[:, 20:]),
    ]
    assert torch.allclose(decode_attention_torch(q, parts, 0.125), want, atol=1e-5)
    idx = torch.tensor([[3, 7, 9]] * 3)
    got = decode_attention_torch(q, [Segment(keys=k, values=v, index=idx)], 0.125)
    assert torch.allclose(got, sm.attend(q, k[:, [3, 7, 9]], v[:, [3, 7, 9]], 0.125), atol=1e-5)


def test_compressed_reference_tracks_exact_attention():
    """QJL keys (m = 4d) and 4-bit values stay close to exact attention; 1-bit sketches drift more."""
    from kernels import qjl as K
    from kernels.decode_attention import decode_attention_torch
    from kernels.formats import Segment
    from kernels.quant import quantize_groups

    d = 64
    k, v, q = _rand(2, 300, d, seed=4), _rand(2, 300, d, seed=5), _rand(6, 1, d, seed=6)
    exact = sm.attend(q, k, v, d**-0.5)

    def rel(m):
        seg = Segment(qjl=K.qjl_quantize_torch(k, _sketch(m, d, 0)), qvalues=quantize_groups(v, 4, 32, -1))
        return ((decode_attention_torch(q, [seg], d**-0.5) - exact).norm() / exact.norm()).item()

    assert rel(4 * d) < 0.5
    assert rel(4 * d) < rel(16)


def test_turboquant_references_are_the_methods_maths(lm, prefill_state):
    """On a real compressed layer (3.5 bits: an outlier instance beside the main one, for keys and values),
    the references over each instance's codes are exactly the method's own logits and values, and equal
    the query against the method's dequantized keys and the weights against its dequantized values."""
    from kernels.tensor_ops import group_queries
    from kernels.turboquant import turboquant_logits_torch, turboquant_values_torch
    from kvlab.core.budgets import Budget
    from kvlab.methods.registry import get

    comp = get("turboquant")(lm.info, Budget.parse("0.5"), {"bits": 3.5, "residual": 0}, seed=0)
    budget_search.planned(comp, prefill_state.n_tokens)
    comp.compress(prefill_state)
    layer = 3
    st, inst = comp.layers[layer], comp.instances
    hkv, d = st.res_k.shape[0], lm.info.head_dim
    assert st.n_coded == prefill_state.n_tokens and comp.k_split[1] == comp.v_split[1] == d // 2

    def channels(idx):  # the method's split, written out: the regular channels in order, then the outliers
        out = [sorted(set(h.tolist())) for h in idx]
        return torch.tensor([[c for c in range(d) if c not in set(o)] + o for o in out])

    q = prefill_state.queries[layer, :, -2:].float()  # two query tokens
    qg = group_queries(q * comp.sem[layer].scaling, hkv)
    kch = channels(st.extra["key_outlier_channels"]).unsqueeze(1).expand_as(qg)
    qs = torch.gather(qg, -1, kch)
    ref = turboquant_logits_torch(qs[..., : d // 2], inst["key"].part(layer, st.codes))
    ref = ref + turboquant_logits_torch(qs[..., d // 2 :], inst["outlier_key"].part(layer, st.codes))
    assert torch.equal(comp.code_logits(layer, qg, st), ref)
    k_hat, v_hat = comp.dequantize(layer, st)
    torch.testing.assert_close(ref, qg @ k_hat.transpose(-1, -2), atol=2e-3, rtol=1e-3)

    p = torch.softmax(ref, -1)
    parts = torch.cat(
        [
            turboquant_values_torch(p, inst["value"].part(layer, st.codes)),
            turboquant_values_torch(p, inst["outlier_value"].part(layer, st.codes)),
        ],
        -1,
    )
    vch = channels(st.extra["value_outlier_channels"]).unsqueeze(1).expand_as(parts)
    vref = torch.empty_like(parts).scatter_(-1, vch, parts)
    assert torch.equal(comp.code_values(layer, p, st), vref)
    torch.testing.assert_close(vref, p @ v_hat, atol=1e-5, rtol=1e-4)


def test_merge_partials_equals_one_softmax():
    from kernels.decode_attention import merge_partials

    logits, v = _rand(2, 3, 40, seed=1), _rand(2, 40, 16, seed=2)
    want = torch.softmax(logits, -1) @ v

    def part(sl):
        lg = logits[..., sl]
        m = lg.amax(-1)
        p = torch.exp(lg - m.unsqueeze(-1))
        return m.unsqueeze(1), p.sum(-1).unsqueeze(1), (p @ v[:, sl]).unsqueeze(1)

    got = merge_partials([part(slice(0, 13)), part(slice(13, 40))])
    assert torch.allclose(got, want, atol=1e-5)


if __name__ == "__main__" and "--cases" in sys.argv:
    print(json.dumps(run_cases()))


def test_kernels_import_nothing_from_kvlab():
    """The kernels package (formats, references, Triton kernels) stands alone: no ``kvlab`` module is loaded."""
    code = (
        "import kernels, kernels.qjl, kernels.decode_attention, kernels.formats, kernels.turboquant, sys; "
        "assert not any(m == 'kvlab' or m.startswith('kvlab.') for m in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_one_qjl_sketch_implementation():
    """The compressor and the kernels share the sketch and the outlier helpers."""
    import kernels.qjl
    import kvlab.methods.qjl

    for name in ("make_sketch", "outlier_channels", "outlier_mask"):
        assert getattr(kvlab.methods.qjl, name) is getattr(kernels.qjl, name)

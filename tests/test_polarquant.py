"""PolarQuant against its own maths: the polar transform and its inverse, the angle codebooks'
Lloyd conditions for Lemma 2's densities (checked by sampling Gaussian vectors), no scale or zero point
held, 3.875 bits per number, and the distortion at that rate: real keys after the rotation reach the
distortion the codebooks predict for Gaussian vectors (the paper's premise), without it they do worse."""

import math

import numpy as np
import torch
from kv_samples import compressed

from kvlab.core.budgets import exact_bytes
from kvlab.methods.polarquant import angle_codebook, angle_density, polar, unpolar


def _gauss(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_polar_transform_round_trips():
    x = _gauss(100, 64, 0)
    angles, radii = polar(x, 4)
    assert [a.shape[-1] for a in angles] == [32, 16, 8, 4] and radii.shape[-1] == 4
    assert (angles[0] >= 0).all() and (angles[0] < 2 * math.pi).all()
    assert all(((a >= 0) & (a <= math.pi / 2)).all() for a in angles[1:])
    torch.testing.assert_close(radii, x.reshape(100, 4, 16).norm(dim=-1).float())
    torch.testing.assert_close(unpolar(angles, radii), x.float(), atol=1e-5, rtol=1e-5)


def test_angle_codebooks_meet_the_lloyd_conditions():
    """Per level: boundaries at midpoints, each centroid the mean of the sampled angles of its cell
    (Gaussian vectors' polar angles follow Lemma 2's densities), and the densities integrate to 1."""
    angles, _ = polar(_gauss(60_000, 16, 1), 4)
    for level, bits in enumerate((4, 2, 2, 2), 1):
        c, b = angle_codebook(level, bits)
        np.testing.assert_allclose(b, (c[1:] + c[:-1]) / 2, atol=1e-15)
        grid = np.linspace(0, 2 * np.pi if level == 1 else np.pi / 2, 100_001)
        assert abs(np.trapezoid(angle_density(level, grid), grid) - 1) < 1e-6
        a = angles[level - 1].double().flatten().numpy()
        cell = np.searchsorted(b, a)
        for i in range(len(c)):
            part = a[cell == i]
            assert abs(part.mean() - c[i]) < 5 * part.std() / math.sqrt(len(part)) + 1e-4, (level, i)


def _rel_mse(comp, x: torch.Tensor) -> float:
    """||x - x_hat||^2 / ||x||^2 of x [Hkv, n, d] coded as keys by ``comp``'s instance of PolarQuant."""
    codes = {k: t[0] for k, t in comp.encode(slice(0, 1), x[None], x[None], [{}]).items()}
    y = comp.rotated("key", codes)
    x_hat = y @ comp.state[f"rotation_{x.shape[-1]}"].T
    return float(((x_hat - x.float()) ** 2).sum() / (x.float() ** 2).sum())


def test_no_per_block_constants_and_the_bit_rate(lm, prefill_state):
    """What a coded token holds: packed angle codes and one float16 radius per 16 numbers, nothing else
    (no scale, no zero point); 31 bytes per 64 numbers = 3.875 bits."""
    n, info = prefill_state.n_tokens, lm.info
    comp, knobs = compressed(lm, prefill_state, "polarquant", "0.25", residual=0)
    assert knobs["bits_per_number"] == 3.875
    by = comp.nbytes_by_kind()
    assert set(by) == {
        "key_radii",
        "key_angles_4bit",
        "key_angles_2bit",
        "value_radii",
        "value_angles_4bit",
        "value_angles_2bit",
        "residual_keys",
        "residual_values",
    }
    coded = info.n_layers * info.n_kv_heads * n
    assert by["key_radii"] == coded * (info.head_dim // 16) * 2
    assert by["key_angles_4bit"] + by["key_angles_2bit"] + by["key_radii"] == coded * info.head_dim * 3.875 / 8
    assert comp.nbytes() / exact_bytes(info, n) == 3.875 / 16
    assert {k for k, _ in comp.shared_tensors()} == {"rotation", "centroids", "boundaries"}


def test_distortion_at_the_paper_rate(lm, prefill_state):
    """Gaussian vectors (the preconditioned case of the analysis) and the model's real keys after the
    rotation reach the same relative error at 3.875 bits; the real keys without the rotation do worse
    (outlier channels break the angles' assumed densities)."""
    comp, _ = compressed(lm, prefill_state, "polarquant", "0.25", residual=0)
    plain, _ = compressed(lm, prefill_state, "polarquant", "0.25", residual=0, precondition=False)
    gauss = _rel_mse(comp, _gauss(3 * 400, 64, 2).float().reshape(3, 400, 64))
    keys = prefill_state.keys[10].float()
    rotated, unrotated = _rel_mse(comp, keys), _rel_mse(plain, keys)
    assert 0.01 < gauss < 0.05, gauss
    assert abs(rotated - gauss) < 0.25 * gauss, (rotated, gauss)
    assert unrotated > 1.2 * rotated, (unrotated, rotated)


def test_prefill_only_generated_tokens_stay_16_bit(lm, prefill_state):
    n = prefill_state.n_tokens
    comp, _ = compressed(lm, prefill_state, "polarquant", "0.3")
    st = comp.layers[2]
    coded, window = st.n_coded, st.res_k.shape[1]
    comp.append(2, prefill_state.keys[2, :, -1:], prefill_state.values[2, :, -1:], n)
    assert st.n_coded == coded and st.res_k.shape[1] == window + 1


def test_keys_and_values_take_their_own_level_bits(lm, prefill_state):
    """``key_level_bits`` / ``value_level_bits``: each side coded (and counted) at its own levels' bits."""
    from kv_samples import compressed

    info, n = lm.info, prefill_state.n_tokens
    comp, knobs = compressed(lm, prefill_state, "polarquant", "0.6", key_level_bits="4,4,2,2", residual=0)
    assert (knobs["key_level_bits"], knobs["value_level_bits"]) == ("4,4,2,2", "4,2,2,2")
    key = 32 * 4 // 8 + 16 * 4 // 8 + (8 + 4) * 2 // 8 + 2 * 4  # 4-bit level 1 and 2, 2-bit 3 and 4, fp16 radii
    value = 32 * 4 // 8 + (16 + 8 + 4) * 2 // 8 + 2 * 4
    assert comp.nbytes() == info.n_layers * info.n_kv_heads * n * (key + value)
    st = comp.layers[3]
    k_err = (comp.decoded(3, st, "key") - prefill_state.keys[3].float()).norm()
    even, _ = compressed(lm, prefill_state, "polarquant", "0.6", residual=0)
    assert k_err < (even.decoded(3, even.layers[3], "key") - prefill_state.keys[3].float()).norm()  # finer keys

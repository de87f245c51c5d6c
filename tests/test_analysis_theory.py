"""Closed forms of replayssm_quant.analysis.theory against independent float64 references (appendix C.6).

References: explicit float64 loops and double sums for the moment recursions, ml_dtypes value
tables for the element grids, the project's quantizer (a separate implementation) for scaled
grids, and Monte Carlo with the real quantizer for the SR moments.
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from replayssm_quant.analysis import theory
from replayssm_quant import quantize

ALL_FORMATS = ("bf16", "fp16", "fp8e4m3", "fp8e5m2", "nvfp4", "mxfp8", "mxfp4")


def _moments_loop(a, T, b, s2, L, point):
    """Reference: step e_t = a e_{t-1} (+ r at flushes), recording before/after the flush."""
    m = v = 0.0
    means, vars_ = [0.0], [0.0]  # t = 0
    for t in range(1, T + 1):
        m, v = a * m, a * a * v
        read_m, read_v = m, v
        if t % L == 0:
            m, v = m + b, v + s2
        if point == "state":
            means.append(m), vars_.append(v)
        else:
            means.append(read_m), vars_.append(read_v)
    return np.array(means), np.array(vars_)


@pytest.mark.parametrize("point", ["state", "read"])
@pytest.mark.parametrize("L", [1, 4, 16])
@pytest.mark.parametrize("a", [0.0, 0.5, 0.9, 0.99, 0.999, 1.0])
def test_closed_forms_match_float64_recursion(a, L, point):
    T, b, s2 = 300, 0.3, 2.0
    ref_m, ref_v = _moments_loop(a, T, b, s2, L, point)
    t = np.arange(T + 1)
    np.testing.assert_allclose(theory.error_mean(a, t, b, L, point), ref_m, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(theory.error_variance(a, t, s2, L, point), ref_v, rtol=1e-9, atol=1e-12)


def test_eq_c61_c62_literal_form():
    a, t, b, s2 = 0.97, np.arange(1, 50), 0.1, 0.5
    np.testing.assert_allclose(theory.error_mean(a, t, b), b * (1 - a**t) / (1 - a), rtol=1e-12)
    np.testing.assert_allclose(
        theory.error_variance(a, t, s2), s2 * (1 - a ** (2 * t)) / (1 - a**2), rtol=1e-12
    )


@pytest.mark.parametrize("L", [1, 16])
def test_limits_and_blow_up_near_one(L):
    for a in (0.9, 0.999):
        big = theory.error_variance(a, 10**7 * L, 1.0, L)
        assert big == pytest.approx(float(theory.stationary_variance(a, 1.0, L)), rel=1e-9)
        assert float(theory.stationary_mean(a, 1.0, L)) == pytest.approx(1 / (1 - a**L), rel=1e-9)
    # near a -> 1: sigma2 / (2 L (1 - a)), computed without cancellation
    a = 1 - 1e-9
    assert float(theory.stationary_variance(a, 1.0, L)) == pytest.approx(1 / (2 * L * 1e-9), rel=1e-6)
    assert math.isinf(float(theory.stationary_variance(1.0, 1.0, L)))
    assert float(theory.stationary_variance(1.0, 0.0, L)) == 0.0
    # a = 1: random walk, variance grows like the number of roundings
    assert float(theory.error_variance(1.0, 64, 1.0, L)) == pytest.approx(64 // L)


def test_time_varying_sums_match_double_sum():
    rng = np.random.default_rng(0)
    T = 60
    a = rng.uniform(0.8, 1.0, size=(3, T))
    b = rng.normal(size=(3, T))
    s2 = rng.uniform(0, 1, size=(3, T))
    rounds = rng.random((3, T)) < 0.5
    mean, var = theory.time_varying_moments(a, b, s2, rounds)
    for i in range(3):
        for t in range(T):
            gam = [np.prod(a[i, j + 1 : t + 1]) for j in range(t + 1)]  # gamma_{j+1:t}
            bm = np.where(rounds[i, : t + 1], b[i, : t + 1], 0)
            sm = np.where(rounds[i, : t + 1], s2[i, : t + 1], 0)
            assert mean[i, t] == pytest.approx(np.dot(gam, bm), rel=1e-10, abs=1e-12)
            assert var[i, t] == pytest.approx(np.dot(np.square(gam), sm), rel=1e-10, abs=1e-12)


def test_separate_prediction_is_one_rounding():
    mean, var = theory.separate_read_moments(np.array([0.9, 0.999]), 0, 0.0, 2.5)
    np.testing.assert_allclose(var, [2.5, 2.5])  # independent of a (and N: no t argument)
    _, var_h = theory.separate_read_moments(0.9, 3, 0.0, 2.5, anchor_var=1.0)
    assert float(var_h) == pytest.approx(0.9**6 * 3.5)


def test_gdn_effective_decay_against_monte_carlo():
    rng = np.random.default_rng(1)
    dk, beta, alpha, n = 16, 0.7, 0.95, 200_000
    e = rng.normal(size=(n, 4, dk))
    k = rng.normal(size=(n, dk))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    ek = np.einsum("nmk,nk->nm", e, k)
    e2 = alpha * (e - beta * ek[:, :, None] * k[:, None, :])
    a_mean, a_rms = theory.gdn_effective_decay(alpha, beta, dk)
    assert np.mean(e2**2) / np.mean(e**2) == pytest.approx(float(a_rms) ** 2, rel=5e-3)
    # mean factor: E[e (I - beta k k^T)] = (1 - beta/dk) e for fixed e
    e0 = np.ones((4, dk))
    m = alpha * (e0 - beta * np.einsum("mk,nk->nm", e0, k)[:, :, None] * k[:, None, :]).mean(0)
    np.testing.assert_allclose(m, float(a_mean) * e0, rtol=1e-2)


def test_mean_square_stability_threshold_against_iteration():
    for a, L in ((0.99, 1), (0.999, 16)):
        rc = float(theory.rho_critical(a, L))
        assert rc == pytest.approx(a ** (-2 * L) - 1, rel=1e-12)
        for rho, stable in ((0.8 * rc, True), (1.2 * rc, False)):
            m = 0.0
            for _ in range(200_000 // L):
                m = a ** (2 * L) * (1 + rho) * m + 1.0
            assert (m < 10 / (1 - a ** (2 * L) * (1 + 0.8 * rc))) == stable
            assert bool(theory.mean_square_stable(a, rho, L)) == stable


_ML = {
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
}


def _finite_table(dt):
    nbits = np.dtype(dt).itemsize * 8
    if dt is ml_dtypes.float4_e2m1fn:  # 4-bit type: no byte view; the OCP MX table
        return np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
    codes = np.arange(2**nbits, dtype=np.uint16 if nbits == 16 else np.uint8)
    with np.errstate(invalid="ignore"):
        vals = codes.view(dt).astype(np.float64)
    vals = vals[np.isfinite(vals) & (vals >= 0)]
    return np.unique(vals)


@pytest.mark.parametrize("name", ["bf16", "fp16", "e4m3", "e5m2", "e2m1"])
def test_element_grid_against_ml_dtypes_table(name):
    table = _finite_table(_ML[name])
    if name == "e2m1":  # cross-check the literal table against ml_dtypes conversion
        np.testing.assert_array_equal(table.astype(ml_dtypes.float4_e2m1fn).astype(np.float64), table)
    grid = {"bf16": theory.BF16, "fp16": theory.FP16, "e4m3": theory.E4M3, "e5m2": theory.E5M2,
            "e2m1": theory.E2M1}[name]  # fmt: skip
    rng = np.random.default_rng(2)
    top = table.max()
    m = np.concatenate([table, np.exp(rng.uniform(np.log(table[1] / 4), np.log(top * 1.5), 5000))])
    lo, hi, _ = theory._element_neighbours(m, grid)
    idx = np.searchsorted(table, m, side="right") - 1
    ref_lo = table[np.clip(idx, 0, None)]
    ref_hi = np.where(ref_lo == m, m, table[np.clip(idx + 1, 0, table.size - 1)])
    sat = m >= top
    np.testing.assert_array_equal(lo[~sat], ref_lo[~sat])
    np.testing.assert_array_equal(hi[~sat], ref_hi[~sat])
    assert np.all(lo[sat] == top) and np.all(hi[sat] == top)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_grid_model_matches_project_quantizer(fmt):
    """Two independent implementations of DESIGN.md s.4: RTN equal, SR lands on {down, up}."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, 32, generator=g) * torch.exp(2 * torch.randn(32, 1, 1, generator=g))
    xn = x.double().numpy()
    q = quantize(x, fmt).double().numpy()
    # the quantizer forms (grid value x FP32 scale) in FP32: one rounding, <= 2^-24 relative
    tol = dict(rtol=2.0**-23, atol=0)
    np.testing.assert_allclose(q, xn + theory.rtn_error(xn, fmt), **tol)
    n = theory.grid_neighbours(xn, fmt)
    qs = quantize(x, fmt + "+sr", seed=5, stream=torch.arange(32)).double().numpy()
    assert np.all(np.isclose(qs, n.down, **tol) | np.isclose(qs, n.up, **tol))


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_sr_moments_against_quantizer_monte_carlo(fmt):
    """Exact conditional SR moments (eq. C6.8) versus 2000 independent SR draws per element.

    The mean test includes saturated block maxima (mx/nvfp4), where SR is biased toward zero
    and sr_moments predicts that bias. Bound: 4 standard errors (two-sided p ~ 6e-5 each).
    """
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2, 32, generator=g)
    reps = 2000
    xs = x.expand(reps, 2, 32).contiguous()
    q = quantize(xs, fmt + "+sr", seed=9, stream=torch.arange(reps)).double().numpy()
    err = q - x.double().numpy()
    mean_ref, var_ref = theory.sr_moments(x.double().numpy(), fmt)
    sd = np.sqrt(var_ref[0]) / math.sqrt(reps)
    fp32_slack = 2.0**-23 * np.abs(x[0].double().numpy())  # FP32 product of grid value, scale
    assert np.all(np.abs(err.mean(0) - mean_ref[0]) <= 4 * sd + fp32_slack)
    pooled = err.var(0).sum() / var_ref.sum()
    assert pooled == pytest.approx(1.0, rel=0.05)


def test_uniform_fraction_approximation():
    """For values spread over many spacings, E[p(1-p) delta^2] ~ E[delta^2] / 6 (eq. C6.10)."""
    rng = np.random.default_rng(5)
    x = np.exp(rng.uniform(-3, 3, 1600 * 128)).reshape(-1, 4, 32) * rng.choice([-1, 1], (1600, 4, 32))
    # log-uniform values have density ~1/x, not flat inside one spacing: the approximation
    # is good to ~1% with 7 mantissa bits (bf16) but only ~6% with 3 (fp8e4m3)
    for fmt, rel in (("bf16", 0.015), ("fp8e4m3", 0.08)):
        _, v = theory.sr_moments(x, fmt)
        _, vu = theory.uniform_moments(x, fmt, "sr")
        _, vr = theory.uniform_moments(x, fmt, "rtn")
        assert v.mean() / vu.mean() == pytest.approx(1.0, rel=rel)
        assert vu.mean() / vr.mean() == pytest.approx(2.0)
        r = theory.rtn_error(x, fmt)
        assert np.mean(r**2) / vr.mean() == pytest.approx(1.0, rel=rel)


def test_rtn_stuck_threshold_bf16():
    thr = float(theory.rtn_stuck_threshold(1.0, "bf16"))
    assert thr == 2.0**-9  # half the spacing below 1.0 (2^-8), relative to 1.0
    one = torch.ones(1, 1, 1)
    assert quantize(one * (1 - 0.99 * thr), "bf16").item() == 1.0  # stuck
    assert quantize(one * (1 - 1.01 * thr), "bf16").item() < 1.0  # moves
    assert quantize(one * 0.999, "bf16").item() == 1.0  # the example


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="decay"):
        theory.error_variance(1.5, 3, 1.0)
    with pytest.raises(ValueError, match="window"):
        theory.error_mean(0.9, 3, 1.0, window=0)
    with pytest.raises(ValueError, match="point"):
        theory.error_mean(0.9, 3, 1.0, point="middle")
    with pytest.raises(ValueError, match="unknown format"):
        theory.grid_neighbours(np.ones((2, 32)), "fp6")
    with pytest.raises(ValueError, match="multiple of the block"):
        theory.grid_neighbours(np.ones((2, 20)), "nvfp4")
    with pytest.raises(ValueError, match="rtn_stuck_threshold"):
        theory.rtn_stuck_threshold(1.0, "nvfp4")


def test_driven_regime_helpers():
    """C6.11/C6.12: sigma2_drv = mean of p(1-p) delta^2 + b^2 over exact states; kappa; windows."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(64, 4, 32))
    for f in ("bf16", "fp8e4m3", "mxfp8"):
        s2, parts = theory.driven_sigma2(x, f)
        b, v = theory.sr_moments(x, f)
        assert s2 == pytest.approx(float((v + b * b).mean()), rel=1e-12)
        assert parts["rho"] == pytest.approx(s2 / float((x * x).mean()), rel=1e-12)
    assert theory.clipping_stats(x, "fp8e4m3")["clip_fraction"] == 0.0
    c = theory.clipping_stats(x, "mxfp4")
    assert 0 < c["clip_fraction"] < 0.1 and 0 < c["clip_rel_bias"] < 0.25
    assert float(theory.driven_kappa(0.99, 0.02, 16, 1.0)) == pytest.approx(0.02 / (1 - 0.99**32))
    assert [theory.driven_window(a) for a in (0.9, 0.99, 0.999)] == [1, 16, 128]
    with pytest.raises(ValueError):
        theory.driven_window(0.99999)

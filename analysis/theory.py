"""Closed forms for rounding error in low-precision linear recurrences (ReplaySSM appendix C.6).

Source: ReplaySSM, arXiv 2610.13778, appendix C.6 ("error propagation"). The equation labels
below (C6.1 ...) are this module's own, so that docstrings, tests and ``docs/analysis.md`` can
refer to them; the formulas are the ones of the appendix's scaling argument.

Model. A state ``x_t = a_t x_{t-1} + u_t`` is stored in a low-precision format. Every time it is
stored (every step for eager decoding, every ``L`` steps for ReplaySSM), a rounding error ``r``
is added, and under the *shared* policy the rounded state feeds the next update. The error
``e_t = y_t - x_t`` of the stored state then obeys the same linear recurrence::

    e_t = a_t e_{t-1} + r_t                                                   (C6.0)

With independent per-rounding errors of mean ``b`` and variance ``sigma2`` and constant decay
``a`` (rounding every step)::

    E[e_t]   = b (1 - a^t) / (1 - a)                 -> b / (1 - a)          (C6.1)
    Var[e_t] = sigma2 (1 - a^(2t)) / (1 - a^2)       -> sigma2 / (1 - a^2)   (C6.2)

At ``a = 1`` these are ``b t`` and ``sigma2 t`` (no limit: the error is a random walk), and as
``a -> 1`` the limits blow up like ``1 / (1 - a)``. With time-varying decays::

    E[e_t]   = sum_{j<=t} gamma_{j+1:t}   b_j,   gamma_{i:t} = a_i ... a_t   (C6.3)
    Var[e_t] = sum_{j<=t} gamma_{j+1:t}^2 sigma2_j                           (C6.4)

Window effect (ReplaySSM rounds the recurrence anchor once per ``L`` steps): after ``m`` flushes
the effective decay per rounding is ``a^L``, and ``h`` steps later the error has decayed by
``a^h``::

    E[e_{mL+h}]   = a^h   b (1 - a^(Lm)) / (1 - a^L)                          (C6.5)
    Var[e_{mL+h}] = a^(2h) sigma2 (1 - a^(2Lm)) / (1 - a^(2L))                 (C6.6)

so the stationary variance is ``sigma2 / (1 - a^(2L)) ~ sigma2 / (2 L (1 - a))``: ``L`` times
fewer roundings.

Separate precisions (recurrence anchor A in format G, read copy R in format F, both cast from the
same unrounded state at each flush): the read path's error is the anchor's accumulated error plus
*one* rounding of the read copy, decayed by ``a^h`` until the next flush::

    E[e^R] = a^h (E[e^A] + b_F),   Var[e^R] = a^(2h) (Var[e^A] + sigma2_F)    (C6.7)

With an FP32 anchor (``Var[e^A] ~ 0``) this is one rounding, independent of ``a`` and of ``N``.

Per-rounding moments. For a value ``x`` between neighbouring grid points ``lo <= |x| < hi``
(spacing ``delta = hi - lo``, fractional distance ``p = (|x| - lo) / delta``):

* stochastic rounding (SR) is unbiased, with variance ``p (1 - p) delta^2``            (C6.8)
* round-to-nearest (RTN) has the deterministic error ``min(p, 1 - p) delta`` in sign  (C6.9)

and, *under the uniform-fraction approximation* (``p ~ U(0, 1)``, valid when the values spread
over many grid spacings and vary between roundings), SR has mean 0 and variance
``delta^2 / 6`` and RTN has mean 0 and variance ``delta^2 / 12``                       (C6.10)

Driven regime (the formulation the SR acceptance tests use; our derivation, not the
appendix's). In a driven recurrence the exact state has a stationary distribution set by its
inputs (``S_t = a S_{t-1} + u_t``; Mamba-2 / GDN ``v k^T`` writes). SR errors are martingale
differences, so ``e`` is uncorrelated with ``S`` and C6.0 holds exactly with ``r_t`` the rounding
error of the *stored* value ``S_t + a^L e_{t-1}``. While the error is small next to the state, the
block scales, grid spacings and clipping decisions are those of the exact state, so ``r_t`` is an
additive error whose per-rounding mean square is its average over the stationary state::

    sigma2_drv = E_S[ p (1 - p) delta^2 + b^2 ]        (C6.11, at each element's block scale)

with ``b`` the conditional clipping bias (C6.8; 0 unless the element saturates), evaluated in
float64 on the exact state by the grid model, independently of any simulated error path
(:func:`driven_sigma2`). The stationary error variance is then C6.6 with ``sigma2_drv``. The
clipped elements are counted as one uncorrelated error of mean square ``b^2`` per rounding: a
clipped MX block maximum is stored as exactly ``max * X`` whatever its small error, so its
error is reset rather than accumulated coherently (measured: accumulating ``b`` coherently
through C6.3 overshoots the MX variance by up to 2x). The regime is valid when the predicted
relative error variance::

    kappa = sigma2_drv / ((1 - a^(2L)) E[S^2])                                  (C6.12)

is small (:func:`driven_kappa`; measured: within 15% for kappa <= ~0.15). For scaled formats
``sigma2_drv ~ rho E[S^2]`` with the relative variance ``rho`` of one rounding, so kappa does not
depend on the input scale: FP4 (``rho ~ 0.02``) is driven only where ``a^(2L) <~ 0.8``, e.g.
``L = 16`` at ``a = 0.99`` and ``L = 128`` at ``a = 0.999`` (:func:`driven_window`). At
``kappa ~ 1`` the error feeds the scales (multiplicative noise, below) -- outside this theory.

Where the theory breaks (demonstrated in the notebook and the tests):

* RTN errors are state dependent, not independent: a bf16 state decaying with ``a = 0.999`` from
  1.0 never moves, since the decay step 0.001 is under half a spacing (2^-9) -- see
  :func:`rtn_stuck_threshold`; SR tracks the exact value in expectation.
* For scaled formats the error scales with the state (relative variance ``rho`` per rounding),
  so the noise is multiplicative; the shared recurrence is mean-square stable only when
  ``a^(2L) (1 + rho) < 1`` (:func:`mean_square_stable`), i.e. ``rho < ~2 L (1 - a)``.

The grid model here is an independent float64 re-implementation of DESIGN.md section 4 (scales
included), used as the reference for the Monte Carlo; it does not call the project's quantizer.
Everything is numpy float64; inputs may be numpy arrays, Python floats or CPU torch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replayssm_quant.formats import (
    BF16,
    E2M1,
    E4M3,
    E4M3_MAX,
    E2M1_MAX,
    E5M2,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    FP16,
    MX_BLOCK,
    MXFP4_EMAX,
    MXFP8_EMAX,
    NVFP4_BLOCK,
    FloatGrid,
)

__all__ = [
    "error_mean",
    "error_variance",
    "stationary_mean",
    "stationary_variance",
    "time_varying_moments",
    "separate_read_moments",
    "gdn_effective_decay",
    "mean_square_stable",
    "rho_critical",
    "Neighbours",
    "grid_neighbours",
    "sr_moments",
    "rtn_error",
    "uniform_moments",
    "rtn_stuck_threshold",
    "driven_sigma2",
    "driven_kappa",
    "driven_window",
    "clipping_stats",
    "SCALED_FORMATS",
    "UNSCALED_FORMATS",
]

UNSCALED_FORMATS = {"bf16": BF16, "fp16": FP16}
SCALED_FORMATS = ("fp8e4m3", "fp8e5m2", "nvfp4", "mxfp8", "mxfp4")


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _ratio_geometric(a: np.ndarray, n: np.ndarray, k: int | np.ndarray) -> np.ndarray:
    """(1 - a^n) / (1 - a^k), stable near a -> 1 (limit n / k at a == 1)."""
    a = _f64(a)
    la = np.log(np.where(a > 0, a, 1.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        num = -np.expm1(_f64(n) * la)
        den = -np.expm1(_f64(k) * la)
        out = np.where(np.abs(den) > 0, num / np.where(den == 0, 1.0, den), _f64(n) / _f64(k))
    # a == 0: only the most recent rounding survives.
    return np.where(a > 0, out, np.where(_f64(n) > 0, 1.0, 0.0))


def _split(t, window: int, point: str):
    t = np.asarray(t)
    if np.any(t < 0):
        raise ValueError("step t must be >= 0")
    if window < 1:
        raise ValueError(f"window L must be >= 1, got {window}")
    if point == "state":
        m = t // window  # flushes done up to and including step t
    elif point == "read":
        m = np.maximum(t - 1, 0) // window  # output at step t comes before step t's rounding
    else:
        raise ValueError(f"point must be 'state' or 'read', got {point!r}")
    h = t - m * window
    return m, h


def _check_decay(a):
    a = _f64(a)
    if np.any((a < 0) | (a > 1)):
        raise ValueError("decay a must lie in [0, 1]")
    return a


def error_mean(a, t, b, window: int = 1, point: str = "state"):
    """Mean rounding error of the stored state after ``t`` steps (eqs. C6.1 and C6.5).

    ``E[e_t] = a^h b (1 - a^(L m)) / (1 - a^L)`` with ``m`` roundings so far and ``h`` steps
    since the last one; for ``L = 1`` and ``point='state'`` this is ``b (1 - a^t) / (1 - a)``.

    Args:
        a: per-step decay in [0, 1] (scalar or array; broadcasts with ``t`` and ``b``).
        t: step index (>= 0), the error starts at 0 at ``t = 0``.
        b: mean of one rounding error (state units).
        window: ReplaySSM window ``L`` (rounding once per ``L`` steps); 1 = eager decoding.
        point: ``'state'``: the stored (anchor) state after step ``t``'s flush, if any;
            ``'read'``: the state the output of step ``t`` is read from (before step ``t``'s
            rounding -- at a flush step the output comes from the unrounded state).

    Returns:
        float64 array, state units. At ``a = 1`` the limit ``b m`` is returned.

    Raises:
        ValueError: ``a`` outside [0, 1], ``t < 0``, ``window < 1`` or an unknown ``point``.
    """
    a = _check_decay(a)
    m, h = _split(t, window, point)
    return a**h * _f64(b) * _ratio_geometric(a, window * m, window)


def error_variance(a, t, sigma2, window: int = 1, point: str = "state"):
    """Variance of the stored state's rounding error after ``t`` steps (eqs. C6.2 and C6.6).

    ``Var[e_t] = a^(2h) sigma2 (1 - a^(2 L m)) / (1 - a^(2 L))``; for ``L = 1``:
    ``sigma2 (1 - a^(2t)) / (1 - a^2)``. Assumes uncorrelated per-rounding errors (exact for
    SR, whose errors are martingale differences; an approximation for RTN).

    Args and errors as :func:`error_mean`, with ``sigma2`` the variance of one rounding
    (state units squared). Returns float64 (state units squared); ``sigma2 m`` at ``a = 1``.
    """
    a = _check_decay(a)
    m, h = _split(t, window, point)
    a2 = a * a
    return a2**h * _f64(sigma2) * _ratio_geometric(a2, window * m, window)


def stationary_mean(a, b, window: int = 1):
    """Limit of :func:`error_mean` at flush points as ``t -> inf``: ``b / (1 - a^L)`` (C6.1).

    Returns ``inf`` (signed like ``b``) at ``a = 1`` with ``b != 0``, 0 where ``b == 0``.
    Raises ValueError for ``a`` outside [0, 1] or ``window < 1``.
    """
    a = _check_decay(a)
    if window < 1:
        raise ValueError(f"window L must be >= 1, got {window}")
    b = _f64(b)
    den = -np.expm1(window * np.log(np.where(a > 0, a, 1.0)))
    den = np.where(a > 0, den, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, b / den)


def stationary_variance(a, sigma2, window: int = 1):
    """Limit of :func:`error_variance` at flush points: ``sigma2 / (1 - a^(2L))`` (C6.2, C6.6).

    Near ``a -> 1`` this is ``~ sigma2 / (2 L (1 - a))``: it blows up, and at ``a = 1`` it is
    ``inf`` (the error is a random walk with variance ``sigma2 t / L``).
    Raises ValueError for ``a`` outside [0, 1] or ``window < 1``.
    """
    a = _check_decay(a)
    if window < 1:
        raise ValueError(f"window L must be >= 1, got {window}")
    sigma2 = _f64(sigma2)
    den = -np.expm1(2 * window * np.log(np.where(a > 0, a, 1.0)))
    den = np.where(a > 0, den, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sigma2 == 0, 0.0, sigma2 / den)


def time_varying_moments(decays, b, sigma2, rounds=None):
    """Mean and variance of ``e_t`` for time-varying decays (eqs. C6.3, C6.4).

    ``E[e_t] = sum_{j<=t} gamma_{j+1:t} b_j`` and ``Var[e_t] = sum_{j<=t} gamma_{j+1:t}^2
    sigma2_j`` with ``gamma_{j+1:t} = a_{j+1} ... a_t``, evaluated by the equivalent O(T)
    recursion ``E_t = a_t E_{t-1} + b_t``, ``V_t = a_t^2 V_{t-1} + sigma2_t``.

    Args:
        decays: ``[..., T]`` per-step decays ``a_1 .. a_T`` (``a_t`` multiplies ``e_{t-1}``).
        b, sigma2: per-rounding mean and variance, broadcastable to ``[..., T]``.
        rounds: optional bool mask ``[..., T]``; steps where it is False add no error (the
            window effect: ``rounds[t] = (t + 1) % L == 0`` with 0-based ``t``).

    Returns:
        ``(mean, var)``, float64 arrays ``[..., T]``: the moments after each step.
    """
    a = _f64(decays)
    b = np.broadcast_to(_f64(b), a.shape)
    s2 = np.broadcast_to(_f64(sigma2), a.shape)
    if rounds is not None:
        r = np.broadcast_to(np.asarray(rounds, dtype=bool), a.shape)
        b = np.where(r, b, 0.0)
        s2 = np.where(r, s2, 0.0)
    mean = np.empty(a.shape)
    var = np.empty(a.shape)
    em = np.zeros(a.shape[:-1])
    ev = np.zeros(a.shape[:-1])
    for t in range(a.shape[-1]):
        em = a[..., t] * em + b[..., t]
        ev = a[..., t] ** 2 * ev + s2[..., t]
        mean[..., t] = em
        var[..., t] = ev
    return mean, var


def separate_read_moments(a, h, read_b, read_sigma2, anchor_mean=0.0, anchor_var=0.0):
    """Moments of the read-path error under separate precisions (eq. C6.7).

    The read copy ``R = Q_F(S)`` is one independent rounding of the unrounded flushed state
    ``S`` (whose own error is the anchor's, ``anchor_mean`` / ``anchor_var``); ``h`` steps after
    the flush the read path's error has decayed by ``a^h``. With an FP32 anchor pass
    ``anchor_var = 0``: the result is a single rounding, independent of the sequence length
    ``N`` and (at ``h = 0``) of ``a``.

    Args:
        a: decay in [0, 1]; h: steps since the flush (>= 0); read_b, read_sigma2: per-rounding
            moments of the read format; anchor_mean, anchor_var: the anchor's error moments.

    Returns:
        ``(mean, var)`` float64 arrays, state units and units squared.
    """
    a = _check_decay(a)
    h = _f64(h)
    if np.any(h < 0):
        raise ValueError("h must be >= 0")
    return a**h * (_f64(anchor_mean) + _f64(read_b)), a ** (2 * h) * (
        _f64(anchor_var) + _f64(read_sigma2)
    )


def gdn_effective_decay(alpha, beta, d_k: int):
    """Mean and mean-square per-step contraction of an error under the GDN delta rule.

    The delta rule ``S_t = alpha S_{t-1} (I - beta k k^T) + beta v k^T`` (DESIGN.md section 3)
    propagates a state error as ``e_t = alpha e_{t-1} (I - beta k_t k_t^T) + r_t``. For unit
    keys uniformly distributed on the sphere in ``d_k`` dimensions and an isotropic error,
    ``E[I - beta k k^T] = (1 - beta / d_k) I`` and ``E[(I - beta k k^T)^2] = I - (2 beta -
    beta^2) k k^T``, so (an approximation: isotropy of the error is assumed)::

        mean factor  = alpha (1 - beta / d_k)
        square factor = alpha^2 (1 - (2 beta - beta^2) / d_k)

    Use them in :func:`error_mean` / :func:`error_variance` as ``a`` and ``sqrt(square)``.

    Returns:
        ``(a_mean, a_rms)``: float64, the decay to use for the mean and for the variance.
    Raises:
        ValueError: ``d_k < 1`` or ``beta`` outside [0, 2].
    """
    if d_k < 1:
        raise ValueError(f"d_k must be >= 1, got {d_k}")
    beta = _f64(beta)
    if np.any((beta < 0) | (beta > 2)):
        raise ValueError("beta must lie in [0, 2]")
    alpha = _f64(alpha)
    return alpha * (1 - beta / d_k), np.sqrt(alpha**2 * (1 - (2 * beta - beta**2) / d_k))


def rho_critical(a, window: int = 1):
    """Largest relative per-rounding variance ``rho`` for which the shared recurrence is stable.

    With multiplicative rounding noise (scaled formats: ``Var[r] = rho E[x^2]``) the second
    moment of the stored state obeys ``E[y^2] <- a^(2L) (1 + rho) E[y^2] + input``, which is
    bounded iff ``a^(2L) (1 + rho) < 1``, i.e. ``rho < a^(-2L) - 1 ~ 2 L (1 - a)``.
    Returns float64 (inf at ``a = 0``).
    """
    a = _check_decay(a)
    with np.errstate(divide="ignore"):
        return np.expm1(-2 * window * np.log(a))


def mean_square_stable(a, rho, window: int = 1):
    """True where ``a^(2L) (1 + rho) < 1`` (see :func:`rho_critical`); bool array."""
    return _f64(rho) < rho_critical(a, window)


# --------------------------------------------------------------------------------------------
# Per-rounding moments from an independent float64 model of the format grids (DESIGN.md s.4).
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Neighbours:
    """Grid neighbours of values ``x`` in state units (float64 arrays shaped like ``x``).

    ``down`` (toward zero) and ``up`` (away from zero) bracket ``x``: ``|down| <= |x| <= |up|``
    with ``down == up`` when ``x`` is on the grid or saturates (then both are ``+-max``).
    ``quantum`` is the local grid spacing at ``x`` (non-zero even on the grid; used by the
    uniform-fraction approximation). ``x`` is the float64 input.
    """

    x: np.ndarray
    down: np.ndarray
    up: np.ndarray
    quantum: np.ndarray


def _element_neighbours(m: np.ndarray, g: FloatGrid):
    """lo <= m <= hi on the unscaled grid ``g`` for magnitudes ``m >= 0``; saturating."""
    mant, ex = np.frexp(m)  # m = mant * 2^ex, mant in [0.5, 1)
    e = np.maximum(ex - 1, g.emin)  # floor(log2 m), clamped to the subnormal exponent
    q = np.ldexp(1.0, e - g.mbits)
    lo = np.floor(m / q) * q
    hi = np.where(lo < m, lo + q, lo)
    sat = m >= g.max
    lo = np.where(sat, g.max, lo)
    hi = np.where(sat, g.max, hi)
    return lo, hi, q


def _rtn_unscaled(v: np.ndarray, g: FloatGrid) -> np.ndarray:
    m = np.abs(v)
    lo, hi, q = _element_neighbours(m, g)
    dl, dh = m - lo, hi - m
    even = np.mod(np.round(lo / q), 2) == 0
    pick_lo = (dl < dh) | ((dl == dh) & even)
    return np.sign(v) * np.where(pick_lo, lo, hi)


def _scales(x: np.ndarray, fmt: str) -> tuple[np.ndarray, FloatGrid]:
    """Per-element scale (state units per grid unit, an FP32 number) and the element grid.

    Scales are FP32 numbers (DESIGN.md s.4), so they are formed in float32 arithmetic
    (``amax / 448`` etc.); everything after the division by the scale is exact float64.
    """
    if fmt in UNSCALED_FORMATS:
        return np.ones_like(x), UNSCALED_FORMATS[fmt]
    if x.ndim < 2:
        raise ValueError(f"{fmt} is scaled per matrix: x must be [..., M, K], got {x.shape}")
    x32 = np.abs(x).astype(np.float32)
    amax = np.max(x32, axis=(-2, -1), keepdims=True)
    if fmt in ("fp8e4m3", "fp8e5m2"):
        grid = E4M3 if fmt == "fp8e4m3" else E5M2
        s = np.where(amax > 0, amax / np.float32(grid.max), np.float32(1.0))
        return np.broadcast_to(s.astype(np.float64), x.shape), grid
    block = NVFP4_BLOCK if fmt == "nvfp4" else MX_BLOCK
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"{fmt}: last dim {k} is not a multiple of the block {block}")
    xb = x32.reshape(*x.shape[:-1], k // block, block)
    bamax = np.max(xb, axis=-1, keepdims=True)
    if fmt == "nvfp4":
        # s_g = amax / (448 * 6); block scale = E4M3 RTN of bamax / (6 s_g) (DESIGN.md s.4);
        # the largest element of a block clips to 6 when the block scale rounds down.
        s_g = amax[..., None] / np.float32(E4M3_MAX * E2M1_MAX)
        s_g = np.where(s_g > 0, s_g, np.float32(1.0))
        raw = bamax / (s_g * np.float32(E2M1_MAX))
        bs = _rtn_unscaled(raw.astype(np.float64), E4M3).astype(np.float32)
        s = (bs * s_g).astype(np.float64)
        grid = E2M1
    elif fmt in ("mxfp8", "mxfp4"):
        # OCP MX v1.0: X = 2^(floor(log2 bamax) - emax); block maxima above max clip.
        emax = MXFP8_EMAX if fmt == "mxfp8" else MXFP4_EMAX
        _, ex = np.frexp(np.where(bamax > 0, bamax, 1.0).astype(np.float64))
        e = np.clip(ex - 1 - emax, E8M0_MIN_EXP, E8M0_MAX_EXP)
        s = np.ldexp(1.0, e)
        grid = E4M3 if fmt == "mxfp8" else E2M1
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return np.broadcast_to(s, xb.shape).reshape(x.shape), grid


def grid_neighbours(x, fmt: str) -> Neighbours:
    """Grid neighbours of every element of ``x`` in format ``fmt``, scales included.

    An independent float64 model of DESIGN.md section 4 (not the project's quantizer):
    bf16/fp16 unscaled; fp8e4m3/fp8e5m2 with one scale per matrix (amax -> 448 / 57344);
    nvfp4 with ``s_g = amax / (448 * 6)`` per matrix and an E4M3 (round-to-nearest) scale per
    16 elements of the last dim; mxfp8/mxfp4 with ``2^(floor(log2 bamax) - emax)`` per 32.
    Values beyond the largest finite value saturate; a block whose scale rounds to 0 maps to 0.

    Args:
        x: ``[..., M, K]`` finite values (``[...]`` suffices for bf16/fp16), state units.
        fmt: one of ``bf16 fp16 fp8e4m3 fp8e5m2 nvfp4 mxfp8 mxfp4`` (no ``+sr`` suffix).

    Returns:
        :class:`Neighbours` in state units.
    Raises:
        ValueError: unknown format, a scaled format on a non-matrix, a bad block multiple,
            or non-finite input.
    """
    x = _f64(x)
    if not np.all(np.isfinite(x)):
        raise ValueError("grid_neighbours needs finite values")
    s, grid = _scales(x, fmt)
    s = np.asarray(s, dtype=np.float64)
    zero = s == 0
    ss = np.where(zero, 1.0, s)
    if fmt in UNSCALED_FORMATS:
        m = np.abs(x)
    else:  # the division by an FP32 scale happens in FP32, as in the quantizer
        m = (np.abs(x).astype(np.float32) / ss.astype(np.float32)).astype(np.float64)
    lo, hi, q = _element_neighbours(m, grid)
    sign = np.sign(x)
    down = np.where(zero, 0.0, sign * lo * ss)
    up = np.where(zero, 0.0, sign * hi * ss)
    return Neighbours(x=x, down=down, up=up, quantum=np.where(zero, 0.0, q * ss))


def sr_moments(x, fmt: str):
    """Exact conditional moments of the stochastic-rounding error ``Q(x) - x`` (eq. C6.8).

    ``Q(x)`` is ``up`` with probability ``p = (|x| - |down|) / (|up| - |down|)``, else ``down``:
    mean error 0 inside the range (``-(|x| - max)`` in sign when saturating), variance
    ``p (1 - p) delta^2 = (|x| - |down|)(|up| - |x|)``.

    Args: ``x`` ``[..., M, K]`` (state units), ``fmt`` as :func:`grid_neighbours`.
    Returns: ``(mean, var)`` float64 arrays shaped like ``x``.
    """
    n = grid_neighbours(x, fmt)
    m = np.abs(n.x)
    lo, hi = np.abs(n.down), np.abs(n.up)
    var = np.clip((m - lo) * (hi - m), 0.0, None)
    delta = hi - lo
    p = np.where(delta > 0, (m - lo) / np.where(delta > 0, delta, 1.0), 0.0)
    mean = np.sign(n.x) * (lo + p * delta - m)  # 0 unless saturated
    return mean, var


def rtn_error(x, fmt: str):
    """Deterministic round-to-nearest-even error ``Q(x) - x`` (eq. C6.9); float64 like ``x``.

    Ties go to the neighbour with an even significand. Args as :func:`grid_neighbours`.
    """
    n = grid_neighbours(x, fmt)
    m = np.abs(n.x)
    lo, hi = np.abs(n.down), np.abs(n.up)
    dl, dh = m - lo, hi - m
    q = np.where(n.quantum > 0, n.quantum, 1.0)
    even = np.mod(np.round(lo / q), 2) == 0
    pick_lo = (dl < dh) | ((dl == dh) & even)
    return np.sign(n.x) * np.where(pick_lo, lo, hi) - n.x


def uniform_moments(x, fmt: str, rounding: str = "sr"):
    """Per-rounding moments under the uniform-fraction approximation (eq. C6.10).

    Assumes the fractional position ``p`` of ``x`` between its grid neighbours is uniform on
    [0, 1): SR error variance ``delta^2 / 6``, RTN ``delta^2 / 12``, mean 0 for both (the
    saturation bias is ignored). ``delta`` is the local grid spacing at ``x``.

    Returns ``(mean, var)`` float64 arrays shaped like ``x``.
    Raises ValueError for a rounding other than ``'sr'`` / ``'rtn'``.
    """
    if rounding not in ("sr", "rtn"):
        raise ValueError(f"rounding must be 'sr' or 'rtn', got {rounding!r}")
    n = grid_neighbours(x, fmt)
    var = n.quantum**2 / (6.0 if rounding == "sr" else 12.0)
    return np.zeros_like(var), var


def rtn_stuck_threshold(x, fmt: str):
    """Largest ``1 - a`` for which RTN leaves a positive unscaled state ``x`` unchanged.

    ``RTN(a x) = x`` while the decay step ``(1 - a) x`` is under half the grid spacing *below*
    ``x`` (which at a power of two is half the spacing above): threshold ``delta_below / (2 x)``
    (ties to even may also hold at equality). For bf16 and ``x = 1`` this is ``2^-9 ~
    0.00195``, so every ``a > 1 - 2^-9 ~ 0.99805`` is stuck, e.g. ``a = 0.999``.

    Args: ``x > 0`` values on the grid of an unscaled format (``bf16`` or ``fp16``).
    Returns: float64 array. Raises ValueError for scaled formats or ``x <= 0``.
    """
    if fmt not in UNSCALED_FORMATS:
        raise ValueError(f"rtn_stuck_threshold supports {sorted(UNSCALED_FORMATS)}, got {fmt!r}")
    x = _f64(x)
    if np.any(x <= 0):
        raise ValueError("x must be > 0")
    g = UNSCALED_FORMATS[fmt]
    below = np.nextafter(x, 0.0)  # any value just under x lies in the binade below x's spacing
    _, _, q_below = _element_neighbours(below, g)
    return q_below / (2.0 * x)


# --------------------------------------------------------------------------------------------
# Driven regime (eqs. C6.11, C6.12; see the module docstring).
# --------------------------------------------------------------------------------------------


def driven_sigma2(x, fmt: str):
    """Per-rounding mean-square SR error over stationary exact states ``x`` (eq. C6.11).

    ``sigma2_drv = mean over elements of p (1 - p) delta^2 + b^2`` with ``p, delta`` the
    fractional position and spacing of each element under its own (block / matrix) scale and
    ``b`` its saturation (clipping) bias, from the independent float64 grid model
    (:func:`sr_moments`). ``x`` are samples of the *exact* (unrounded) state, so the result does
    not depend on any simulated error path.

    Args:
        x: ``[..., M, K]`` samples of the exact stationary state (state units).
        fmt: format name as :func:`grid_neighbours`.

    Returns:
        ``(sigma2, parts)``: float ``sigma2`` (state units squared) and a dict with
        ``sr_var`` (mean ``p(1-p) delta^2``), ``bias2`` (mean ``b^2``), ``state_ms``
        (mean ``x^2``), ``rho`` (``sigma2 / state_ms``) and the :func:`clipping_stats` entries.
    """
    x = _f64(x)
    b, v = sr_moments(x, fmt)
    sr_var, bias2 = float(v.mean()), float((b * b).mean())
    ms = float((x * x).mean())
    sigma2 = sr_var + bias2
    parts = dict(sr_var=sr_var, bias2=bias2, state_ms=ms, rho=sigma2 / ms if ms > 0 else np.nan)
    parts.update(_clip_from_bias(x, b, v))
    return sigma2, parts


def _clip_from_bias(x, b, v):
    clip = np.abs(b) > 1e-6 * np.abs(x)  # ignore FP32-scale round-off of the scales
    n = max(int(clip.sum()), 1)
    return dict(
        clip_fraction=float(clip.mean()),
        clip_rel_bias=float((np.abs(b)[clip] / np.abs(x)[clip]).sum() / n),
        clip_bias2_share=float((b * b).sum() / max((v + b * b).sum(), 1e-300)),
    )


def clipping_stats(x, fmt: str) -> dict:
    """How much SR saturates on values ``x`` in ``fmt`` (eq. C6.8's bias term).

    Returns a dict: ``clip_fraction`` (share of elements beyond the largest grid value of their
    block, e.g. an MX block maximum in ``[448, 512) X`` or an NVFP4 block maximum whose E4M3 scale
    rounded down), ``clip_rel_bias`` (mean ``|b| / |x|`` over the clipped elements: the shrink
    toward zero) and ``clip_bias2_share`` (``sum b^2 / sum (p(1-p) delta^2 + b^2)``: the clipping
    share of the per-rounding mean square). Zero clipping gives zeros.
    """
    x = _f64(x)
    b, v = sr_moments(x, fmt)
    return _clip_from_bias(x, b, v)


def driven_kappa(a, sigma2, window: int = 1, state_ms=1.0):
    """Predicted relative stationary error variance ``sigma2 / ((1 - a^(2L)) E[S^2])`` (C6.12).

    The driven-regime closed form (C6.6 with C6.11) assumes the error is small next to the
    state; ``kappa`` is that ratio. Returns float64 (``inf`` at ``a = 1``).
    """
    return stationary_variance(a, sigma2, window) / _f64(state_ms)


def driven_window(a, per_round_decay: float = 0.9, windows=(1, 2, 4, 8, 16, 32, 64, 128, 256)):
    """Smallest window ``L`` in ``windows`` with ``a^L <= per_round_decay``.

    With ``a^L <= 0.9`` the stationary relative error is ``kappa <= rho / 0.19``, i.e. at most
    ~0.13 for every format here (FP4 ``rho ~ 0.025``): the driven regime of eq. C6.12. Raises
    ValueError if no window qualifies.
    """
    a = float(a)
    for L in windows:
        if a**L <= per_round_decay:
            return int(L)
    raise ValueError(f"no window in {windows} gives a^L <= {per_round_decay} at a = {a}")

"""Monte Carlo of low-precision recurrent state with the project's real quantizers.

Each run simulates many independent trials at once (the batch dimension) of a small state
recurrence, in float64, next to its exact (unrounded) twin, under a precision policy:

* ``shared``: one checkpoint in format F; every ``L`` steps the state reconstructed from it is
  rounded and fed back (``L = 1`` is conventional eager decoding).
* ``separate``: a recurrence anchor A in format G (``rec``, FP32 by default) carries the
  recurrence; a read copy R in format F is cast independently from the same unrounded state at
  each flush and used only for outputs (DESIGN.md section 3).

Between flushes nothing is rounded: the anchor path and the read path are stepped exactly from
their checkpoints, which is what ReplaySSM's reconstruction from the buffer computes. The output
at a flush step comes from the unrounded flushed state; at other steps from the read path.

Recurrences (DESIGN.md section 3; the state is ``[M, K]`` = value x key per trial):

* ``scalar``: ``M*K`` independent scalars ``x_t = a x_{t-1} + sqrt(1 - a^2) u_t`` (grouped into
  matrices only because scaled formats share scales per matrix); stationary variance 1.
* ``mamba2``: ``S_t = a S_{t-1} + sqrt(1 - a^2) v_t k_t^T`` with ``v, k ~ N(0, 1)``.
* ``gdn``: the delta rule ``S_t = a S_{t-1} (I - beta k k^T) + beta v_t k_t^T`` with unit keys.

For each (configuration, step) the tidy frame holds measured moments of the error of the stored
state and of the state the output is read from, and predictions from :mod:`replayssm_quant.analysis.theory`
(ReplaySSM arXiv 2610.13778, appendix C.6) fed with per-rounding moments from the independent
float64 grid model: ``pred_*`` evaluates them at the simulated pre-rounding values (exact for SR
up to saturation), ``apriori_*`` at the exact state (independent of the quantised path, valid
while errors are small relative to the state), ``cf_*`` is the constant-sigma closed form.
The simulated state passes through FP32 before each quantizer call (quantize's input dtype);
that extra rounding (2^-24 relative) is negligible next to every format studied.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from replayssm_quant.capabilities import torch_threads

from . import theory

__all__ = [
    "simulate", "stuck_state", "sr_acceptance", "MODELS", "POLICIES", "FRAME_COLUMNS",
    "ALL_FORMATS",
]  # fmt: skip

ALL_FORMATS = ("bf16", "fp16", "fp8e4m3", "fp8e5m2", "nvfp4", "mxfp8", "mxfp4")

MODELS = ("scalar", "mamba2", "gdn")
POLICIES = ("shared", "separate")
FRAME_COLUMNS = (
    "model", "format", "rounding", "policy", "spec_read", "spec_rec", "window", "decay",
    "trials", "elements", "step", "flush", "ref_var",
    "state_mean", "state_var", "state_sem", "read_mean", "read_var", "read_sem",
    "sigma2_rec", "sigma2_read",
    "pred_state_mean", "pred_state_var", "pred_read_mean", "pred_read_var",
    "apriori_state_var", "apriori_read_var", "cf_state_var",
)  # fmt: skip


def _default_quantizer() -> Callable:
    from replayssm_quant import quantize  # the project's real fake-quantizer

    return quantize


def _spec(fmt: str, rounding: str) -> str:
    if fmt == "fp32":
        return "fp32"
    return fmt + ("+sr" if rounding == "sr" else "")


def _round_moments(x: np.ndarray, spec: str, groups: int):
    """Per-group (mean, variance) of one rounding error of ``x`` [B, M, K] in ``spec``.

    SR: exact conditional moments (eq. C6.8), the variance including the spread of the
    conditional (saturation) bias; RTN: the uniform-fraction model (eq. C6.10)."""
    if spec == "fp32":
        return np.zeros(groups), np.zeros(groups)
    fmt, sr = spec.removesuffix("+sr"), spec.endswith("+sr")
    if sr:
        b, v = theory.sr_moments(x, fmt)
    else:
        b, v = theory.uniform_moments(x, fmt, "rtn")
    bm = b.reshape(groups, -1).mean(axis=1)
    second = (v + b * b).reshape(groups, -1).mean(axis=1)
    return bm, second - bm * bm


class _Stepper:
    """Exact linear update of a batch of states ``[B, M, K]`` with per-trial decay ``a [B]``."""

    def __init__(self, model: str, a: torch.Tensor, shape, beta: float, gen: torch.Generator):
        self.model, self.a, self.beta, self.gen = model, a, beta, gen
        self.B = a.shape[0]
        self.M, self.K = shape
        self.gain = torch.sqrt(1 - a * a)[:, None, None]

    def inputs(self):
        B, M, K, g = self.B, self.M, self.K, self.gen
        if self.model == "scalar":
            return (self.gain * torch.randn(B, M, K, generator=g, dtype=torch.float64),)
        v = torch.randn(B, M, generator=g, dtype=torch.float64)
        k = torch.randn(B, K, generator=g, dtype=torch.float64)
        if self.model == "mamba2":
            return (self.gain * v[:, :, None] * k[:, None, :],)
        k = k / k.norm(dim=-1, keepdim=True)
        return v, k

    def step(self, S: torch.Tensor, inp) -> torch.Tensor:
        a = self.a[:, None, None]
        if self.model in ("scalar", "mamba2"):
            return a * S + inp[0]
        v, k = inp
        Sk = torch.einsum("bmk,bk->bm", S, k)
        return a * (S - self.beta * Sk[:, :, None] * k[:, None, :]) + self.beta * v[
            :, :, None
        ] * k[:, None, :]

    def init(self) -> torch.Tensor:
        if self.model == "gdn":
            return torch.zeros(self.B, self.M, self.K, dtype=torch.float64)
        return torch.randn(self.B, self.M, self.K, generator=self.gen, dtype=torch.float64)


def _group_stats(e: torch.Tensor, groups: int):
    x = e.reshape(groups, -1)
    n = x.shape[1]
    mean = x.mean(dim=1)
    var = x.var(dim=1, unbiased=True)
    return mean.numpy(), var.numpy(), (var / n).sqrt().numpy()


def _run_one(
    model, fmt, rounding, policy, rec, window, decays, steps, trials, shape, beta, seed, every,
    quantizer, prefill_flush,
) -> pd.DataFrame:  # fmt: skip
    G = len(decays)
    B = G * trials
    gen = torch.Generator().manual_seed(seed)
    a = torch.tensor(np.repeat(np.asarray(decays, dtype=np.float64), trials))
    st = _Stepper(model, a, shape, beta, gen)
    spec_read = _spec(fmt, rounding)
    spec_rec = spec_read if policy == "shared" else _spec(rec, rounding)
    if model == "gdn":
        dm, drms = theory.gdn_effective_decay(np.asarray(decays), beta, shape[1])
    else:
        dm, drms = np.asarray(decays, dtype=np.float64), np.asarray(decays, dtype=np.float64)
    dv2 = drms**2
    stream_b = torch.arange(B, dtype=torch.int64)

    def cast(x: torch.Tensor, spec: str, flush: int, copy: int) -> torch.Tensor:
        if spec == "fp32":
            return x.float().double()
        stream = (flush * 2 + copy) * B + stream_b
        return quantizer(x.float(), spec, seed=seed, stream=stream).double()

    S = st.init()
    P = S.clone()  # anchor path (pre-rounding between flushes)
    R = S.clone()  # read path (separate policy; under shared the read path is P)
    # predicted moments [G]: anchor path (pm, pv), read path (rm, rv), a-priori (apv, arv)
    z = np.zeros(G)
    mom = dict(pm=z, pv=z, rm=z, rv=z, apv=z, arv=z)
    s2_hist: list[np.ndarray] = []
    flush_idx = 0

    def do_flush():
        """Both casts of the unrounded anchor-path state P (DESIGN.md s.3 flush)."""
        nonlocal P, R, flush_idx
        Pn, Sn = P.numpy(), S.numpy()
        b_rec, s2_rec = _round_moments(Pn, spec_rec, G)
        _, s2_rec_ap = _round_moments(Sn, spec_rec, G)
        s2_read = s2_rec
        A = cast(P, spec_rec, flush_idx, 0)
        if policy == "separate":
            b_read, s2_read = _round_moments(Pn, spec_read, G)
            _, s2_read_ap = _round_moments(Sn, spec_read, G)
            R = cast(P, spec_read, flush_idx, 1)
            mom.update(rm=mom["pm"] + b_read, rv=mom["pv"] + s2_read,
                       arv=mom["apv"] + s2_read_ap)  # fmt: skip
        mom.update(pm=mom["pm"] + b_rec, pv=mom["pv"] + s2_rec, apv=mom["apv"] + s2_rec_ap)
        if policy == "shared":
            mom.update(rm=mom["pm"], rv=mom["pv"], arv=mom["apv"])
        s2_hist.append(s2_rec_ap)
        P = A
        flush_idx += 1
        return s2_rec, s2_read

    if prefill_flush:  # the prefill's final state is treated as a flush (DESIGN.md s.3)
        do_flush()
    rows: list[dict] = []
    for t in range(1, steps + 1):
        inp = st.inputs()
        S = st.step(S, inp)
        P = st.step(P, inp)
        if policy == "separate":
            R = st.step(R, inp)
        for k in ("pm", "rm"):
            mom[k] = dm * mom[k]
        for k in ("pv", "rv", "apv", "arv"):
            mom[k] = dv2 * mom[k]
        flush = t % window == 0
        s2_rec = s2_read = np.full(G, np.nan)
        if flush:  # the output comes from the unrounded flushed state
            out, out_m, out_v, out_av = P, mom["pm"], mom["pv"], mom["apv"]
            s2_rec, s2_read = do_flush()
        else:  # shared: the read copy is the anchor, stepped exactly since the flush
            out = R if policy == "separate" else P
            out_m, out_v, out_av = mom["rm"], mom["rv"], mom["arv"]
        pm, pv, apv = mom["pm"], mom["pv"], mom["apv"]
        if t % every and t != steps:
            continue
        sm, sv, ss = _group_stats(P - S, G)
        om, ov, os_ = _group_stats(out - S, G)
        ref_var = S.reshape(G, -1).var(dim=1).numpy()
        for g in range(G):
            rows.append(
                dict(
                    step=t, flush=flush, decay=float(decays[g]), ref_var=ref_var[g],
                    state_mean=sm[g], state_var=sv[g], state_sem=ss[g],
                    read_mean=om[g], read_var=ov[g], read_sem=os_[g],
                    sigma2_rec=s2_rec[g], sigma2_read=s2_read[g],
                    pred_state_mean=pm[g], pred_state_var=pv[g],
                    pred_read_mean=out_m[g], pred_read_var=out_v[g],
                    apriori_state_var=apv[g], apriori_read_var=out_av[g],
                )  # fmt: skip
            )
    df = pd.DataFrame(rows)
    sbar = np.mean(s2_hist, axis=0) if s2_hist else np.zeros(G)
    gi = df["decay"].map({d: i for i, d in enumerate(decays)}).to_numpy(dtype=int)
    # closed form C6.6 with one constant sigma2; the prefill flush is one extra rounding
    t_eff = df["step"].to_numpy() + (window if prefill_flush else 0)
    cf = theory.error_variance(drms[gi], t_eff, sbar[gi], window=window)
    df["cf_state_var"] = cf
    df["model"], df["format"], df["rounding"], df["policy"] = model, fmt, rounding, policy
    df["spec_read"], df["spec_rec"], df["window"] = spec_read, spec_rec, window
    df["trials"], df["elements"] = trials, trials * shape[0] * shape[1]
    return df[list(FRAME_COLUMNS)]


def simulate(
    model: str = "scalar",
    formats: Iterable[str] = ("bf16",),
    roundings: Iterable[str] = ("sr",),
    policies: Iterable[str] = ("shared",),
    decays: Sequence[float] = (0.9, 0.99, 0.999),
    windows: Iterable[int] = (1,),
    steps: int = 2000,
    trials: int = 16,
    shape: tuple[int, int] = (4, 32),
    rec: str = "fp32",
    beta: float = 0.5,
    seed: int = 0,
    record_every: int = 1,
    quantizer: Callable | None = None,
    threads: int | None = 1,
    prefill_flush: bool = True,
) -> pd.DataFrame:
    """Monte Carlo of rounding-error propagation in a state recurrence; a tidy frame.

    Every combination of ``formats x roundings x policies x windows`` is one vectorised run over
    ``len(decays) * trials`` independent state matrices of ``shape = (M, K)`` (value x key).

    Args:
        model: ``'scalar'``, ``'mamba2'`` or ``'gdn'`` (see the module docstring).
        formats: read formats ``F`` (``bf16 fp16 fp8e4m3 fp8e5m2 nvfp4 mxfp8 mxfp4``).
        roundings: ``'rtn'`` and/or ``'sr'`` (applied to both copies).
        policies: ``'shared'`` (``shared:F``) and/or ``'separate'`` (``read:F/rec:<rec>``).
        decays: per-step decays ``a`` in (0, 1) (GDN: ``alpha``).
        windows: ReplaySSM windows ``L >= 1`` (rounding once per ``L`` steps).
        steps: sequence length ``N`` simulated; trials: independent matrices per decay.
        shape: ``(M, K)``; ``K`` must be a multiple of 32 for mx formats, 16 for nvfp4.
        rec: recurrence-anchor format under ``separate`` (``'fp32'`` or a format name).
        beta: GDN write strength in (0, 2]. seed: generator seed and quantizer seed.
        record_every: keep every n-th step (and the last).
        quantizer: ``quantize(x, spec, *, seed, stream)``; default ``replayssm_quant.quantize``.
        prefill_flush: cast the initial (exact) state once at step 0, as ReplaySSM does after
            prefill; False starts both paths from the exact state (error 0 at t = 0).
        threads: torch intra-op threads during the run (restored after); the tensors are
            small, and on CPU one thread is several times faster than a pool. None: unchanged.

    Returns:
        DataFrame with :data:`FRAME_COLUMNS`, one row per (configuration, decay, recorded step).
        Errors are in state units: ``state_*`` of the stored (anchor) state after the step,
        ``read_*`` of the state the step's output is read from; ``*_sem`` = sd / sqrt(elements);
        ``sigma2_*`` = mean per-rounding variance at that flush (NaN between flushes);
        ``pred_*`` / ``apriori_*`` / ``cf_*`` as in the module docstring (eqs. C6.4, C6.6, C6.7).

    Raises:
        ValueError: unknown model, policy, rounding or format; decays outside (0, 1); bad
            window, steps, trials or shape.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    formats, roundings, policies, windows = map(list, (formats, roundings, policies, windows))
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {p!r}")
    for r in roundings:
        if r not in ("rtn", "sr"):
            raise ValueError(f"rounding must be 'rtn' or 'sr', got {r!r}")
    known = set(theory.UNSCALED_FORMATS) | set(theory.SCALED_FORMATS)
    for f in formats + ([rec] if rec != "fp32" else []):
        if f not in known:
            raise ValueError(f"unknown format {f!r}; expected one of {sorted(known)}")
    d = np.asarray(decays, dtype=np.float64)
    if d.ndim != 1 or d.size == 0 or np.any((d <= 0) | (d >= 1)) or len(set(d)) != d.size:
        raise ValueError("decays must be distinct values in (0, 1)")
    if any(int(w) < 1 for w in windows) or steps < 1 or trials < 1 or record_every < 1:
        raise ValueError("windows, steps, trials and record_every must be >= 1")
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"shape must be (M, K), got {shape}")
    if model == "gdn" and not 0 < beta <= 2:
        raise ValueError(f"beta must lie in (0, 2], got {beta}")
    quantizer = quantizer or _default_quantizer()
    frames = []
    with torch_threads(threads):
        for i, (f, r, p, w) in enumerate(itertools.product(formats, roundings, policies, windows)):
            frames.append(
                _run_one(
                    model, f, r, p, rec, int(w), list(map(float, d)), steps, trials,
                    tuple(shape), beta, seed * 1000 + i, record_every, quantizer, prefill_flush,
                )  # fmt: skip
            )
    return pd.concat(frames, ignore_index=True)


def stuck_state(
    fmt: str = "bf16",
    decay: float = 0.999,
    x0: float = 1.0,
    steps: int = 2000,
    trials: int = 256,
    seed: int = 0,
    quantizer: Callable | None = None,
) -> pd.DataFrame:
    """Pure decay ``x_t = Q(a x_{t-1})`` of a state stored in ``fmt``, RTN versus SR.

    The textbook failure of the additive model (eq. C6.9): with bf16 RTN, ``a = 0.999`` and
    ``x_0 = 1``, ``a x`` is within half a spacing of ``x`` (see
    :func:`replayssm_quant.analysis.theory.rtn_stuck_threshold`), so the state never moves, while the exact value
    is ``a^t``. SR is unbiased, so ``E[x_t] = a^t`` exactly (a martingale argument).

    Args:
        fmt: an unscaled format (``bf16`` or ``fp16``); decay in (0, 1); x0 > 0 (rounded to the
            format first); steps >= 1; trials >= 1 independent SR streams.

    Returns:
        Tidy frame, one row per (rounding, step): ``rounding, step, exact, mean, sem, min, max``
        (state units).
    Raises:
        ValueError: a scaled format, ``decay`` outside (0, 1), ``x0 <= 0``, ``steps < 1``.
    """
    if fmt not in theory.UNSCALED_FORMATS:
        raise ValueError(f"stuck_state supports {sorted(theory.UNSCALED_FORMATS)}, got {fmt!r}")
    if not 0 < decay < 1 or x0 <= 0 or steps < 1 or trials < 1:
        raise ValueError("need 0 < decay < 1, x0 > 0, steps >= 1, trials >= 1")
    quantizer = quantizer or _default_quantizer()
    rows = []
    streams = torch.arange(trials, dtype=torch.int64)
    with torch_threads(1):
        return _stuck_loop(fmt, decay, x0, steps, trials, seed, quantizer, rows, streams)


def _stuck_loop(fmt, decay, x0, steps, trials, seed, quantizer, rows, streams):
    for rounding in ("rtn", "sr"):
        spec = _spec(fmt, rounding)
        x = quantizer(torch.full((trials, 1, 1), float(x0)), _spec(fmt, "rtn"), seed=seed)
        x = x.double()
        for t in range(1, steps + 1):
            z = (decay * x).float()
            x = quantizer(z, spec, seed=seed, stream=streams + t * trials).double()
            v = x.flatten()
            rows.append(
                dict(
                    rounding=rounding, step=t, exact=float(x0) * decay**t,
                    mean=v.mean().item(), sem=(v.std() / math.sqrt(trials)).item(),
                    min=v.min().item(), max=v.max().item(),
                )  # fmt: skip
            )
    return pd.DataFrame(rows)


SUMMARY_COLUMNS = (
    "format", "decay", "window", "flushes", "elements", "sigma2_drv", "rho", "kappa",
    "clip_fraction", "clip_rel_bias", "clip_bias2_share", "measured_var", "closed_form_var",
    "ratio", "ratio_tv", "ratio_onpath", "mean", "sem", "mean_over_se",
)  # fmt: skip


def sr_acceptance(
    formats: Iterable[str] = ALL_FORMATS,
    decays: Sequence[float] = (0.9, 0.99, 0.999),
    windows: dict | None = None,
    per_round_decay: float = 0.9,
    flushes: int = 60,
    late_flushes: int = 20,
    trials: int = 16,
    shape: tuple[int, int] = (4, 32),
    seed: int = 0,
    stationary_samples: int = 1024,
    quantizer: Callable | None = None,
) -> pd.DataFrame:
    """SR acceptance experiment of issue 7 in the driven regime (eqs. C6.6, C6.11, C6.12).

    Scalar driven recurrences ``x_t = a x_{t-1} + sqrt(1 - a^2) u_t`` (stationary ``N(0, 1)``),
    shared policy, SR with the real quantizer, rounding once per window ``L``. For each format
    and decay the window is ``windows[a]`` if given, else :func:`replayssm_quant.analysis.theory.driven_window`
    (smallest power of two with ``a^L <= per_round_decay``: 1, 16, 128 for 0.9, 0.99, 0.999).

    The prediction is fully a priori: ``sigma2_drv`` (C6.11) is evaluated by the float64 grid
    model on ``stationary_samples`` fresh draws of the exact stationary state (``N(0, 1)``
    matrices of ``shape``), independently of the simulation, and the closed form is the
    stationary variance ``sigma2_drv / (1 - a^(2L))`` (C6.6). The measurement averages the error
    variance over flushes ``late_flushes+1 .. flushes`` (the transient has decayed by
    ``a^(2L late_flushes)``, under 1e-2 for ``a^L <= 0.9``).

    Returns:
        one row per (format, decay) with :data:`SUMMARY_COLUMNS`: ``ratio`` = measured /
        closed form; ``ratio_tv`` = measured / C6.4 along the exact trajectory (the frame's
        ``apriori_state_var``); ``ratio_onpath`` = measured / C6.4 at the simulated pre-rounding
        values (``pred_state_var``); ``mean`` / ``sem``: late-window average of the per-flush
        mean error and of its standard error (sd / sqrt(elements)); ``kappa`` (C6.12), ``rho``
        and the clipping statistics of :func:`replayssm_quant.analysis.theory.clipping_stats` at the stationary
        state.
    """
    formats = list(formats)
    rng = np.random.default_rng(10_000 + seed)
    z = rng.standard_normal((stationary_samples, *shape))
    drv = {f: theory.driven_sigma2(z, f) for f in formats}
    rows = []
    for i, a in enumerate(decays):
        L = int(windows[a]) if windows and a in windows else theory.driven_window(a, per_round_decay)
        df = simulate(
            "scalar", formats=formats, roundings=["sr"], policies=["shared"], decays=[a],
            windows=[L], steps=flushes * L, trials=trials, shape=shape, seed=seed * 10 + i,
            record_every=L, quantizer=quantizer,
        )  # fmt: skip
        late = df[df["flush"] & (df["step"] > late_flushes * L)]
        for f, g in late.groupby("format", sort=False):
            s2, parts = drv[f]
            cf = float(theory.stationary_variance(a, s2, L))
            meas = float(g["state_var"].mean())
            mean, sem = float(g["state_mean"].mean()), float(g["state_sem"].mean())
            rows.append(dict(
                format=f, decay=float(a), window=L, flushes=flushes,
                elements=int(g["elements"].iloc[0]), sigma2_drv=s2, rho=parts["rho"],
                kappa=float(theory.driven_kappa(a, s2, L, parts["state_ms"])),
                clip_fraction=parts["clip_fraction"], clip_rel_bias=parts["clip_rel_bias"],
                clip_bias2_share=parts["clip_bias2_share"], measured_var=meas,
                closed_form_var=cf, ratio=meas / cf,
                ratio_tv=meas / float(g["apriori_state_var"].mean()),
                ratio_onpath=meas / float(g["pred_state_var"].mean()),
                mean=mean, sem=sem, mean_over_se=mean / sem,
            ))  # fmt: skip
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))

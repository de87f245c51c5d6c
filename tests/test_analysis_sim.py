"""Monte Carlo with the project's quantizers against the closed forms (issue 7 acceptance).

Statistical bounds (stated, not tuned to pass):
* mean: |late-window mean error| <= 4 standard errors (per-step SE across independent
  elements; the window average of a correlated series has at most that SE). 4 SE: a false
  alarm probability ~6e-5 per case.
* variance: within 15% of the closed form (the issue's tolerance); the estimates use >= 1024
  independent elements per step, a relative SE of ~4% per step, lower after averaging.
* trend: 99% confidence interval of a linregress slope.
"""

import numpy as np
import pytest
from scipy import stats

from analysis import simulate as sim
from analysis import theory

ALL_FORMATS = ("bf16", "fp16", "fp8e4m3", "fp8e5m2", "nvfp4", "mxfp8", "mxfp4")
# Formats whose SR is unbiased everywhere: no block maximum can clip (the matrix scale maps
# amax exactly onto the format maximum). nvfp4 (RTN-rounded E4M3 block scale) and MX (floor
# log2 E8M0 scale) clip block maxima, a conditional bias that breaks the uncorrelated-error
# assumption once errors persist (a >= 0.99); see docs/analysis.md for the measured ratios.
UNBIASED = ("bf16", "fp16", "fp8e4m3", "fp8e5m2")


@pytest.fixture(scope="module")
def sr_runs():
    """Shared-policy SR runs: L = 1 for a in {0.9, 0.99}; L = 16 for a = 0.999 (so the run
    reaches stationarity in 100 flushes: a^(2L) = 0.968 per rounding)."""
    fast = sim.simulate(
        "scalar", formats=ALL_FORMATS, roundings=["sr"], policies=["shared"],
        decays=[0.9, 0.99], windows=[1], steps=250, trials=8, seed=11,
    )  # fmt: skip
    slow = sim.simulate(
        "scalar", formats=ALL_FORMATS, roundings=["sr"], policies=["shared"],
        decays=[0.999], windows=[16], steps=1600, trials=16, seed=12, record_every=16,
    )  # fmt: skip
    late = {0.9: 150, 0.99: 150, 0.999: 1000}
    out = {}
    for df in (fast, slow):
        for (f, a), g in df.groupby(["format", "decay"]):
            out[(f, a)] = g[g["step"] > late[a]]
    return out


def _case_id(c):
    return f"{c[0]}-a{c[1]}"


MEAN_CASES = [(f, a) for f in ALL_FORMATS for a in (0.9, 0.99, 0.999)]
VAR_CASES = [(f, 0.9) for f in ALL_FORMATS] + [(f, a) for f in UNBIASED for a in (0.99, 0.999)]


@pytest.mark.parametrize("case", MEAN_CASES, ids=_case_id)
def test_sr_mean_error_is_zero(sr_runs, case):
    g = sr_runs[case]
    assert len(g) >= 30
    assert abs(g["state_mean"].mean()) <= 4 * g["state_sem"].mean()


@pytest.mark.parametrize("case", VAR_CASES, ids=_case_id)
def test_sr_stationary_variance_matches_closed_form(sr_runs, case):
    """Measured variance versus eq. C6.4/C6.6 fed with the per-rounding SR variance of eq. C6.8
    (independent float64 grid model at the pre-rounding values)."""
    g = sr_runs[case]
    ratio = g["state_var"].mean() / g["pred_state_var"].mean()
    assert ratio == pytest.approx(1.0, abs=0.15)


@pytest.mark.parametrize(
    "case", [(f, a) for f in ("bf16", "fp16", "fp8e4m3") for a in (0.9, 0.99, 0.999)], ids=_case_id
)
def test_sr_variance_a_priori_closed_form(sr_runs, case):
    """Fully a-priori prediction: sigma2 from the exact (unquantised) trajectory, one constant
    sigma2 in the closed form C6.6 -- valid while errors are small next to the state."""
    g = sr_runs[case]
    assert g["state_var"].mean() / g["cf_state_var"].mean() == pytest.approx(1.0, abs=0.15)


def test_separate_read_error_does_not_grow_with_n():
    """read:nvfp4+sr/rec:fp32, Mamba-2 state, L = 16: the read-path error is one rounding
    (eq. C6.7) at every N; the shared policy's grows (negative control)."""
    kw = dict(formats=["nvfp4"], roundings=["sr"], decays=[0.999], windows=[16], steps=960,
              trials=8, seed=21)  # fmt: skip
    sep = sim.simulate("mamba2", policies=["separate"], **kw)
    shr = sim.simulate("mamba2", policies=["shared"], **kw)

    def per_window(df):
        nf = df[~df["flush"]].assign(w=lambda d: (d["step"] - 1) // 16)
        nf = nf.assign(norm=nf["read_var"] / nf["pred_read_var"])
        return nf.groupby("w")[["step", "read_var", "pred_read_var", "norm"]].mean()

    s = per_window(sep)
    # error normalised by the single-rounding prediction: no trend in N (99% CI holds 0)
    r = stats.linregress(s["step"], s["norm"])
    tcrit = stats.t.ppf(0.995, len(s) - 2)
    assert abs(r.slope) <= tcrit * r.stderr
    assert s["norm"].mean() == pytest.approx(1.0, abs=0.15)
    # the anchor is FP32: its error stays at FP32 round-off
    assert sep["state_var"].max() < 1e-10
    # negative control: shared nvfp4 error grows with N (slope significantly > 0)
    c = per_window(shr)
    rc = stats.linregress(c["step"], c["read_var"])
    assert rc.slope - tcrit * rc.stderr > 0
    assert c["read_var"].iloc[-5:].mean() > 10 * s["read_var"].iloc[-5:].mean()


def test_bf16_rtn_stuck_state_versus_sr():
    """bf16 RTN with a = 0.999 from 1.0 never moves; SR tracks a^t (unbiased)."""
    df = sim.stuck_state("bf16", decay=0.999, x0=1.0, steps=1000, trials=64, seed=3)
    rtn = df[df["rounding"] == "rtn"]
    srd = df[df["rounding"] == "sr"].set_index("step")
    assert (rtn["max"] == 1.0).all() and (rtn["min"] == 1.0).all()
    assert 1 - 0.999 < theory.rtn_stuck_threshold(1.0, "bf16")  # the closed-form reason
    for t in (100, 500, 1000):
        row = srd.loc[t]
        assert abs(row["mean"] - 0.999**t) <= 4 * row["sem"] + 1e-12
    assert abs(srd.loc[1000, "mean"] - 0.999**1000) < 0.02  # RTN is off by 0.63


def test_gdn_delta_rule_isotropic_prediction():
    """GDN delta rule: error contraction alpha^2 (1 - (2 beta - beta^2)/d_k) per step
    (isotropic approximation of theory.gdn_effective_decay)."""
    df = sim.simulate("gdn", formats=["bf16", "fp8e4m3"], roundings=["sr"], decays=[0.9, 0.99],
                      steps=250, trials=8, beta=0.5, seed=31)  # fmt: skip
    late = df[df["step"] > 150].groupby(["format", "decay"])[["state_var", "pred_state_var"]].mean()
    ratio = late["state_var"] / late["pred_state_var"]
    assert np.all(np.abs(ratio - 1) <= 0.15), ratio


def test_frame_schema_and_validation():
    df = sim.simulate("mamba2", formats=["fp8e4m3"], roundings=["rtn", "sr"],
                      policies=["shared", "separate"], decays=[0.9, 0.5], windows=[1, 4],
                      steps=8, trials=2, record_every=4)  # fmt: skip
    assert tuple(df.columns) == sim.FRAME_COLUMNS
    assert len(df) == 2 * 2 * 2 * 2 * 2  # (rounding, policy, window, decay) x steps {4, 8}
    assert not df.duplicated(["rounding", "policy", "window", "decay", "step"]).any()
    with pytest.raises(ValueError, match="model"):
        sim.simulate("rwkv")
    with pytest.raises(ValueError, match="policy"):
        sim.simulate(policies=["mixed"])
    with pytest.raises(ValueError, match="unknown format"):
        sim.simulate(formats=["fp6"])
    with pytest.raises(ValueError, match="decays"):
        sim.simulate(decays=[1.0])

"""Scale modes of the block-scaled formats (issue 18, item 4): MX ``+rceil`` / ``+even`` (and
the OCP ``floor`` default) and NVFP4 ``+up``, against independent float64 / ml_dtypes oracles;
no clipping (hence unbiased SR) where the mode promises it; the Triton kernels against the
reference under ``TRITON_INTERPRET=1``."""

import math
import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from replayssm_quant import formats as F  # noqa: E402
from replayssm_quant.formats import QuantSpec, parse_spec  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402
from replayssm_quant.quant import pack, quantize  # noqa: E402

MX = {"mxfp8": (F.E4M3, ml_dtypes.float8_e4m3fn, F.MXFP8_EMAX),
      "mxfp4": (F.E2M1, ml_dtypes.float4_e2m1fn, F.MXFP4_EMAX)}


# ------------------------------------------------------------------------------ parsing
@pytest.mark.parametrize("token,canon,mode", [
    ("mxfp4+rceil", "mxfp4+rceil", "rceil"), ("MXFP8+SR+EVEN", "mxfp8+even+sr", "even"),
    ("mxfp4+floor", "mxfp4", "floor"), ("nvfp4+up+sr", "nvfp4+up+sr", "up"),
    ("nvfp4+rn", "nvfp4", "rn"), ("fp16", "fp16", ""),
])
def test_parse_scale_modes(token, canon, mode):
    s = parse_spec(token)
    assert str(s) == canon and s.scale_mode == mode and parse_spec(str(s)) == s
    assert str(StatePolicy.parse(f"read:{token}/rec:fp32")) == f"read:{canon}/rec:fp32"


@pytest.mark.parametrize("bad", ["fp16+up", "nvfp4+rceil", "mxfp4+up", "mxfp4+rceil+even",
                                 "mxfp4+rceil+rceil", "nvfp4+", "fp8e4m3+even"])
def test_bad_scale_modes(bad):
    with pytest.raises(ValueError) as e:
        parse_spec(bad)
    assert repr(bad) in str(e.value) and "+rceil" in str(e.value)
    with pytest.raises(ValueError, match="scale mode"):
        QuantSpec("fp16", False, "up")


# ------------------------------------------------------------------------------ MX oracle
def _mx_scale_exp(amax: float, mode: str, grid: F.FloatGrid, emax: int) -> int:
    """float64 definition of the E8M0 exponent (formats.SCALE_MODES)."""
    if amax == 0:
        return F.E8M0_MIN_EXP
    m, e = math.frexp(amax)  # amax = m 2^e, m in [0.5, 1)
    E = e - 1  # floor(log2 amax)
    if mode == "floor":
        s = E - emax
    elif mode == "rceil":  # smallest s with amax <= max_elem * 2^s
        s = E - emax - 2
        while amax > grid.max * 2.0 ** s:
            s += 1
    else:  # even: amax rounded half-up to mbits mantissa bits, then floor(log2)
        r = math.floor(amax / 2.0 ** E * 2 ** grid.mbits + 0.5) / 2 ** grid.mbits * 2.0 ** E
        s = math.frexp(r)[1] - 1 - emax
    return max(F.E8M0_MIN_EXP, min(F.E8M0_MAX_EXP, s))


def _mx_oracle(x: np.ndarray, name: str, mode: str) -> np.ndarray:
    grid, dt, emax = MX[name]
    out = np.empty_like(x, dtype=np.float64)
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx].astype(np.float64)
        for b in range(0, row.size, F.MX_BLOCK):
            blk = row[b: b + F.MX_BLOCK]
            X = 2.0 ** _mx_scale_exp(float(np.abs(blk).max()), mode, grid, emax)
            y = np.clip(blk / X, -grid.max, grid.max)  # saturation policy
            out[idx][b: b + F.MX_BLOCK] = y.astype(dt).astype(np.float64) * X
    return out


def _mx_values(seed: int) -> np.ndarray:
    """Rows whose block amax sits on, just below and just above every mode's threshold, plus
    random rows over many binades."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 8, 64)) * np.exp2(rng.uniform(-30, 30, (6, 8, 1)))).astype(np.float32)
    specials = [1.5, 1.75, 1.875, 1.9375, 1.99, 1.0, 1.25]
    x[0] *= 1e-6
    x[3] *= 1e-6
    for i, m in enumerate(specials):  # matrix 0: exact threshold | next up; matrix 3: next down
        v = np.float32(m * 2.0 ** (i - 3))
        x[0, i, 0] = v
        x[0, i, 32] = np.nextafter(v, np.float32(np.inf))
        x[3, i, 0] = -np.nextafter(v, np.float32(0))
    x[1, :, :32] *= 1e-3
    x[2, 0, :] = 0.0
    return x


@pytest.mark.parametrize("name", list(MX))
@pytest.mark.parametrize("mode", ["floor", "rceil", "even"])
def test_mx_scale_modes_match_float64_oracle(name, mode):
    x = _mx_values(zlib.crc32(f"{name}{mode}".encode()))
    spec = name + ("" if mode == "floor" else "+" + mode)
    got = quantize(torch.from_numpy(x), spec).numpy().astype(np.float64)
    want = _mx_oracle(x, name, mode)
    bad = got != want
    assert not bad.any(), (bad.sum(), x[bad][:4], got[bad][:4], want[bad][:4])
    assert np.array_equal(pack(torch.from_numpy(x), spec).dequantize().numpy(), got.astype(np.float32))


@pytest.mark.parametrize("name", list(MX))
def test_mx_rceil_never_clips(name):
    grid, _, _ = MX[name]
    x = torch.from_numpy(_mx_values(5))
    p = pack(x, name + "+rceil")
    scale = torch.pow(2.0, p.block_scales.double() - F.E8M0_BIAS)  # [.., M, nb]
    amax = x.abs().unflatten(-1, (-1, F.MX_BLOCK)).amax(-1).double()
    assert (amax <= grid.max * scale).all()
    floor = pack(x, name).block_scales.double()
    assert ((p.block_scales.double() - floor) >= 0).all()  # never below the OCP exponent


# ------------------------------------------------------------------------------ NVFP4 up oracle
_E4M3_POS = np.unique(np.arange(1, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))


def _nvfp4_up_oracle(mat: np.ndarray):
    """Brute force (numpy float32 arithmetic, as the element path): the smallest FP32 s_g >=
    amax/2688 with amax / (448 s_g) <= 6, then per block the smallest positive E4M3 s_b with
    bamax / (s_b s_g) <= 6 (0 for a zero block); elements RTN by ml_dtypes."""
    f = np.float32
    amax = f(np.abs(mat).max())
    s_g = f(amax / f(2688.0)) if amax > 0 else f(1.0)
    while amax / f(f(448.0) * s_g) > f(6.0):
        s_g = np.nextafter(s_g, f(np.inf))
    out = np.empty_like(mat)
    sbs = []
    for r in range(mat.shape[0]):
        for b in range(0, mat.shape[1], 16):
            blk = mat[r, b: b + 16]
            bamax = f(np.abs(blk).max())
            if bamax == 0:
                out[r, b: b + 16] = 0
                sbs.append(0.0)
                continue
            ok = [v for v in _E4M3_POS if bamax / f(v * s_g) <= f(6.0)]
            s_b = f(min(ok))
            scale = f(s_b * s_g)
            y = (blk / scale).astype(np.float32)
            assert np.abs(y).max() <= 6.0  # no clipping
            out[r, b: b + 16] = y.astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * scale
            sbs.append(float(s_b))
    return out, s_g, np.array(sbs, dtype=np.float32)


def test_nvfp4_up_matches_brute_force_oracle():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((5, 6, 64)) * np.exp2(rng.uniform(-20, 20, (5, 6, 1)))
         * np.exp2(rng.uniform(-6, 0, (5, 6, 64)))).astype(np.float32)
    x[0, 0, :16] = [3.1875] + [0.0] * 15  # the docs' RTN-clipping block
    x[0, 1, :16] = 0.0
    x[1] = rng.standard_normal((6, 64)).astype(np.float32) * 1e-4
    x[1, 2, 5] = 2688.0  # s_g = 1 exactly
    x[2, :, :] = np.float32(448 * 6) * rng.uniform(0.999, 1.0, (6, 64)).astype(np.float32)
    p = pack(torch.from_numpy(x), "nvfp4+up")
    q = quantize(torch.from_numpy(x), "nvfp4+up").numpy()
    sb_got = p.block_scales.view(torch.float8_e4m3fn).float().numpy()
    for i in range(x.shape[0]):
        want, s_g, sbs = _nvfp4_up_oracle(x[i])
        assert np.float32(p.matrix_scale[i]) == s_g
        assert np.array_equal(sb_got[i].reshape(-1), sbs)
        assert np.array_equal(q[i], want), i
    # never below the default's block scale
    rn = pack(torch.from_numpy(x), "nvfp4").block_scales.view(torch.float8_e4m3fn).float()
    assert (torch.from_numpy(sb_got) >= rn).all()


def test_nvfp4_up_never_clips_random():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, 64, generator=g) * torch.pow(10.0, torch.empty(64, 8, 1).uniform_(-8, 8, generator=g))
    p = pack(x, "nvfp4+up")
    scale = p.block_scales.view(torch.float8_e4m3fn).float() * p.matrix_scale[:, None, None]
    bamax = x.abs().unflatten(-1, (-1, 16)).amax(-1)
    assert (bamax / scale <= 6.0).all()


# ------------------------------------------------------------------------------ unbiased SR
@pytest.mark.parametrize("spec,biased", [("nvfp4+sr", True), ("nvfp4+up+sr", False),
                                         ("mxfp4+sr", True), ("mxfp4+rceil+sr", False)])
def test_sr_is_unbiased_only_without_clipping(spec, biased):
    """A block whose default scale clips its largest element (NVFP4: s_g = 1, amax 3.1875 ->
    s_b 0.5, y = 6.375; MXFP4: amax 7.5 -> X = 1, y = 7.5): the default SR mean is the clipped
    value; with the scale rounded up the SR mean is the input within 4 standard errors."""
    nv = spec.startswith("nvfp4")
    v = 3.1875 if nv else 7.5
    x = torch.zeros(4000, 1, 32)
    x[:, 0, 0] = v
    if nv:
        x[:, 0, 16] = 2688.0  # matrix amax -> s_g = 1 exactly
    streams = torch.arange(4000, dtype=torch.int64)
    q = quantize(x, spec, seed=1, stream=streams)[:, 0, 0].double()
    if biased:
        assert torch.all(q == (3.0 if nv else 6.0))
    else:
        se = q.std() / math.sqrt(q.numel())
        assert abs(q.mean().item() - v) < 4 * se.item(), (q.mean().item(), v, se.item())
        assert q.unique().numel() == 2


# ------------------------------------------------------------------------------ kernels
SCALE_SPECS = ["nvfp4+up", "mxfp4+rceil", "mxfp4+even", "mxfp8+rceil", "mxfp8+even"]


@pytest.mark.parametrize("spec", SCALE_SPECS)
@pytest.mark.parametrize("sr", ["", "+sr"])
def test_kernel_matches_reference(spec, sr):
    import test_quant_kernels as T

    shape = T.SHAPES[0]
    T.check_against_reference(T._random(shape, seed=zlib.crc32((spec + sr).encode())), spec + sr,
                              T._streams(shape[0]))
    x = T._special(spec.split("+")[0])
    T.check_against_reference(x, spec + sr, T._streams(x.shape[:1]))

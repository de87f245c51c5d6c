"""Triton quantizer kernels against the torch reference, bit for bit.

Runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1``, set by conftest.py and
again here before the kernels are imported), or on CUDA when the interpreter is switched off
(``TRITON_INTERPRET=0``) and a GPU is present. Shapes are small: the interpreter runs each
program in Python.

Compared: fake-quant values (int32 views of float32, NaN positions equal), packed codes, block
scales and matrix scales (bytes equal), and ``pack(x).dequantize() == quantize(x)``.
"""

from __future__ import annotations

import importlib
import math
import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from replayssm_quant import formats as F  # noqa: E402
from replayssm_quant.quant import pack, pack_reference, quantize, quantize_reference  # noqa: E402

from replayssm_quant.capabilities import triton_interpreting  # noqa: E402

INTERPRET = triton_interpreting()
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

import replayssm_quant.kernels.quant as kq  # noqa: E402

if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
if INTERPRET and type(kq._matrix_kernel).__name__ != "InterpretedFunction":
    # imported before TRITON_INTERPRET was set: decorate the kernels again
    kq = importlib.reload(kq)

FORMATS = ["bf16", "fp16", "fp8e4m3", "fp8e5m2", "nvfp4", "mxfp8", "mxfp4"]
MODES = ["rtn", "sr"]
SEED = 0x1234_5678_9ABC  # > 2^32: both Philox key words matter
NAN, INF = float("nan"), float("inf")
FLT_MAX = torch.finfo(torch.float32).max


def _spec(fmt: str, mode: str) -> str:
    return fmt + ("+sr" if mode == "sr" else "")


def _streams(lead) -> torch.Tensor:
    n = math.prod(lead)
    # distinct keys with non-zero high words
    keys = torch.arange(n, dtype=torch.int64) * 0x1_0000_0001 + 17
    return keys.view(lead)


# ----------------------------------------------------------------------------------------
# comparison helpers
# ----------------------------------------------------------------------------------------


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str = "values") -> None:
    """float32 tensors equal bit for bit, except that NaN payloads are not compared."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype == torch.float32, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN positions differ at {(gn != wn).nonzero()[:5]}"
    gi = torch.where(gn, 0, got.view(torch.int32))
    wi = torch.where(wn, 0, want.view(torch.int32))
    bad = (gi != wi).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} of {got.numel()} differ; first at {bad[0].tolist()}: "
        f"got {got[tuple(bad[0])].item()!r}, want {want[tuple(bad[0])].item()!r}"
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.uint8)


def assert_same_bytes(got, want, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    assert got is not None, what
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    gb, wb = _bytes(got), _bytes(want)
    bad = (gb != wb).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at byte {bad[0].item()}"


def check_against_reference(x: torch.Tensor, spec: str, stream, seed: int = SEED) -> None:
    """Kernel vs reference: fake values, packed storage, and packed decode."""
    xd = x.to(DEVICE)
    sd = stream.to(DEVICE) if isinstance(stream, torch.Tensor) else stream
    want = quantize_reference(x, spec, seed=seed, stream=stream)
    got = kq.quantize_triton(xd, spec, seed=seed, stream=sd)
    assert_bitwise(got, want, f"{spec} quantize")

    pw = pack_reference(x, spec, seed=seed, stream=stream)
    pg = kq.pack_triton(xd, spec, seed=seed, stream=sd)
    assert str(pg.spec) == str(pw.spec) and tuple(pg.shape) == tuple(pw.shape)
    assert_same_bytes(pg.codes, pw.codes, f"{spec} codes")
    assert_same_bytes(pg.block_scales, pw.block_scales, f"{spec} block scales")
    assert_same_bytes(pg.matrix_scale, pw.matrix_scale, f"{spec} matrix scale")
    assert pg.nbytes == pw.nbytes
    assert_bitwise(pg.dequantize(), got, f"{spec} pack(x).dequantize() vs quantize(x)")


# ----------------------------------------------------------------------------------------
# random data across many binades
# ----------------------------------------------------------------------------------------

# (leading dims, M, K): K = 40 and 20 leave tail blocks for MX (32) and NVFP4 (16); K = 64
# divides both; the last shape spans several loop tiles of every kernel.
SHAPES = [((2,), 3, 40), ((1,), 2, 20), ((2, 1), 2, 64),
          ((3,), 3, 7)]  # M K = 21: four consecutive elements can span two matrices (no ALIGNED4)
BIG_SHAPE = ((2,), 24, 100)


def _shape_id(shape) -> str:
    lead, m, k = shape
    return f"B{'x'.join(map(str, lead))}-M{m}-K{k}"


def _random(shape, seed: int) -> torch.Tensor:
    lead, m, k = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, m, k, generator=g)
    # per-row magnitudes over 12 decades, and some elements much smaller than their row
    rows = torch.pow(10.0, torch.empty(*lead, m, 1).uniform_(-6, 6, generator=g))
    elems = torch.pow(10.0, torch.empty(*lead, m, k).uniform_(-8, 0, generator=g))
    return (x * rows * torch.where(torch.rand(x.shape, generator=g) < 0.2, elems, 1.0)).float()


CASES = [
    pytest.param(fmt, mode, shape, id=f"{fmt}-{mode}-{_shape_id(shape)}")
    for fmt in FORMATS
    for mode in MODES
    for shape in SHAPES
] + [
    pytest.param(fmt, "sr", BIG_SHAPE, id=f"{fmt}-sr-{_shape_id(BIG_SHAPE)}")
    for fmt in FORMATS
]


@pytest.mark.parametrize("fmt,mode,shape", CASES)
def test_kernel_matches_reference_random(fmt, mode, shape):
    x = _random(shape, seed=zlib.crc32(f"{fmt}-{mode}-{_shape_id(shape)}".encode()))
    check_against_reference(x, _spec(fmt, mode), _streams(shape[0]))


# ----------------------------------------------------------------------------------------
# special values
# ----------------------------------------------------------------------------------------


def _anchor(fmt: str) -> float:
    """A block value that makes the element scale exactly 1 (so ties stay ties)."""
    return {"fp8e4m3": 448.0, "fp8e5m2": 57344.0, "nvfp4": 6.0, "mxfp8": 448.0,
            "mxfp4": 6.0}.get(fmt, 1.0)


def _ties(fmt: str, n: int, g: torch.Generator) -> torch.Tensor:
    """Exact midpoints between neighbouring points of the element grid (normal binades and
    the subnormal range), random signs."""
    grid = F.FORMATS[fmt].element
    e = torch.randint(grid.emin - 1, grid.emin + 6, (n,), generator=g)
    e = torch.maximum(e, torch.tensor(grid.emin))
    odd = 2 * torch.randint(0, 2 ** (grid.mbits + 1), (n,), generator=g) + 1
    v = odd.double() * torch.pow(2.0, (e - grid.mbits - 1).double())
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (v * sign).clamp(-grid.max, grid.max).float()


def _special(fmt: str) -> torch.Tensor:
    """[6, 4, 40]: one scenario per matrix (K = 40 leaves tail blocks for 16 and 32)."""
    g = torch.Generator().manual_seed(7)
    m, k = 4, 40
    x = torch.randn(6, m, k, generator=g)
    # 0: non-finite values, -0.0, zeros, huge and subnormal values mixed with ordinary ones
    x[0, 0, :8] = torch.tensor([NAN, -NAN, INF, -INF, -0.0, 0.0, 1e-40, -1.4e-45])
    x[0, 1, :16] = 0.0  # an all-zero block (nvfp4) next to a normal one
    x[0, 1, 16:32] = -0.0
    x[0, 2, 33] = -INF  # non-finite in the padded tail block
    x[0, 3, :] = torch.randn(k, generator=g) * 1e-38
    # NaNs with payloads (quiet, signalling, negative) in blocks that hold no inf: the
    # block amax must mark them without an inf beside them; fp16 codes are 0x7E00 | sign
    bits = torch.tensor([0x7FFFFFFF, 0x7FA00000, 0xFFA00000 - 2**32, 0x7F800001],
                        dtype=torch.int64).to(torch.int32)
    x[0, 2, 20:24] = bits.view(torch.float32)
    x[0, 3, 5] = bits[1:2].view(torch.float32)
    # 1: all zeros, half of them -0.0
    x[1] = 0.0
    x[1, :, ::2] = -0.0
    # 2: only subnormals and tiny normals (amax is subnormal in row 0)
    x[2] = torch.randn(m, k, generator=g) * 1e-39
    x[2, 0] = torch.randn(k, generator=g) * 1e-44
    x[2, 1, :5] = torch.tensor([1.4e-45, -2.8e-45, 1.2e-38, -1.1755e-38, 5e-39])
    # 3: huge values up to FLT_MAX and one tiny element per row
    x[3] = torch.randn(m, k, generator=g) * 1e37
    x[3, :, 0] = torch.tensor([FLT_MAX, -FLT_MAX, 3.0e38, -2.9e38])
    x[3, :, 7] = 1e-30
    # 4: grid midpoints with unit scale (anchor at the format's maximum in every block)
    x[4] = _ties(fmt, m * k, g).view(m, k)
    if fmt == "nvfp4":
        x[4, 0, 0] = F.E4M3_MAX * F.E2M1_MAX  # s_g = 1
        x[4, 1:, ::16] = _anchor(fmt)
        x[4, 2, 16:32] = torch.tensor([3.1875, -3.0] + [0.25, 0.75, 1.25, 2.5] * 3 + [1.0, -1.5])
    elif fmt.startswith("mx"):
        x[4, :, ::32] = _anchor(fmt)
    else:
        x[4, 0, 0] = _anchor(fmt)
    # 5: the ties the issue names, plus saturation inputs, unscaled where the format is
    row = [0.25, 0.75, 1.25, 2.5, 5.0, 1.00048828125, 248.0, 465.0, 1e9, -1e9, 1.0 + 2**-8,
           65520.0, 65519.0, 57344.0 * 1.125, -0.0, 3.39e38]
    x[5, 0, :len(row)] = torch.tensor(row)
    x[5, 1] = torch.linspace(-500, 500, k)
    return x


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_matches_reference_special_values(fmt, mode):
    x = _special(fmt)
    check_against_reference(x, _spec(fmt, mode), _streams((x.shape[0],)))


# ----------------------------------------------------------------------------------------
# batch composition, streams, dtypes, dispatch
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_result_does_not_depend_on_batch(fmt):
    """A matrix's result is the same alone or in a batch (its stream key travels with it);
    for formats without a matrix scale, also a row's result whatever the other rows hold."""
    spec = _spec(fmt, "sr")
    x = _random(((3,), 3, 40), seed=11).to(DEVICE)
    st = _streams((3,)).to(DEVICE)
    full = kq.quantize_triton(x, spec, seed=SEED, stream=st)
    for i in (0, 2):
        alone = kq.quantize_triton(x[i : i + 1], spec, seed=SEED, stream=st[i : i + 1])
        assert_bitwise(alone[0], full[i], f"{spec} matrix {i} alone")
    if F.FORMATS[fmt].scaling in ("none", "mx"):
        y = x.clone()
        y[1, 0] *= 1e6  # other rows of the same matrix change
        y[1, 2] = NAN
        got = kq.quantize_triton(y, spec, seed=SEED, stream=st)
        assert_bitwise(got[1, 1], full[1, 1], f"{spec} row 1 of matrix 1")


@pytest.mark.parametrize("M,K", [(3, 40), (3, 7)], ids=["aligned4", "unaligned"])
def test_unscaled_sr_does_not_depend_on_batch(M, K):
    """The unscaled kernel's SR draws (one Philox call per four elements where M K % 4 == 0,
    per element otherwise) are the same for a matrix alone, in a batch, and at another batch
    position (the batch reversed with its stream keys)."""
    spec = _spec("fp16", "sr")
    x = _random(((5,), M, K), seed=13).to(DEVICE)
    st = _streams((5,)).to(DEVICE)
    full = kq.quantize_triton(x, spec, seed=SEED, stream=st)
    rev = kq.quantize_triton(x.flip(0), spec, seed=SEED, stream=st.flip(0)).flip(0)
    assert_bitwise(rev, full, f"{spec} M={M} K={K} reversed batch")
    for i in (0, 3):
        alone = kq.quantize_triton(x[i : i + 1], spec, seed=SEED, stream=st[i : i + 1])
        assert_bitwise(alone[0], full[i], f"{spec} M={M} K={K} matrix {i} alone")


def test_stream_broadcast_and_errors():
    x = _random(((2, 3), 2, 40), seed=3)
    st = torch.tensor([[5], [2**40 + 9]])  # [2, 1] -> [2, 3]
    check_against_reference(x, "mxfp4+sr", st)
    check_against_reference(x, "fp8e5m2+sr", 123)
    with pytest.raises(ValueError, match="does not broadcast"):
        kq.quantize_triton(x.to(DEVICE), "nvfp4+sr", stream=torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_input_dtypes_and_layouts(dtype):
    x = _random(((2,), 40, 3), seed=5).transpose(-1, -2).to(dtype)  # non-contiguous [2,3,40]
    check_against_reference(x, "nvfp4+sr", _streams((2,)))


def test_float64_beyond_float32_range_saturates_in_kernels():
    """The kernels take float64 input through the reference's saturating float32 cast: a
    finite value beyond float32's range gives the bits of float32 max (fp16: 65504, scaled
    formats: finite), against the reference and the float32 input with float32 max."""
    f32max = torch.finfo(torch.float32).max
    x32 = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(4))
    x64 = x32.double()
    x64[0, 1, 3], x64[1, 2, 31] = 1e39, -3.5e38
    x32[0, 1, 3], x32[1, 2, 31] = f32max, -f32max
    for spec in ("fp16", "fp8e4m3+sr", "nvfp4", "mxfp8"):
        check_against_reference(x64, spec, 0)
        got = kq.quantize_triton(x64.to(DEVICE), spec, seed=SEED)
        want = kq.quantize_triton(x32.to(DEVICE), spec, seed=SEED)
        assert_bitwise(got, want, spec)
        assert torch.isfinite(got).all(), spec


def test_public_api_dispatches_to_kernels(monkeypatch):
    x = _random(((2,), 3, 40), seed=9).to(DEVICE)
    for spec in ("fp8e4m3+sr", "mxfp8"):
        want = kq.quantize_triton(x, spec, seed=3, stream=4)
        assert_bitwise(quantize(x, spec, seed=3, stream=4, backend="triton"), want, spec)
        p = pack(x, spec, seed=3, stream=4, backend="triton")
        assert_same_bytes(p.codes, kq.pack_triton(x, spec, seed=3, stream=4).codes, spec)
    monkeypatch.setenv("REPLAYSSM_BACKEND", "triton")
    assert_bitwise(quantize(x, "mxfp4+sr", seed=1, stream=2),
                   kq.quantize_triton(x, "mxfp4+sr", seed=1, stream=2), "env backend")


def test_rejects_identity_and_bad_specs():
    x = torch.zeros(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="identity"):
        kq.quantize_triton(x, "fp32")
    with pytest.raises(ValueError, match="nvfp5"):
        kq.pack_triton(x, "nvfp5")
    with pytest.raises(ValueError):
        kq.quantize_triton(torch.zeros(16, device=DEVICE), "nvfp4")


def test_sr_threshold_is_exact():
    """SR rounds up iff r < frac * 2^32, exactly at the boundary: with unit MX scale and
    E2M1 quantum 0.5, an element y = t * 2^-33 has frac * 2^32 = t. Setting t = r with its
    low 8 bits cleared (t == r for about 1 in 256 elements) must never round up; t one
    step of 256 above must always round up."""
    from replayssm_quant.philox import random_bits

    m, k, stream = 64, 64, 77
    elem = torch.arange(m * k, dtype=torch.int64).view(m, k)
    r = random_bits(SEED, torch.tensor(stream), elem)
    t = torch.where(elem % 2 == 0, r & ~0xFF, (r | 0xFF) + 1)
    x = (t.double() * 2.0**-33).float()
    x[:, ::32] = F.E2M1_MAX  # block amax 6 -> E8M0 scale 2^0
    assert int(((r & 0xFF) == 0)[:, ::2].sum()) > 0  # the boundary r == t occurs
    want = torch.where(elem % 2 == 0, 0.0, 0.5)
    want[:, ::32] = F.E2M1_MAX
    want = torch.where(x == 2.0**-1, 0.5, want)  # t = 2^32: y = 0.5 exactly, no rounding
    got = kq.quantize_triton(x[None].to(DEVICE), "mxfp4+sr", seed=SEED, stream=stream)[0]
    assert_bitwise(got, want, "kernel")
    ref = quantize_reference(x[None], "mxfp4+sr", seed=SEED, stream=stream)[0]
    assert_bitwise(ref, want, "reference")


def test_sr_threshold_ceiling_below_the_32_bit_fraction():
    """When the fraction frac(m) * 2^32 is not an integer (|y| far below the quantum, the
    kernel's shift > 32), the threshold is its ceiling: y = S * 2^(-33 - j) (S odd, 24 bits)
    has m = y / 0.5 < 1 and frac(m) * 2^32 = S / 2^j = r + 2^-j for S = r 2^j + 1, so it must
    round up to 0.5 exactly when r < ceil(...) = r + 1, i.e. always. Only draws r < 2^23 can
    be placed so (j = 23 - floor(log2 r) >= 1); the other elements are 2^-40 (never up with
    r >= 2^23: the threshold is at most 2^-8 * 2^32)."""
    from replayssm_quant.philox import random_bits

    m, k, stream = 256, 256, 5
    elem = torch.arange(m * k, dtype=torch.int64).view(m, k)
    r = random_bits(SEED, torch.tensor(stream), elem)
    placed = (r > 0) & (r < 2**23)
    placed[:, ::32] = False
    assert int(placed.sum()) > 20  # about 1 in 512 of the draws
    rr = torch.where(placed, r, 1).double()
    j = 23 - torch.floor(torch.log2(rr))  # r 2^j in [2^23, 2^24)
    s = rr * 2.0**j + 1
    x = torch.where(placed, s * 2.0 ** (-33 - j), 2.0**-40).float()
    x[:, ::32] = F.E2M1_MAX  # block amax 6 -> E8M0 scale 2^0
    assert bool((x.double()[placed] == (s * 2.0 ** (-33 - j))[placed]).all())  # exact in fp32
    want = torch.where(placed, 0.5, 0.0)
    want[:, ::32] = F.E2M1_MAX
    got = kq.quantize_triton(x[None].to(DEVICE), "mxfp4+sr", seed=SEED, stream=stream)[0]
    assert_bitwise(got, want, "kernel")
    ref = quantize_reference(x[None], "mxfp4+sr", seed=SEED, stream=stream)[0]
    assert_bitwise(ref, want, "reference")


# ----------------------------------------------------------------------------------------
# pack_pair_triton: two casts of one tensor in one launch (the split flush's casts)
# ----------------------------------------------------------------------------------------

PAIR_PLAIN = ["fp16+sr", "fp16", "bf16+sr", "bf16", "fp32"]
PAIR_SCALED = ["nvfp4", "nvfp4+sr", "nvfp4+up", "nvfp4+up+sr"]
# the default run: every plain and every scaled spec at least once; the other pairs are slow
PAIR_FAST = {("fp16+sr", "nvfp4+sr"), ("fp16+sr", "nvfp4+up+sr"), ("fp16", "nvfp4+up"),
             ("bf16+sr", "nvfp4"), ("bf16", "nvfp4+up+sr"), ("fp32", "nvfp4")}
# the lean kernel: the nvfp4 policy the decode benchmark times (fp16+sr + nvfp4), bf16 codes
# (by _quant inside the lean kernel) with SR on both copies, the fp32 plain copy with nvfp4+up
# (the RTN fp16 plain copy, 6 s under the interpreter on 2 cores, with -m slow)
PAIR_FAST_LEAN = {("fp16+sr", "nvfp4"), ("bf16+sr", "nvfp4+sr"), ("fp32", "nvfp4+up")}
# the reciprocal division: RTN NVFP4 copies (under SR it is the lean form); with an SR fp16
# plain copy (12 s) with -m slow
PAIR_FAST_RCP = {("fp16", "nvfp4+up"), ("fp32", "nvfp4")}
PAIR_CASES = [pytest.param(p, c, form, marks=() if (p, c) in fast else pytest.mark.slow,
                           id=f"{p}-{c}-{form}")
              for form, fast in (("generic", PAIR_FAST), ("lean", PAIR_FAST_LEAN),
                                 ("lean_rcp", PAIR_FAST_RCP))
              for p in PAIR_PLAIN for c in PAIR_SCALED]


def _finite_amax(x):
    """Each matrix's max |x| over its finite elements (0 where none): float32 ``x.shape[:-2]``."""
    a = x.abs()
    return torch.where(a < float("inf"), a, torch.zeros_like(a)).amax(dim=(-2, -1))


def _check_pair(x, plain, scaled, sp, ss, **tile):
    """pack_pair_triton against pack_reference of each copy, byte for byte (the reference
    with its own stream per copy); the plain fp32 copy is x itself."""
    xd = x.to(DEVICE)
    p_st, s_st = kq.pack_pair_triton(xd, plain, scaled, seed=SEED, plain_stream=sp.to(DEVICE),
                                     scaled_stream=ss.to(DEVICE), **tile)
    want = pack_reference(x, scaled, seed=SEED, stream=ss)
    assert str(s_st.spec) == str(want.spec) and tuple(s_st.shape) == tuple(want.shape)
    for part in ("codes", "block_scales", "matrix_scale"):
        g, w = getattr(s_st, part), getattr(want, part)
        assert g.shape == w.shape, (part, g.shape, w.shape)  # 0-dim matrix scale: no lead dims
        assert_same_bytes(g.reshape(-1), w.reshape(-1), f"{plain}|{scaled} {part}")
    if plain == "fp32":
        assert p_st is xd
        return p_st, s_st
    want = pack_reference(x, plain, seed=SEED, stream=sp)
    assert str(p_st.spec) == str(want.spec) and p_st.block_scales is None
    assert_same_bytes(p_st.codes, want.codes, f"{plain}|{scaled} plain codes")
    return p_st, s_st


@pytest.mark.parametrize("plain,scaled,form", PAIR_CASES)
def test_pack_pair_matches_reference(plain, scaled, form):
    """Both copies equal the reference packs (each with its own SR stream) on special values
    (non-finite, -0, subnormal, FLT_MAX, grid midpoints; K = 40 leaves a padded NVFP4 tail
    block of 8), on random data over many binades with K = 7 (no four-element Philox
    alignment: the lean form falls back to the generic kernel), K = 44, 20 and 4 (tail
    blocks of 12 and 4, and a row that is one padded block), and with tiles of 4 block rows
    on 1 warp (several tiles per matrix); each kernel form (``form``)."""
    x = _special("nvfp4")
    lead = (x.shape[0],)
    sp, ss = _streams(lead), _streams(lead) * 3 + 1
    _check_pair(x, plain, scaled, sp, ss, form=form)
    _check_pair(x, plain, scaled, sp, ss, rows=4, num_warps=1, form=form)
    # the matrix amax given (as the split flush's fp32 flush gives it): the same bytes
    _check_pair(x, plain, scaled, sp, ss, rows=4, num_warps=1, form=form,
                matrix_amax=_finite_amax(x).to(DEVICE))
    y = _random(((2, 1), 3, 7), seed=21)
    _check_pair(y, plain, scaled, _streams((2, 1)), _streams((2, 1)) + 5, rows=2, form=form)
    w = _random(((2,), 3, 44), seed=23)
    _check_pair(w, plain, scaled, _streams((2,)) + 2, _streams((2,)) + 7, rows=2, form=form)
    v = _random(((2,), 3, 20), seed=24)
    _check_pair(v, plain, scaled, _streams((2,)) + 4, _streams((2,)) + 9, form=form)
    u = _random(((3,), 2, 4), seed=25)
    _check_pair(u, plain, scaled, _streams((3,)) + 6, _streams((3,)) + 1, rows=2, form=form)
    z = _random(((), 5, 48), seed=22)  # one matrix, no leading dims (a 0-dim matrix scale)
    _check_pair(z, plain, scaled, torch.tensor(3), torch.tensor(8), form=form)


@pytest.mark.parametrize("form", ["generic", "lean", "lean_rcp"])
def test_pack_pair_batch_and_tile_invariant(form):
    """A matrix's two copies are the same alone, in the batch, at another batch position
    (the batch reversed with its stream keys), under another tile and in the other kernel
    form."""
    x = _random(((5,), 24, 64), seed=17).to(DEVICE)
    sp, ss = _streams((5,)).to(DEVICE), (_streams((5,)) + 9).to(DEVICE)

    scaled = "nvfp4" if form == "lean_rcp" else "nvfp4+sr"  # the reciprocal: RTN only

    def run(xx, a, b, **tile):
        p, s = kq.pack_pair_triton(xx, "fp16+sr", scaled, seed=SEED, plain_stream=a,
                                   scaled_stream=b, **{"form": form, **tile})
        return p.codes.view(torch.int16), s.codes, s.block_scales, s.matrix_scale

    full = run(x, sp, ss)
    rev = run(x.flip(0).contiguous(), sp.flip(0), ss.flip(0))
    other = run(x, sp, ss, rows=16, num_warps=2)
    alt = run(x, sp, ss, form={"generic": "lean", "lean": "generic", "lean_rcp": "generic"}[form])
    for f, r, o, a in zip(full, rev, other, alt, strict=True):
        assert_same_bytes(r.flip(0), f, "reversed batch")
        assert_same_bytes(o, f, "tile of 16 rows")
        assert_same_bytes(a, f, "the other form")
    for i in (0, 3):
        alone = run(x[i : i + 1].contiguous(), sp[i : i + 1], ss[i : i + 1])
        for a, f in zip(alone, full, strict=True):
            assert_same_bytes(a, f[i : i + 1], f"matrix {i} alone")


def test_pack_pair_refused():
    x = torch.zeros(2, 4, 16, device=DEVICE)
    for plain, scaled in (("nvfp4", "fp16"), ("fp16", "mxfp4"), ("fp8e4m3", "nvfp4"),
                          ("fp16", "fp8e4m3"), ("nvfp4", "nvfp4")):
        with pytest.raises(ValueError, match="casts to"):
            kq.pack_pair_triton(x, plain, scaled)
    with pytest.raises(ValueError, match="nvfp5"):
        kq.pack_pair_triton(x, "fp16", "nvfp5")
    for bad in (x.half(), x.transpose(-1, -2), torch.zeros(16, device=DEVICE), [1.0]):
        with pytest.raises(ValueError, match="contiguous float32"):
            kq.pack_pair_triton(bad, "fp16", "nvfp4")
    for rows in (0, 3, True, 2.0, 2048):
        with pytest.raises(ValueError, match="rows must be"):
            kq.pack_pair_triton(x, "fp16", "nvfp4", rows=rows)
    for form in ("fast", "", 1, "Lean"):
        with pytest.raises(ValueError, match="form must be one of"):
            kq.pack_pair_triton(x, "fp16", "nvfp4", form=form)
    for nw in (0, 3, 64, True):
        with pytest.raises(ValueError, match="num_warps must be"):
            kq.pack_pair_triton(x, "fp16", "nvfp4", num_warps=nw)
    with pytest.raises(ValueError, match="does not broadcast"):
        kq.pack_pair_triton(x, "fp16+sr", "nvfp4", plain_stream=torch.zeros(3, dtype=torch.int64))
    for bad in (torch.zeros(3, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE),
                torch.zeros(2, 1, device=DEVICE), 1.0):
        with pytest.raises(ValueError, match=r"matrix_amax must be None or a float32 tensor "
                                             r"of shape \(2,\)"):
            kq.pack_pair_triton(x, "fp16", "nvfp4", matrix_amax=bad)


@pytest.mark.parametrize("form", ["generic", "lean", "lean_rcp"])
def test_pack_pair_takes_the_given_matrix_amax(form):
    """With ``matrix_amax`` the kernel makes no amax pass of its own: the matrix scale is
    the given amax / (448 x 6) in float32 (1 for a zero amax), whatever the data, on several
    tiles per matrix and on one (the single-tile lean form takes the amax from its tile)."""
    x = _random(((3,), 8, 32), seed=31).to(DEVICE)
    given = torch.tensor([0.0, 1.5, 300.0], device=DEVICE)
    _, s = kq.pack_pair_triton(x, "fp16", "nvfp4", rows=4, num_warps=1, form=form,
                               matrix_amax=given)
    want = torch.where(given > 0, given / F.NVFP4_SCALE_DIVISOR, torch.ones_like(given))
    assert_same_bytes(s.matrix_scale, want, "matrix scale from the given amax")
    _, one = kq.pack_pair_triton(x, "fp16", "nvfp4", rows=16, num_warps=1, form=form,
                                 matrix_amax=given)
    if form == "generic":  # the generic kernel has no single-tile form
        assert_same_bytes(one.matrix_scale, want, "one tile")
    else:
        ref = pack_reference(x.cpu(), "nvfp4")
        assert_same_bytes(one.matrix_scale, ref.matrix_scale.to(DEVICE), "one tile (own amax)")


@triton.jit
def _div_by_rcp_kernel(x_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0)
    b = tl.load(b_ptr + i, mask=ok, other=1.0)
    y = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), b)
    tl.store(out_ptr + i, kq._div_by_rcp(x, b, y), mask=ok)


def _div_cases(g: torch.Generator):
    """(x, b) float32 pairs for ``_div_by_rcp``: divisors at both ends of its range, with
    all-ones and unit mantissas, E4M3 block scales times random matrix scales, and random
    ones; dividends a few ulps either side of b times every E2M1 grid value and midpoint
    (the quotients where RTN codes change), random quotients in [2^-4, 9.5], tiny and zero
    dividends, both signs."""
    f32 = torch.float32
    lo, hi = kq.RCP_MATRIX_SCALE_RANGE
    ends = [2.0 ** -95, 2.0 ** 95, (2 - 2 ** -23) * 2.0 ** 94, (2 - 2 ** -23) * 2.0 ** -95,
            1.0, 1 + 2 ** -23, 2 - 2 ** -23, 3.0, 6.0, 2688.0, 1 / 3, 0.1]
    e4m3 = torch.tensor([0.001953125, 0.0166015625, 0.875, 1.125, 13.0, 240.0, 448.0])
    sg = torch.exp2(torch.empty(6).uniform_(math.log2(lo), math.log2(hi), generator=g))
    sg = sg * (1 + torch.rand(6, generator=g))
    rnd = torch.exp2(torch.empty(20).uniform_(-95, 95, generator=g))
    bs = torch.cat([torch.tensor(ends), (e4m3[:, None] * sg[None, :]).flatten(), rnd]).to(f32)
    bs = bs.clamp(2.0 ** -95, 2.0 ** 95)
    grid = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0,
                         6.0, 0.125, 9.0], dtype=torch.float64)
    xs, ds = [], []
    for b in bs:
        base = (grid * float(b)).to(f32)
        near = [base]
        up, down = base, base
        for _ in range(3):
            up, down = torch.nextafter(up, torch.tensor(INF)), torch.nextafter(down, torch.tensor(0.0))
            near += [up, down]
        z = torch.exp2(torch.empty(64).uniform_(-4, math.log2(9.5), generator=g))
        tiny = torch.tensor([0.0, 1e-45, 1e-40, 2.0 ** -126, 1e-20, float(b) * 2.0 ** -30])
        x = torch.cat(near + [(z.double() * float(b)).to(f32), tiny.to(f32)])
        x = torch.where(torch.rand(x.shape, generator=g) < 0.3, -x, x)
        xs.append(x)
        ds.append(torch.full_like(x, float(b)))
    return torch.cat(xs), torch.cat(ds)


def test_div_by_rcp_matches_div_rn():
    """``_div_by_rcp`` (one reciprocal per divisor, FMA refinements) against the IEEE
    float32 quotient (torch's CPU division): the same bits wherever |x / b| >= 2^-3; below,
    the same sign and |q| < 0.25, so the same E2M1 RTN code."""
    x, b = _div_cases(torch.Generator().manual_seed(31))
    n = x.numel()
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    _div_by_rcp_kernel[(triton.cdiv(n, 1024),)](x.to(DEVICE), b.to(DEVICE), out, n, BLOCK=1024)
    got, want = out.cpu(), x / b
    big = want.abs() >= 0.125
    assert big.sum() > 0.9 * n  # most cases are in the exact range
    assert_bitwise(got[big], want[big], "quotients >= 2^-3")
    small = ~big
    assert torch.equal(torch.signbit(got[small]), torch.signbit(want[small]))
    assert (got[small].abs() < 0.25).all()


def test_pack_pair_rcp_division_range_edges():
    """The lean pair cast with the reciprocal division (``form="lean_rcp"``) on matrices whose
    NVFP4 matrix scale lies at either end of ``RCP_MATRIX_SCALE_RANGE`` (the reciprocal
    division inside, ``div_rn`` outside) equals the reference, RTN and ``up`` scales, beside
    fp16 with SR; the element magnitudes span 2^-40 of the matrix amax, with grid
    midpoints."""
    g = torch.Generator().manual_seed(41)
    lo, hi = kq.RCP_MATRIX_SCALE_RANGE
    x = _random(((8,), 4, 48), seed=43)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75])
    x[:, 1, 16:24] = mids
    x[:, 2] *= torch.exp2(-40 * torch.rand(48, generator=g))
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    target = torch.tensor([lo * 0.999, lo, lo * 1.001, 1.0, hi * 0.999, hi, hi * 1.001, hi * 4])
    x = (x / amax * (target * F.NVFP4_SCALE_DIVISOR).view(8, 1, 1)).float()
    for scaled in ("nvfp4", "nvfp4+up"):
        _check_pair(x, "fp16+sr", scaled, _streams((8,)), _streams((8,)) + 3, form="lean_rcp")
    # far outside the range, where the reciprocal division would give wrong codes (the
    # range test is what keeps them right): block scales from 2^-9 to 448, E2M1 grid points
    # and midpoints nudged by -1, 0, +1 ulp
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0,
                         6.0, 0.125, 0.375], dtype=torch.float64)
    sbs = [2.0**-9, 3 * 2.0**-9, 2.0**-6 * 1.125, 0.875, 1.0, 13.0, 448.0, 2.0**-8]
    for e in (-122, -118, -100, 100):
        y = torch.zeros(2, 8, 64, dtype=torch.float64)
        for r in range(8):
            for blk in range(4):
                v = vals[torch.randperm(16, generator=g)] * sbs[(r + blk) % 8]
                v[0] = 6.0 * sbs[(r + blk) % 8]  # the block amax: s_b exactly
                y[:, r, blk * 16:(blk + 1) * 16] = v
        y[:, 0, 0] = 2688.0  # amax 2688: s_g = 1 before the scaling by 2^e
        y = (y * 2.0**e).float()
        nudge = torch.randint(-1, 2, y.shape, generator=g, dtype=torch.int32)
        nudge[..., ::16] = 0
        y = torch.where(y != 0, (y.view(torch.int32) + nudge).view(torch.float32), y)
        y[1] = -y[1]
        for scaled in ("nvfp4", "nvfp4+up"):
            _check_pair(y, "fp16", scaled, _streams((2,)), _streams((2,)), form="lean_rcp")


# ----------------------------------------------------------------------------------------
# the lean pair cast's helpers against the generic ones
# ----------------------------------------------------------------------------------------


@triton.jit
def _lean_codes_kernel(y_ptr, r_ptr, out_ptr, N, BLOCK: tl.constexpr, G16: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    y = tl.load(y_ptr + i, mask=m, other=0.0)
    r = tl.load(r_ptr + i, mask=m, other=0).to(tl.uint32, bitcast=True)
    bits = y.to(tl.int32, bitcast=True)
    _, sr_gen = kq._quant(y, r, True, G16)
    _, rtn_gen = kq._quant(y, 0, False, G16)
    tl.store(out_ptr + i, kq._f16_sr_signed(bits, r), mask=m)
    tl.store(out_ptr + N + i, sr_gen, mask=m)
    tl.store(out_ptr + 2 * N + i, kq._f16_rtn_signed(y), mask=m)
    tl.store(out_ptr + 3 * N + i, rtn_gen, mask=m)
    fin = tl.abs(y) < float("inf")  # the E2M1 codes are defined for finite quotients
    tl.store(out_ptr + 4 * N + i, tl.where(fin, kq._e2m1_rtn_code_lean(y), -1), mask=m)
    tl.store(out_ptr + 5 * N + i, tl.where(fin, kq._e2m1_rtn_code(y), -1), mask=m)


def _lean_codes(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """[6, n] int32: fp16 SR codes (lean, generic), fp16 RTN codes (lean, generic), E2M1 RTN
    codes (lean, generic; -1 for non-finite y)."""
    n = y.numel()
    out = torch.empty(6, n, dtype=torch.int32, device=y.device)
    block = 1024
    _lean_codes_kernel[(triton.cdiv(n, block),)](y, r, out, n, BLOCK=block,
                                                 G16=kq._grid_consts(F.FP16))
    return out


def test_lean_cast_codes_match_generic():
    """The lean pair cast's per-element helpers give the generic helpers' codes: fp16 with
    SR (``_f16_sr_signed`` against ``_quant``) and RTN (``_f16_rtn_signed``, the hardware
    conversion on CUDA, against ``_quant``), signs, NaN (several payloads, signalling ones
    included), +-inf, -0 and saturation included; E2M1 RTN (``_e2m1_rtn_code_lean`` against
    ``_e2m1_rtn_code``) for finite values. Inputs: every float32 within 64 ulps of 2^e
    (e = -40..16) and of the E2M1 midpoints and grid points, values near 65504 and 65520,
    subnormals, a log-uniform sample, both signs; each with the draws 0, 1, 2^31, 2^32 - 1, a
    random one and those at and beside the SR threshold (both formulas, as in
    ``test_fp16_bf16_sr_codes_match_generic``). On CUDA also every float32 bit pattern for
    the RTN codes, every float32 below 2^17 with a random draw for the SR codes, and every
    float32 in [0, 8] (both signs) for the E2M1 codes."""
    g = torch.Generator().manual_seed(31)
    pts = [2.0**e for e in range(-40, 17)] + [65504.0, 65520.0, 1e-40, 0.25, 0.75, 1.25, 1.75,
                                              2.5, 3.5, 5.0, 6.0, 7.0, 0.5, 1.5, 3.0, 4.0]
    bits = torch.tensor(pts).view(torch.int32)[:, None] + torch.arange(-64, 64, dtype=torch.int32)
    special = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000, 0x7F800000,
                            0x7F7FFFFF, 0, 1, 0x007FFFFF, 0x00800000],
                           dtype=torch.int64).to(torch.int32)
    sample = torch.pow(2.0, torch.empty(3000).uniform_(-40, 17, generator=g))
    y = torch.cat([bits.clamp_min(0).flatten().view(torch.float32), special.view(torch.float32),
                   sample, torch.rand(2000, generator=g) * 8])
    mbits = y.view(torch.int32).long() & 0x7FFFFFFF
    ya = mbits.to(torch.int32).view(torch.float32).double()
    frac = ya * 2.0**24 - torch.floor(ya * 2.0**24)
    thr = [(mbits & 0x1FFF) << 19, torch.ceil(torch.nan_to_num(frac) * 2.0**32).long()]
    rs = [torch.zeros_like(mbits), torch.ones_like(mbits), torch.full_like(mbits, 1 << 31),
          torch.full_like(mbits, (1 << 32) - 1), torch.randint(0, 1 << 32, mbits.shape, generator=g)]
    rs += [t + d for t in thr for d in (-1, 0, 1)]
    r = torch.cat([x.clamp(0, (1 << 32) - 1) for x in rs])
    r = torch.where(r >= 1 << 31, r - (1 << 32), r).to(torch.int32)
    yy = y.repeat(len(rs))
    yy = torch.cat([yy, -yy])
    r = torch.cat([r, r])
    out = _lean_codes(yy.to(DEVICE), r.to(DEVICE)).cpu()
    for name, (a, b) in {"fp16 SR": (0, 1), "fp16 RTN": (2, 3), "E2M1 RTN": (4, 5)}.items():
        bad = (out[a] != out[b]).nonzero().flatten()
        assert bad.numel() == 0, (f"{name}: {bad.numel()} differ; first y = {yy[bad[0]].item()!r} "
                                  f"(bits {int(yy[bad[0]].view(torch.int32)):#x}), draw "
                                  f"{int(r[bad[0]]) & 0xFFFFFFFF:#x}: {int(out[a, bad[0]]):#x} "
                                  f"against {int(out[b, bad[0]]):#x}")
    assert int((out[4] >= 0).sum()) > 0.9 * out.shape[1]  # the E2M1 half compared values
    if DEVICE == "cuda":
        gc = torch.Generator(device="cuda").manual_seed(32)
        step = 1 << 27
        for lo in range(-(1 << 31), 1 << 31, step):  # every bit pattern: RTN
            b = torch.arange(lo, lo + step, dtype=torch.int64, device="cuda").to(torch.int32)
            out = _lean_codes(b.view(torch.float32), torch.zeros_like(b))
            assert torch.equal(out[2], out[3]), f"fp16 RTN, block {lo:#x}"
        top = int(torch.tensor(2.0**17).view(torch.int32))
        for lo in range(0, top, step):
            b = torch.arange(lo, min(lo + step, top), dtype=torch.int32, device="cuda")
            rr = torch.randint(-(1 << 31), 1 << 31, b.shape, dtype=torch.int32, device="cuda",
                               generator=gc)
            for sign in (0, -(2**31)):
                out = _lean_codes((b | sign).view(torch.float32), rr)
                assert torch.equal(out[0], out[1]), f"fp16 SR, block {lo:#x} sign {sign}"
        top = int(torch.tensor(8.0).view(torch.int32))
        for lo in range(0, top + 1, step):
            b = torch.arange(lo, min(lo + step, top + 1), dtype=torch.int32, device="cuda")
            for sign in (0, -(2**31)):
                out = _lean_codes((b | sign).view(torch.float32), torch.zeros_like(b))
                assert torch.equal(out[4], out[5]), f"E2M1 RTN, block {lo:#x} sign {sign}"


@triton.jit
def _philox_words_kernel(out_ptr, c_ptr, seed, N: tl.constexpr):
    i = tl.arange(0, N)
    c0 = tl.load(c_ptr + i).to(tl.uint32, bitcast=True)
    lo = tl.load(c_ptr + N + i).to(tl.uint32, bitcast=True)
    hi = tl.load(c_ptr + 2 * N + i).to(tl.uint32, bitcast=True)
    a = kq._random_words(seed, c0, lo, hi)
    b = kq._random_words(seed, c0, lo, hi, True)
    for w in tl.static_range(4):
        tl.store(out_ptr + w * N + i, a[w].to(tl.int32, bitcast=True))
        tl.store(out_ptr + (4 + w) * N + i, b[w].to(tl.int32, bitcast=True))


@pytest.mark.parametrize("seed", [SEED, 0, 1, 2**31 - 1, 2**32 + 7, 2**63 - 1])
def test_philox_wide_matches_triton(seed):
    """``_philox_wide`` (each round's products as one 64-bit multiply) gives the four words of
    ``tl.philox`` and of the torch reference (``philox4x32``) for random and extreme counters
    and stream words; seeds with one or both key words, and 1 (which Triton specialises to a
    compile-time constant)."""
    from replayssm_quant.philox import philox4x32

    n = 256
    c = torch.randint(-(2**31), 2**31, (3 * n,), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(33))
    c[:4] = torch.tensor([0, -1, 2**31 - 1, -(2**31)], dtype=torch.int32)
    c[n : n + 2] = torch.tensor([0, -1], dtype=torch.int32)
    out = torch.empty(8 * n, dtype=torch.int32, device=DEVICE)
    _philox_words_kernel[(1,)](out, c.to(DEVICE), seed, N=n)
    out = out.cpu().long() & 0xFFFFFFFF
    u = c.long() & 0xFFFFFFFF
    ref = torch.cat(philox4x32(u[:n], u[n : 2 * n], u[2 * n :], torch.zeros(n, dtype=torch.int64),
                               seed & 0xFFFFFFFF, seed >> 32))
    assert torch.equal(out[: 4 * n], ref)
    assert torch.equal(out[4 * n :], ref)

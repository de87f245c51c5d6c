"""Quantizer reference against independent oracles (ml_dtypes, torch dtypes, closed-form moments).

Issue 2, "What correct means". Kernel-vs-reference comparisons live in test_quant_kernels.py.
"""

import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

from replayssm_quant import FORMAT_NAMES, PackedTensor, pack, parse_spec, quantize, stream_key
from replayssm_quant import formats as F
from replayssm_quant.philox import philox4x32, random_bits, random_bits_matrix
from replayssm_quant.quant import round_to_grid

ORACLE_DTYPES = {
    "e4m3": (F.E4M3, ml_dtypes.float8_e4m3fn),
    "e5m2": (F.E5M2, ml_dtypes.float8_e5m2),
    "e2m1": (F.E2M1, ml_dtypes.float4_e2m1fn),
    "bf16": (F.BF16, ml_dtypes.bfloat16),
    "fp16": (F.FP16, np.float16),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """int32 view (bitwise comparison; NaNs canonicalised)."""
    t = t.to(torch.float32)
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def _spanning_values(grid: F.FloatGrid, n: int, seed: int) -> np.ndarray:
    """n float32 values with log-uniform magnitudes from below the smallest subnormal of the
    grid to 4x beyond its max, random signs, plus every exact midpoint of the grid's
    neighbouring representable values in a sample."""
    rng = np.random.default_rng(seed)
    lo = np.log2(grid.min_subnormal) - 3
    hi = min(np.log2(grid.max) + 2, 127.99)  # stay finite in FP32
    mag = np.exp2(rng.uniform(lo, hi, n)).astype(np.float32)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0).astype(np.float32)
    return mag * sign


def _oracle(x: np.ndarray, grid: F.FloatGrid, dtype) -> np.ndarray:
    """ml_dtypes cast with our saturation policy applied (finite -> clip at +-max)."""
    clipped = np.clip(x, -grid.max, grid.max)
    return clipped.astype(dtype).astype(np.float32)


@pytest.mark.parametrize("name", list(ORACLE_DTYPES))
def test_rtn_matches_ml_dtypes_bit_for_bit(name):
    grid, dtype = ORACLE_DTYPES[name]
    x = _spanning_values(grid, 100_000, seed=zlib.crc32(name.encode()) % 1000)  # not hash(): salted per process
    # add all midpoints between consecutive representable values of a range of the grid
    if grid.ebits <= 5:
        codes = np.arange(2 ** (1 + grid.ebits + grid.mbits), dtype=np.uint16)
        if grid is F.E2M1:
            vals = np.array(F.E2M1_VALUES, dtype=np.float32)
        else:
            vals = codes.astype(np.uint8 if grid.ebits + grid.mbits < 8 else np.uint16)
            vals = vals.view(dtype).astype(np.float32) if vals.dtype.itemsize == 1 else \
                vals.view(np.float16).astype(np.float32)
        vals = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
        mids = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)
        x = np.concatenate([x, mids, -mids, vals, -vals])
    got = round_to_grid(torch.from_numpy(x), grid).numpy()
    want = _oracle(x, grid, dtype)
    assert got.shape == want.shape
    mismatch = got.view(np.int32) != want.view(np.int32)
    assert not mismatch.any(), (
        f"{mismatch.sum()} mismatches, e.g. x={x[mismatch][:5]} got={got[mismatch][:5]} "
        f"want={want[mismatch][:5]}"
    )
    assert len(x) >= 100_000


@pytest.mark.parametrize("spec,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_public_unscaled_matches_torch_cast(spec, torch_dtype):
    x = torch.from_numpy(_spanning_values(parse_spec(spec).info.element, 100_000, 7))
    finfo = torch.finfo(torch_dtype)
    want = x.clamp(finfo.min, finfo.max).to(torch_dtype).float()
    got = quantize(x.view(-1, 100), spec).view(-1)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize(
    "grid,x,want",
    [
        (F.E2M1, [0.25, 0.75, 1.25, 2.5, 5.0], [0.0, 1.0, 1.0, 2.0, 4.0]),
        (F.E2M1, [-0.25, -0.75, -1.75, -3.5], [-0.0, -1.0, -2.0, -4.0]),
        (F.FP16, [1.00048828125], [1.0]),
        (F.E4M3, [248.0], [256.0]),
        (F.BF16, [1.0 + 2.0**-8], [1.0]),
        (F.E5M2, [1.125], [1.0]),
    ],
    ids=["e2m1", "e2m1-neg", "fp16", "e4m3", "bf16", "e5m2"],
)
def test_ties_to_even(grid, x, want):
    got = round_to_grid(torch.tensor(x, dtype=torch.float32), grid)
    assert torch.equal(bits(got), bits(torch.tensor(want)))


def test_float64_beyond_float32_range_saturates():
    """A finite float64 value beyond float32's range saturates to +-float32 max before the
    float32 working cast (DESIGN.md section 4: overflow saturates), so in every format it
    gives the bits of float32 max: fp16 +-65504 (not inf), and a matrix- or block-scaled
    format finite values (not NaN for the whole matrix). Oracle: the same matrix in float32
    with +-float32 max in those places; inf and NaN inputs still behave as float32's."""
    f32max = torch.finfo(torch.float32).max
    gen = torch.Generator().manual_seed(3)
    x32 = torch.randn(2, 4, 32, generator=gen)
    x64 = x32.double()
    x64[0, 1, 3], x64[1, 2, 31] = 1e39, -3.5e38
    x32[0, 1, 3], x32[1, 2, 31] = f32max, -f32max
    for spec in ("fp32", "fp16", "bf16", "fp8e4m3", "fp8e5m2+sr", "nvfp4", "mxfp4+sr"):
        want = pack(x32, spec, seed=5)
        got = pack(x64, spec, seed=5)
        assert torch.equal(bits(got.dequantize()), bits(want.dequantize())), spec
        assert torch.isfinite(got.dequantize()).all(), spec
        if spec != "fp32":
            assert torch.equal(bits(quantize(x64, spec, seed=5)),
                               bits(quantize(x32, spec, seed=5))), spec
    assert quantize(x64, "fp16")[0, 1, 3].item() == 65504.0
    inf = torch.tensor([[float("inf"), 1.0]], dtype=torch.float64)
    assert torch.equal(bits(quantize(inf, "fp16")), bits(quantize(inf.float(), "fp16")))


def test_overflow_saturates_and_specials():
    x = torch.tensor([465.0, 1e9, -1e9, -0.0, float("nan")])
    got = round_to_grid(x, F.E4M3)
    assert got[:3].tolist() == [448.0, 448.0, -448.0]
    assert got[3].item() == 0.0 and torch.signbit(got[3])
    assert torch.isnan(got[4])
    # through the public scaled path: a matrix whose amax is 448 has scale 1
    m = torch.tensor([[448.0, 465.0 * 0 + 447.0, -0.0, 3.0]])
    p = pack(m, "fp8e4m3")
    assert p.matrix_scale.item() == 1.0
    assert p.codes[0, 2].item() == 0x80  # -0.0 keeps its sign code
    assert torch.equal(bits(p.dequantize()), bits(quantize(m, "fp8e4m3")))
    # never finite -> NaN for huge finite values on fp16/bf16 either
    for spec, big, mx in (("fp16", 65520.0, 65504.0), ("bf16", 3.4e38, F.BF16.max)):
        q = quantize(torch.tensor([[big, -big, 1e9 if spec == "fp16" else 3.39e38]]), spec)
        assert torch.isfinite(q).all(), spec
        assert q[0, 0].item() == mx and q[0, 1].item() == -mx and q[0, 2].item() == mx, spec
    # NaN stays NaN in every format, and only its own block/element is affected
    for spec in FORMAT_NAMES:
        x = torch.ones(1, 40)
        x[0, 0] = float("nan")
        q = quantize(x, spec)
        assert torch.isnan(q[0, 0]), spec
        assert torch.isfinite(q[0, 35:]).all(), spec


def test_nan_codes_decode_to_nan():
    for code in (0x7F, 0xFF):
        for spec in ("fp8e4m3", "mxfp8"):
            p = pack(torch.ones(1, 32), spec)
            p.codes[0, 0] = code
            assert torch.isnan(p.dequantize()[0, 0]), (spec, hex(code))
            assert p.dequantize()[0, 1].item() == 1.0
    # NVFP4: NaN block scale code makes the block NaN
    p = pack(torch.ones(1, 32), "nvfp4")
    p.block_scales[0, 0] = 0x7F
    d = p.dequantize()
    assert torch.isnan(d[0, :16]).all() and torch.isfinite(d[0, 16:]).all()


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4+sr", "mxfp4", "mxfp8", "fp8e4m3", "fp8e5m2+sr"])
def test_zero_blocks_give_exact_zeros(spec):
    z = torch.zeros(2, 3, 4, 48)
    assert torch.equal(bits(quantize(z, spec)), bits(z))
    x = torch.randn(2, 3, 4, 48)
    x[..., 16:32] = 0.0  # all-zero blocks inside nonzero matrices
    q = quantize(x, spec)
    assert torch.isfinite(q).all()
    assert (q[..., 16:32] == 0).all()


def test_nvfp4_block_scale_rounding_and_clipping():
    # block 0: amax 3.1875; block 1 holds 2688 = 448 * 6 so the matrix scale is exactly 1
    x = torch.zeros(1, 32)
    x[0, 0] = 3.1875
    x[0, 1] = 1.0
    x[0, 16] = 2688.0
    p = pack(x, "nvfp4")
    assert p.matrix_scale.item() == 1.0
    scale_b0 = p.block_scales.view(torch.float8_e4m3fn).float()[0, 0].item()
    assert scale_b0 == 0.5  # 3.1875 / 6 = 0.53125 is an E4M3 tie -> 0.5
    d = p.dequantize()
    assert d[0, 0].item() == 3.0  # 3.1875 / 0.5 = 6.375 clips to E2M1 max 6 -> 6 * 0.5
    assert d[0, 1].item() == 1.0
    assert d[0, 16].item() == 2688.0
    # SR never exceeds the maximum: many streams, the block max stays 3.0
    xs = x.expand(4096, 1, 32).contiguous()
    q = quantize(xs, "nvfp4+sr", seed=3, stream=torch.arange(4096))
    assert q[..., 0].max().item() == 3.0
    assert (q[..., :16].abs() <= 3.0).all()


@pytest.mark.parametrize("spec,k,block", [("mxfp8", 40, 32), ("mxfp4", 40, 32), ("nvfp4", 20, 16)])
def test_partial_tail_block_padding(spec, k, block):
    torch.manual_seed(0)
    x = torch.randn(3, 5, k) * torch.logspace(-3, 3, 5).view(1, 5, 1)
    p = pack(x, spec)
    kp = -(-k // block) * block
    assert p.block_scales.shape == (3, 5, kp // block)  # one scale set per row: never shared
    code_cols = kp // 2 if parse_spec(spec).info.code_bits == 4 else kp
    assert p.codes.shape == (3, 5, code_cols)
    # padding is initialised: the codes beyond K are +0
    if code_cols == kp:
        assert (p.codes[..., k:] == 0).all()
    else:
        assert (p.codes[..., k // 2:] == 0).all()
    assert torch.equal(bits(p.dequantize()), bits(quantize(x, spec)))
    # tail block equals quantising the row explicitly zero-padded to whole blocks
    xp = torch.nn.functional.pad(x, (0, kp - k))
    assert torch.equal(bits(quantize(xp, spec)[..., :k]), bits(quantize(x, spec)))
    if spec.startswith("mx"):
        # no matrix scale: a row does not depend on the other rows
        y = x.clone()
        y[:, 1:] *= 1000
        assert torch.equal(bits(quantize(y, spec)[:, 0]), bits(quantize(x, spec)[:, 0]))


# -- stochastic rounding ------------------------------------------------------------------

# (spec, anchor that makes the effective scale exactly 1, width of the matrix row)
SR_CASES = {
    "bf16": (None, 1), "fp16": (None, 1),
    "fp8e4m3": (448.0, 2), "fp8e5m2": (57344.0, 2),
    "nvfp4": ("nvfp4", 32), "mxfp8": (448.0, 32), "mxfp4": (6.0, 32),
}


def _grid_values(spec: str) -> np.ndarray:
    grid = parse_spec(spec).info.element
    if grid is F.E2M1:
        return np.array(F.E2M1_VALUES)
    if grid is F.E4M3:
        v = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    elif grid is F.E5M2:
        v = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2).astype(np.float64)
    elif grid is F.FP16:
        v = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float64)
    else:
        with np.errstate(invalid="ignore"):  # NaN payload codes cast to NaN
            v = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    return np.unique(v[np.isfinite(v) & (v >= 0)])


def _sr_values(spec: str) -> list[float]:
    g = _grid_values(spec)
    i = len(g) // 3
    mid = (g[i] + g[i + 1]) / 2  # exact midpoint
    off = g[i] + 0.3 * (g[i + 1] - g[i])
    sub = g[1] * 0.7  # below the smallest positive value (subnormal region / underflow)
    top = g[-2] + 0.8 * (g[-1] - g[-2])  # next to the maximum
    return [float(np.float32(v)) for v in (mid, off, -off, sub, top)]


@pytest.mark.parametrize("spec", list(SR_CASES))
def test_sr_unbiased_and_variance(spec):
    anchor, width = SR_CASES[spec]
    n = 10_000
    grid = _grid_values(spec)
    for v in _sr_values(spec):
        row = torch.zeros(width)
        row[0] = v
        if anchor == "nvfp4":
            row[1] = 6.0  # block amax 6 -> block scale 1 ...
            row[16] = 2688.0  # ... given matrix scale 1 (2688 = 448 * 6)
        elif anchor is not None:
            row[1] = anchor
        x = row.expand(n, 1, width).contiguous()
        q = quantize(x, spec + "+sr", seed=11, stream=torch.arange(n))[:, 0, 0].double()
        a = abs(np.float64(np.float32(v)))
        lo = grid[grid <= a].max()
        hi = grid[grid >= a].min()
        assert set(q.abs().unique().tolist()) <= {lo, hi}, (spec, v)
        delta = hi - lo
        p = 0.0 if delta == 0 else (a - lo) / delta
        mean, var = q.mean().item(), q.var().item()
        se = np.sqrt(p * (1 - p) * delta**2 / n)
        assert abs(mean - np.float32(v)) <= 4 * se + 1e-30, (spec, v, mean, se)
        want_var = p * (1 - p) * delta**2
        assert abs(var - want_var) <= 0.1 * want_var, (spec, v, var, want_var)


def test_sr_of_zero_is_zero_and_keeps_sign():
    x = torch.tensor([[0.0, -0.0, 1.0]]).expand(64, 1, 3).contiguous()
    for spec in FORMAT_NAMES:
        q = quantize(x, spec + "+sr", stream=torch.arange(64))
        assert (q[..., 0] == 0).all() and (q[..., 1] == 0).all(), spec
        assert not torch.signbit(q[..., 0]).any() and torch.signbit(q[..., 1]).all(), spec


def test_meta_tensor_refused_by_name():
    x = torch.randn(4, 16, device="meta")
    for fn in (quantize, pack):
        for spec in ("fp16", "nvfp4+sr", "fp32"):
            with pytest.raises(ValueError, match="device 'meta', which holds no values"):
                fn(x, spec)


def test_nvfp4_zero_scale_block_keeps_signs():
    """A block whose E4M3 scale is 0 stores zeros with each element's sign, as every other
    format keeps -0.0: an all-(-0) block, and a block of +-1e-7 under a matrix amax of 1
    (block amax / (6 s_g) far below E4M3's smallest step; with scale rule ``up`` that block
    gets the smallest scale instead, so only its all-zero blocks are checked there), RTN and
    SR, fake and packed."""
    x = torch.zeros(2, 48)
    x[0, 16:32] = -0.0
    x[1, 0] = 1.0
    x[1, 16:32] = 1e-7 * torch.tensor([1.0, -1.0] * 8)
    x[1, 32:48] = -0.0
    want = torch.signbit(x)
    for spec in ("nvfp4", "nvfp4+sr", "nvfp4+up", "nvfp4+up+sr"):
        q = quantize(x, spec, seed=1, stream=0)
        d = pack(x, spec, seed=1, stream=0).dequantize()
        cols = slice(32, 48) if "up" in spec else slice(16, 48)
        for got in (q, d):
            assert (got[:, cols] == 0).all() and (got[0] == 0).all(), spec
            assert torch.equal(torch.signbit(got[:, cols]), want[:, cols]), spec
            assert torch.equal(torch.signbit(got[0]), want[0]), spec
    codes = pack(x, "nvfp4").codes  # E2M1 pairs: element 2i in the low nibble
    assert (codes[0, 8:16] == 0x88).all() and (codes[1, 8:16] == 0x80).all()


# -- random bits --------------------------------------------------------------------------


def test_philox_known_answers():
    """Random123 known-answer vectors for Philox-4x32-10."""
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    out = philox4x32(t(0), t(0), t(0), t(0), 0, 0)
    assert [int(o) for o in out] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    m = 0xFFFFFFFF
    out = philox4x32(t(m), t(m), t(m), t(m), m, m)
    assert [int(o) for o in out] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    out = philox4x32(t(0x243F6A88), t(0x85A308D3), t(0x13198A2E), t(0x03707344),
                     0xA4093822, 0x299F31D0)
    assert [int(o) for o in out] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_philox_matches_triton_interpreter():
    """Element e's bits are word e & 3 of Triton's Philox call at counter e >> 2 (the four
    words taken straight from tl.philox, not through the package's kernels)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def _bits(out_ptr, seed, stream_lo, stream_hi, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        zero = tl.zeros_like(offs)
        r0, r1, r2, r3 = tl.philox(seed, offs, zero + stream_lo, zero + stream_hi, zero)
        for w, r in enumerate((r0, r1, r2, r3)):
            tl.store(out_ptr + w * BLOCK + offs, r.to(tl.int32, bitcast=True))

    seed, stream = 0x1234_5678_9ABC, (5 << 32) | 77
    out = torch.zeros(4, 16, dtype=torch.int32)
    _bits[(1,)](out, seed, stream & 0xFFFFFFFF, stream >> 32, BLOCK=16)
    e = torch.arange(64)
    want = (out.long() & 0xFFFFFFFF)[e & 3, e >> 2]
    assert torch.equal(random_bits(seed, torch.tensor(stream), e), want)
    # the matrix form: the same bits in row-major order, also with K not a multiple of 4;
    # each matrix draws from its own stream key
    other = stream + 1
    for M, K in ((4, 16), (3, 7), (1, 1)):
        got = random_bits_matrix(seed, torch.tensor([other, stream]), M, K)
        assert got.shape == (2, M, K)
        assert torch.equal(got[1].flatten(), want[: M * K])
        assert torch.equal(got[0].flatten(), random_bits(seed, torch.tensor(other),
                                                         torch.arange(M * K)))
        assert not torch.equal(got[0], got[1]) or M * K == 1


def test_random_bits_words_distinct():
    """The four elements of a call take four different words (no word is used twice), and
    the words of neighbouring calls differ: 64 elements give 64 distinct values."""
    bits = random_bits(7, torch.tensor(3), torch.arange(64))
    assert len(set(bits.tolist())) == 64
    with pytest.raises(ValueError, match="seed"):
        random_bits(-1, torch.tensor(3), torch.arange(4))
    with pytest.raises(ValueError, match="M and K"):
        random_bits_matrix(7, torch.tensor(3), 0, 4)
    with pytest.raises(ValueError, match="2\\^32"):
        random_bits_matrix(7, torch.tensor(3), 2**17, 2**16)
    with pytest.raises(ValueError, match="stream"):
        random_bits(7, torch.tensor(1.7), torch.arange(4))
    with pytest.raises(ValueError, match="seed"):
        random_bits_matrix(1.5, torch.tensor(3), 2, 2)
    with pytest.raises(ValueError, match="seed"):
        random_bits(np.True_, torch.tensor(3), torch.arange(4))
    # a numpy integer seed is its int: the same bits, here and in quantize
    assert torch.equal(random_bits(np.int64(7), torch.tensor(3), torch.arange(64)), bits)
    x = torch.randn(3, 16)
    assert torch.equal(quantize(x, "nvfp4+sr", seed=np.uint32(9), stream=2),
                       quantize(x, "nvfp4+sr", seed=9, stream=2))


def test_sr_independent_of_batch_composition():
    torch.manual_seed(1)
    x = torch.randn(5, 4, 8, 32)
    keys = stream_key(layer=2, sequence=torch.arange(5)[:, None], head=torch.arange(4), flush=3)
    for spec in ("nvfp4+sr", "fp8e4m3+sr", "bf16+sr", "mxfp4+sr"):
        full = quantize(x, spec, seed=9, stream=keys)
        one = quantize(x[3:4], spec, seed=9, stream=keys[3:4])
        assert torch.equal(bits(full[3:4]), bits(one)), spec
        other_seed = quantize(x, spec, seed=10, stream=keys)
        assert not torch.equal(bits(full), bits(other_seed)), spec


def test_stream_key_fields_and_errors():
    k = stream_key(layer=3, sequence=7, head=5, flush=11, copy=1)
    assert int(k) == 1 | (5 << 1) | (3 << 11) | (7 << 19) | (11 << 39)
    assert stream_key(copy=0) != stream_key(copy=1)
    with pytest.raises(ValueError, match="head"):
        stream_key(head=1024)
    with pytest.raises(ValueError, match="flush"):
        stream_key(flush=-1)
    # a float field is refused, not truncated to another key (layer=1.5 would be layer 1)
    for bad in (dict(layer=1.5), dict(head=torch.tensor([0.5, 1.5])), dict(sequence=True),
                dict(copy="1")):
        with pytest.raises(ValueError, match=f"stream field {next(iter(bad))}"):
            stream_key(**bad)
    assert torch.equal(stream_key(head=torch.tensor([1, 2], dtype=torch.int32)),
                       stream_key(head=torch.tensor([1, 2])))


# -- fake vs packed -----------------------------------------------------------------------


def test_fp32_of_float64_quantize_keeps_pack_rounds():
    """The documented exception to pack == quantize: ``fp32`` keeps a float64 run's working
    precision in ``quantize``; ``pack`` stores float32 (rounded, saturated)."""
    x = torch.tensor([[1 + 2 ** -40, 1e300, -1e300, 3.0]], dtype=torch.float64)
    q = quantize(x, "fp32")
    assert q.dtype == torch.float64 and torch.equal(q, x)
    d = pack(x, "fp32").dequantize()
    f32max = torch.finfo(torch.float32).max
    assert d.dtype == torch.float32
    assert d.tolist() == [[1.0, f32max, -f32max, 3.0]]


@pytest.mark.parametrize("spec", [s + sr for s in FORMAT_NAMES for sr in ("", "+sr")])
def test_pack_dequantize_equals_quantize(spec):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 5, 40) * torch.logspace(-6, 6, 5).view(1, 1, 5, 1)
    x[0, 0, 0, 0] = float("nan")
    x[0, 1, 1, 3] = float("inf")
    x[1, 0, 2, 5] = -0.0
    x[1, 2] = 0.0
    keys = torch.arange(6).view(2, 3)
    p = pack(x, spec, seed=4, stream=keys)
    q = quantize(x, spec, seed=4, stream=keys)
    canonical = "fp32" if spec == "fp32+sr" else spec  # '+sr' on fp32 rounds nothing
    assert isinstance(p, PackedTensor) and p.shape == x.shape and str(p.spec) == canonical
    assert q.dtype == torch.float32 and q.shape == x.shape
    assert torch.equal(bits(p.dequantize()), bits(q))
    info = parse_spec(spec).info
    n_mat, m, k = 6, 5, 40
    kp = -(-k // info.block) * info.block if info.block else k
    want = n_mat * m * kp * info.code_bits // 8
    if info.scaling in ("matrix", "nvfp4"):
        want += 4 * n_mat
    if info.block:
        want += n_mat * m * kp // info.block
    assert p.nbytes == want


def test_fp8_scaled_matches_oracle():
    torch.manual_seed(3)
    x = torch.randn(4, 8, 64) * 10
    for spec, dt, fmax in (("fp8e4m3", ml_dtypes.float8_e4m3fn, 448.0),
                           ("fp8e5m2", ml_dtypes.float8_e5m2, 57344.0)):
        xn = x.numpy()
        s = (np.abs(xn).max(axis=(1, 2), keepdims=True) / np.float32(fmax)).astype(np.float32)
        want = (np.clip(xn / s, -fmax, fmax).astype(dt).astype(np.float32) * s)
        got = quantize(x, spec).numpy()
        assert (got.view(np.int32) == want.view(np.int32)).all(), spec


def test_mx_scale_exponent_from_bits():
    # amax exactly a power of two, just below one, and an FP32 subnormal
    for amax, spec, emax in ((8.0, "mxfp4", 2), (7.999999, "mxfp4", 2), (1e-40, "mxfp8", 8)):
        x = torch.zeros(1, 32)
        x[0, 0] = amax
        p = pack(x, spec)
        e = int(np.floor(np.log2(np.float64(np.float32(amax)))))
        assert int(p.block_scales[0, 0]) - 127 == max(e - emax, -127), (amax, spec)


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["nvfp5", "fp8+rtn", "", "fp8", "nvfp4+sr+sr", "int8"])
def test_bad_specs_raise(bad):
    with pytest.raises(ValueError) as e:
        quantize(torch.zeros(2, 2), bad)
    assert repr(bad) in str(e.value) and "nvfp4" in str(e.value)


def test_bad_shapes_and_inputs_raise():
    with pytest.raises(ValueError, match=r"\[\.\.\., M, K\]"):
        quantize(torch.zeros(4), "nvfp4")
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.zeros(2, 2, dtype=torch.int32), "fp16")
    with pytest.raises(ValueError, match="empty|non-empty"):
        quantize(torch.zeros(2, 0), "nvfp4")
    with pytest.raises(ValueError, match="stream"):
        quantize(torch.zeros(3, 2, 2), "nvfp4+sr", stream=torch.arange(4))
    with pytest.raises(ValueError, match="seed"):
        quantize(torch.zeros(2, 2), "nvfp4+sr", seed=-1)
    with pytest.raises(ValueError, match="backend"):
        quantize(torch.zeros(2, 2), "nvfp4", backend="cuda")


def test_one_seed_rule_for_quantizers_configs_and_states():
    """Seeds are ints in [0, 2^63) wherever they enter (they travel as int64); the edge
    values are accepted or refused alike by the quantizers, StateConfig and the decode
    state, with the value named."""
    from replayssm_quant.config import StateConfig
    from replayssm_quant.replay import GDNReplayState

    top = 2 ** 63 - 1
    quantize(torch.zeros(2, 2), "fp16+sr", seed=np.int64(top))
    StateConfig.build("read:nvfp4/rec:fp16+sr", 4, top)
    for bad in (2 ** 63, -1, 1.0, True):
        for make in (lambda s: quantize(torch.zeros(2, 2), "fp16+sr", seed=s),
                     lambda s: pack(torch.zeros(2, 2), "fp16+sr", seed=s),
                     lambda s: StateConfig.build("fp32", 4, s),
                     lambda s: GDNReplayState("fp32", batch=1, key_heads=1, value_heads=1,
                                              key_dim=32, value_dim=4, seed=s)):
            with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\^63\)") as e:
                make(bad)
            assert repr(bad) in str(e.value)


def test_backend_and_stream_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        quantize(torch.zeros(2, 2), "nvfp4", backend="triton")
    with pytest.raises(ValueError, match="integer"):
        quantize(torch.zeros(3, 2, 2), "nvfp4+sr", stream=torch.zeros(3))
    # keys that are not integers are refused by name, with SR and with RTN (which does not
    # use them), by quantize and pack alike; a Python float is not truncated to a key
    x = torch.randn(2, 4, 32)
    for bad in (1.7, 2 ** 70, "a", True, None, [1.5], torch.tensor([True, False])):
        for fn in (quantize, pack):
            for spec in ("nvfp4+sr", "nvfp4", "fp16+sr"):
                with pytest.raises(ValueError, match=r"stream must be an int or integer tensor"):
                    fn(x, spec, stream=bad)
    # integer keys in any integer form draw the same bits
    ref = quantize(x, "nvfp4+sr", seed=3, stream=torch.tensor([5, 9]))
    for ok in ([5, 9], (5, 9), torch.tensor([5, 9], dtype=torch.int32)):
        assert torch.equal(quantize(x, "nvfp4+sr", seed=3, stream=ok), ref)


def test_packed_tensor_checks_its_fields():
    """A PackedTensor built by hand with fields that do not fit fails at construction, naming
    the field (it failed later inside a decoder, or decoded to another shape than declared);
    a format string is parsed."""
    x = torch.randn(2, 32)
    p = pack(x, "nvfp4")
    q = PackedTensor("nvfp4", p.shape, p.codes, p.block_scales, p.matrix_scale)
    assert q.spec == p.spec and torch.equal(q.dequantize(), p.dequantize())
    with pytest.raises(ValueError, match=r"codes of shape \(2, 16\) do not hold .* \(4, 32\)"):
        PackedTensor(p.spec, torch.Size((4, 32)), p.codes, p.block_scales, p.matrix_scale)
    with pytest.raises(ValueError, match="must be torch.uint8, got torch.float32"):
        PackedTensor(p.spec, p.shape, p.codes.float(), p.block_scales, p.matrix_scale)
    with pytest.raises(ValueError, match="needs block_scales"):
        PackedTensor(p.spec, p.shape, p.codes, None, p.matrix_scale)
    with pytest.raises(ValueError, match="needs matrix_scale"):
        PackedTensor(p.spec, p.shape, p.codes, p.block_scales, None)
    with pytest.raises(ValueError, match="spec must be a QuantSpec"):
        PackedTensor(3, p.shape, p.codes)
    h = pack(x, "fp16")
    with pytest.raises(ValueError, match="must be torch.float16, got torch.float32"):
        PackedTensor(h.spec, h.shape, h.codes.float())


def test_packed_tensor_to_an_unavailable_device_is_a_value_error():
    """``PackedTensor.to`` on a device this build or machine lacks names it (a raw torch
    assertion before); to the same device the values are unchanged."""
    p = pack(torch.randn(2, 32), "nvfp4")
    assert torch.equal(p.to("cpu").dequantize(), p.dequantize())
    dev = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=f"device '{dev}' is not available"):
        p.to(dev)
    with pytest.raises(ValueError, match="device 'bogus' is not available"):
        p.to("bogus")

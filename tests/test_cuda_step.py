"""GDN's decode step as one CUDA C++ kernel (``replayssm_quant/kernels/replay/cuda_step.py``,
``gdn_step.cu``; ``backend="cuda"``; issue 15).

On CPU: the kernel's exact NVFP4 decode (its shifts and masks, written in torch) against
``PackedTensor.dequantize`` for every E2M1 and E4M3 code; the kernel's scaled products (keys
and queries pre-scaled by 2^(126 - e)) against float64; which calls the kernel covers and why
the others go to the Triton kernel; a failed build leaving the state as it was. On a CUDA
device (skipped here): the kernel against the float64 step at every ring position, its ring
append, batch invariance, the position assert, and the decode state under ``backend="cuda"``.
"""

from __future__ import annotations

import pytest
import torch

from replayssm_quant.formats import parse_spec
from replayssm_quant.kernels.replay import cuda_step as cs
from replayssm_quant.kernels.replay import cuda_verify as cv
from replayssm_quant.quant import PackedTensor, pack
from replayssm_quant.replay import gdn_step_output

CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= cv.MIN_CAPABILITY
needs_gpu = pytest.mark.skipif(not CUDA, reason="the CUDA kernel runs on a GPU of compute "
                                                "capability >= 8.0 (nvcc to build it)")
D = 128


def _all_codes_nvfp4(B=2, H=3, seed=0) -> PackedTensor:
    """An NVFP4 [B, H, 128, 128] copy whose codes cover every byte (so every pair of E2M1
    codes) and whose block scales cover every E4M3 code, the subnormals and the two NaNs
    included."""
    g = torch.Generator().manual_seed(seed)
    n = B * H * D * D // 2
    codes = (torch.arange(n) * 7 + torch.randint(0, 256, (n,), generator=g)) % 256
    nb = B * H * D * D // 16
    scales = torch.arange(nb) % 256
    return PackedTensor(parse_spec("nvfp4"), (B, H, D, D),
                        codes.to(torch.uint8).view(B, H, D, D // 2),
                        scales.to(torch.uint8).view(B, H, D, D // 16),
                        torch.rand(B, H, generator=g) * 1e-2 + 1e-4)


def test_nvfp4_tiny_decode_is_dequantize():
    """The step kernel's decode (``nvfp4_tiny_decode``: an E2M1 code's bits placed in a
    float32 as the element times 2^-126; an E4M3 code's bits at 20..26 times 2^120) gives
    ``PackedTensor.dequantize``'s values bit for bit, for every E2M1 code pair and every E4M3
    code (subnormal scales, NaN codes 0x7F and 0xFF included)."""
    p = _all_codes_nvfp4()
    tiny, sf = cs.nvfp4_tiny_decode(p.codes, p.block_scales)
    assert set(p.block_scales.unique().tolist()) == set(range(256))
    assert set(p.codes.unique().tolist()) == set(range(256))
    elem = tiny * 2.0 ** 126
    want_elem = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    lo = (p.codes & 0xF).long()
    assert torch.equal(elem[..., 0::2], want_elem[lo])  # (-0.0 == 0.0: signs checked below)
    assert torch.equal(torch.signbit(elem[..., 0::2]), torch.signbit(want_elem[lo]))
    scale = sf * p.matrix_scale[..., None, None]
    got = elem * scale.repeat_interleave(16, -1)
    assert torch.equal(torch.isnan(got), torch.isnan(p.dequantize()))
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(p.dequantize()))
    assert torch.isnan(sf[p.block_scales == 0x7F]).all() and torch.isnan(sf[p.block_scales == 0xFF]).all()
    assert (sf[p.block_scales == 0x01] == 2.0 ** -9).all()  # the smallest subnormal scale
    assert (sf[p.block_scales == 0x7E] == 448.0).all() and (sf[p.block_scales == 0xFE] == -448.0).all()


def _kernel_products(read: PackedTensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's NVFP4 products ``R x`` in float32 torch arithmetic, in its factorisation:
    ``x`` pre-scaled by ``2^(126 - e)`` (``2^e`` above its largest magnitude), each
    16-element block's sum of ``tiny * x'`` times the block scale, the row's sum times the
    matrix scale and ``2^e``. ``x [B, H, K]`` (a head's key or query)."""
    tiny, sf = cs.nvfp4_tiny_decode(read.codes, read.block_scales)
    m = x.abs().amax(-1, keepdim=True)
    e = torch.frexp(m).exponent
    xs = torch.ldexp(x, 126 - e)
    blk = (tiny * xs[:, :, None, :]).view(*tiny.shape[:-1], D // 16, 16).sum(-1)
    acc = (blk * sf).sum(-1)
    return torch.ldexp(acc * read.matrix_scale[..., None], e)


def _mma_products(read: PackedTensor, x: torch.Tensor) -> torch.Tensor:
    """Stage 3's products ``R x`` emulated from its operands (``nvfp4_mma_operands``) in
    float32: each bf16 part's sum, then ``hi + (mid + lo)``, times the matrix scale and 2^e."""
    a, parts, e = cs.nvfp4_mma_operands(read.codes, read.block_scales, x)
    y = torch.einsum("bhvk,bhpk->bhvp", a, parts)
    return torch.ldexp((y[..., 0] + (y[..., 1] + y[..., 2])) * read.matrix_scale[..., None], e)


@pytest.mark.parametrize("products", [_kernel_products, _mma_products],
                         ids=["fma_forms", "stage3"])
@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e12])
def test_kernel_nvfp4_products_are_exact_to_float32(scale, products):
    """The kernel's factorised NVFP4 products (emulated in torch: the FMA forms' per-block
    factorisation, and stage 3's bf16 operands) are within float32 rounding of the float64
    products with the dequantized copy, for keys of any magnitude (the decode's 2^126, or
    stage 3's 2^-16, cancels against the keys' scaling, with no overflow, no subnormal
    product and no lost part)."""
    g = torch.Generator().manual_seed(3)
    S = torch.randn(2, 3, D, D, generator=g)
    read = pack(S, "nvfp4")
    x = torch.randn(2, 3, D, generator=g) * scale
    got = products(read, x)
    R = read.dequantize().double()
    want = torch.einsum("bhvk,bhk->bhv", R, x.double())
    bound = torch.einsum("bhvk,bhk->bhv", R.abs(), x.double().abs()) * 2e-6
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs() <= bound).all()


def test_mma_column_order_is_a_permutation_the_fragments_share():
    """Stage 3's column order: over its 8 k-steps and 16 k-indices (each held by lanes
    ``t = (kk % 8) // 2``) every column 0..127 comes exactly once; the B-fragment writer's
    inverse (``gdn_step.cu``: column c to k-step, register, half) lands each column where
    ``mma_column`` reads it; and the A registers (word j's code pairs ``(n, n + 4)``) hold the
    same columns."""
    seen = {}
    for ks in range(8):
        for kk in range(16):
            t = (kk & 7) >> 1
            seen[(ks, kk)] = cs.mma_column(ks, t, kk)
            for other in {0, 1, 2, 3} - {t}:
                with pytest.raises(ValueError, match="does not hold"):
                    cs.mma_column(ks, other, kk)
    assert sorted(seen.values()) == list(range(128))
    for c in range(128):  # the writer's formula, as in the kernel
        tg, j, n = c >> 5, (c >> 3) & 3, c & 7
        ks, rg, half = 2 * j + ((n >> 1) & 1), n & 1, n >> 2
        assert cs.mma_column(ks, tg, 2 * tg + 8 * rg + half) == c
    for ks in range(8):  # the A registers: a0/a1 = pair 2s of word j, a2/a3 = pair 2s + 1
        j, s_ = ks >> 1, ks & 1
        for t in range(4):
            for reg in range(2):
                for half in range(2):
                    nib = 2 * s_ + reg + 4 * half  # the pair's low or high code
                    assert cs.mma_column(ks, t, 2 * t + 8 * reg + half) == 32 * t + 8 * j + nib
    for bad in ((8, 0, 0), (0, 4, 0), (0, 0, 16), (-1, 0, 0)):
        with pytest.raises(ValueError, match="kstep"):
            cs.mma_column(*bad)


def test_nvfp4_mma_operands_are_exact():
    """Stage 3's operands (the kernel's shifts and masks, bf16 scale and bf16 product, in
    torch): every element times its block scale times 2^-16, bit for bit against
    the E2M1 value table times the E4M3 scales (every E2M1 pair, every E4M3 code; NaN where
    the scale is NaN); and the three bf16 parts of a key sum to it scaled by
    2^(16 - e) exactly, for keys of any magnitude (and the zero key)."""
    p = _all_codes_nvfp4()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, D, generator=g)
    a, parts, e = cs.nvfp4_mma_operands(p.codes, p.block_scales, x)
    table = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                         dtype=torch.float64)
    nib = torch.stack([p.codes & 0xF, p.codes >> 4], -1).flatten(-2).long()
    _, sf = cs.nvfp4_tiny_decode(p.codes, p.block_scales)  # (dequantize's scales: above)
    want = table[nib] * sf.double().repeat_interleave(16, -1) * 2.0 ** -16
    nan = torch.isnan(want)
    assert nan.any() and torch.equal(torch.isnan(a), nan)
    assert torch.equal(a.double()[~nan], want[~nan])
    assert torch.equal(torch.signbit(a[~nan]), torch.signbit(want[~nan].float()))
    for scale in (1.0, 1e-20, 1e12, 0.0):
        xs = torch.randn(4, D, generator=g) * scale
        if scale:  # key 0's largest element just below a power of two: its hi part is 2^16
            ex = torch.frexp(xs[0].abs().max()).exponent
            xs[0, 0] = torch.ldexp(torch.tensor(1 - 2.0 ** -20), ex)
        _, parts, e = cs.nvfp4_mma_operands(p.codes[0, :4], p.block_scales[0, :4], xs)
        total = parts.double().sum(-2)
        assert torch.equal(total, torch.ldexp(xs.double(), (16 - e).double()))
        # the scaled key is below 2^16; its hi part, rounded to nearest, at most 2^16
        assert (parts[..., 0, :].abs() <= 2.0 ** 16).all()
        assert (parts[0, 0, 0] == 2.0 ** 16) == (scale != 0)


def test_stage_is_checked():
    """``stage`` outside 0..3 and stage 3 (the tensor cores, NVFP4's form) with an FP32 read
    copy are refused by name, before any other check."""
    read, ring, tok = _step_inputs(2, 4, 2, 8)
    args = (ring, tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"], torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="stage must be 0, 1, 2, 3 or None.*got 4"):
        cs.gdn_step_cuda(read, *args, stage=4)
    with pytest.raises(ValueError, match="stage 3 .* NVFP4 read copy's form"):
        cs.gdn_step_cuda(read, *args, stage=3)
    assert cs.STAGES["nvfp4"] == (0, 1, 2, 3) and 3 not in cs.STAGES["f32"]
    assert all(c["stage"] in cs.STAGES[f] for f, c in cs.GDN_STEP_CUDA_CONFIG.items())


def _step_inputs(B, H, G, JS, seed=0, device="cpu", fmt="f32"):
    """A read copy (FP32 or NVFP4) ``[B, H, 128, 128]``, a ring of JS slots, a token."""
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(B, H, D, D, generator=g) * 0.3
    read = S if fmt == "f32" else pack(S, "nvfp4")
    nrm = torch.nn.functional.normalize
    ring = {"la": torch.log(0.9 + 0.0999 * torch.rand(B, JS, H, generator=g)),
            "beta": torch.sigmoid(torch.randn(B, JS, H, generator=g)),
            "v": torch.randn(B, JS, H, D, generator=g),
            "k": nrm(torch.randn(B, JS, G, D, generator=g), dim=-1),
            "uR": torch.randn(B, JS, H, D, generator=g) * 0.1}
    tok = {"q": nrm(torch.randn(B, G, D, generator=g), dim=-1) * D ** -0.5,
           "k": nrm(torch.randn(B, G, D, generator=g), dim=-1),
           "v": torch.randn(B, H, D, generator=g),
           "g": torch.log(0.9 + 0.0999 * torch.rand(B, H, generator=g)),
           "beta": torch.sigmoid(torch.randn(B, H, generator=g))}
    if device != "cpu":
        read = read.to(device)
        ring = {n: t.to(device) for n, t in ring.items()}
        tok = {n: t.to(device) for n, t in tok.items()}
    return read, ring, tok


def test_unsupported_names_why():
    """Covered calls need an FP32 or NVFP4 read copy, float32 ring and token tensors of the
    state's shapes, at most 32 contiguous ring slots and one CUDA device; each refusal says
    which (and the call goes to the Triton kernel)."""
    read, ring, tok = _step_inputs(2, 4, 2, 24)
    h = torch.tensor([0, 15])

    def why(read=read, ring=ring, h=h, **kw):
        t = dict(tok, **kw)
        return cs.unsupported(read, ring, t["q"], t["k"], t["v"], t["g"], t["beta"], h)

    assert "one CUDA device" in why()
    assert "one CUDA device" in why(read=pack(read, "nvfp4"))  # covered but for the device
    assert "neither FP32 nor NVFP4" in why(read=pack(read, "fp16"))
    assert "neither FP32 nor NVFP4" in why(read=None)
    assert "dict of the tensors" in why(ring={n: t for n, t in ring.items() if n != "uR"})
    assert "integer [B]" in why(h=h.float())
    big = {n: torch.cat([t, t], 1) for n, t in ring.items()}  # 48 slots
    assert "48 ring slots" in why(ring=big)
    assert "not float32" in why(ring={n: t.double() for n, t in ring.items()})
    assert "not float32" in why(v=tok["v"].double())
    assert "ring's shapes" in why(q=tok["q"][:, :1])
    assert "key heads do not divide" in why(ring=dict(ring, k=ring["k"][:, :, :1].expand(
        -1, -1, 3, -1)), q=torch.zeros(2, 3, D), k=torch.zeros(2, 3, D))
    assert "not contiguous" in why(ring=dict(ring, v=ring["v"].transpose(0, 1).contiguous(
    ).transpose(0, 1)))
    assert "not [B, JS" in why(ring=dict(ring, uR=ring["uR"][:, :-1]))
    assert "not a float32 [B, H, 128, 128]" in why(read=read.to(torch.bfloat16))
    assert "not a float32 [B, H, 128, 128]" in why(read=read.double())
    empty = {n: t[:, :, :0] if n != "k" else t for n, t in ring.items()}
    assert "empty batch or head axis" in why(read=read[:, :0], ring=empty, v=tok["v"][:, :0],
                                             g=tok["g"][:, :0], beta=tok["beta"][:, :0])


def test_unsupported_alignment():
    """A read copy, NVFP4 block scales or ring tensor that does not start on a 16-byte
    boundary is not covered (float4 and 8-byte loads). (The alignment rule comes before the
    device rule: aligned CPU inputs get only the device reason.)"""
    read, ring, tok = _step_inputs(2, 4, 2, 8)
    args = (tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"], torch.tensor([0, 3]))
    assert "one CUDA device" in cs.unsupported(read, ring, *args)
    p = pack(read, "nvfp4")
    assert "one CUDA device" in cs.unsupported(p, ring, *args)
    raw = torch.zeros(p.block_scales.numel() + 8, dtype=torch.uint8)
    shifted = raw[8:].view(p.block_scales.shape)  # 8 bytes past a 16-byte boundary
    bad = PackedTensor(p.spec, p.shape, p.codes, shifted, p.matrix_scale)
    assert raw.data_ptr() % 16 == 0 and "16-byte boundary" in cs.unsupported(bad, ring, *args)
    buf = torch.zeros(read.numel() + 1)
    assert "16-byte boundary" in cs.unsupported(buf[1:].view(read.shape), ring, *args)
    vb = torch.zeros(ring["v"].numel() + 2)
    assert "16-byte boundary" in cs.unsupported(
        read, dict(ring, v=vb[2:].view(ring["v"].shape)), *args)


def test_fallback_is_the_triton_kernel(monkeypatch):
    """An uncovered call (CPU tensors) runs :func:`gdn_step_kernel` with the same arguments
    (swapped here for the torch reference); ``fallback=False`` refuses it naming why."""
    from replayssm_quant.kernels.replay import records
    from replayssm_quant.replay.gdn import gdn_state_step

    class Cps:
        def __init__(self, r):
            self.read = r

    calls = []

    def ref(read, ring, q, k, v, g, beta, h):
        calls.append(h)
        return gdn_state_step(Cps(read), ring, h, q, k, v, g, beta)

    monkeypatch.setattr(records, "gdn_step_kernel", ref)
    read, ring, tok = _step_inputs(2, 4, 2, 8, seed=1)
    h = torch.tensor([0, 5])
    want_ring = {n: t.clone() for n, t in ring.items()}
    want = gdn_state_step(Cps(read), want_ring, h, tok["q"], tok["k"], tok["v"], tok["g"],
                          tok["beta"])
    got = cs.gdn_step_cuda(read, ring, tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"], h)
    assert len(calls) == 1 and torch.equal(got, want)
    assert all(torch.equal(ring[n], want_ring[n]) for n in ring)
    with pytest.raises(ValueError, match="does not cover this call: the inputs are not all "
                                         "on one CUDA device"):
        cs.gdn_step_cuda(read, ring, tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"], h,
                         fallback=False)


def test_failed_build_leaves_the_state_unchanged(monkeypatch):
    """A decode state's step under the CUDA kernel builds it before anything is written: where
    the build fails (no nvcc), the RuntimeError leaves the ring, the position and the
    checkpoints as they were. On CPU, with the kernel swapped in and the coverage rule patched
    to say it covers the call."""
    from _replay_inputs import same_snapshot, snapshot

    from replayssm_quant.kernels import replay as kr
    from replayssm_quant.replay import GDNReplayState

    B, HK, HV, L = 2, 1, 2, 4
    st = GDNReplayState("fp32", batch=B, key_heads=HK, value_heads=HV, key_dim=D,
                        value_dim=D, window=L, max_drafts=2, backend="torch")
    g = torch.Generator().manual_seed(0)

    def tok():
        k = torch.nn.functional.normalize(torch.randn(B, HK, D, generator=g), dim=-1)
        return (k * D ** -0.5, k, torch.randn(B, HV, D, generator=g),
                -0.01 * torch.rand(B, HV, generator=g), torch.rand(B, HV, generator=g))

    st.step(*tok())
    torch_step, st._ops.step = st._ops.step, kr.gdn_state_step_cuda

    def fail_build(all_variants=False):
        raise RuntimeError("the CUDA kernels (GDN verify and step) are built at first use and "
                           "need nvcc")

    monkeypatch.setattr(cs, "unsupported", lambda *a, **k: None)
    monkeypatch.setattr(cs, "build", fail_build)
    before = snapshot(st)
    with pytest.raises(RuntimeError, match="need nvcc"):
        st.step(*tok())
    assert same_snapshot(before, snapshot(st))
    st._ops.step = torch_step
    st.step(*tok())


# ------------------------------------------------------------------------ on the device
def _reference_step(read, ring, tok, h):
    """The float64 step (``gdn_step_output`` on the dequantized copy) and the ring it leaves."""
    R = (read.dequantize() if isinstance(read, PackedTensor) else read).double()
    ref = {n: t.clone() for n, t in ring.items()}
    b = torch.arange(h.shape[0], device=h.device)
    for n, src in (("la", "g"), ("beta", "beta"), ("v", "v"), ("k", "k")):
        ref[n][b, h] = tok[src]
    J = ref["la"].shape[1]
    o, u = gdn_step_output(R, *(ref[n][:, :J].double() for n in ("la", "beta", "v", "k")),
                           tok["q"].double(), ref["uR"].double(), h + 1)
    ref["uR"][b, h] = u[b, h].float()
    return o, u[b, h], ref


@needs_gpu
@pytest.mark.parametrize("fmt", ["f32", "nvfp4"])
@pytest.mark.parametrize("JS", [24, 32, 1])
def test_kernel_matches_float64_at_every_position(fmt, JS):
    """The kernel at every ring position (one per sequence, 0 .. JS - 1) against the float64
    step: output and new correction within ``1e-5 + 1e-5 |ref|``; the record appended to slot
    h bit for bit (la, beta, v, and k once per key group); every other slot untouched (slots
    past h hold random values that must stay); every launch form (``stage``) the same
    bits (NVFP4's stage 3, the tensor cores, its own bits, checked the same way)."""
    B = JS
    read, ring0, tok = _step_inputs(B, 4, 2, JS, seed=JS, device="cuda", fmt=fmt)
    h = torch.arange(B, device="cuda")
    want_o, want_u, want_ring = _reference_step(read, ring0, tok, h)
    runs = {}
    for stage in cs.STAGES[fmt]:
        ring = {n: t.clone() for n, t in ring0.items()}
        runs[stage] = (cs.gdn_step_cuda(read, ring, tok["q"], tok["k"], tok["v"], tok["g"],
                                        tok["beta"], h, stage=stage, fallback=False), ring)
    for stage in (1, 2):  # the FMA forms: the same bits
        assert torch.equal(runs[0][0], runs[stage][0])
        assert all(torch.equal(runs[0][1][n], runs[stage][1][n]) for n in ring0)
    if fmt == "nvfp4":  # stage 3 ran (its own bits), and it is the default
        assert not torch.equal(runs[0][0], runs[3][0])
        ring = {n: t.clone() for n, t in ring0.items()}
        assert torch.equal(cs.gdn_step_cuda(read, ring, tok["q"], tok["k"], tok["v"], tok["g"],
                                            tok["beta"], h, fallback=False), runs[3][0])
    b = torch.arange(B, device="cuda")
    for stage, (o, ring) in runs.items():
        assert ((o.double() - want_o).abs() <= 1e-5 + 1e-5 * want_o.abs()).all(), stage
        assert ((ring["uR"][b, h].double() - want_u).abs()
                <= 1e-5 + 1e-5 * want_u.abs()).all(), stage
        for n in ("la", "beta", "v", "k"):
            assert torch.equal(ring[n], want_ring[n]), (stage, n)
        other = torch.ones_like(ring["uR"], dtype=torch.bool)
        other[b, h] = False
        assert torch.equal(ring["uR"][other], want_ring["uR"][other]), stage


@needs_gpu
@pytest.mark.parametrize("stage", [0, 3])
def test_kernel_products_alone_to_float32(stage):
    """The NVFP4 products alone, to float32 accuracy: at ring position 0 with log decay 0,
    beta 1 and value 0 the new correction is exactly ``-R k``, and with the key 0 the output
    is exactly ``R q``; each within a relative Frobenius error of 1e-6 of float64 (float32
    rounding gives about 2e-7; stage 3 without its key's third bf16 part would give about
    2.4e-6, in ``nvfp4_mma_operands``' float64 emulation of these inputs)."""
    B, H, G, JS = 16, 4, 2, 8
    read, ring0, tok = _step_inputs(B, H, G, JS, seed=11, device="cuda", fmt="nvfp4")
    h = torch.zeros(B, dtype=torch.int64, device="cuda")
    tok = dict(tok, g=torch.zeros_like(tok["g"]), beta=torch.ones_like(tok["beta"]),
               v=torch.zeros_like(tok["v"]))
    R = read.dequantize().double()
    rep = H // G

    def rel(got, want):
        return float((got.double() - want).norm() / want.norm())

    ring = {n: t.clone() for n, t in ring0.items()}
    cs.gdn_step_cuda(read, ring, tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"], h,
                     stage=stage, fallback=False)
    rk = torch.einsum("bhvk,bhk->bhv", R, tok["k"].double().repeat_interleave(rep, 1))
    assert rel(-ring["uR"][:, 0], rk) <= 1e-6
    ring = {n: t.clone() for n, t in ring0.items()}
    o = cs.gdn_step_cuda(read, ring, tok["q"], torch.zeros_like(tok["k"]), tok["v"], tok["g"],
                         tok["beta"], h, stage=stage, fallback=False)
    rq = torch.einsum("bhvk,bhk->bhv", R, tok["q"].double().repeat_interleave(rep, 1))
    assert rel(o, rq) <= 1e-6


@needs_gpu
def test_kernel_decodes_every_nvfp4_code():
    """The kernel on a read copy whose codes cover every E2M1 pair and whose block scales
    cover every E4M3 code (subnormal, negative, NaN): against the float64 step on the
    dequantized copy, NaN exactly in the rows with a NaN block scale, the other rows within
    ``1e-5 + 1e-5 |ref|`` (relative to the rows' scale), the FMA forms the same bits, and
    stage 3 (the tensor cores: bf16 subnormal code 0.5, every scale) checked the same way."""
    B, H, G, JS = 2, 3, 1, 8
    read = _all_codes_nvfp4(B, H).to("cuda")
    _, ring0, tok = _step_inputs(B, H, G, JS, seed=4, device="cuda")
    h = torch.tensor([0, 5], device="cuda")
    want_o, want_u, _ = _reference_step(read, ring0, tok, h)
    outs = {}
    for stage in cs.STAGES["nvfp4"]:
        ring = {n: t.clone() for n, t in ring0.items()}
        outs[stage] = cs.gdn_step_cuda(read, ring, tok["q"], tok["k"], tok["v"], tok["g"],
                                       tok["beta"], h, stage=stage, fallback=False)
    for stage in (1, 2):
        assert torch.equal(torch.nan_to_num(outs[stage], 1e30), torch.nan_to_num(outs[0], 1e30))
    nan = torch.isnan(want_o)
    scale = want_o.nan_to_num(0).abs().amax() + 1.0
    for o in (outs[0].double(), outs[3].double()):
        assert nan.any() and (~nan).any() and torch.equal(torch.isnan(o), nan)
        assert ((o - want_o).abs()[~nan] <= 1e-5 * scale).all()


@needs_gpu
def test_kernel_batch_invariant():
    """A sequence's bits do not depend on its batch, position or neighbours (FP32 and NVFP4
    read copies, every launch form): the first 5 sequences alone, the batch reversed and other
    neighbours give the same outputs and rings."""
    for fmt, stage in ((f, s) for f in ("f32", "nvfp4") for s in cs.STAGES[f]):
        B, JS = 20, 24
        read, ring, tok = _step_inputs(B, 4, 2, JS, seed=7, device="cuda", fmt=fmt)
        h = torch.arange(B, device="cuda") % 16

        def sel(idx):
            r = read
            if isinstance(read, PackedTensor):
                r = PackedTensor(read.spec, (len(idx), *read.shape[1:]),
                                 read.codes[idx].contiguous(),
                                 read.block_scales[idx].contiguous(),
                                 read.matrix_scale[idx].contiguous())
            else:
                r = read[idx].contiguous()
            return (r, {n: t[idx].contiguous() for n, t in ring.items()},
                    {n: t[idx].contiguous() for n, t in tok.items()}, h[idx].contiguous())

        def run(r, rg, t, hh):
            o = cs.gdn_step_cuda(r, rg, t["q"], t["k"], t["v"], t["g"], t["beta"], hh,
                                 stage=stage, fallback=False)
            return o, rg

        full_o, full_r = run(*sel(torch.arange(B, device="cuda")))
        o5, r5 = run(*sel(torch.arange(5, device="cuda")))
        assert torch.equal(o5, full_o[:5]) and all(torch.equal(r5[n], full_r[n][:5]) for n in r5)
        rev = torch.arange(B - 1, -1, -1, device="cuda")
        orv, rrv = run(*sel(rev))
        assert torch.equal(orv, full_o[rev]) and torch.equal(rrv["uR"], full_r["uR"][rev])


@needs_gpu
def test_kernel_asserts_the_ring_position():
    """A ring position outside ``0 .. JS - 1`` stops the kernel with a device-side assert after
    it prints a bad sequence and its position (in a subprocess: the assert leaves its CUDA
    context unusable)."""
    from _replay_common import run_expecting_device_assert

    code = (
        "import torch\n"
        "from replayssm_quant.kernels.replay import cuda_step as cs\n"
        "B, H, G, D, JS = 3, 4, 2, 128, 8\n"
        "f = lambda *s: torch.randn(*s, device='cuda')\n"
        "ring = dict(la=f(B, JS, H), beta=f(B, JS, H), v=f(B, JS, H, D), k=f(B, JS, G, D),\n"
        "            uR=f(B, JS, H, D))\n"
        "o = cs.gdn_step_cuda(f(B, H, D, D), ring, f(B, G, D), f(B, G, D), f(B, H, D), f(B, H),\n"
        "                     f(B, H), torch.tensor([-1, 3, 8], device='cuda'), fallback=False)\n"
        "torch.cuda.synchronize()\n"
        "print('NO ASSERT')\n")
    out = run_expecting_device_assert(code)
    assert ("sequence 0 has h = -1" in out or "sequence 2 has h = 8" in out)
    assert "sequence 1 " not in out


def _decode_steps(backend, policy, dtype=torch.float32, B=4, n=40, seed=0):
    """A GDN decode state (HK = 2, HV = 4, DK = DV = 128, L = 16) through prefill and ``n``
    steps (two flushes); returns the outputs ``[n, B, HV, DV]``."""
    from replayssm_quant.replay import GDNReplayState

    g = torch.Generator().manual_seed(seed)
    HK, HV, L = 2, 4, 16
    st = GDNReplayState(policy, batch=B, key_heads=HK, value_heads=HV, key_dim=D, value_dim=D,
                        window=L, max_drafts=8, dtype=dtype, device="cuda", backend=backend)
    st.prefill((torch.randn(B, HV, D, D, generator=g, dtype=torch.float64) * 0.1).to(
        dtype=dtype, device="cuda"))
    outs = []
    nrm = torch.nn.functional.normalize
    for _ in range(n):
        q = nrm(torch.randn(B, HK, D, generator=g, dtype=torch.float64), dim=-1) * D ** -0.5
        k = nrm(torch.randn(B, HK, D, generator=g, dtype=torch.float64), dim=-1)
        v = torch.randn(B, HV, D, generator=g, dtype=torch.float64)
        gg = torch.log(0.9 + 0.0999 * torch.rand(B, HV, generator=g, dtype=torch.float64))
        beta = torch.sigmoid(torch.randn(B, HV, generator=g, dtype=torch.float64))
        outs.append(st.step(*(t.to(dtype=dtype, device="cuda") for t in (q, k, v, gg, beta))))
    return torch.stack(outs)


@needs_gpu
@pytest.mark.parametrize("policy", ["fp32", "read:nvfp4/rec:fp16+sr", "shared:nvfp4"])
def test_state_steps_under_cuda_backend(policy):
    """``GDNReplayState(backend="cuda")`` stepping 40 tokens (two flushes): within 1e-5 of the
    Triton backend (and, under ``fp32``, of the float64 torch state), not the Triton bits
    (the CUDA kernel ran); a read copy it does not cover (``shared:fp16``) gives the Triton
    bits. Under ``shared:nvfp4`` the flush folds the cached corrections, whose last bits
    differ between the kernels, and a rounding decision of the new read copy may then differ:
    there only the first window (16 steps, the flush's own output included) is compared.
    Under ``read:nvfp4/rec:fp16+sr`` the flush itself runs on the CUDA flush kernel
    (``tests/test_cuda_flush.py``), whose S differs from the Triton flush's in last bits, so
    the same holds there."""
    got = _decode_steps("cuda", policy)
    tri = _decode_steps("triton", policy)
    n = len(got) if policy == "fp32" else 16
    assert torch.isfinite(got).all()
    assert (got[:n] - tri[:n]).abs().max() <= 1e-5
    assert not torch.equal(got[:n], tri[:n])
    if policy == "fp32":
        ref = _decode_steps("torch", "fp32", dtype=torch.float64)
        assert ((got.double() - ref).abs() <= 1e-5 + 1e-5 * ref.abs()).all()
    assert torch.equal(_decode_steps("cuda", "shared:fp16", n=18),
                       _decode_steps("triton", "shared:fp16", n=18))

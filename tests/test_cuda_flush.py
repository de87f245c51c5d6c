"""GDN's flush with an fp16 anchor and an NVFP4 read copy as one CUDA C++ kernel
(``replayssm_quant/kernels/replay/cuda_flush.py``, ``gdn_flush.cu``; ``backend="cuda"``;
issue 15).

On CPU: which calls the kernel covers and why the others go to the Triton kernel; the fallback
runs the Triton kernel with the same arguments; a decode state builds the kernel at its first
step, so a failed build leaves the state as it was. On a CUDA device (skipped here): S, the
corrections and the flush token's output against the float64 reference; the new anchor and read
copy against the torch casts of the kernel's own S, bit for bit (fp16 RTN and SR, special
values included); the serving form's bits; batch invariance; the range assert; the decode state
under ``backend="cuda"``.
"""

from __future__ import annotations

import pytest
import torch

from replayssm_quant.kernels.replay import cuda_flush as cf
from replayssm_quant.kernels.replay import cuda_verify as cv
from replayssm_quant.policy import StatePolicy
from replayssm_quant.quant import PackedTensor, pack
from replayssm_quant.checkpoints import FlushResult
from replayssm_quant.replay import core

CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= cv.MIN_CAPABILITY
needs_gpu = pytest.mark.skipif(not CUDA, reason="the CUDA kernel runs on a GPU of compute "
                                                "capability >= 8.0 (nvcc to build it)")
D = 128
POLICY = StatePolicy.parse("read:nvfp4/rec:fp16+sr")
RTN = StatePolicy.parse("read:nvfp4/rec:fp16")
SEED, LAYER = 2 ** 63 - 12345, 3  # (a high seed word >= 2^31)


def _inputs(B, H, G, J, seed=0, device="cpu", scale=0.3):
    """A stored fp16 anchor ``[B, H, 128, 128]``, records of J slots, the flush token's query,
    per-sequence lengths (0, J and values between), sequence ids and flush indices."""
    g = torch.Generator().manual_seed(seed)
    A = pack(torch.randn(B, H, D, D, generator=g) * scale, "fp16")
    nrm = torch.nn.functional.normalize
    recs = {"la": torch.log(0.9 + 0.0999 * torch.rand(B, J, H, generator=g)),
            "beta": torch.sigmoid(torch.randn(B, J, H, generator=g)),
            "v": torch.randn(B, J, H, D, generator=g),
            "k": nrm(torch.randn(B, J, G, D, generator=g), dim=-1)}
    q = nrm(torch.randn(B, G, D, generator=g), dim=-1) * D ** -0.5
    length = torch.tensor([(J, 0, 1, J - 1, J // 2, 3)[i % 6] for i in range(B)]).clamp(max=J)
    seq = torch.arange(B) * 7 + 2
    fi = torch.arange(B) % 5 + 1
    if device != "cpu":
        A = A.to(device)
        recs = {n: t.to(device) for n, t in recs.items()}
        q, length, seq, fi = (t.to(device) for t in (q, length, seq, fi))
    return A, recs, q, length, seq, fi


def _why(A, recs, length, seq, fi, q=None, policy=POLICY, **kw):
    if isinstance(policy, str) and policy != "raw":
        policy = StatePolicy.parse(policy)
    elif policy == "raw":
        policy = str(POLICY)
    return cf.unsupported(A, recs["la"], recs["beta"], recs["v"], recs["k"], length, policy,
                          sequence_ids=seq, flush_index=fi, q=q, **kw)


def test_unsupported_names_why():
    """Covered calls need ``read:nvfp4/rec:fp16[+sr]``, the corrections re-solved, an fp16
    anchor of 128 x 128 matrices, float32 records of at most 16 slots of one layout, integer
    lengths and ids, one CUDA device; each refusal says which."""
    A, recs, q, length, seq, fi = _inputs(2, 4, 2, 16)
    assert "one CUDA device" in _why(A, recs, length, seq, fi, q)
    assert "one CUDA device" in _why(A, recs, length, seq, fi, policy="read:nvfp4/rec:fp16")
    assert "one CUDA device" in _why(A, recs, length, seq, 1)  # an int flush index
    assert "single-checkpoint" in _why(A, recs, length, seq, fi, policy="fp32")
    assert "single-checkpoint" in _why(A, recs, length, seq, fi, policy="shared:nvfp4")
    assert "anchor format is fp32" in _why(A, recs, length, seq, fi,
                                           policy="read:nvfp4/rec:fp32")
    assert "anchor format is bf16" in _why(A, recs, length, seq, fi,
                                           policy="read:nvfp4/rec:bf16+sr")
    assert "read format is nvfp4+sr" in _why(A, recs, length, seq, fi,
                                             policy="read:nvfp4+sr/rec:fp16")
    assert "read format is fp8e4m3" in _why(A, recs, length, seq, fi,
                                            policy="read:fp8e4m3/rec:fp16")
    assert "not a parsed StatePolicy" in _why(A, recs, length, seq, fi, policy="raw")
    assert "fold_cached_corrections" in _why(A, recs, length, seq, fi,
                                             fold_cached_corrections=True)
    assert "not an fp16 PackedTensor" in _why(A.dequantize(), recs, length, seq, fi)
    assert "not an fp16 PackedTensor" in _why(pack(A.dequantize(), "bf16"), recs, length, seq,
                                              fi)
    assert "not float32" in _why(A, {n: t.double() for n, t in recs.items()}, length, seq, fi)
    big = {n: torch.cat([t, t[:, :1]], 1) for n, t in recs.items()}  # 17 slots
    assert "J = 17 record slots" in _why(A, big, length, seq, fi)
    assert "key heads do not divide" in _why(
        A, dict(recs, k=recs["k"][:, :, :1].expand(-1, -1, 3, -1).contiguous()), length,
        seq, fi)
    assert "not [B, J" in _why(A, dict(recs, v=recs["v"][:, :-1]), length, seq, fi)
    strided = recs["v"].transpose(0, 1).contiguous().transpose(0, 1)
    assert "one layout" in _why(A, dict(recs, v=strided), length, seq, fi)
    assert "length is not an integer [B]" in _why(A, recs, length.float(), seq, fi)
    assert "sequence_ids is not" in _why(A, recs, length, seq[:1], fi)
    assert "flush_index is not" in _why(A, recs, length, seq, 1.5)
    assert "flush_index is not" in _why(A, recs, length, seq, fi.float())
    assert "q is not a contiguous float32 [B, G, 128]" in _why(A, recs, length, seq, fi, q[:, :1])
    wide = torch.zeros(2, 2, 2 * D)
    assert "q is not a contiguous" in _why(A, recs, length, seq, fi, wide[:, :, :D])
    ring = {n: torch.cat([t, t], 1)[:, :16] for n, t in recs.items()}  # a ring's first slots
    assert "one CUDA device" in _why(A, ring, length, seq, fi)
    raw = torch.zeros(A.codes.numel() + 4, dtype=torch.float16)
    bad = PackedTensor(A.spec, A.shape, raw[4:].view(A.codes.shape), None, None)  # 8 bytes on
    assert raw.data_ptr() % 16 == 0 and "16-byte boundary" in _why(bad, recs, length, seq, fi)
    for name in ("k", "v"):  # the operands of cp.async (4 bytes on: a float32 view at 1)
        t = recs[name]
        flat = torch.zeros(t.numel() + 1)
        assert flat.data_ptr() % 16 == 0
        moved = dict(recs, **{name: flat[1:].view(t.shape)})
        assert "16-byte boundary" in _why(A, moved, length, seq, fi), name


def test_fallback_is_the_triton_kernel(monkeypatch):
    """An uncovered call (CPU tensors) runs :func:`gdn_flush_kernel` with the same arguments
    (swapped here for a recorder); ``fallback=False`` refuses it naming why."""
    from replayssm_quant.kernels.replay import flush

    calls = []

    def rec(*a, **kw):
        calls.append((a, kw))
        return "triton"

    monkeypatch.setattr(flush, "gdn_flush_kernel", rec)
    A, recs, q, length, seq, fi = _inputs(2, 4, 2, 8)
    args = (A, recs["la"], recs["beta"], recs["v"], recs["k"], length, POLICY)
    out = cf.gdn_flush_cuda(*args, seed=5, layer=1, sequence_ids=seq, flush_index=fi, q=q,
                            store_state=False, return_w=False, block_v=32)
    assert out == "triton" and len(calls) == 1
    a, kw = calls[0]
    assert all(x is y for x, y in zip(a, args)) and len(a) == len(args)
    assert kw["q"] is q and kw["seed"] == 5 and kw["layer"] == 1 and kw["block_v"] == 32
    assert kw["store_state"] is False and kw["return_w"] is False
    assert kw["sequence_ids"] is seq and kw["flush_index"] is fi
    # the seed rule (philox.check_seed) holds before the fallback, not only in the kernel
    for bad in (2 ** 63, -1, 2.0):
        with pytest.raises(ValueError, match=r"gdn_flush_cuda: seed must be an int in \[0, 2\^63\)"):
            cf.gdn_flush_cuda(*args, seed=bad, layer=1, sequence_ids=seq, flush_index=fi)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="variant must be one of"):
        cf.gdn_flush_cuda(*args, seed=5, layer=1, sequence_ids=seq, flush_index=fi, variant=9)
    with pytest.raises(ValueError, match="does not cover this call: the inputs are not all "
                                         "on one CUDA device"):
        cf.gdn_flush_cuda(*args, seed=5, layer=1, sequence_ids=seq, flush_index=fi,
                          fallback=False)


def test_same_bits_is_the_form_of_a_variant():
    """``same_bits`` groups the launch variants by form: the FMA forms 0-3 together, the
    tensor-core forms 4-7 together; the variant asked for comes first; others are refused."""
    assert cf.same_bits(0) == (0, 1, 2, 3) and cf.same_bits(2) == (2, 0, 1, 3)
    assert cf.same_bits(4) == (4, 5, 6, 7)
    for v in cf.VARIANTS:
        assert {cf.VARIANTS[x]["tc"] for x in cf.same_bits(v)} == {cf.VARIANTS[v]["tc"]}
    with pytest.raises(KeyError):
        cf.same_bits(9)


def test_state_builds_the_flush_kernel_before_its_first_step(monkeypatch):
    """A decode state whose flush runs the CUDA kernel builds it at its first step or verify,
    before anything is written (a flush comes after a step's record is appended, or after a
    commit moves the position): where the build
    fails, the RuntimeError leaves the ring, the position and the checkpoints as they were.
    The build is asked only where the kernel would run (policy, dims, window). On CPU, with
    the kernel's prepare hook swapped in."""
    from _replay_inputs import same_snapshot, snapshot

    from replayssm_quant.kernels import replay as kr
    from replayssm_quant.replay import GDNReplayState

    asked = []

    def fail_build(all_variants=False):
        asked.append(1)
        raise RuntimeError("the CUDA kernels (GDN verify, step and flush) are built at first "
                           "use and need nvcc")

    monkeypatch.setattr(cf, "build", fail_build)
    B, HK, HV, L = 2, 1, 2, 4
    g = torch.Generator().manual_seed(0)

    def tok():
        k = torch.nn.functional.normalize(torch.randn(B, HK, D, generator=g), dim=-1)
        return (k * D ** -0.5, k, torch.randn(B, HV, D, generator=g),
                -0.01 * torch.rand(B, HV, generator=g), torch.rand(B, HV, generator=g))

    def state(policy):
        st = GDNReplayState(policy, batch=B, key_heads=HK, value_heads=HV, key_dim=D,
                            value_dim=D, window=L, max_drafts=2, backend="torch")
        st._ops.flush = kr.gdn_state_flush_cuda  # (a namespace of this state's own ops)
        return st

    st = state(POLICY)
    before = snapshot(st)
    with pytest.raises(RuntimeError, match="need nvcc"):
        st.step(*tok())
    assert same_snapshot(before, snapshot(st)) and len(asked) == 1
    st = state(POLICY)  # a verify first (its commit may flush): the same
    T = 2
    q, k, v, gg, beta = (torch.stack([t] * T, 1) for t in tok())
    before = snapshot(st)
    with pytest.raises(RuntimeError, match="need nvcc"):
        st.verify(q, k, v, gg, beta)
    assert same_snapshot(before, snapshot(st)) and len(asked) == 2
    asked.clear()
    asked.append(1)
    prep = kr.gdn_state_flush_cuda.prepare
    for policy, kw in ((StatePolicy.parse("read:nvfp4/rec:fp32"), {}),
                       (StatePolicy.parse("fp32"), {}), (POLICY, {"window": 17}),
                       (POLICY, {"key_dim": 64}), (POLICY, {"fold_cached_corrections": True})):
        prep(policy, **{**dict(key_dim=D, value_dim=D, window=L,
                               fold_cached_corrections=False), **kw})  # not covered: no build
    assert len(asked) == 1
    st = state("read:nvfp4/rec:fp32")  # its flush stays on Triton: the step builds nothing
    st.step(*tok())
    assert len(asked) == 1 and int(st._h[0]) == 1
    with pytest.raises(RuntimeError, match="need nvcc"):
        prep(POLICY, key_dim=D, value_dim=D, window=L, fold_cached_corrections=False)


# ------------------------------------------------------------------------ on the device
def _run(A, recs, q, length, seq, fi, policy=POLICY, **kw):
    return cf.gdn_flush_cuda(A, recs["la"], recs["beta"], recs["v"], recs["k"], length, policy,
                             seed=SEED, layer=LAYER, sequence_ids=seq, flush_index=fi, q=q,
                             fallback=False, **kw)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same_copies(cps, own):
    """The stored anchor and read copy of ``cps`` are ``own``'s, byte for byte."""
    a, oa = cps.anchor_stored, own.anchor_stored
    r, o = cps.read_stored, own.read_stored
    assert torch.equal(_bits(a.codes), _bits(oa.codes))
    assert torch.equal(_bits(r.codes), _bits(o.codes))
    assert torch.equal(_bits(r.block_scales), _bits(o.block_scales))
    assert torch.equal(_bits(r.matrix_scale), _bits(o.matrix_scale))


def _reference(A, recs, length, H):
    """The float64 flush (``gdn_flush``'s S and corrections, without its casts)."""
    la, beta, v = core.mask_records(length, *(recs[n].double() for n in ("la", "beta", "v")))
    k = core.expand_heads(recs["k"].double(), H, 2)
    A64 = A.dequantize().double()
    w = core.solve_corrections(A64, la, beta, v, k)
    return FlushResult(core.reconstruct(A64, la, w, k), None, w)


def _own_casts(S, policy, seq, fi):
    return core.cast_checkpoints(S, policy, store=True, sequence_ids=seq, flush_index=fi,
                                 seed=SEED, layer=LAYER)


#: the kernel's forms: FMAs (variant 0; 1-3 give its bits) and the tensor cores (6, the
#: default; 4, 5 and 7 give its bits)
FORMS = [0, 6]


@needs_gpu
@pytest.mark.parametrize("variant", FORMS)
@pytest.mark.parametrize("policy", [POLICY, RTN])
@pytest.mark.parametrize("J", [16, 5])
def test_kernel_matches_float64_and_casts_its_own_state(policy, J, variant):
    """S, the solved corrections and ``y = S q`` within FP32 tolerance of the float64
    reference (``gdn_flush``, corrections re-solved); the fp16 anchor (RTN and SR) and the
    NVFP4 read copy equal the torch casts of the kernel's own S, bit for bit, with the SR bits
    of ``checkpoint_streams``; lengths 0..J per sequence; both forms of the kernel."""
    B, H, G = 6, 4, 2
    A, recs, q, length, seq, fi = _inputs(B, H, G, J, device="cuda")
    res, y = _run(A, recs, q, length, seq, fi, policy=policy, variant=variant)
    ref = _reference(A, recs, length, H)
    assert ((res.state.double() - ref.state).abs() <= 1e-5 + 1e-5 * ref.state.abs()).all()
    assert ((res.w.double() - ref.w).abs() <= 1e-5 + 1e-5 * ref.w.abs()).all()
    yref = core.matvec(ref.state, core.expand_heads(q.double(), H, 1))
    assert ((y.double() - yref).abs() <= 1e-5 + 1e-5 * yref.abs()).all()
    n0 = length == 0  # S = A exactly
    assert torch.equal(res.state[n0], A.dequantize()[n0])
    _same_copies(res.checkpoints, _own_casts(res.state, policy, seq, fi))
    assert torch.equal(res.checkpoints.anchor, res.checkpoints.anchor_stored.dequantize())


@needs_gpu
@pytest.mark.parametrize("variant", FORMS)
def test_kernel_products_and_fold_to_float32(variant):
    """The products and the fold alone, bounded by FP32 rounding: one committed slot with
    decay 0, beta 1 and value 0 makes the correction exactly ``-A k`` (the kernel's product)
    and S exactly ``A + u k^T`` (its fold). The product within 1e-6 relative Frobenius error
    of float64, S within its own FP32 rounding (2^-24 relative an element, at most two
    roundings) plus 1e-6 of the term ``u k^T`` (the tensor-core form without a key's third
    bf16 part is off by 2.5e-6 of them in a float64 emulation of inputs like these, without the
    anchor's second part 1.7e-3)."""
    B, H, G, J = 4, 4, 2, 16
    A, recs, q, length, seq, fi = _inputs(B, H, G, J, device="cuda", seed=7, scale=1.0)
    recs = dict(recs, la=torch.zeros_like(recs["la"]), beta=torch.ones_like(recs["beta"]),
                v=torch.zeros_like(recs["v"]))
    length = torch.ones_like(length)
    res, _ = _run(A, recs, q, length, seq, fi, variant=variant)
    A64 = A.dequantize().double()
    k0 = core.expand_heads(recs["k"].double(), H, 2)[:, 0]  # [B, H, 128]
    prod = torch.einsum("bhrc,bhc->bhr", A64, k0)
    w0 = res.w[:, 0].double()  # [B, H, 128]
    assert (w0 + prod).norm() <= 1e-6 * prod.norm()
    term = w0.unsqueeze(-1) * k0.unsqueeze(-2)
    fold = A64 + term
    assert (res.state.double() - fold).norm() <= 2 ** -23 * fold.norm() + 1e-6 * term.norm()
    assert (res.w[:, 1:] == 0).all()


@needs_gpu
@pytest.mark.parametrize("variant", FORMS)
@pytest.mark.parametrize("policy", [POLICY, RTN])
def test_kernel_casts_special_values(policy, variant):
    """The casts on states with what a cast must handle: NaN and inf elements (an NVFP4 block
    with one is marked NaN, its codes 0; fp16 keeps them), fp16 subnormals (the SR subnormal
    path), values at and beyond 65504 (fp16 saturates), all-zero blocks and an all-zero matrix
    (matrix scale 1), signed zeros, a matrix of huge amax beside tiny blocks (block scales 0:
    signs only). Records with n = 0 leave S = A; with n > 0 large values go past 65504."""
    B, H, G, J = 4, 4, 2, 4
    A, recs, q, length, seq, fi = _inputs(B, H, G, J, device="cuda")
    x = A.dequantize().clone()
    x[0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    x[0, 0, 1, :16] = torch.tensor([2.0 ** -20, -2.0 ** -24, 3 * 2.0 ** -17, 65504.0] * 4)
    x[0, 0, 2] = -0.0
    x[0, 1] = 0.0
    x[0, 2] = x[0, 2] * 1e-6
    x[0, 2, 5, 0] = 60000.0
    x[1, 0] = x[1, 0] * 2.0 ** -14
    A2 = pack(x, "fp16")
    length = torch.tensor([0, 0, 2, 4], device="cuda")
    recs = dict(recs, v=recs["v"] * 1e5)  # |S| up to about 9e4
    res, y = _run(A2, recs, q, length, seq[:B], fi[:B], policy=policy, variant=variant)
    assert torch.equal(_bits(res.state[:2]), _bits(A2.dequantize()[:2]))
    own = _own_casts(res.state, policy, seq[:B], fi[:B])
    _same_copies(res.checkpoints, own)
    assert res.checkpoints.read_stored.block_scales[0, 0, 0, 0] == 0x7F
    assert (res.checkpoints.read_stored.matrix_scale[0, 1] == 1.0)
    assert (res.state[2:].abs() > 65504).any()


@needs_gpu
@pytest.mark.parametrize("variant", FORMS)
def test_serving_form_and_batch_invariance(variant):
    """Without S and w (the serving form) the copies and ``y`` are the full form's bits, in
    every launch variant of the form (variants 0-3 share their bits; the tensor-core variants
    4-7 have their own, within FP32 tolerance of them); a sequence's bits do not depend on the
    batch it is flushed in, its position or its neighbours."""
    B, H, G, J = 7, 4, 2, 16
    A, recs, q, length, seq, fi = _inputs(B, H, G, J, device="cuda", seed=3)
    res, y = _run(A, recs, q, length, seq, fi, variant=variant)
    for var in cf.same_bits(variant):
        res2, y2 = _run(A, recs, q, length, seq, fi, store_state=False, return_w=False,
                        dequantize=False, variant=var)
        assert res2.state is None and res2.w is None and res2.checkpoints.anchor is None
        _same_copies(res.checkpoints, res2.checkpoints)
        assert torch.equal(y, y2)
    other, _ = _run(A, recs, q, length, seq, fi, variant=6 if variant == 0 else 0)
    assert not torch.equal(other.state, res.state)  # (the two forms ran: their last bits)
    assert ((other.state - res.state).abs() <= 1e-5 + 1e-5 * res.state.abs()).all()
    idx = torch.tensor([5, 2, 6], device="cuda")
    sub = PackedTensor(A.spec, (3, H, D, D), A.codes[idx].contiguous(), None, None)
    rs, ys = _run(sub, {n: t[idx].contiguous() for n, t in recs.items()}, q[idx], length[idx],
                  seq[idx], fi[idx], variant=variant)
    assert torch.equal(ys, y[idx]) and torch.equal(rs.state, res.state[idx])
    a, r = res.checkpoints.anchor_stored, res.checkpoints.read_stored
    assert torch.equal(_bits(rs.checkpoints.anchor_stored.codes), _bits(a.codes[idx]))
    assert torch.equal(rs.checkpoints.read_stored.codes, r.codes[idx])
    assert torch.equal(rs.checkpoints.read_stored.block_scales, r.block_scales[idx])
    assert torch.equal(_bits(rs.checkpoints.read_stored.matrix_scale), _bits(r.matrix_scale[idx]))


@needs_gpu
def test_kernel_asserts_the_ranges():
    """A length outside ``0 .. J`` (or a sequence id or flush index beyond its stream-key
    field) stops the kernel with a device-side assert after it prints the sequence (in a
    subprocess: the assert leaves its CUDA context unusable)."""
    from _replay_common import run_expecting_device_assert

    code = (
        "import torch\n"
        "from replayssm_quant.kernels.replay import cuda_flush as cf\n"
        "from replayssm_quant.quant import pack\n"
        "from replayssm_quant.policy import StatePolicy\n"
        "B, H, G, D, J = 3, 4, 2, 128, 8\n"
        "f = lambda *s: torch.randn(*s, device='cuda')\n"
        "A = pack(f(B, H, D, D), 'fp16')\n"
        "cf.gdn_flush_cuda(A, f(B, J, H), f(B, J, H), f(B, J, H, D), f(B, J, G, D),\n"
        "                  torch.tensor([2, 9, 8], device='cuda'),\n"
        "                  StatePolicy.parse('read:nvfp4/rec:fp16+sr'),\n"
        "                  seed=1, layer=0, sequence_ids=torch.arange(B, device='cuda'),\n"
        "                  flush_index=1, fallback=False)\n"
        "torch.cuda.synchronize()\n"
        "print('NO ASSERT')\n")
    out = run_expecting_device_assert(code)
    assert "sequence 1: length 9 (expected 0..8)" in out
    assert "sequence 0:" not in out and "sequence 2:" not in out


@needs_gpu
def test_state_under_cuda_backend_runs_the_kernel(monkeypatch):
    """``GDNReplayState(backend="cuda")`` under ``read:nvfp4/rec:fp16+sr`` flushes on the CUDA
    kernel (counted), and its first window of outputs, the flush token's own included, is
    within 1e-5 of the Triton backend's. (After the flush the copies are casts of S's with
    other last bits, so a rounding decision may differ: the later steps are checked finite.)"""
    from test_cuda_step import _decode_steps

    calls = []
    real = cf.gdn_flush_cuda

    def counted(*a, **kw):
        calls.append(kw.get("fallback", True))
        return real(*a, fallback=False, **kw)

    monkeypatch.setattr(cf, "gdn_flush_cuda", counted)
    got = _decode_steps("cuda", POLICY)
    tri = _decode_steps("triton", POLICY)
    assert len(calls) == 2 and torch.isfinite(got).all()
    assert (got[:16] - tri[:16]).abs().max() <= 1e-5

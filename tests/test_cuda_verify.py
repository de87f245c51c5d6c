"""GDN's verify as one CUDA C++ kernel (``replayssm_quant/kernels/replay/cuda_verify.py``,
``backend="cuda"``; issue 15).

On CPU: the kernel's decomposition of the verify (what ``gdn_verify.cu`` computes,
written in torch) against float64 ``gdn_verify``; which calls the kernel covers and why the
others go to the Triton kernel; the refusals. On a CUDA device (skipped here): the kernel
against float64 ``gdn_verify`` at every start, on a state's ring layout, batch invariance,
and the decode state under ``backend="cuda"`` against ``"triton"`` and the float64 state.
"""

from __future__ import annotations

import pytest
import torch

from replayssm_quant.config import GDNFold
from replayssm_quant.kernels.replay import cuda_verify as cv
from replayssm_quant.replay import gdn_verify

CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= cv.MIN_CAPABILITY
needs_gpu = pytest.mark.skipif(not CUDA, reason="the CUDA kernel runs on a GPU of compute "
                                                "capability >= 8.0 (nvcc to build it)")


def _inputs(B, H, G, V, K, J, T, seed=0, dtype=torch.float64, device="cpu"):
    """R [B,H,V,K], la, beta [B,J,H], v, uk [B,J,H,V], k [B,J,G,K] (unit rows), q [B,T,G,K]."""
    g = torch.Generator().manual_seed(seed)
    d = torch.float64
    la = torch.log(0.9 + 0.0999 * torch.rand(B, J, H, generator=g, dtype=d))
    k = torch.nn.functional.normalize(torch.randn(B, J, G, K, generator=g, dtype=d), dim=-1)
    x = dict(R=torch.randn(B, H, V, K, generator=g, dtype=d) * 0.3, la=la,
             beta=torch.sigmoid(torch.randn(B, J, H, generator=g, dtype=d)),
             v=torch.randn(B, J, H, V, generator=g, dtype=d), k=k,
             q=torch.randn(B, T, G, K, generator=g, dtype=d),
             uk=torch.randn(B, J, H, V, generator=g, dtype=d) * 0.1)
    return {n: t.to(dtype=dtype, device=device) for n, t in x.items()}


def _ring(t, slots):
    """``t [B, J, ...]`` as the first J slots of a ring of ``slots`` per sequence (NaN past J,
    so that a kernel reading beyond J shows it)."""
    big = torch.full((t.shape[0], slots, *t.shape[2:]), float("nan"), dtype=t.dtype,
                     device=t.device)
    big[:, :t.shape[1]] = t
    return big[:, :t.shape[1]]


@pytest.mark.parametrize("T", [8, 3])
def test_decomposition_is_gdn_verify(T):
    """``decomposition`` (the kernel's split into ``Y = R X``, the ring keys' products,
    coefficient tables and a per-row forward substitution) equals the float64 ``gdn_verify``
    with cached corrections and anchor = read copy, at every start including the one whose
    last draft lands on the flush slot; and the committed corrections matter (zeroing them
    moves the outputs)."""
    J = 16
    x = _inputs(J - T + 1, 4, 2, 8, 16, J, T)
    start = torch.arange(J - T + 1)  # every start, one per sequence
    o, u = cv.decomposition(*x.values(), start)
    R = x["R"]
    want_o, want_u = gdn_verify(R, R, x["la"], x["beta"], x["v"], x["k"], x["q"], x["uk"],
                                start, J, GDNFold.CACHED)
    assert torch.allclose(o, want_o, rtol=1e-12, atol=1e-12)
    assert torch.allclose(u, want_u, rtol=1e-12, atol=1e-12)
    o0, _ = cv.decomposition(*dict(x, uk=torch.zeros_like(x["uk"])).values(), start)
    assert (o0[1:] - want_o[1:]).abs().amax() > 1e-3  # start 0 has no committed rows


def _covered_args(device="cpu", ring_slots=None, B=2, T=8, J=16):
    x = _inputs(B, 4, 2, 128, 128, J, T, dtype=torch.float32, device=device)
    ring = [x[n] if ring_slots is None else _ring(x[n], ring_slots)
            for n in ("la", "beta", "v", "k", "uk")]
    start = torch.zeros(B, dtype=torch.int64, device=device)
    return dict(read=x["R"], anchor=x["R"], la=ring[0], beta=ring[1], v=ring[2], k=ring[3],
                q=x["q"], u_known=ring[4], start=start, fold_cached_corrections=True)


def test_unsupported_names_why():
    """Every call the kernel does not cover goes to the Triton kernel, and ``unsupported``
    says why (the first reason that applies); on CPU the last reason, the device, is what
    stops a call that is covered otherwise (including the first J slots of a longer ring, a
    decode state's layout)."""
    dev = "the inputs are not all on one CUDA device"
    a = _covered_args()
    assert cv.unsupported(**a) == dev
    assert cv.unsupported(**_covered_args(ring_slots=24)) == dev  # a state's ring slices
    assert cv.unsupported(**_covered_args(T=3, J=12)) == dev
    assert cv.unsupported(**_covered_args(B=1, T=1, J=1)) == dev

    def why(**kw):
        return cv.unsupported(**{**a, **kw})

    from replayssm_quant.quant import pack
    assert "read is not a plain torch.Tensor" in why(read=pack(a["read"], "fp16"))
    assert "dual policy" in why(anchor=a["read"].clone())
    assert "fold_cached_corrections is off" in why(fold_cached_corrections=False)
    assert "start is not an integer [B] tensor" in why(start=a["start"].float())
    assert "not float32" in why(q=a["q"].double())
    x64 = a["read"][..., :64].contiguous()
    assert "[B, H, 128, 128]" in why(read=x64, anchor=x64)
    assert "T = 9 drafts (the kernel takes 1..8)" in why(q=torch.zeros(2, 9, 2, 128))
    assert "T = 0 drafts" in why(q=torch.zeros(2, 0, 2, 128))
    big = _covered_args(T=8, J=17)
    assert "J = 17 ring slots (the kernel takes at most 16)" in cv.unsupported(**big)
    assert "fewer ring slots than drafts" in why(q=torch.zeros(2, 8, 2, 128),
                                                 **{n: a[n][:, :4] for n in
                                                    ("la", "beta", "v", "k", "u_known")})
    assert "key or value dims other than 128" in why(q=torch.zeros(2, 8, 2, 64))
    assert "one layout of contiguous slots" in why(la=_ring(a["la"], 20))  # the others: 16
    assert "one layout of contiguous slots" in why(v=a["v"].transpose(2, 3).contiguous()
                                                   .transpose(2, 3))
    ring = ("la", "beta", "v", "k", "u_known")

    def restrided(t, slot_stride, batch_slots):
        """``t [B, J, ...]`` re-viewed with slot stride ``slot_stride`` slots and a batch stride
        of ``batch_slots`` slots (in a buffer large enough for both)."""
        per = t[0, 0].numel()
        buf = torch.zeros(t.shape[0] * int(batch_slots * per) + t.shape[1] * slot_stride * per)
        inner = t.stride()[2:]
        return buf.as_strided(t.shape, (int(batch_slots * per), slot_stride * per, *inner))

    # every ring tensor with a slot stride of 2 slots (a [:, ::2] view): one layout, but not
    # contiguous slots
    assert "one layout of contiguous slots" in why(**{n: restrided(a[n], 2, 32) for n in ring})
    # a batch stride that is not a whole number of slots; sequences overlapping (JS < J)
    assert "one layout of contiguous slots" in why(**{n: restrided(a[n], 1, 16.5) for n in ring})
    assert "one layout of contiguous slots" in why(**{n: restrided(a[n], 1, 8) for n in ring})
    assert why(**{n: restrided(a[n], 1, 16) for n in ring}) == dev  # (the helper itself)
    assert "q is not contiguous" in why(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3))
    off = torch.zeros(a["q"].numel() + 1)[1:].view(a["q"].shape)  # 4 bytes off
    assert "16-byte boundary" in why(q=off)
    assert "not a plain torch.Tensor" in why(v=None)


def test_refusals():
    """``fallback=False`` refuses an uncovered call naming why; a launch variant the build
    lacks is refused naming the library's variants; the build without a GPU says what is
    missing and what runs instead."""
    a = _covered_args()
    with pytest.raises(ValueError, match="does not cover this call: the inputs are not all "
                                         "on one CUDA device"):
        cv.gdn_verify_cuda(a["read"], a["anchor"], a["la"], a["beta"], a["v"], a["k"], a["q"],
                           a["u_known"], a["start"], 16, True, fallback=False)
    assert cv._variant(None, None, None, None, False) == tuple(
        cv.GDN_VERIFY_CUDA_CONFIG[n] for n in ("nw", "pf", "mb", "ep"))
    assert cv._variant(4, None, None, 0, False) == (4, 3, 0, 0)
    with pytest.raises(ValueError, match=r"\(4, 4, 0, 0\) is not one of the library's variants"):
        cv._variant(4, 4, 0, 0, False)
    assert cv._variant(4, 4, 0, 0, True) == (4, 4, 0, 0)
    with pytest.raises(ValueError, match=r"\(8, 6, 0, 2\) is not a launch variant"):
        cv._variant(8, 6, 0, 2, True)
    # refused before the coverage rule: also where the call would go to the Triton kernel
    with pytest.raises(ValueError, match=r"\(3, 3, 0, 2\) is not one of the library's"):
        cv.gdn_verify_cuda(a["read"], a["anchor"], a["la"], a["beta"], a["v"], a["k"], a["q"],
                           a["u_known"], a["start"], 16, True, nw=3)
    # a missing anchor is named (by the Triton kernel's checks, where the call goes)
    with pytest.raises(ValueError, match="anchor must be a stored checkpoint .* got NoneType"):
        cv.gdn_verify_cuda(a["read"], None, a["la"], a["beta"], a["v"], a["k"], a["q"],
                           a["u_known"], a["start"], 16, True)
    with pytest.raises(ValueError, match=r"\(4, 3, 0, 3\) is not a launch variant"):
        cv._variant(4, 3, 0, 3, True)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="need a CUDA device; backend='triton'"):
            cv.build()


def test_out_refusals_and_coverage():
    """``out``: another shape, dtype or device than ``u_known``, a non-tensor, and memory
    overlapping an input (other than ``u_known`` itself, the in-place use) are refused naming
    the problem; ``u_known``'s own view and memory of its own pass; an ``out`` without
    contiguous slots goes to the Triton kernel, saying so."""
    a = _covered_args()
    args = [a[n] for n in ("read", "anchor", "la", "beta", "v", "k", "q", "u_known", "start")]

    def call(out):
        return cv.gdn_verify_cuda(*args, 16, True, out=out, fallback=False)

    with pytest.raises(ValueError, match=r"out must be float32 \(2, 16, 4, 128\) on cpu "
                                         r"\(like u_known\), got torch.float32 \(2, 15, 4"):
        call(a["u_known"][:, :15])
    with pytest.raises(ValueError, match="out must be float32.*got torch.float64"):
        call(a["u_known"].double())
    with pytest.raises(ValueError, match="out must be a tensor like u_known, got list"):
        call([])
    with pytest.raises(ValueError, match="out must be float32.* on meta"):
        call(torch.empty_like(a["u_known"], device="meta"))
    with pytest.raises(ValueError, match="out overlaps v in memory"):
        call(a["v"])
    with pytest.raises(ValueError, match="out requires grad"):
        call(torch.zeros_like(a["u_known"]).requires_grad_())
    with pytest.raises(ValueError, match=r"out has a dimension of stride 0 \(an expanded view"):
        call(torch.zeros(1, 1, 1, 128).expand(a["u_known"].shape))
    shifted = torch.zeros(a["u_known"].numel() * 2)
    uk = shifted[:a["u_known"].numel()].view(a["u_known"].shape)
    uk.copy_(a["u_known"])
    args[7] = uk
    with pytest.raises(ValueError, match="out overlaps u_known in memory; out must be u_known "
                                         "itself"):
        call(shifted[128:128 + uk.numel()].view(uk.shape))
    dev = "does not cover this call: the inputs are not all on one CUDA device"
    for ok in (uk, uk[:, :], torch.empty_like(uk)):  # checked; then only the device is missing
        with pytest.raises(ValueError, match=dev):
            call(ok)
    assert cv.unsupported(*args, True, out=uk) == "the inputs are not all on one CUDA device"
    strided = torch.zeros(2, 32, 4, 128)[:, ::2]
    assert cv.unsupported(*args, True, out=strided) == "out does not have contiguous slots"
    # u_known's address with other strides (slots and heads swapped) is not u_known's view:
    # it overlaps it, and is refused
    swapped = uk.transpose(1, 2).contiguous().transpose(1, 2)
    twin = uk.as_strided(uk.shape, swapped.stride())
    with pytest.raises(ValueError, match="out overlaps u_known in memory"):
        call(twin)
    per = 4 * 128  # sequences 8 slots apart: the second overlaps the first's last 8 slots
    packed = torch.zeros(2 * 16 * per).as_strided(uk.shape, (8 * per, per, 128, 1))
    assert cv.unsupported(*args, True, out=packed) == "out does not have contiguous slots"
    assert cv.unsupported(*args, True, out=uk.reshape(-1)) == \
        "out does not have contiguous slots"  # (never raises: the 1-D out is _check_out's)


def test_out_on_the_triton_fallback(monkeypatch):
    """An uncovered call with ``out`` (here: on CPU, the Triton kernel swapped for the float64
    reference) writes the slots from ``start`` on, the drafts' corrections then zeros, and
    leaves the slots below ``start`` as they were; ``out=u_known`` gives the whole result in
    place."""
    from replayssm_quant.kernels.replay import records

    def reference(read, anchor, la, beta, v, k, q, uk, start, window, fold):
        return gdn_verify(read, anchor, la, beta, v, k, q, uk, start, window,
                          GDNFold.CACHED if fold else GDNFold.RECOMPUTE)

    monkeypatch.setattr(records, "gdn_verify_kernel", reference)
    J, T, B = 12, 3, 10
    x = _inputs(B, 4, 2, 128, 128, J, T, seed=2, dtype=torch.float32)
    start = torch.arange(B)
    args = [x[n] for n in ("R", "R", "la", "beta", "v", "k", "q")]
    want_o, want_u = reference(*args, x["uk"], start, J, True)
    assert (want_u[0, T:] == 0).all() and (want_u[-1, -1] != 0).all()  # zeros past start + T
    own = torch.full_like(x["uk"], 7.0)
    o, u = cv.gdn_verify_cuda(*args, x["uk"], start, J, True, out=own)
    below = (torch.arange(J) < start[:, None])[:, :, None, None]
    assert u is own and torch.equal(o, want_o) and torch.equal(own, torch.where(below, 7.0,
                                                                                want_u))
    uk = x["uk"].clone()
    o, u = cv.gdn_verify_cuda(*args, uk, start, J, True, out=uk)
    assert u is uk and torch.equal(o, want_o) and torch.equal(uk, want_u)


# ------------------------------------------------------------------------ on the device
@needs_gpu
@pytest.mark.parametrize("T,J", [(8, 16), (3, 12), (1, 1)])
def test_kernel_matches_float64_at_every_start(T, J):
    """The kernel (through ``gdn_verify_cuda``, on the first J slots of a longer ring) against
    float64 ``gdn_verify`` at every start, one per sequence, at ``1e-5 + 1e-5 |ref|``; every
    launch variant of the library's build gives outputs of that accuracy; int32 starts give
    the int64 starts' bits; and no call fell back (``fallback=False``)."""
    B = J - T + 1
    x = _inputs(B, 4, 2, 128, 128, J, T, seed=3, dtype=torch.float32, device="cuda")
    start = torch.arange(B, device="cuda")
    ring = {n: _ring(x[n], J + 5) for n in ("la", "beta", "v", "k", "uk")}
    xd = {n: t.double() for n, t in x.items()}
    want_o, want_u = gdn_verify(xd["R"], xd["R"], xd["la"], xd["beta"], xd["v"], xd["k"],
                                xd["q"], xd["uk"], start, J, GDNFold.CACHED)
    o32, u32 = cv.gdn_verify_cuda(x["R"], x["R"], ring["la"], ring["beta"], ring["v"],
                                  ring["k"], x["q"], ring["uk"], start.int(), J, True,
                                  fallback=False)  # int32 starts
    for nw, pf, mb, ep in cv.LIBRARY_VARIANTS:
        o, u = cv.gdn_verify_cuda(x["R"], x["R"], ring["la"], ring["beta"], ring["v"],
                                  ring["k"], x["q"], ring["uk"], start, J, True, nw=nw, pf=pf,
                                  mb=mb, ep=ep, fallback=False)
        assert o.shape == (B, T, 4, 128) and u.shape == (B, J, 4, 128)
        assert ((o.double() - want_o).abs() <= 1e-5 + 1e-5 * want_o.abs()).all()
        assert ((u.double() - want_u).abs() <= 1e-5 + 1e-5 * want_u.abs()).all()
        if (nw, pf, mb, ep) == cv._variant(None, None, None, None, False):
            assert torch.equal(o32, o) and torch.equal(u32, u)
    # out: in place in a ring slice (as the decode state runs it), and into memory of its own
    # (slots below start left as they were); the same bits as the fresh tensor
    base = torch.full((B, J + 5, 4, 128), float("nan"), device="cuda")
    base[:, :J] = x["uk"]
    inplace = base[:, :J]
    oi, ui = cv.gdn_verify_cuda(x["R"], x["R"], ring["la"], ring["beta"], ring["v"], ring["k"],
                                x["q"], inplace, start, J, True, out=inplace, fallback=False)
    assert ui is inplace and torch.equal(oi, o32) and torch.equal(inplace, u32)
    assert base[:, J:].isnan().all()  # the ring's slots past J untouched
    own = torch.full((B, J, 4, 128), 7.0, device="cuda")
    _, uo = cv.gdn_verify_cuda(x["R"], x["R"], ring["la"], ring["beta"], ring["v"], ring["k"],
                               x["q"], ring["uk"], start, J, True, out=own, fallback=False)
    below = (torch.arange(J, device="cuda") < start[:, None])[:, :, None, None]
    assert uo is own and torch.equal(own, torch.where(below, 7.0, u32))


@needs_gpu
def test_kernel_asserts_the_ring_range():
    """A start outside ``0 .. J - T`` (drafts that do not fit the ring) stops the kernel with
    a device-side assert (RuntimeError at the next synchronisation), after it prints a bad
    sequence and its start (the CTA that stops the grid first has printed; others may not have
    run). In a subprocess: the assert leaves its CUDA context unusable."""
    from _replay_common import run_expecting_device_assert

    code = (
        "import torch\n"
        "from replayssm_quant.kernels.replay import cuda_verify as cv\n"
        "B, H, G, D, J, T = 3, 4, 2, 128, 16, 8\n"
        "f = lambda *s: torch.randn(*s, device='cuda')\n"
        "R = f(B, H, D, D)\n"
        "o, u = cv.gdn_verify_cuda(R, R, f(B, J, H), f(B, J, H), f(B, J, H, D), f(B, J, G, D),\n"
        "                          f(B, T, G, D), f(B, J, H, D),\n"
        "                          torch.tensor([-1, 8, 9], device='cuda'), J, True,\n"
        "                          fallback=False)\n"
        "torch.cuda.synchronize()\n"
        "print('NO ASSERT')\n")
    out = run_expecting_device_assert(code)
    assert ("sequence 0 has start -1 with T = 8" in out
            or "sequence 2 has start 9 with T = 8" in out) and "sequence 1 " not in out


@needs_gpu
def test_kernel_batch_invariant():
    """A sequence's bits do not depend on its batch, position or neighbours: the first 5
    sequences alone, the batch reversed, and a batch with other neighbours give the same
    outputs and corrections."""
    B, T, J = 24, 8, 16
    x = _inputs(B, 4, 2, 128, 128, J, T, seed=5, dtype=torch.float32, device="cuda")
    y = _inputs(B, 4, 2, 128, 128, J, T, seed=6, dtype=torch.float32, device="cuda")
    start = torch.arange(B, device="cuda") % (J - T + 1)
    order = ("R", "R", "la", "beta", "v", "k", "q", "uk")

    def run(d, s):
        return cv.gdn_verify_cuda(*(d[n] for n in order), s, J, True, fallback=False)

    o, u = run(x, start)
    sub = {n: t[:5].contiguous() for n, t in x.items()}
    o5, u5 = run(sub, start[:5].contiguous())
    assert torch.equal(o5, o[:5]) and torch.equal(u5, u[:5])
    rev = torch.arange(B - 1, -1, -1, device="cuda")
    orv, urv = run({n: t[rev].contiguous() for n, t in x.items()}, start[rev].contiguous())
    assert torch.equal(orv, o[rev]) and torch.equal(urv, u[rev])
    mix = {n: torch.cat([x[n][:5], y[n][5:]]) for n in x}
    om, um = run(mix, start)
    assert torch.equal(om[:5], o[:5]) and torch.equal(um[:5], u[:5])


@needs_gpu
def test_kernel_non_finite_state_rows():
    """A NaN or an infinity in the state R makes its value row's outputs and drafts'
    corrections non-finite (NaN, +inf or -inf in R: never a finite number in their place,
    whatever the TF32 split does with the bits), in every launch variant; every other value
    row keeps the bits of the clean run (the rows do not mix)."""
    B, T, J = 3, 8, 16
    x = _inputs(B, 4, 2, 128, 128, J, T, seed=7, dtype=torch.float32, device="cuda")
    start = torch.arange(B, device="cuda")
    order = ("la", "beta", "v", "k", "q", "uk")
    # (the last: the canonical NaN 0x7FFFFFFF, whose mantissa carries into the sign when half
    # a TF32 unit is added; set through an integer view so that its bits are exact)
    bad = [(0, 1, 5, 17, float("nan")), (1, 2, 9, 100, float("inf")),
           (2, 0, 3, 0, float("-inf")), (2, 3, 77, 64, None)]
    R = x["R"].clone()
    for b, h, row, k, val in bad:
        if val is None:
            R.view(torch.int32)[b, h, row, k] = 0x7FFFFFFF
        else:
            R[b, h, row, k] = val
    hit = torch.zeros(B, 4, 128, dtype=torch.bool, device="cuda")  # [b, h, row]
    for b, h, row, _, _ in bad:
        hit[b, h, row] = True
    for nw, pf, mb, ep in cv.LIBRARY_VARIANTS:
        kw = dict(nw=nw, pf=pf, mb=mb, ep=ep, fallback=False)
        oc, uc = cv.gdn_verify_cuda(x["R"], x["R"], *(x[n] for n in order), start, J, True, **kw)
        o, u = cv.gdn_verify_cuda(R, R, *(x[n] for n in order), start, J, True, **kw)
        ho = hit[:, None].expand_as(o)  # o [B, T, H, V]
        slot = torch.arange(J, device="cuda")[None]
        drafts = ((slot >= start[:, None]) & (slot < start[:, None] + T))[:, :, None, None]
        hu = hit[:, None] & drafts  # u [B, J, H, V]: the drafts' slots of a hit row
        assert not o[ho].isfinite().any() and not u[hu].isfinite().any(), (nw, pf, mb, ep)
        assert torch.equal(o[~ho], oc[~ho]) and torch.equal(u[~hu], uc[~hu]), (nw, pf, mb, ep)


def _decode(backend, policy, dtype=torch.float32, B=5, seed=0):
    """A GDN decode state (HK = 2, HV = 4, DK = DV = 128, L = 16, T = 8) through prefill,
    3 steps, verify, a per-sequence commit, verify (starts 3..11), commit and a verify that
    reaches the flush slot; returns the three verifies' outputs."""
    from replayssm_quant.replay import GDNReplayState

    g = torch.Generator().manual_seed(seed)
    HK, HV, D, L, T = 2, 4, 128, 16, 8

    def tok(n):
        q = torch.nn.functional.normalize(torch.randn(B, n, HK, D, generator=g, dtype=torch.float64), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(B, n, HK, D, generator=g, dtype=torch.float64), dim=-1)
        v = torch.randn(B, n, HV, D, generator=g, dtype=torch.float64)
        gg = torch.log(0.9 + 0.0999 * torch.rand(B, n, HV, generator=g, dtype=torch.float64))
        beta = torch.sigmoid(torch.randn(B, n, HV, generator=g, dtype=torch.float64))
        return [t.to(dtype=dtype, device="cuda") for t in (q * D ** -0.5, k, v, gg, beta)]

    S0 = (torch.randn(B, HV, D, D, generator=g, dtype=torch.float64) * 0.1).to(dtype=dtype,
                                                                             device="cuda")
    st = GDNReplayState(policy, batch=B, key_heads=HK, value_heads=HV, key_dim=D, value_dim=D,
                        window=L, max_drafts=T, dtype=dtype, device="cuda", backend=backend)
    st.prefill(S0)
    outs = []
    for _ in range(3):
        st.step(*(t[:, 0] for t in tok(1)))
    outs.append(st.verify(*tok(T)))
    st.commit(torch.tensor([0, 2, 5, 8, 1][:B], device="cuda"))
    outs.append(st.verify(*tok(T)))
    st.commit(torch.tensor([5, 3, 0, 2, 4][:B], device="cuda"))
    outs.append(st.verify(*tok(T)))
    return outs


@needs_gpu
def test_state_under_cuda_backend():
    """``GDNReplayState(backend="cuda")`` under ``fp32``: verify within ``1e-5 + 1e-5 |ref|``
    of the float64 torch state, within 1e-5 of the Triton backend, and not the Triton kernel's
    bits (the CUDA kernel ran); under a policy the verify kernel does not cover, the same bits
    as ``"triton"`` where the step kernel does not cover it either (``shared:fp16``: the Triton
    kernels ran), within 1e-5 where the CUDA step ran (an NVFP4 read copy)."""
    ref = _decode("torch", "fp32", dtype=torch.float64)
    got = _decode("cuda", "fp32")
    tri = _decode("triton", "fp32")
    for o, r, t in zip(got, ref, tri, strict=True):
        assert ((o.double() - r).abs() <= 1e-5 + 1e-5 * r.abs()).all()
        assert (o - t).abs().max() <= 1e-5
    assert any(not torch.equal(o, t) for o, t in zip(got, tri, strict=True))
    for o, t in zip(_decode("cuda", "shared:fp16"), _decode("triton", "shared:fp16"),
                    strict=True):
        assert torch.equal(o, t)
    for o, t in zip(_decode("cuda", "read:nvfp4/rec:fp16+sr"),
                    _decode("triton", "read:nvfp4/rec:fp16+sr"), strict=True):
        assert (o - t).abs().max() <= 1e-5


@needs_gpu
def test_state_under_cuda_backend_batch_invariant():
    """The decode state's verifies under ``backend="cuda"``: a batch of 3 gives the bits that
    the same 3 sequences get as the first rows of a batch of 5 (same inputs, same per-sequence
    commits, starts that differ by sequence)."""
    from replayssm_quant.replay import GDNReplayState

    g = torch.Generator().manual_seed(1)
    B, HK, HV, D, L, T = 5, 2, 4, 128, 16, 8
    toks = []
    for n in (1, 1, T, T):
        q = torch.nn.functional.normalize(torch.randn(B, n, HK, D, generator=g), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(B, n, HK, D, generator=g), dim=-1)
        toks.append([t.cuda() for t in (q * D ** -0.5, k, torch.randn(B, n, HV, D, generator=g),
                                        torch.log(0.9 + 0.0999 * torch.rand(B, n, HV, generator=g)),
                                        torch.sigmoid(torch.randn(B, n, HV, generator=g)))])
    S0 = (torch.randn(B, HV, D, D, generator=g) * 0.1).cuda()
    acc = torch.tensor([3, 0, 6, 8, 1], device="cuda")

    def run(b):
        st = GDNReplayState("fp32", batch=b, key_heads=HK, value_heads=HV, key_dim=D,
                            value_dim=D, window=L, max_drafts=T, device="cuda", backend="cuda")
        st.prefill(S0[:b].contiguous())
        for t in toks[:2]:
            st.step(*(x[:b, 0] for x in t))
        o1 = st.verify(*(x[:b] for x in toks[2]))
        st.commit(acc[:b])
        return o1, st.verify(*(x[:b] for x in toks[3]))

    full, part = run(B), run(3)
    for f, p in zip(full, part, strict=True):
        assert torch.equal(f[:3], p)


def test_failed_build_leaves_the_state_unchanged(monkeypatch):
    """A decode state's verify under the CUDA kernel builds it (``prepare``) before anything
    changes: where the build fails (no nvcc), the RuntimeError leaves the state as it was,
    including the early flush a verify past the window would do. Run on CPU with the kernel
    swapped in and the coverage rule patched to say it covers the call (the CPU path cannot
    reach a covered call otherwise)."""
    from _replay_inputs import same_snapshot, snapshot

    from replayssm_quant.kernels import replay as kr
    from replayssm_quant.replay import GDNReplayState

    B, HK, HV, D, L, T = 2, 1, 2, 32, 4, 3
    st = GDNReplayState("fp32", batch=B, key_heads=HK, value_heads=HV, key_dim=D,
                        value_dim=D, window=L, max_drafts=T, backend="torch")
    g = torch.Generator().manual_seed(0)

    def tok(*lead):
        k = torch.nn.functional.normalize(torch.randn(*lead, HK, D, generator=g), dim=-1)
        return (k * D ** -0.5, k, torch.randn(*lead, HV, D, generator=g),
                -0.01 * torch.rand(*lead, HV, generator=g), torch.rand(*lead, HV, generator=g))

    for _ in range(2):  # h = 2: a verify of 3 drafts flushes the committed part first
        st.step(*tok(B))
    torch_verify, st._ops.verify = st._ops.verify, kr.gdn_state_verify_cuda
    calls = []

    def fail_build(all_variants=False):
        calls.append(all_variants)
        raise RuntimeError("the CUDA verify kernel is built at first use and needs nvcc")

    monkeypatch.setattr(cv, "unsupported", lambda *a, **k: None)
    monkeypatch.setattr(cv, "build", fail_build)
    monkeypatch.setattr(cv, "_BUILT", set())
    before = snapshot(st)
    with pytest.raises(RuntimeError, match="needs nvcc"):
        st.verify(*tok(B, T))
    assert calls == [False]
    assert same_snapshot(before, snapshot(st)) and st.pending_drafts is None
    st._ops.verify = torch_verify  # the state goes on (its own torch op: no interpreter needed)
    st.verify(*tok(B, T))
    st.commit(1)


def test_build_warns_where_the_build_lock_is_held(monkeypatch, tmp_path):
    """torch waits without a word on its build lock, forever where an interrupted build left
    it: ``build`` warns first, naming the file, and only where the file exists (a build
    stubbed: no GPU or nvcc here)."""
    import warnings

    from torch.utils import cpp_extension as ce

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(ce, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(ce, "is_ninja_available", lambda: True)
    monkeypatch.setattr(ce, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    loaded = []
    monkeypatch.setattr(ce, "load", lambda name, **kw: loaded.append((name, kw)) or object())
    monkeypatch.setattr(cv, "_BUILT", set())
    (tmp_path / "replayssm_gdn_cuda").mkdir()
    cv.build.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cv.build()  # no lock: no warning
        cv.build.cache_clear()
        lock = tmp_path / "replayssm_gdn_cuda" / "lock"
        lock.write_text("")
        with pytest.warns(RuntimeWarning, match="interrupted.*delete it") as rec:
            cv.build()
        assert str(lock) in str(rec[0].message)
        assert [n for n, _ in loaded] == ["replayssm_gdn_cuda"] * 2
        # three translation units of kernels (built in parallel) and the binding, written
        # into the extension's build directory
        bind, *units = loaded[0][1]["sources"]
        assert units == [str(cv.SOURCE), str(cv.STEP_SOURCE), str(cv.FLUSH_SOURCE)]
        assert bind == str(tmp_path / "replayssm_gdn_cuda" / "replayssm_binding.cpp")
        assert open(bind).read() == cv.binding_source()
    finally:
        cv.build.cache_clear()


def test_binding_declares_what_the_kernel_files_define():
    """The binding (its own translation unit) declares each host function with the
    signature its .cu file defines, and binds all three: a mismatch would be a link error at
    the first build on a GPU."""
    import re

    src = cv.binding_source()
    norm = lambda t: re.sub(r"\s+", " ", t).strip()  # noqa: E731
    for fn, path in (("gdn_verify_cuda", cv.SOURCE), ("gdn_step_cuda", cv.STEP_SOURCE),
                     ("gdn_flush_cuda", cv.FLUSH_SOURCE)):
        defined = re.search(r"\nvoid " + fn + r"\(([^)]*)\)\s*\{", path.read_text())
        declared = re.search(r"void " + fn + r"\(([^)]*)\);", src)
        assert defined and declared, fn
        assert norm(defined.group(1)) == norm(declared.group(1)), fn
        assert f'm.def("{fn}", &{fn}' in src
    assert "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)" in src


def test_kernel_sources_local_includes_ship_with_them():
    """Every quoted include of the three kernel files (``replay_device.cuh``, the helpers
    they share) lies next to them, and the package data ships it: a missing header would be
    a compile error at the first build on a GPU, after install."""
    import fnmatch
    import re
    import tomllib
    from pathlib import Path

    here = cv.SOURCE.parent
    patterns = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml")
                             .read_text())["tool"]["setuptools"]["package-data"]["*"]
    seen = set()
    for path in (cv.SOURCE, cv.STEP_SOURCE, cv.FLUSH_SOURCE):
        names = re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.M)
        assert names, path.name
        for name in names:
            assert (here / name).is_file(), (path.name, name)
            assert any(fnmatch.fnmatch(name, p) for p in patterns), name
            seen.add(name)
    assert "replay_device.cuh" in seen
    # the shared helpers are defined once, in the header
    for path in (cv.SOURCE, cv.STEP_SOURCE, cv.FLUSH_SOURCE):
        text = path.read_text()
        assert "cp.async.cg.shared.global [%0], [%1], 16;" not in text, path.name
        assert "m16n8k16.row.col.f32.bf16.bf16.f32" not in text, path.name

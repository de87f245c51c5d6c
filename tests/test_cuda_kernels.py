"""The CUDA C++ kernels (``replayssm_quant.kernels.cuda``; issue 15, forty-first pass).

The setting's parsing and the dispatch's refusals run everywhere (CPU included). The kernel
itself runs only on a CUDA device whose toolchain builds it (nvcc, ninja): there it is checked
against the float64-free torch reference of the step (``replay.gdn.gdn_step_output``, the
oracle the Triton step is checked against), the Triton step, its own batch invariance (a
sequence gives the same bits alone, in any batch and at any position) and its refusals.
"""

from __future__ import annotations

import os

import pytest
import torch

from replayssm_quant.kernels import cuda as kc
from replayssm_quant.replay.gdn import gdn_step_output

TOL = dict(atol=1e-5, rtol=1e-5)
CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


# ---------------------------------------------------------------- everywhere
@pytest.mark.parametrize("value, want", [(None, "off"), ("", "off"), ("on", "on"),
                                         (" AUTO ", "auto"), ("Off", "off")])
def test_mode_parses(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(kc.ENV, raising=False)
    else:
        monkeypatch.setenv(kc.ENV, value)
    assert kc.mode() == want


def test_mode_refuses_bad_value(monkeypatch):
    monkeypatch.setenv(kc.ENV, "yes")
    with pytest.raises(ValueError, match=r"REPLAYSSM_CUDA_KERNELS='yes'.*off, on, auto"):
        kc.mode()


def _case(gen, B=3, H=4, G=2, V=128, CAP=16, device="cpu", h=None):
    """A step's operands: read copy, ring (h[b] committed rows), the new record and query."""
    f = dict(dtype=torch.float32)
    read = torch.randn(B, H, V, 128, generator=gen, **f) * 0.3
    la = torch.log(0.9 + 0.0999 * torch.rand(B, CAP, H, generator=gen, **f))
    ring = {"la": la, "beta": torch.rand(B, CAP, H, generator=gen, **f),
            "v": torch.randn(B, CAP, H, V, generator=gen, **f),
            "uR": torch.randn(B, CAP, H, V, generator=gen, **f) * 0.1,
            "k": torch.nn.functional.normalize(torch.randn(B, CAP, G, 128, generator=gen, **f),
                                               dim=-1)}
    q = torch.nn.functional.normalize(torch.randn(B, G, 128, generator=gen, **f), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, G, 128, generator=gen, **f), dim=-1)
    v = torch.randn(B, H, V, generator=gen, **f)
    g = torch.log(0.9 + 0.0999 * torch.rand(B, H, generator=gen, **f))
    beta = torch.rand(B, H, generator=gen, **f)
    if h is None:
        h = torch.randint(0, CAP, (B,), generator=gen)
    h = torch.as_tensor(h, dtype=torch.int64)
    mv = lambda t: t.to(device)  # noqa: E731
    return (mv(read), {n: mv(t) for n, t in ring.items()}, mv(q), mv(k), mv(v), mv(g),
            mv(beta), mv(h))


def test_cpu_tensors_never_take_it(monkeypatch):
    """On CPU tensors (and under the interpreter) the setting does nothing, and nothing is
    built."""
    monkeypatch.setenv(kc.ENV, "on")
    monkeypatch.setattr(kc, "build", lambda: (_ for _ in ()).throw(AssertionError("built")))
    args = _case(torch.Generator().manual_seed(0))
    assert not kc.use_gdn_step(*args)


def test_off_never_builds(monkeypatch):
    monkeypatch.setenv(kc.ENV, "off")
    monkeypatch.setattr(kc, "build", lambda: (_ for _ in ()).throw(AssertionError("built")))
    monkeypatch.setattr(kc, "_fits", lambda *a: True)
    assert not kc.use_gdn_step(*_case(torch.Generator().manual_seed(0)))


def test_auto_falls_back_with_one_warning(monkeypatch):
    """``auto`` where the build fails: a RuntimeWarning naming the failure, once, and the
    Triton step; ``on`` raises it."""
    monkeypatch.setattr(kc, "_fits", lambda *a: True)

    def fail():
        raise RuntimeError("REPLAYSSM_CUDA_KERNELS: could not build the CUDA kernels: no nvcc")
    monkeypatch.setattr(kc, "build", fail)
    monkeypatch.setattr(kc.use_gdn_step, "_warned", False, raising=False)
    monkeypatch.setenv(kc.ENV, "auto")
    args = _case(torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match="no nvcc; the Triton step runs instead"):
        assert not kc.use_gdn_step(*args)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kc.use_gdn_step(*args)  # no second warning
    monkeypatch.setenv(kc.ENV, "on")
    with pytest.raises(RuntimeError, match="no nvcc"):
        kc.use_gdn_step(*args)


# ---------------------------------------------------------------- CUDA
cuda_only = pytest.mark.skipif(not CUDA, reason="the CUDA kernels need a CUDA device")


@pytest.fixture(scope="module")
def ext():
    try:
        return kc.build()
    except RuntimeError as err:
        pytest.skip(f"the CUDA kernels do not build here: {err}")


def _reference(read, ring, q, k, v, g, beta, h):
    """The torch step reference on the ring after the append: ``(o, uR, ring after)``."""
    r = {n: t.clone() for n, t in ring.items()}
    b = torch.arange(read.shape[0], device=read.device)
    for n, t in (("la", g), ("v", v), ("k", k), ("beta", beta)):
        r[n][b, h] = t
    J = int(h.max()) + 1
    o, uR = gdn_step_output(read, r["la"][:, :J], r["beta"][:, :J], r["v"][:, :J],
                            r["k"][:, :J], q, r["uR"][:, :J], h + 1)
    return o, uR, r


@cuda_only
@pytest.mark.parametrize("V, CAP, h", [(128, 16, [0, 7, 15]), (64, 32, [31, 0, 20]),
                                       (128, 5, [4, 2, 0])])
def test_gdn_f32_step_matches_reference(ext, V, CAP, h):
    read, ring, q, k, v, g, beta, hh = _case(torch.Generator().manual_seed(1), V=V, CAP=CAP,
                                             device="cuda", h=h)
    want, uR, ref_ring = _reference(read, ring, q, k, v, g, beta, hh)
    got = kc.gdn_f32_step(read, ring, q, k, v, g, beta, hh)
    torch.testing.assert_close(got, want, **TOL)
    b = torch.arange(3, device="cuda")
    torch.testing.assert_close(ring["uR"][b, hh], uR[b, hh], **TOL)  # the new correction
    for n in ("la", "v", "k", "beta"):  # the append: the record as given, nothing else
        assert torch.equal(ring[n], ref_ring[n]), n
    untouched = torch.ones(3, CAP, dtype=torch.bool, device="cuda")
    untouched[b, hh] = False
    assert torch.equal(ring["uR"][untouched], ref_ring["uR"][untouched])


@cuda_only
def test_gdn_f32_step_against_triton(ext, monkeypatch):
    """The dispatch in ``gdn_step_kernel``: ``on`` takes the CUDA kernel (one call), a launch
    option keeps the Triton step; both agree to FP32 rounding."""
    from replayssm_quant.kernels import replay as kr
    case = _case(torch.Generator().manual_seed(2), B=4, device="cuda", h=[3, 9, 0, 14])
    calls = []
    real = kc.gdn_f32_step
    monkeypatch.setattr(kc, "gdn_f32_step", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv(kc.ENV, "on")
    read, ring, q, k, v, g, beta, h = case
    r_cuda = {n: t.clone() for n, t in ring.items()}
    o_cuda = kr.gdn_step_kernel(read, r_cuda, q, k, v, g, beta, h)
    assert calls == [1]
    r_tri = {n: t.clone() for n, t in ring.items()}
    o_tri = kr.gdn_step_kernel(read, r_tri, q, k, v, g, beta, h, read_pass=(32, 1, "lean_out"))
    assert calls == [1]
    monkeypatch.setenv(kc.ENV, "off")
    r_off = {n: t.clone() for n, t in ring.items()}
    o_off = kr.gdn_step_kernel(read, r_off, q, k, v, g, beta, h)
    assert calls == [1]
    torch.testing.assert_close(o_cuda, o_tri, **TOL)
    torch.testing.assert_close(o_cuda, o_off, **TOL)
    torch.testing.assert_close(r_cuda["uR"], r_off["uR"], **TOL)
    for n in ("la", "v", "k", "beta"):
        assert torch.equal(r_cuda[n], r_off[n]), n


@cuda_only
def test_gdn_f32_step_batch_invariant(ext):
    """A sequence's output and ring give the same bits alone, in a batch, and at another
    batch position."""
    read, ring, q, k, v, g, beta, h = _case(torch.Generator().manual_seed(3), B=6,
                                            device="cuda")
    r_all = {n: t.clone() for n, t in ring.items()}
    o_all = kc.gdn_f32_step(read, r_all, q, k, v, g, beta, h)
    perm = torch.tensor([4, 1, 5, 0, 3, 2], device="cuda")
    r_p = {n: t[perm].clone() for n, t in ring.items()}
    o_p = kc.gdn_f32_step(read[perm].contiguous(), r_p, q[perm].contiguous(),
                          k[perm].contiguous(), v[perm].contiguous(), g[perm].contiguous(),
                          beta[perm].contiguous(), h[perm].contiguous())
    assert torch.equal(o_p, o_all[perm])
    for n in ring:
        assert torch.equal(r_p[n], r_all[n][perm]), n
    for b in (0, 5):
        sl = slice(b, b + 1)
        r_1 = {n: t[sl].clone() for n, t in ring.items()}
        o_1 = kc.gdn_f32_step(read[sl], r_1, q[sl], k[sl], v[sl], g[sl], beta[sl], h[sl])
        assert torch.equal(o_1, o_all[sl])
        for n in ring:
            assert torch.equal(r_1[n], r_all[n][sl]), n


@cuda_only
def test_gdn_f32_step_slot_out_of_range(ext):
    """A slot outside the ring: NaN outputs for that sequence, no ring write anywhere of
    it; the other sequences as usual."""
    read, ring, q, k, v, g, beta, _ = _case(torch.Generator().manual_seed(4), device="cuda")
    h = torch.tensor([16, 2, -1], device="cuda")
    r = {n: t.clone() for n, t in ring.items()}
    o = kc.gdn_f32_step(read, r, q, k, v, g, beta, h)
    assert torch.isnan(o[0]).all() and torch.isnan(o[2]).all() and torch.isfinite(o[1]).all()
    for n in r:
        assert torch.equal(r[n][0], ring[n][0]) and torch.equal(r[n][2], ring[n][2]), n


@pytest.mark.parametrize("bad, match", [
    (lambda a: a.update(q=a["q"][..., :64].contiguous()), r"q has shape \(3, 2, 64\), expected "
                                                           r"\(3, 2, 128\)"),
    (lambda a: a.update(beta=a["beta"].double()), "beta has dtype torch.float64"),
    (lambda a: a.update(read=a["read"][..., :64].contiguous()), r"K = 128 and V in \(64, 128\)"),
    (lambda a: a.update(v=a["v"].transpose(1, 2).contiguous().transpose(1, 2)),
     "v must be contiguous"),
    (lambda a: a["ring"].pop("uR"), r"ring lacks \['uR'\]"),
    (lambda a: a.update(h=a["h"].float()), "h must be an int64 or int32 \\[3\\] tensor"),
    (lambda a: a.update({n: ({m: u.to("meta") for m, u in t.items()} if isinstance(t, dict)
                             else t.to("meta")) for n, t in a.items()}),
     "the operands are on meta, expected a CUDA device"),
    (lambda a: a.update(g=a["g"].to("meta")), r"g is on meta, expected (cpu|cuda:0)"),
])
def test_gdn_f32_step_refuses_mismatches(bad, match):
    """Checked before anything is built or launched (so on CPU too: the device is checked
    last)."""
    read, ring, q, k, v, g, beta, h = _case(torch.Generator().manual_seed(5))
    a = dict(read=read, ring=ring, q=q, k=k, v=v, g=g, beta=beta, h=h)
    if CUDA:
        a = {n: ({m: u.cuda() for m, u in t.items()} if isinstance(t, dict) else t.cuda())
             for n, t in a.items()}
    bad(a)
    with pytest.raises(ValueError, match=match):
        kc.gdn_f32_step(**a)

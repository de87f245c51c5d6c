"""Anchor-chain kernel (kernels/replay.py ``anchor_chain``): the rounded-anchor recurrence of
the teacher-forced form and of the adapters' step flush on the kernel path.

Runs on CPU under the Triton interpreter (TRITON_INTERPRET=1, conftest.py), float32, tiny
shapes. Checks:

* per window, the kernel's anchor is bit-identical to the torch cast (``core.cast_state`` with
  the flush's stream key, i.e. ``core.cast_checkpoints``) of the kernel's own unrounded S, and
  that S equals the torch flush arithmetic (``core.solve_corrections`` + ``core.reconstruct``)
  run from the kernel's previous anchor to 1e-5 (the kernel sums in another order);
  the kernel's default row tiles (here one tile per matrix: the anchor stays in registers,
  decoded from the codes just stored) and smaller ones (read back from memory), every
  stored layout (fp32, fp16, bf16, fp8 E4M3/E5M2, NVFP4, MXFP4, MXFP8);
* with queries (single-checkpoint policies) the outputs it writes, against float64
  references from its own anchors, and the last-anchor-only launch against the full chain;
* on the kernel path (``REPLAYSSM_BACKEND=triton``), teacher-forced emulation
  (``LayerState.advance``) and stepping (``LayerState.step``) give bit-identical anchors and
  read copies and outputs to 1e-5.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from replayssm_quant.backend import ENV as BACKEND_ENV  # noqa: E402
from replayssm_quant.adapters.state import LayerState  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402
from replayssm_quant.replay import core  # noqa: E402
from replayssm_quant.config import StateConfig  # noqa: E402
from replayssm_quant.replay import window as W  # noqa: E402
from replayssm_quant.replay import window_fast as WF  # noqa: E402

from replayssm_quant.capabilities import triton_interpreting  # noqa: E402

INTERPRET = triton_interpreting()
if not INTERPRET:  # the GPU checks are `benchmarks/kl_throughput.py --check-chain`
    pytest.skip("CPU tests of the chain kernel run under TRITON_INTERPRET=1",
                allow_module_level=True)

from replayssm_quant.kernels import replay as kr  # noqa: E402

POLICIES = ["shared:nvfp4+sr", "read:nvfp4/rec:fp16+sr", "eager:fp8e4m3", "shared:mxfp4",
            "read:fp8e4m3+sr/rec:bf16", "fp32", "read:nvfp4/rec:fp32", "shared:mxfp8+sr",
            "shared:fp8e5m2+sr", "shared:nvfp4+up+sr", "shared:mxfp4+rceil"]  # last two: issue 18


def _records(gdn: bool, B=2, T=12, H=2, V=6, K=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    la = -0.3 * torch.rand(B, T, H, generator=g)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    beta = torch.rand(B, T, H, generator=g) if gdn else None
    return la, k, v, beta


# the default suite: every policy for both families in one tile, and every policy in tiles of
# 4 rows for one family (alternating by policy); the other 11 cases with -m slow (about 1 s
# each under the interpreter on 2 cores, 2026-12-06)
@pytest.mark.parametrize("gdn,policy,block_v", [
    (g, p, bv) if bv is None or i % 2 == int(g) else pytest.param(g, p, bv, marks=pytest.mark.slow)
    for bv in (None, 4) for i, p in enumerate(POLICIES) for g in (False, True)])
def test_chain_matches_torch_flush(gdn, policy, block_v):
    pol = StatePolicy.parse(policy)
    L = StateConfig.build(pol, window=4).window
    B, T, H, V, K = 2, 12 if L > 1 else 5, 2, 6, 32
    la, k, v, beta = _records(gdn, B, T, H, V, K, seed=3)
    ids = torch.tensor([5, 1])
    A0 = core.cast_state(torch.randn(B, H, V, K), pol.rec, seed=9, stream=7)[0]
    NW = T // L
    flush = torch.tensor([3, 8])[:, None] + torch.arange(NW)[None, :]
    ka = WF._stream_keys(2, ids, H, flush, core.ANCHOR_COPY)
    res = kr.anchor_chain(A0, la, k, v, beta, pol.rec, L=L, seed=9, streams=ka,
                          block_v=block_v)
    S, A = res.states, res.anchors
    assert res.outputs is None and S.shape == A.shape == (B, NW, H, V, K)
    prev = A0
    for w in range(NW):
        r = slice(w * L, (w + 1) * L)
        wv = v[:, r] if beta is None else core.solve_corrections(prev, la[:, r], beta[:, r],
                                                                 v[:, r], k[:, r])
        S_ref = core.reconstruct(prev, la[:, r], wv, k[:, r])
        assert (S[:, w] - S_ref).abs().max() <= 1e-5 * max(1.0, float(S_ref.abs().max()))
        A_ref = core.cast_state(S[:, w], pol.rec, seed=9, stream=ka[:, w])[0]
        assert torch.equal(A[:, w].view(torch.int32), A_ref.view(torch.int32))
        prev = A[:, w]


@pytest.mark.parametrize("gdn", [False, True])
@pytest.mark.parametrize("policy", ["shared:nvfp4+sr", "eager:fp8e4m3", "shared:bf16+sr", "fp32"])
def test_chain_outputs_of_single_checkpoint_policies(gdn, policy):
    """With queries, the kernel also writes every output (the read copy is the anchor):
    against core.window_outputs from the kernel's previous anchor (positions before the flush
    token) and S q (the flush token), float64 references; the last anchor alone (no S stored)
    is bit-identical to the full chain's."""
    pol = StatePolicy.parse(policy)
    L = StateConfig.build(pol, window=4).window
    B, T, H, V, K = 2, 12 if L > 1 else 5, 2, 6, 32
    la, k, v, beta = _records(gdn, B, T, H, V, K, seed=4)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    A0 = core.cast_state(torch.randn(B, H, V, K), pol.rec, seed=2, stream=3)[0]
    NW = T // L
    ka = WF._stream_keys(1, torch.tensor([0, 7]), H, torch.arange(1, NW + 1)[None].expand(B, -1),
                        core.ANCHOR_COPY)
    full = kr.anchor_chain(A0, la, k, v, beta, pol.rec, L=L, seed=2, streams=ka)
    last = kr.anchor_chain(A0, la, k, v, beta, pol.rec, L=L, seed=2, streams=ka, q=q,
                           store_states=False, all_anchors=False, block_v=4)
    assert last.states is None and last.anchors.shape == (B, 1, H, V, K)
    assert torch.equal(last.anchors[:, 0].view(torch.int32), full.anchors[:, -1].view(torch.int32))
    d = torch.float64
    prev = A0.to(d)
    for w in range(NW):
        r = slice(w * L, (w + 1) * L)
        wv = v[:, r].to(d) if beta is None else core.solve_corrections(
            prev, la[:, r].to(d), beta[:, r].to(d), v[:, r].to(d), k[:, r].to(d))
        ref = core.window_outputs(prev, la[:, r].to(d), wv, k[:, r].to(d), q[:, r].to(d))
        ref[:, -1] = core.matvec(full.states[:, w].to(d), q[:, r][:, -1].to(d))
        got = last.outputs[:, r].to(d)
        assert (got - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max())), w
        prev = full.anchors[:, w].to(d)


@pytest.mark.parametrize("policy", POLICIES)
def test_anchor_in_registers_equals_anchor_from_memory(policy):
    """A program that owns its rows keeps the anchor in registers (decoded from the codes it
    just stored); one that loops over several tiles reads it back from memory. Same bits, for
    every stored layout, with NaN, +-inf, an all-zero row and a huge row planted in the
    starting state (non-finite blocks, zero-scale blocks, saturation), GDN, V not a multiple
    of the tile."""
    pol = StatePolicy.parse(policy)
    L = StateConfig.build(pol, window=4).window
    B, T, H, V, K = 1, 8 if L > 1 else 3, 2, 7, 32
    la, k, v, beta = _records(True, B, T, H, V, K, seed=6)
    S0 = torch.randn(B, H, V, K)
    S0[0, 0, 1, 3], S0[0, 0, 2, 5], S0[0, 1, 4, 0] = float("nan"), float("inf"), -float("inf")
    S0[0, 1, 3] = 0.0
    S0[0, 1, 6] *= 1e4
    A0 = core.cast_state(S0, pol.rec, seed=1, stream=2)[0]
    NW = T // L
    ka = WF._stream_keys(0, torch.tensor([3]), H, torch.arange(1, NW + 1)[None], core.ANCHOR_COPY)
    reg = kr.anchor_chain(A0, la, k, v, beta, pol.rec, L=L, seed=1, streams=ka)  # one tile
    mem = kr.anchor_chain(A0, la, k, v, beta, pol.rec, L=L, seed=1, streams=ka, block_v=2)
    assert kr.chain_block_v(V, K) >= V  # the default launch above keeps A in registers
    assert torch.equal(reg.anchors.view(torch.int32), mem.anchors.view(torch.int32))
    assert torch.equal(reg.states.view(torch.int32), mem.states.view(torch.int32))
    assert not torch.isfinite(reg.anchors).all()  # the planted values did reach the chain


@pytest.mark.parametrize("gdn,policy,block_v", [  # every read format once per family, both
    # launches (one tile; several, the read copy read back from memory) for the default dual
    (False, "read:nvfp4/rec:fp16+sr", None), (True, "read:nvfp4/rec:fp16+sr", None),
    (True, "read:nvfp4/rec:fp16+sr", 2), (False, "read:fp8e4m3+sr/rec:bf16", 2),
    (True, "read:fp8e4m3+sr/rec:bf16", None), (False, "read:nvfp4+sr/rec:fp32", None),
    (True, "read:mxfp4/rec:fp8e4m3", None), (False, "read:mxfp4/rec:fp8e4m3", 2),
    (True, "read:fp32/rec:nvfp4+sr", None)])
def test_dual_chain_outputs_and_read_copies(gdn, policy, block_v):
    """Dual policies in one launch (``read_spec``): every window's read copy is the read cast
    (read stream keys) of the kernel's own unrounded S, bit for bit (torch cast of the S the
    same chain stores), the anchors are those of the chain without a read copy, and the
    outputs are core.window_outputs from the previous read copy with the GDN read-path
    corrections solved against it (float64 reference), the flush token S q; one tile per
    matrix and several (the read copy read back from memory)."""
    pol = StatePolicy.parse(policy)
    L = 4
    B, T, H, V, K = 2, 12, 2, 5, 32
    la, k, v, beta = _records(gdn, B, T, H, V, K, seed=12)
    beta = beta if gdn else None
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    S0 = torch.randn(B, H, V, K)
    A0 = core.cast_state(S0, pol.rec, seed=2, stream=3)[0]
    R0 = core.cast_state(S0, pol.read, seed=2, stream=4)[0]
    NW = T // L
    ids, flush = torch.tensor([0, 7]), torch.arange(1, NW + 1)[None].expand(B, -1)
    ka = WF._stream_keys(1, ids, H, flush, core.ANCHOR_COPY)
    kread = WF._stream_keys(1, ids, H, flush, core.READ_COPY)
    full = kr.anchor_chain(A0, la, k, v, beta, pol.rec, L=L, seed=2, streams=ka,
                           block_v=block_v)
    dual = kr.anchor_chain(A0, la, k, v, beta, pol.rec, L=L, seed=2, streams=ka, q=q,
                           store_states=False, all_anchors=False, block_v=block_v,
                           read_spec=pol.read, read=R0, read_streams=kread)
    assert dual.reads.shape == dual.anchors.shape == (B, 1, H, V, K)
    assert torch.equal(dual.anchors[:, 0].view(torch.int32), full.anchors[:, -1].view(torch.int32))
    Rs = core.cast_state(full.states, pol.read, seed=2, stream=kread)[0]  # [B, NW, H, V, K]
    assert torch.equal(dual.reads[:, 0].view(torch.int32), Rs[:, -1].view(torch.int32))
    d = torch.float64
    prev_r = R0.to(d)
    for w in range(NW):
        r = slice(w * L, (w + 1) * L)
        if gdn:
            wr = core.solve_corrections(prev_r, la[:, r].to(d), beta[:, r].to(d), v[:, r].to(d),
                                        k[:, r].to(d))
        else:
            wr = v[:, r].to(d)
        ref = core.window_outputs(prev_r, la[:, r].to(d), wr, k[:, r].to(d), q[:, r].to(d))
        ref[:, -1] = core.matvec(full.states[:, w].to(d), q[:, r][:, -1].to(d))
        got = dual.outputs[:, r].to(d)
        assert (got - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max())), w
        prev_r = Rs[:, w].to(d)


@pytest.mark.parametrize("gdn", [False, True])
def test_dual_chain_invariance(gdn):
    """The dual chain's outputs, anchors and read copies of a sequence do not depend on its
    batch, its position in it or how many windows a launch holds: the sequence alone, second
    in a batch of two, and its 12 tokens as one launch of 3 windows or as 1 + 2 windows, bit
    for bit (Mamba-2 and GDN)."""
    pol = StatePolicy.parse("read:nvfp4/rec:fp16+sr")
    L, T, H, V, K = 4, 12, 2, 5, 32
    la, k, v, beta = _records(gdn, 2, T, H, V, K, seed=13)
    q = torch.nn.functional.normalize(torch.randn(2, T, H, K), dim=-1)
    S0 = torch.randn(2, H, V, K)
    A0 = core.cast_state(S0, pol.rec, seed=2, stream=3)[0]
    R0 = core.cast_state(S0, pol.read, seed=2, stream=4)[0]
    ids = torch.tensor([3, 9])

    def run(sel, t0, t1, A, R, fi):
        n = (t1 - t0) // L
        flush = fi[:, None] + torch.arange(n)[None]
        res = kr.anchor_chain(A, la[sel, t0:t1], k[sel, t0:t1], v[sel, t0:t1],
                              beta[sel, t0:t1] if gdn else None,
                              pol.rec, L=L, seed=2, q=q[sel, t0:t1], store_states=False,
                              all_anchors=False, read_spec=pol.read, read=R,
                              streams=WF._stream_keys(1, ids[sel], H, flush, core.ANCHOR_COPY),
                              read_streams=WF._stream_keys(1, ids[sel], H, flush,
                                                           core.READ_COPY))
        return res.outputs, res.anchors[:, 0], res.reads[:, 0]

    both = run(slice(0, 2), 0, T, A0, R0, torch.tensor([1, 1]))
    alone = run(slice(1, 2), 0, T, A0[1:], R0[1:], torch.tensor([1]))
    o1, A1, R1 = run(slice(1, 2), 0, L, A0[1:], R0[1:], torch.tensor([1]))
    o2, A2, R2 = run(slice(1, 2), L, T, A1, R1, torch.tensor([2]))
    for x, y in zip(both, alone, strict=True):
        assert torch.equal(x[1:].view(torch.int32), y.view(torch.int32))
    assert torch.equal(torch.cat([o1, o2], 1).view(torch.int32), alone[0].view(torch.int32))
    assert torch.equal(A2.view(torch.int32), alone[1].view(torch.int32))
    assert torch.equal(R2.view(torch.int32), alone[2].view(torch.int32))


def test_chain_rejects_bad_input():
    la, k, v, beta = _records(True, 1, 8, 2, 6, 32)
    A0 = torch.zeros(1, 2, 6, 32)
    keys = torch.zeros(1, 2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="multiple of L"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=3, seed=0, streams=keys)
    with pytest.raises(ValueError, match=r"v must be float32 \[1, 8, 2, 6\]"):
        kr.anchor_chain(A0, la, k, v[..., :5], beta, "fp16", L=4, seed=0, streams=keys)
    with pytest.raises(ValueError, match=r"k must be float32 \[1, 8, 2, 32\] \(B, H, V, K from the "
                                         r"anchor, T from la\)"):
        kr.anchor_chain(A0, la, k[:, :4], v, beta, "fp16", L=4, seed=0, streams=keys)
    with pytest.raises(ValueError, match=r"anchor must be \[B, H, V, K\], got shape \[2, 6, 32\]"):
        kr.anchor_chain(A0[0], la, k, v, beta, "fp16", L=4, seed=0, streams=keys)
    with pytest.raises(ValueError, match="q must be float32"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, q=k.double())
    with pytest.raises(ValueError, match=r"streams must be integer stream keys \[B, NW, H\]"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys[:, :1])
    with pytest.raises(ValueError, match="streams must be integer"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys.double())
    with pytest.raises(ValueError, match="window L must be an int >= 1, got 0"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=0, seed=0, streams=keys)
    with pytest.raises(ValueError, match="block_v must be a power of two, got 3"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, block_v=3)
    with pytest.raises(ValueError, match="split=True needs a GPU"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, split=True)
    q = torch.nn.functional.normalize(k, dim=-1)
    dual = dict(read_spec="nvfp4", read=A0, read_streams=keys)
    with pytest.raises(ValueError, match="read_spec needs q"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, **dual)
    with pytest.raises(ValueError, match="read_spec needs read"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, q=q,
                        read_spec="nvfp4", read_streams=keys)
    with pytest.raises(ValueError, match=r"read must be float32 \[1, 2, 6, 32\]"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, q=q,
                        **dict(dual, read=A0[..., :16]))
    with pytest.raises(ValueError, match=r"read_streams must be integer stream keys"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, q=q,
                        **dict(dual, read_streams=keys[:, :1]))
    with pytest.raises(ValueError, match="read must be a float32 torch.Tensor"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, q=q,
                        **dict(dual, read=A0.numpy()))
    with pytest.raises(ValueError, match="streams must be integer stream keys"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys > 0)
    with pytest.raises(ValueError, match="give read_spec too"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, q=q, read=A0)
    with pytest.raises(ValueError, match="nvfp5"):
        kr.anchor_chain(A0, la, k, v, beta, "fp16", L=4, seed=0, streams=keys, q=q,
                        **dict(dual, read_spec="nvfp5"))


def _inputs(family, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if family == "gdn":
        HK, HV, DK, DV = 1, 2, 32, 8
        return {"q": torch.nn.functional.normalize(r(B, T, HK, DK), dim=-1) * DK ** -0.5,
                "k": torch.nn.functional.normalize(r(B, T, HK, DK), dim=-1),
                "v": r(B, T, HV, DV), "g": -0.2 * torch.rand(B, T, HV, generator=g),
                "beta": torch.rand(B, T, HV, generator=g)}
    H, P, G, N = 2, 8, 1, 32
    return {"x": r(B, T, H, P), "dt": 0.5 * torch.rand(B, T, H, generator=g),
            "A": -torch.rand(H, generator=g) - 0.1, "B": r(B, T, G, N) * 0.3,
            "C": r(B, T, G, N) * 0.3}


def _slice(inp, s):
    return {n: (t if n == "A" else t[:, s]) for n, t in inp.items()}


@pytest.mark.parametrize("family", ["mamba2", "gdn"])
@pytest.mark.parametrize("policy", [  # eager (17-21 s each under the interpreter): -m slow
    "shared:nvfp4+sr", "read:nvfp4/rec:fp16+sr",
    pytest.param("eager:fp8e4m3", marks=pytest.mark.slow), "fp32", "read:nvfp4/rec:fp32"])
def test_step_equals_emulation_on_kernel_path(family, policy, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    B, T, L = 2, 19, 4
    inp = _inputs(family, B, T, seed=5)
    ids = torch.tensor([4, 9])
    if family == "gdn":
        shape = (B, 2, 8, 32)
    else:
        shape = (B, 2, 8, 32)
    S0 = torch.randn(*shape) * 0.5
    kw = dict(family=family, config=StateConfig.build(policy, window=L, seed=3), layer=1,
              sequence_ids=ids)
    em = LayerState(S0, **kw)
    st = LayerState(S0, **kw)
    assert W.chain_kernel_enabled(em.anchor)
    ys_em, ys_st = [], []
    done = 0
    for cut in (6, 17, T):  # partial head, full windows (batched chain), partial tail
        ys_em.append(em.advance(_slice(inp, slice(done, cut))))
        done = cut
    for t in range(T):
        ys_st.append(st.step(_slice(inp, slice(t, t + 1))))
    ye, ys = torch.cat(ys_em, 1), torch.cat(ys_st, 1)
    assert torch.allclose(ye, ys, atol=1e-5, rtol=1e-5)
    assert torch.equal(em.anchor, st.anchor) and torch.equal(em.read, st.read)
    assert em.flushes == st.flushes and em.h == st.h


@pytest.mark.parametrize("gdn,policy,L,block_v", [
    (True, "shared:nvfp4+sr", 4, None), (True, "fp32", 3, 2), (False, "shared:bf16+sr", 1, None),
    (False, "shared:nvfp4+sr", 4, None)])
def test_chain_prefetch_same_bits(gdn, policy, L, block_v):
    """``prefetch`` (record p + 1's rows loaded during slot p) changes no value: states,
    anchors and outputs bit for bit against the launch without it, with one tile per matrix
    and with several (anchor read back from memory), L = 1 (no slot after the first) and
    windows longer than one slot. (The amax ``exchange`` of split tiles only runs on a GPU:
    ``benchmarks/chain_tune.py`` compares its bytes there.)"""
    pol = StatePolicy.parse(policy)
    B, T, H, V, K = 2, 3 * L, 2, 6, 32
    la, k, v, beta = _records(gdn, B, T, H, V, K, seed=11)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    A0 = core.cast_state(torch.randn(B, H, V, K), pol.rec, seed=4, stream=5)[0]
    ka = WF._stream_keys(1, torch.tensor([2, 6]), H, torch.arange(1, 4)[None].expand(B, -1),
                        core.ANCHOR_COPY)
    base, pf = [kr.anchor_chain(A0, la, k, v, beta, pol.rec, L=L, seed=4, streams=ka, q=q,
                                block_v=block_v, prefetch=p) for p in (False, True)]
    for a, b in zip(base, pf, strict=True):
        if a is None:  # reads: no dual policy here
            assert b is None
            continue
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_chain_refuses_bad_launch_options():
    """An unknown exchange, the slots exchange with a number of row tiles that is not a power
    of two (its poll is a tl.arange over the tiles), and a prefetch that is not None or a
    bool are refused, naming the value."""
    la, k, v, beta = _records(True, 1, 4, 1, 6, 32)
    keys = WF._stream_keys(0, torch.tensor([0]), 1, torch.tensor([[1]]), core.ANCHOR_COPY)
    A0 = torch.zeros(1, 1, 6, 32)
    with pytest.raises(ValueError, match="exchange must be one of .*'fence'"):
        kr.anchor_chain(A0, la, k, v, beta, "nvfp4", L=4, seed=0, streams=keys,
                        exchange="fence")
    with pytest.raises(ValueError, match="power-of-two number of row tiles .*got 3"):
        kr.anchor_chain(A0, la, k, v, beta, "nvfp4", L=4, seed=0, streams=keys, block_v=2,
                        exchange="slots")
    with pytest.raises(ValueError, match="prefetch must be None, True or False, got 'off'"):
        kr.anchor_chain(A0, la, k, v, beta, "nvfp4", L=4, seed=0, streams=keys, prefetch="off")
    # None picks the counter exchange for three tiles: runs
    kr.anchor_chain(A0, la, k, v, beta, "nvfp4", L=4, seed=0, streams=keys, block_v=2)


def test_resident_maxnreg():
    """The register cap that keeps every program of a split chain in one wave: none while
    they fit at 255 registers (two programs of 4 warps per SM, one of 8), 65536 / (programs per
    SM x threads) rounded down to 8 above, none below the floor; and bad caps are refused."""
    from replayssm_quant.kernels.replay.chain import CHAIN_MIN_MAXNREG, resident_maxnreg

    assert resident_maxnreg(264, 4, 132) is None  # 2 per SM
    assert resident_maxnreg(320, 4, 132) == 168  # 3 per SM: 65536 / 384 = 170.7
    assert resident_maxnreg(512, 4, 132) == 128  # 4 per SM
    assert resident_maxnreg(660, 4, 132) is None  # 5 per SM: 102 < the floor
    assert CHAIN_MIN_MAXNREG == 128
    assert resident_maxnreg(320, 2, 132) is None  # 3 per SM of 2 warps fit at 255 registers
    assert resident_maxnreg(200, 8, 132) == 128  # 2 per SM of 8 warps: one fits uncapped
    assert resident_maxnreg(10, 4, 0) is None  # no CUDA device
    la, k, v, beta = _records(True, 1, 4, 1, 4, 32)
    keys = WF._stream_keys(0, torch.tensor([0]), 1, torch.tensor([[1]]), core.ANCHOR_COPY)
    for bad in (0, 300, 12.0, True, "max"):
        with pytest.raises(ValueError, match="maxnreg must be"):
            kr.anchor_chain(torch.zeros(1, 1, 4, 32), la, k, v, beta, "nvfp4", L=4, seed=0,
                            streams=keys, maxnreg=bad)


@pytest.mark.parametrize("gdn", [False, True])
@pytest.mark.parametrize("policy", ["shared:nvfp4+sr", "read:nvfp4/rec:fp16+sr"])
def test_chain_batch_invariant(gdn, policy):
    """Default launch (prefetch on for GDN or with outputs): each sequence gets the same bits
    for its states, anchors and outputs alone, in a batch of 3 and at another batch position
    (reversed batch); its stream keys travel with it. On a GPU the register cap also differs
    with the batch: ``benchmarks/chain_tune.py --check-batch`` checks that there."""
    pol = StatePolicy.parse(policy)
    B, L, H, V, K = 3, 4, 2, 6, 32
    T = 2 * L
    la, k, v, beta = _records(gdn, B, T, H, V, K, seed=13)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    A0 = core.cast_state(torch.randn(B, H, V, K), pol.rec, seed=6, stream=8)[0]
    ka = WF._stream_keys(1, torch.tensor([4, 0, 9]), H, torch.arange(1, 3)[None].expand(B, -1),
                        core.ANCHOR_COPY)
    out_q = q if pol.single_checkpoint else None

    def run(idx):
        sel = lambda t: None if t is None else t[idx]  # noqa: E731
        return kr.anchor_chain(A0[idx], la[idx], k[idx], v[idx], sel(beta), pol.rec, L=L, seed=6,
                               streams=ka[idx], q=sel(out_q))

    full, rev = run([0, 1, 2]), run([2, 1, 0])
    for i in range(B):
        alone = run([i])
        for a, f, r in zip(alone, full, rev, strict=True):
            if a is None:
                continue
            assert torch.equal(a.view(torch.int32), f[i:i + 1].view(torch.int32))
            assert torch.equal(a.view(torch.int32), r[B - 1 - i:B - i].view(torch.int32))

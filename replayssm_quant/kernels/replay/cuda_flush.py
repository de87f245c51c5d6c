"""GDN's flush with an FP16 recurrence anchor and an NVFP4 read copy as one CUDA C++ kernel
(``gdn_flush.cu``), opt-in through the backend seam (``backend="cuda"``,
:mod:`replayssm_quant.backend`), with :func:`~.flush.gdn_flush_kernel` (Triton) wherever it
does not apply.

What it computes: :func:`replayssm_quant.replay.gdn.gdn_flush` with the corrections re-solved
against the anchor (``fold=RECOMPUTE``, what a dual policy's decode state runs), then the two
casts of the same unrounded S (DESIGN.md section 3, "Flush"). With ``c_j`` the cumulative log
decays of the ``n = length[b]`` committed slots::

    u_p = beta_p (v_p - e^{c_p} A k_p) - sum_{i<p} beta_p e^{c_p - c_i} (k_i . k_p) u_i
    S   = e^{c_{n-1}} A + sum_{j<n} e^{c_{n-1} - c_j} u_j k_j^T
    A'  = fp16(S) (RTN or SR),   R' = nvfp4(S) (RTN),   y = S q (the flush token's output)

One CTA per (sequence, value head) holds the head's S in registers, so the anchor is read
once and S is written only when asked (``store_state``); the Triton split flush writes S and
reads it back for its pair cast. The sums are FP32 FMAs (or, in the tensor-core variant,
FP32-accumulated products of exact bf16 parts) in an order fixed by the CTA's code (a
sequence's bits do not depend on its batch, position or neighbours), different from the
Triton kernel's order, so S agrees with it and with the reference to FP32 tolerance. The casts
are the lean pair cast's operations (``kernels/quant.py``), so A' and R' are the torch casts of
the kernel's own S, bit for bit, with the SR bits of :func:`~replayssm_quant.checkpoints.
checkpoint_streams` (the stream keys are packed inside the kernel). Issue 15, forty-sixth pass
(``docs/kernels-replay.md``).

Covered (:func:`unsupported` says why not, otherwise): policies ``read:nvfp4/rec:fp16`` and
``read:nvfp4/rec:fp16+sr`` (NVFP4 read copy with RTN and the default scale mode); the stored
anchor an fp16 PackedTensor ``[B, H, 128, 128]``; float32 records ``[B, J, ...]`` with
``J <= 16`` slots of one layout (a ring's first J slots); the corrections re-solved (not
``fold_cached_corrections``); CUDA compute capability >= 8.0; the cp.async operands 16-byte
aligned. ``length`` and the per-sequence stream fields (sequence id < 2^20, flush index
< 2^24) are asserted on the device. The extension is :func:`.cuda_verify.build`'s.
"""

from __future__ import annotations

import torch

from ...checkpoints import FlushResult
from ...formats import NVFP4_SCALE_DIVISOR
from ...packed import PackedTensor
from ...philox import STREAM_SHIFTS, as_int, check_seed, stream_key
from ...policy import StatePolicy, require_policy
from .cuda_verify import DIM, _ring_slots, build, placement

__all__ = ["J_MAX", "VARIANTS", "GDN_FLUSH_CUDA_CONFIG", "same_bits", "unsupported",
           "gdn_flush_cuda", "gdn_state_flush_cuda"]

J_MAX = 16  # record slots (gdn_flush.cu's JF)
#: the launch variants (``gdn_flush.cu``), each at 2 CTAs an SM (128 registers with 12-52 bytes
#: of spills; 1 CTA an SM, about 168 registers, took 1.15-1.30x as long on an H100 at 9989e20
#: and was dropped). Variants 0-3 (``tc`` False) form the products and the fold with FP32
#: FMAs and give the same bits; they differ in the NVFP4 division (``rcp``: by a reciprocal
#: and four FMAs, quant.py's ``_div_by_rcp``, where the matrix scale allows; else
#: ``__fdiv_rn``) and ``roll``, the casts' block loop unrolled 1 or 2 times (the registers
#: move down after each step; 4, no loop, overflowed the i-cache). Variant 4 (``tc``) forms
#: them on the tensor cores (mma.sync, exact bf16 parts, FP32 accumulation; forty-ninth
#: pass): another order of the sums, so its S has its own last bits (FP32 tolerance of the
#: reference) and its copies are the casts of that S; variants 5-7 are 4 with the reciprocal
#: division, the casts rolled by 2, or both (the same bits as 4)
VARIANTS = {0: {"mb": 2, "rcp": False, "roll": 1, "tc": False},
            1: {"mb": 2, "rcp": False, "roll": 2, "tc": False},
            2: {"mb": 2, "rcp": True, "roll": 1, "tc": False},
            3: {"mb": 2, "rcp": True, "roll": 2, "tc": False},
            4: {"mb": 2, "rcp": False, "roll": 1, "tc": True},
            5: {"mb": 2, "rcp": True, "roll": 1, "tc": True},
            6: {"mb": 2, "rcp": False, "roll": 2, "tc": True},
            7: {"mb": 2, "rcp": True, "roll": 2, "tc": True}}
#: the default variant: 6, the tensor-core form with its casts rolled by 2 (H100, B = 256, 32
#: heads, J = 16; us, fp16+sr / RTN anchor, three runs at 60e1610,
#: flush_nvfp4_cuda_60e1610_h100_*.json): 734.3-735.1 / 641.3-643.0, against 744.2-745.4 /
#: 657.5-658.4 for 4, 755.4-757.2 / 677.1-679.4 for 5 and 746.4-755.0 / 661.8-661.9 for 7 (the
#: reciprocal division is slower here) and 1091-1097 / 1041-1042 for the Triton split flush.
#: Before it, 4 (roll 1): 778 / 688 at cd4cee4 (flush_nvfp4_cuda_cd4cee4_h100.json), against
#: 810 / 756 for variant 0, 869 / 771, 838 / 764 and 860 / 746 for 1-3 and 1100 / 1047 for
#: the Triton split flush; 788 / 689 at b8680d2, before the Philox and SR changes of
#: cd4cee4, against 888 / 763 for variant 0. Earlier: 0 was the fastest FMA form (9989e20,
#: 792db29: 889-890 / 759-760; the 1-CTA forms 1093-1155 / 987-1043)
GDN_FLUSH_CUDA_CONFIG = {"variant": 6}


def same_bits(variant: int) -> tuple[int, ...]:
    """The launch variants (:data:`VARIANTS`) that give ``variant``'s bits: those of its form,
    the FMAs (``tc`` False) or the tensor cores; ``variant`` first, then ascending. Raises
    KeyError for a variant that is not a key of :data:`VARIANTS`."""
    tc = VARIANTS[variant]["tc"]
    return (variant,) + tuple(v for v, c in VARIANTS.items() if c["tc"] == tc and v != variant)


_F_SR, _F_Y, _F_S, _F_W = 1, 2, 4, 8
# gdn_flush.cu's constants
assert NVFP4_SCALE_DIVISOR == 2688.0
assert (STREAM_SHIFTS["head"], STREAM_SHIFTS["sequence"], STREAM_SHIFTS["flush"]) == (1, 19, 39)


def _policy_reason(policy) -> str | None:
    if not isinstance(policy, StatePolicy):
        return "the policy is not a parsed StatePolicy (a per-head policy, or a string)"
    p = policy
    if p.single_checkpoint:
        return "a single-checkpoint policy (the kernel casts an fp16 anchor and an NVFP4 read copy)"
    if p.rec.name != "fp16" or p.rec.scale:
        return f"the anchor format is {p.rec} (the kernel casts fp16 or fp16+sr)"
    if p.read.name != "nvfp4" or p.read.sr or p.read.scale:
        return f"the read format is {p.read} (the kernel casts nvfp4 with RTN and the default " \
               f"scale mode)"
    return None


def unsupported(anchor, la, beta, v, k, length, policy, *, sequence_ids, flush_index, q=None,
                fold_cached_corrections: bool = False) -> str | None:
    """Why :func:`gdn_flush_cuda` would hand this call to the Triton kernel, or None when the
    CUDA kernel covers it (module docstring). Arguments as :func:`gdn_flush_cuda`; never
    raises (inputs the kernels refuse are left to the Triton kernel's checks)."""
    why = _policy_reason(policy)
    if why is not None:
        return why
    if fold_cached_corrections is not False:
        return "fold_cached_corrections is on (the kernel re-solves against the anchor)"
    if not isinstance(anchor, PackedTensor) or anchor.spec.name != "fp16":
        return "the stored anchor is not an fp16 PackedTensor"
    A = anchor.codes
    if A.dtype != torch.float16 or A.dim() != 4 or tuple(A.shape[2:]) != (DIM, DIM) \
            or not A.is_contiguous():
        return f"the anchor's codes are not a contiguous float16 [B, H, {DIM}, {DIM}] tensor"
    B, H = (int(x) for x in A.shape[:2])
    recs = {"la": la, "beta": beta, "v": v, "k": k}
    if any(type(t) is not torch.Tensor for t in recs.values()):
        return "a record is not a plain torch.Tensor"
    if any(t.dtype != torch.float32 for t in recs.values()):
        return "a record is not float32"
    if (la.dim(), beta.dim(), v.dim(), k.dim()) != (3, 3, 4, 4):
        return "a record tensor has the wrong number of dimensions"
    J, G = la.shape[1], k.shape[2]
    want = {"la": (B, J, H), "beta": (B, J, H), "v": (B, J, H, DIM), "k": (B, J, G, DIM)}
    if any(tuple(recs[n].shape) != s for n, s in want.items()):
        return "the records are not [B, J, ...] of the anchor's B and H with DK = DV = 128"
    if B == 0 or H == 0 or not 1 <= J <= J_MAX:
        return f"an empty batch or head axis, or J = {J} record slots (the kernel takes " \
               f"1..{J_MAX})"
    if G < 1 or H % G:
        return "the key heads do not divide the value heads"
    js = {n: _ring_slots(t, s) for n, t, s in (("la", la, H), ("beta", beta, H),
                                                ("v", v, H * DIM), ("k", k, G * DIM))}
    if None in js.values() or len(set(js.values())) != 1:
        return "the records do not share one layout of contiguous slots"
    ints = {"length": length, "sequence_ids": sequence_ids}
    for n, t in ints.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) \
                or tuple(t.shape) != (B,):
            return f"{n} is not an integer [B] tensor"
    fi = flush_index
    if not (isinstance(fi, torch.Tensor) and fi.dtype in (torch.int32, torch.int64)
            and fi.numel() in (1, B)) and as_int(fi) is None:
        return "flush_index is not an int or an integer tensor of 1 or B elements"
    if q is not None and (type(q) is not torch.Tensor or q.dtype != torch.float32
                          or tuple(q.shape) != (B, G, DIM) or not q.is_contiguous()):
        return "q is not a contiguous float32 [B, G, 128] tensor"
    dev = A.device
    extra = [length, sequence_ids] + ([fi] if isinstance(fi, torch.Tensor) else []) + \
        ([q] if q is not None else [])
    # (the cp.async operands: the keys, the values, the query; the anchor's 16-byte loads)
    return placement(dev, (A, k, v) + ((q,) if q is not None else ()),
                     (A, *recs.values(), *extra))


def gdn_flush_cuda(anchor, la, beta, v, k, length, policy, *, seed, layer, sequence_ids,
                   flush_index, u_cached=None, fold_cached_corrections: bool = False, q=None,
                   store_state: bool = True, dequantize: bool = True, return_w: bool = True,
                   fallback: bool = True, variant: int | None = None, **triton_options):
    """:func:`~.flush.gdn_flush_kernel` (same arguments and results) on the CUDA kernel where
    it applies (:func:`unsupported` is None), else on the Triton kernel (with
    ``triton_options``, its launch options).

    Shapes: ``anchor`` the stored fp16 anchor (PackedTensor ``[B, H, 128, 128]``); records
    ``la, beta [B, J, H]``, ``v [B, J, H, 128]``, grouped ``k [B, J, G, 128]`` float32,
    slots ``< length[b]`` folded (``length`` integer ``[B]``, ``0 <= length <= J``, asserted
    on the device); ``q [B, G, 128]`` the flush token's query or None; ``seed`` in
    ``[0, 2^63)``; ``sequence_ids`` integer ``[B]``; ``flush_index`` an int or integer
    ``[B]`` (or one element). Returns ``(FlushResult, y)``: the state S ``[B, H, 128, 128]``
    float32 with ``store_state`` (else None), the new checkpoints (stored: the fp16 anchor
    and the NVFP4 read copy as PackedTensors; their values with ``dequantize``), the solved
    corrections ``w [B, J, H, 128]`` (zero at slots ``>= length``) with ``return_w`` (else
    None); ``y = S q`` ``[B, H, 128]`` float32, or None without ``q``. ``variant``: the
    launch variant (:data:`VARIANTS`; default :data:`GDN_FLUSH_CUDA_CONFIG`; 0-3 give the same
    bits, 4-7, the tensor-core form, theirs).

    Raises:
        ValueError: ``variant`` not a key of :data:`VARIANTS` or None; with
            ``fallback=False``, a call the CUDA kernel does not cover (naming
            why); a seed outside ``[0, 2^63)`` or a layer or head count beyond the stream
            key's fields; otherwise what the Triton kernel's checks refuse.
        RuntimeError: the extension cannot be built (:func:`.cuda_verify.build`); a length,
            sequence id or flush index out of range (the kernel's device-side assertion, at
            the next synchronisation, after it prints the sequence).
    """
    from .flush import gdn_flush_kernel

    if variant is not None and (as_int(variant) is None or int(variant) not in VARIANTS):
        raise ValueError(f"gdn_flush_cuda: variant must be one of {sorted(VARIANTS)} or None, "
                         f"got {variant!r}")
    s = check_seed(seed, "gdn_flush_cuda")  # (before the fallback: one rule either way)
    why = unsupported(anchor, la, beta, v, k, length, policy, sequence_ids=sequence_ids,
                      flush_index=flush_index, q=q,
                      fold_cached_corrections=fold_cached_corrections)
    if why is not None:
        if not fallback:
            raise ValueError(f"gdn_flush_cuda: the CUDA kernel does not cover this call: {why}")
        return gdn_flush_kernel(anchor, la, beta, v, k, length, policy, seed=s, layer=layer,
                                sequence_ids=sequence_ids, flush_index=flush_index,
                                u_cached=u_cached,
                                fold_cached_corrections=fold_cached_corrections, q=q,
                                store_state=store_state, dequantize=dequantize,
                                return_w=return_w, **triton_options)
    A = anchor.codes
    B, H = int(A.shape[0]), int(A.shape[1])
    stream_key(layer=layer, head=H - 1)  # host range check of the host fields (ValueError)
    pol = require_policy(policy)
    dev = A.device
    mod = build()
    J = int(la.shape[1])
    i64 = dict(dtype=torch.int64, device=dev)
    fi = torch.as_tensor(flush_index, **i64).reshape(-1)
    fi = fi.expand(B).contiguous() if fi.numel() == 1 else fi.contiguous()
    seq = sequence_ids.to(**i64).contiguous()
    length = length.to(**i64).contiguous()
    a_out = torch.empty(B, H, DIM, DIM, dtype=torch.int16, device=dev)
    codes = torch.empty(B, H, DIM, DIM // 2, dtype=torch.uint8, device=dev)
    bs = torch.empty(B, H, DIM, DIM // 16, dtype=torch.uint8, device=dev)
    ms = torch.empty(B, H, dtype=torch.float32, device=dev)
    y = torch.empty(B, H, DIM, dtype=torch.float32, device=dev) if q is not None else None
    S = torch.empty(B, H, DIM, DIM, dtype=torch.float32, device=dev) if store_state else None
    w = torch.empty(B, J, H, DIM, dtype=torch.float32, device=dev) if return_w else None
    flags = (_F_SR if pol.rec.sr else 0) | (_F_Y if q is not None else 0) | \
        (_F_S if store_state else 0) | (_F_W if return_w else 0)
    dummy = ms
    with torch.cuda.device(dev):  # the launch takes the current device and stream
        mod.gdn_flush_cuda(A, la, beta, v, k, length, q if q is not None else dummy, seq, fi,
                           a_out, codes, bs, ms, y if y is not None else dummy,
                           S if S is not None else dummy, w if w is not None else dummy, J,
                           s & 0xFFFFFFFF, s >> 32, int(layer) << STREAM_SHIFTS["layer"],
                           flags, GDN_FLUSH_CUDA_CONFIG["variant"] if variant is None
                           else int(variant))
    shape = torch.Size((B, H, DIM, DIM))
    a_st = PackedTensor(pol.rec, shape, a_out.view(torch.float16), None, None)
    r_st = PackedTensor(pol.read, shape, codes, bs, ms)
    from .flush import _checkpoints

    return FlushResult(S, _checkpoints(a_st, r_st, True, dequantize), w), y


def gdn_state_flush_cuda(anchor, recs: dict, length, policy, *, seed, layer, sequence_ids,
                         flush_index, fold_cached_corrections: bool = False) -> FlushResult:
    """CUDA kernel of :func:`replay.gdn.gdn_state_flush` (the state objects' flush under
    ``backend="cuda"``): :func:`gdn_flush_cuda` with ``return_w=False`` as
    :func:`~.flush.gdn_state_flush` (the state reads S and the checkpoints). A failed build
    raises before anything is written."""
    return gdn_flush_cuda(anchor, recs["la"], recs["beta"], recs["v"], recs["k"], length,
                          policy, seed=seed, layer=layer, sequence_ids=sequence_ids,
                          flush_index=flush_index, u_cached=recs["uR"],
                          fold_cached_corrections=fold_cached_corrections,
                          return_w=False)[0]


def _prepare_state_flush(policy, *, key_dim: int, value_dim: int, window: int,
                         fold_cached_corrections: bool) -> None:
    """Build the extension now if :func:`gdn_state_flush_cuda` will run the CUDA kernel for a
    decode state of this policy, dims and window (:meth:`GDNReplayState._prepare_flush`, at its
    first step, before anything is written); raises what :func:`.cuda_verify.build` raises."""
    if (_policy_reason(policy) is None and not fold_cached_corrections
            and key_dim == value_dim == DIM and window <= J_MAX):
        build()


gdn_state_flush_cuda.prepare = _prepare_state_flush

"""Launch-configuration sweep of the records kernel (issue 15): decode step and verify.

For the two B = 256 serving geometries of ``benchmarks/decode.py`` (GDN: 16 q/k heads, 32 value
heads, 128 x 128; Mamba-2: 128 heads, 1 group, P = 64, N = 128; L = 16, T = 8) and the read
copies fp32 and nvfp4 (policies ``fp32`` and ``read:nvfp4/rec:fp16+sr``, as decode.py), times

* the decode step at h = 7 (``{gdn,mamba2}_step_kernel``: ring append + output) for every
  configuration of ``STEP_CANDIDATES``;
* verify of T = 8 drafts at h = 0 and h = 8 (h = 8: every sequence's last draft on the flush slot,
  so the anchor launch runs for all of them) for every configuration of ``VERIFY_CANDIDATES``.

A configuration is ``(block_v, num_warps, k_chunk, num_stages, use_dot)`` (see
``records_outputs``). Timing: CUDA events around each call, median of ``--reps`` (>= 20) calls,
inputs rotated over a pool of ``--pool`` (>= 4) input sets holding at least 4 x the L2 size;
every configuration is warmed (each pool entry once, plus ``--warmup`` calls) before it is
timed. Each configuration's outputs (GDN: also the new correction / the verify corrections)
are checked against the torch reference (``replay.*_step_output`` / ``*_verify``) on the first
``--ref-seqs`` sequences: mismatch = count of ``|got - ref| > 1e-5 + 1e-5 |ref|``.

Compilation dominates a cold run, so ``--jobs N`` first compiles (and checks) the
configurations in N worker processes sharing Triton's on-disk cache, then times them in this
process. Prints a table and the best configuration per case; writes JSON to ``--out``.

Usage::

    python benchmarks/records_tune.py --out $OUT/records_tune_h200.json          # device
    python benchmarks/records_tune.py --tiny --out /tmp/records_tune_tiny.json   # CPU interpreter
    python benchmarks/records_tune.py --set verify2 --out $OUT/records_tune_verify2_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

if "--tiny" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("REPLAYSSM_BACKEND", "torch")  # references: torch quantizers

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402  (input sets, timer, stats)
import replay_kernels as rk  # noqa: E402  (Model)

from replayssm_quant.kernels import replay as kr  # noqa: E402
from replayssm_quant.kernels.replay import records as rec  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402
from replayssm_quant.replay import (gdn_step_output, gdn_verify, mamba2_step_output,  # noqa: E402
                                    mamba2_verify)

DEV = dc.DEV
POLICIES = dc.POLICIES  # {"fp32": "fp32", "nvfp4": "read:nvfp4/rec:fp16+sr"}

# (block_v, num_warps, k_chunk, num_stages, use_dot)
STEP_CANDIDATES = [
    (64, 4, 64, 2, False), (64, 4, 128, 1, False), (64, 4, 32, 3, False), (64, 4, 32, 2, False),
    (32, 4, 64, 2, False), (32, 2, 64, 2, False), (32, 2, 128, 1, False), (64, 8, 64, 2, False),
    (128, 8, 64, 2, False), (16, 1, 128, 1, False), (64, 4, 32, 2, True),
]
VERIFY_CANDIDATES = [
    (64, 4, 32, 2, True), (64, 4, 64, 2, True), (64, 8, 32, 3, True), (32, 4, 32, 2, True),
    (32, 2, 32, 2, True), (128, 8, 32, 2, True), (64, 4, 128, 1, True), (64, 4, 32, 2, False),
]
# tensor-core products in about-FP32 accuracy (use_dot="tf32x3"; the timed defaults of
# records.py in each list first, for comparison in the same run)
TF32_STEP_CANDIDATES = [
    (64, 4, 128, 1, False), (64, 4, 32, 3, False), (64, 4, 128, 1, "tf32x3"),
    (64, 4, 64, 2, "tf32x3"), (64, 4, 32, 2, "tf32x3"), (32, 4, 128, 1, "tf32x3"),
    (128, 4, 64, 2, "tf32x3"), (64, 2, 128, 1, "tf32x3"),
]
TF32_VERIFY_CANDIDATES = [
    (64, 4, 32, 2, False), (64, 4, 32, 2, True), (64, 4, 32, 2, "tf32x3"),
    (64, 4, 64, 2, "tf32x3"), (64, 4, 128, 1, "tf32x3"), (32, 4, 32, 2, "tf32x3"),
    (128, 4, 64, 2, "tf32x3"), (64, 8, 64, 2, "tf32x3"),
]
# GDN's forward substitution with the solved rows' v / beta prefetched as tiles (prefetch=True,
# the 6th field; timed 2026-12-01, records_tune_prefetch_h200.json): GDN configs with and without it
PREFETCH_STEP_CANDIDATES = [
    (64, 4, 32, 3, False, False), (64, 4, 32, 3, False, True), (64, 4, 128, 1, False, False),
    (64, 4, 128, 1, False, True),
]
PREFETCH_VERIFY_CANDIDATES = [
    (64, 4, 32, 2, "tf32x3", False), (64, 4, 32, 2, "tf32x3", True),
    (128, 4, 64, 2, "tf32x3", False), (128, 4, 64, 2, "tf32x3", True),
]
# the matrix forms of verify (solve="inverse" | "doubling", the 7th field; timed 2026-12-01,
# records_tune_verify2_h200.json, "inverse" now the default): the
# GDN T x T system inverted once per program on scalars and applied to the value rows as small
# products, the T outputs as products with masked decay matrices (records.records_outputs).
# The former defaults (substitution) first, for comparison in the same run; the step
# defaults for the verify / step ratio (docs/kernels-replay.md, issue 15: <= 1.3x).
VERIFY2_STEP_CANDIDATES = [(64, 4, 128, 1, False), (64, 4, 32, 3, False)]
VERIFY2_VERIFY_CANDIDATES = [
    (64, 4, 32, 2, "tf32x3", False, "substitution"),
    (128, 4, 64, 2, "tf32x3", False, "substitution"),
    (64, 4, 32, 2, False, False, "substitution"),
    (64, 4, 32, 2, "tf32x3", False, "inverse"), (64, 4, 32, 2, "tf32x3", False, "doubling"),
    (64, 4, 64, 2, "tf32x3", False, "inverse"), (32, 4, 32, 2, "tf32x3", False, "inverse"),
    (128, 4, 64, 2, "tf32x3", False, "inverse"), (64, 4, 32, 2, False, False, "inverse"),
    # fp32 policy only (A is R): GDN's recompute path in one launch (fuse_shared_anchor, 8th
    # field); Mamba-2 with the second launch kept (skip_shared_anchor=False, 9th field: the
    # behaviour before the skip, for comparison)
    (64, 4, 32, 2, "tf32x3", False, "inverse", True),
    (64, 4, 32, 2, "tf32x3", False, "doubling", True),
    (64, 4, 32, 2, False, False, "substitution", False, False),
    # GDN's anchor launch (the window x window system) with 32 value rows per program
    # (anchor_block_v, 10th field; the matrix forms' anchor launch spills at 64)
    (64, 4, 32, 2, "tf32x3", False, "inverse", False, True, 32),
    (128, 4, 64, 2, "tf32x3", False, "inverse", False, True, 32),
]
# the step with the record keys loaded as one tile before the stream of C (keys_first, the
# 11th field; None: the wrapper's default for that field): the step defaults with and without
_N = (None, None, None, None)  # solve, fuse_shared_anchor, skip_shared_anchor, anchor_block_v
KEYS_STEP_CANDIDATES = [c + (False,) for c in (  # shared_products off: keys_first needs the
    # record keys loaded in the records kernel (the defaults of the fifth session)
    (64, 4, 32, 3, False, None) + _N + (False,),  # GDN fp32 / half read
    (64, 4, 128, 1, False, None) + _N + (False,),  # STEP_CONFIG (Mamba-2)
    (64, 4, 128, 1, False, None) + _N + (True,),
    (64, 4, 128, 1, False, True) + _N + (False,),  # GDN nvfp4
    (64, 4, 128, 1, False, True) + _N + (True,),
    (32, 4, 128, 1, False, True) + _N + (True,),
    (32, 4, 128, 1, False, None) + _N + (True,),
)]
# the products with the record keys once per (sequence, key group) (shared_products, the 12th
# field) against the wrappers' defaults (all fields None), and with it wider value tiles (the
# products no longer repeat per tile)
_D = (None,) * 11
SHARED_STEP_CANDIDATES = [
    _D + (False,), _D + (True,),
    (128, 4, 128, 1, False, None) + _N + (None, True),
    (128, 8, 128, 1, False, None) + _N + (None, True),
    (64, 8, 128, 1, False, None) + _N + (None, True),
    (32, 4, 128, 1, False, None) + _N + (None, True),
    (64, 4, 64, 2, False, None) + _N + (None, True),
]
SHARED_VERIFY_CANDIDATES = [_D + (False,), _D + (True,)]
# verify with shared products: whole-K chunks (one reduction per query instead of one per
# chunk), tensor-core products, tile sizes (--set verify3); the step defaults for reference
_V = (None, "inverse") + (None,) * 4 + (True,)  # prefetch, solve, ..., shared_products
VERIFY3_VERIFY_CANDIDATES = [
    _D + (True,),
    (64, 4, 128, 1, False) + _V, (32, 4, 128, 1, False) + _V, (64, 4, 64, 2, False) + _V,
    (64, 8, 128, 1, False) + _V, (64, 4, 128, 1, "tf32x3") + _V,
    (64, 4, 64, 2, "tf32x3") + _V, (128, 4, 64, 2, "tf32x3") + _V,
    (128, 8, 128, 1, "tf32x3") + _V, (32, 4, 64, 2, "tf32x3") + _V,
]
# the E2M1 decoders (e2m1_decode, the 13th field; --set lut, nvfp4 read copy only): the
# defaults with each decoder, and with the table lookup (fewer registers and instructions per
# code) the step's tiles again
_E = (None,) * 12
_T = (None,) * 6 + _N + (None, None, "lookup")  # after block_v, num_warps, k_chunk, num_stages
LUT_STEP_CANDIDATES = [
    _E + ("integer",), _E + ("lookup",),
    (64, 4, 64, 2) + _T[4:], (64, 4, 32, 2) + _T[4:], (64, 4, 32, 3) + _T[4:],
    (32, 4, 128, 1) + _T[4:], (32, 4, 64, 2) + _T[4:], (128, 4, 128, 1) + _T[4:],
    (128, 8, 128, 1) + _T[4:], (64, 8, 128, 1) + _T[4:], (64, 2, 128, 1) + _T[4:],
    (32, 2, 128, 1) + _T[4:], (128, 4, 64, 2) + _T[4:],
    (64, 4, 128, 1, None, False) + _T[6:],  # GDN without its prefetch (its default then set it)
]
LUT_VERIFY_CANDIDATES = [_E + ("integer",), _E + ("lookup",)]
# --set lut2: the narrow tiles of the first lut sweep (records_tune_lut_h200.json: 32 rows and
# 2 warps won for both models), around them
LUT2_STEP_CANDIDATES = [
    _E + ("lookup",), (32, 2, 128, 1) + _T[4:], (32, 2, 128, 1, None, False) + _T[6:],
    (32, 1, 128, 1) + _T[4:], (32, 1, 128, 1, None, False) + _T[6:],
    (16, 1, 128, 1) + _T[4:], (16, 1, 128, 1, None, False) + _T[6:],
    (16, 2, 128, 1) + _T[4:], (16, 2, 128, 1, None, False) + _T[6:],
    (32, 2, 64, 2) + _T[4:], (32, 2, 64, 2, None, False) + _T[6:],
    (64, 2, 128, 1, None, False) + _T[6:],
]
LUT2_VERIFY_CANDIDATES = [_E + ("integer",), (32, 2) + (None,) * 10 + ("integer",),
                          (32, 2) + (None,) * 10 + ("lookup",)]
# --set readpass (2026-12-02, tenth session): the step's products with R in a launch of their own
# (read_pass, the 14th field: (block_v, num_warps) of that launch; False: one launch) with the
# records launch (block_v, num_warps: the first two fields) on wide tiles, since it no longer
# streams R; both read copies, step only; first one launch at the wrappers' tiles and at the
# former one-launch defaults (GDN: 32 x 2 from nvfp4, 128 x 4 from fp32; records_tune_readpass_h200.json
# was run at 6d4b974, before the read pass became GDN's default, when the first row was those)
_R = (None,) * 11  # k_chunk .. e2m1_decode left to the wrappers
READPASS_STEP_CANDIDATES = [(None, None) + _R + (False,), (32, 2) + _R + (False,),
                            (128, 4) + _R + (False,)] + [
    (rb, rw) + _R + (rp,)
    for rb, rw in ((128, 1), (128, 2), (128, 4), (64, 1), (64, 2), (64, 4))
    for rp in ((32, 2), (16, 1), (32, 4), (64, 4), (128, 4))]
# --set half (2026-12-02, run at 3fe59dc: records_tune_half_h200.json): the packed-half E2M1
# decoder (e2m1_decode="half", the 13th field) against the defaults (lookup; Mamba-2's
# tensor-core verify: integer), nvfp4 read copy, step and verify
HALF_STEP_CANDIDATES = [_E + ("lookup",), _E + ("half",)]
HALF_VERIFY_CANDIDATES = [_E + (None,), _E + ("half",)]
# --set f16 (2026-12-02, eleventh session): C's products on float16 tensor cores
# (use_dot="f16x3", the 5th field; nvfp4 read copy) in the step's read pass (tiles: the 14th
# field) with the half decoder's float16 pairs or the lookup's values converted, and in verify,
# against the defaults; the records launch keeps the wrappers' tile
_F = (None,) * 7  # prefetch .. keys_first, shared_products
F16_STEP_CANDIDATES = [_E + ("lookup",)] + [
    (None, None, None, None, "f16x3") + _F + (dec, rp)
    for dec in ("half", "lookup") for rp in ((32, 2), (64, 2), (64, 4), (128, 4))]
F16_VERIFY_CANDIDATES = [(None, None, None, None, "tf32x3") + _F + (None,),  # the former defaults
                         (None, None, None, None, "f16x3") + _F + ("half",),
                         (None, None, None, None, "f16x3") + _F + ("lookup",)]
# --set f16split (2026-12-02, eleventh session): the step's read pass with use_dot="f16x3" after
# X is split once per (sequence, key group) (_x_split_kernel), half decoder, read-pass tiles
F16SPLIT_STEP_CANDIDATES = [_E + ("lookup",)] + [
    (None, None, None, None, "f16x3") + _F + ("half", rp)
    for rp in ((32, 1), (32, 2), (64, 2), (64, 4), (128, 4))]
# --set pdl (2026-12-03, fourteenth session): programmatic dependent launch between the
# launches of one call (pdl, the 15th field: the records launch streams C while the products
# launch runs; the read pass likewise), on and off at the wrappers' defaults, step and verify
_P = (None,) * 14
PDL_STEP_CANDIDATES = [_P + (False,), _P + (True,)]
PDL_VERIFY_CANDIDATES = [_P + (False,), _P + (True,)]
# --set verifyrp (2026-12-03, fourteenth session): verify's products with the read copy in a
# launch of their own (read_pass, the 14th field) on narrow tiles, the records launch (the
# solve, the outputs, the corrections) on the first two fields' tile; the defaults first
_RV = (None,) * 11
VERIFYRP_VERIFY_CANDIDATES = [_P] + [
    (rb, rw) + _RV + (rp,)
    for rb, rw in ((None, None), (64, 4), (32, 2))
    for rp in ((32, 2), (64, 4), (32, 4), (128, 8))]
# --set verify4 (2026-12-03, fourteenth session): verify's tiles again after the corrections
# became the kernel's output (w_out_known): GDN's default 128 x 4 launch holds 255 registers,
# spills and runs 2 blocks per SM (ncu, 12.5% occupancy); its neighbours with tf32x3, and
# Mamba-2's FP32 reductions at other tiles; the defaults first
VERIFY4_VERIFY_CANDIDATES = [_P] + [
    (bv, w, kc, st, "tf32x3") for bv, w, kc, st in (
        (128, 8, 64, 2), (128, 8, 32, 2), (128, 4, 32, 2), (128, 4, 128, 1), (64, 4, 64, 2),
        (64, 2, 64, 2), (64, 4, 128, 1), (32, 2, 64, 2))] + [
    (bv, w, kc, st, False) for bv, w, kc, st in (
        (64, 8, 32, 2), (32, 4, 32, 2), (32, 2, 32, 2), (64, 4, 64, 2), (64, 2, 32, 2))]
# --set verify5 (2026-12-03, fifteenth session): verify on 1- and 2-warp tiles. In verify4
# every tf32x3 tile with 2 warps beat its 4-warp neighbour by 29-54% (Mamba-2 64 x 4 686 ->
# 64 x 2 488 us); on sm_90 Triton takes warpgroup MMA (wgmma, operands through shared memory)
# only when num_warps is a multiple of 4, so 1-2 warps get the register-operand mma.sync
# form. 1 warp and 128 x 2 were never timed for verify; f16x3 (Mamba-2's nvfp4 default, 4
# warps) neither at 2 warps. The defaults first.
VERIFY5_VERIFY_CANDIDATES = [_P] + [
    (bv, w, kc, st, dot) for dot in ("tf32x3", "f16x3") for bv, w, kc, st in (
        (128, 2, 64, 2), (128, 2, 32, 2), (64, 2, 32, 2), (64, 2, 64, 3), (64, 2, 128, 1),
        (64, 1, 64, 2), (64, 1, 32, 2), (32, 1, 64, 2), (32, 1, 32, 2), (16, 1, 64, 2))] + [
    (bv, w, 32, 2, False) for bv, w in ((16, 1), (32, 1), (64, 1))]
# --set verify6 (2026-12-03, fifteenth session): around verify5's winners (GDN 128 x 2 with
# 32-column chunks, Mamba-2 64 x 1): stage depths, and the matrix forms' small products in
# FP32 FMA (solve_precision="ieee", the 16th field; with tf32x3 products they default to
# tf32x3, and with f16x3 too). The ncu of the new defaults still has 255 registers and 12%
# occupancy for both models' verify launches. The defaults first.
_Q = (None,) * 15
VERIFY6_VERIFY_CANDIDATES = [_P, _Q + ("ieee",)] + [
    (bv, w, kc, st, dot) + (None,) * 10 + (sp,) for dot in ("tf32x3", "f16x3")
    for bv, w, kc, st in ((128, 2, 32, 3), (128, 2, 32, 1), (64, 1, 32, 3), (64, 1, 32, 1),
                          (64, 2, 32, 3))
    for sp in (None, "ieee")]
# --set step5 (2026-12-03, fourteenth session): the step without the products launch
# (shared_products=False, the 12th field: the records launch forms Z itself; with keys_first,
# the 11th, its record keys loaded before C) at the default and at 128 x 4 tiles; GDN's
# products launch is 10 us of its 170 us FP32 step
_S = (None,) * 10
STEP5_STEP_CANDIDATES = [_P, _S + (None, False), _S + (True, False),
                         (128, 4) + _S[2:] + (None, False), (128, 4) + _S[2:] + (True, False)]
# --set late (2026-12-03, sixteenth session): C X by FP32 FMA with element-wise sums over
# chunks of late_sum (the 17th field) columns and one cross-lane reduction per program, where
# the step's reductions of a whole [64, 128] row tile ran 320 shuffles per thread (static
# sm_90 SASS, benchmarks/sass_static.py: GDN's FP32 step 188 registers and 2232 instructions
# -> 56-70 registers and 992-1152 with late_sum 4-8). FP32 and half copies only (blocked
# copies ignore it); steps at the defaults' neighbours, verify from FP32 with FMA products
# (use_dot=False) and both precisions of the small products. The defaults first.
_L = (None,) * 11
LATE_STEP_CANDIDATES = [_P] + [
    (bv, w, None, st, False) + _L + (ls,)
    for ls in (4, 8, 16) for bv, w in ((64, 2), (128, 2), (128, 4), (32, 1), (64, 4), (32, 2))
    for st in (1, 3)]
LATE_VERIFY_CANDIDATES = [_P] + [
    (bv, w, None, 2, False) + (None,) * 10 + (sp, ls)
    for ls in (4, 8) for bv, w in ((64, 2), (64, 4), (32, 1), (128, 4), (32, 2))
    for sp in (None, "tf32x3")]
# --set nx8 (2026-12-03, sixteenth session): X padded to 8 columns, not 16, where the
# products have 32-bit operands and X is only their N (Triton's tl.dot takes any N >= 1 for
# them; K >= 16 on Triton 3.6): Mamba-2's verify (8 queries) from FP32 (static sm_90 SASS:
# 225 -> 184 registers, 2056 -> 1584 instructions). Its default and neighbouring tiles, with
# a read pass too; the defaults first.
NX8_VERIFY_CANDIDATES = [_P] + [
    (bv, w, kc, st, "tf32x3") + (None,) * 10 + ("ieee",)
    for bv, w, kc, st in ((64, 2, 64, 3), (64, 2, 64, 2), (64, 2, 128, 1), (128, 2, 32, 3),
                          (128, 4, 32, 3), (64, 4, 32, 3), (64, 1, 32, 3), (32, 1, 32, 3),
                          (32, 2, 32, 3))] + [
    _Q + ("tf32x3",)] + [(None,) * 13 + (rp,) for rp in ((64, 2), (32, 1), (128, 4))]
# --set split (2026-12-03, sixteenth session): GDN's verify with X in two tiles, key columns
# and query columns (split_x, the 18th field), so that each small product of the matrix form
# is formed on its nonzero block only (static sm_90 SASS at the default tile: 5704 -> 4504
# instructions). From FP32 at the default and neighbouring tiles; from nvfp4 with tf32x3
# products (split_x does not apply to the float16 products of an nvfp4 copy, its default; the
# re-solving anchor launch, FP32 products of the fp16 anchor, does split). split_x=True
# splits both launches of a verify. The defaults first.
_S17 = (None,) * 17
SPLIT_VERIFY_CANDIDATES = [_P, _S17 + (True,)] + [
    (bv, w, 32, st, dot) + (None,) * 12 + (True,)
    for dot in ("tf32x3",)
    for bv, w, st in ((128, 2, 3), (64, 2, 2), (64, 2, 3), (128, 4, 2), (32, 1, 2), (64, 1, 2),
                      (32, 2, 2))]
# --set fold (2026-12-03, seventeenth session): GDN's matrix form with its coefficients folded
# into X (fold_x, the 19th field: C (X Wy) + Vd Wv + U^T Wu, the [NX, NX] coefficients formed
# before C is read, no [BV, NX] intermediates of the solve) and K in chunks of 16 (static sm_90
# SASS, Triton 3.9: the bare tf32x3 stream of C on 128 x 2 tiles holds 255 registers with
# chunks of 32 and 146 with 16; the folded verify 195 with no spills against the default's
# 255 with 168 bytes of stack). From FP32 at 128 x 2 and neighbours, stage depths, with the
# products launch (shared_products) and with the anchor launch folded too (split_x=False);
# from nvfp4 (chunks of 16 need an unblocked copy) the fold at the default tile; Mamba-2's
# verify with chunks of 16. The defaults first.
_S18 = (None,) * 18
FOLD_VERIFY_CANDIDATES = [_P, _S18 + (True,)] + [
    (128, 2, 16, st, "tf32x3") for st in (2, 3)] + [
    (bv, w, 16, st, "tf32x3") + (None,) * 13 + (True,)
    for bv, w, st in ((128, 2, 2), (128, 2, 3), (128, 2, 4), (64, 2, 3), (64, 1, 3))] + [
    (128, 2, 16, 3, "tf32x3") + (None,) * 6 + (True,) + (None,) * 6 + (True,),
    (128, 2, 16, 3, "tf32x3") + (None,) * 12 + (False, True)] + [
    (64, 2, 16, st, "tf32x3") + (None,) * 10 + ("ieee",) for st in (3, 4)]
# --set fold2 (2026-12-03, seventeenth session): fold_x="launch", the folded form's
# coefficients (and the products with the keys) in a launch of their own per (sequence, value
# head), so that the records launch starts streaming C at once (static sm_90 SASS: 184
# registers, 2872 instructions at 128 x 2 with chunks of 16, against 255 and 4704 for the
# default); GDN only, the defaults first.
_F18 = (None,) * 18
FOLD2_VERIFY_CANDIDATES = [_P, _F18 + ("launch",)] + [
    (bv, w, kc, st, "tf32x3") + (None,) * 13 + ("launch",)
    for bv, w, kc, st in ((128, 2, 32, 2), (128, 2, 16, 4), (64, 2, 16, 3), (64, 1, 16, 3))] + [
    (None,) * 17 + (False, "launch")]
# --set b16 (2026-12-03, eighteenth session): C's products on bfloat16 tensor cores
# (use_dot="bf16x3": the exact bf16 / fp8 values of the read copy, X in three bfloat16 terms)
# from bf16 and fp8e4m3 read copies (POLICY_SETS["b16"]; an fp16 copy is timed at its default
# for reference), against the defaults (the FP32 tile, tf32x3); verify on GDN's and Mamba-2's
# tiles with chunks of 16-64, the step on two tiles. The defaults first.
_B10 = (None,) * 10  # to solve_precision, the 16th field
B16_STEP_CANDIDATES = [_P] + [(bv, w, kc, st, "bf16x3")
                              for bv, w, kc, st in ((64, 2, 128, 1), (64, 4, 64, 2),
                                                    (32, 2, 64, 2))]
B16_VERIFY_CANDIDATES = [_P] + [
    (bv, w, kc, st, "bf16x3") + _B10 + (sp,)
    for bv, w, kc, st in ((128, 2, 16, 3), (128, 2, 32, 2), (128, 2, 32, 3), (128, 2, 64, 2),
                          (64, 2, 32, 3), (64, 2, 64, 2), (128, 4, 32, 2))
    for sp in (None, "ieee")]
# --set b16b (2026-12-03, eighteenth session): after b16, GDN's new bf16 / fp8 default
# (GDN_VERIFY_B16_CONFIG) against the former one (tf32x3 on the same tile), and Mamba-2's
# verify from fp8 (never swept: VERIFY_CONFIG's FP32 reductions) on MAMBA2_VERIFY_WIDE_CONFIG's
# tile (tf32x3, X on 8 columns) against bf16x3 there (X padded to 16); the defaults first.
B16B_VERIFY_CANDIDATES = [_P, (128, 2, 16, 3, "tf32x3")] + [
    (bv, w, 32, 3, dot) + _B10 + ("ieee",)
    for bv, w in ((64, 2), (64, 1), (32, 1)) for dot in ("tf32x3", "bf16x3")]
# --set fp8step (2026-12-03, eighteenth session): the step from an fp8e4m3 copy (never swept:
# STEP_CONFIG; GDN's 155 us against bf16's 111 at half the bytes) on the tiles of the FP32 /
# half and nvfp4 steps and neighbours, with and without a read pass; the defaults first.
_R8 = (None,) * 8  # to read_pass, the 14th field
FP8STEP_STEP_CANDIDATES = [_P] + [
    (bv, w, kc, st, False) for bv, w, kc, st in (
        (64, 2, 128, 1), (32, 2, 128, 1), (128, 2, 128, 1), (32, 1, 128, 1), (16, 1, 128, 1),
        (64, 2, 64, 2), (32, 2, 64, 2), (128, 4, 64, 2))] + [
    (bv, 2, 128, 1, False) + _R8 + ((rb, rw),) for bv in (64, 128)
    for rb, rw in ((32, 2), (64, 2), (32, 1))]
# --set f16c (2026-12-03, nineteenth session): fp16 read copies with C's products on float16
# tensor cores (use_dot="f16x3": the copy's values as stored, X in three float16 terms)
# against tf32x3 (the defaults when it ran at 2c3d024, records_tune_f16c_h200.json; GDN's
# verify from fp16 has taken f16x3 since, GDN_VERIFY_F16_CONFIG, so its tf32x3 tile is an
# explicit row), verify on b16's tiles and the step on the wrappers' tile; the defaults first.
F16C_STEP_CANDIDATES = [_P, (None, None, None, None, "f16x3")]
F16C_VERIFY_CANDIDATES = [_P, (128, 2, 16, 3, "tf32x3")] + [
    (bv, w, kc, st, "f16x3") + _B10 + (sp,)
    for bv, w, kc, st in ((128, 2, 16, 3), (128, 2, 32, 2), (128, 2, 32, 3), (64, 2, 32, 3),
                          (64, 1, 32, 3))
    for sp in (None, "ieee")]
# --set lean (2026-12-04, twenty-first session): the nvfp4 step's read pass in the lean form
# (records._nvfp4_read_kernel, read_pass=(block_v, num_warps, "lean")) on 1- to 4-warp tiles,
# the records launch on the wrapper's tile; the default first. Since then the default rows of
# the older sets (lut, half, f16, ...) time Mamba-2's nvfp4 step on the lean read pass, and a
# decoder named there (e2m1_decode) picks between its PTX and integer forms (the same bits).
LEAN_STEP_CANDIDATES = [_P] + [
    (None,) * 5 + _R8 + ((rb, rw, "lean"),)
    for rb, rw in ((16, 1), (32, 1), (32, 2), (64, 1), (64, 2), (64, 4), (128, 1), (128, 2),
                   (128, 4))]
# --set rtiles (2026-12-04, twenty-fourth session): the nvfp4 step's records launch (the
# launch after the read pass) on other tiles, the read pass as the default's (GDN the records
# kernel's read pass capped at 96 registers, Mamba-2 the lean one), and Mamba-2's lean read
# pass capped at 64 registers (72 uncapped: 28 one-warp programs per SM, 32 capped).
_GDN_RP, _M2_RP = (32, 2, "records", 96), (64, 1, "lean")
# (Mamba-2's rows name lean_records=False since its nvfp4 default took the lean records
# launch, which has no row tile: the records kernel's launch, as when the set ran.)
_NOLEAN = (None,) * 5 + (False,)
RTILES_STEP_CANDIDATES = [_P] + [
    (bv, w, None, None, None) + _R8 + (rp,) + (() if rp == _GDN_RP else _NOLEAN)
    for rp in (_GDN_RP, _M2_RP)
    for bv, w in ((16, 1), (32, 1), (32, 2), (64, 1), (64, 2), (64, 4), (128, 1), (128, 2),
                  (128, 4))] + [(None,) * 5 + _R8 + ((64, 1, "lean", 64),) + _NOLEAN,
                                (None,) * 5 + _R8 + ((32, 1, "lean", 64),) + _NOLEAN]
# --set lrec (2026-12-04, twenty-fourth session): Mamba-2's nvfp4 step with the lean records
# launch after its lean read pass (lean_records=(heads, num_warps), _m2_step_out_kernel, now
# _step_out_kernel: one program per sequence and that many value heads). (A first run, records_tune_lrec_r1_h200.json,
# also timed the FP32 step with a read pass, 334-399 us against its one launch's 285 us.)
_LR = [(hb, w) for hb in (1, 2, 4, 8) for w in (1, 2, 4, 8) if hb * 64 >= w * 32]
_LR += [(1, 1, True), (1, 2, True), (2, 1, True), (2, 2, True)]  # the read pass lets it start
LREC_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + (None, None, None, None, None, None, lr) for lr in _LR] + [
    (None,) * 13 + ((32, 1, "lean"), None, None, None, None, None, lr)
    for lr in ((1, 1), (1, 1, True))]
# --set leanheads (2026-12-04, twenty-fifth session): the lean read pass on tiles that span the
# value heads of a key group (since then its programs tile a (sequence, key group)'s rows head
# after head; before, one matrix's rows at most): Mamba-2's 128 heads share one key group, GDN's
# pairs of heads one each; the records launch as each model's default after it.
LEANHEADS_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + ((rb, rw, "lean"),)
    for rb, rw in ((64, 1), (128, 1), (128, 2), (256, 1), (256, 2), (256, 4), (512, 2),
                   (512, 4), (512, 8), (1024, 8))] + [
    (None,) * 13 + ((rb, rw, "lean", 96),) for rb, rw in ((128, 1), (256, 2))]
# --set idot (2026-12-04, twenty-fifth session): the lean read pass's integer-dot form
# (read_pass=(block_v, num_warps, "idot"): X as 24-bit integers per block, each word's sum by
# byte-permute lookups and dp4a) on the lean form's tiles and tiles spanning heads.
IDOT_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + ((rb, rw, form),)
    for rb, rw in ((32, 1), (64, 1), (64, 2), (128, 1), (128, 2), (256, 2), (256, 4),
                   (512, 4))
    for form in ("lean", "idot")]
# --set idot2 (2026-12-04, twenty-fifth session): after idot, X's integers in a launch of
# their own before the products launch (the read pass no longer waits for it) and the block
# scales decoded by way of float16; the integer-dot tiles again, and register caps.
IDOT2_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + ((rb, rw, "idot") + cap,)
    for rb, rw in ((32, 1), (64, 1), (128, 1), (128, 2), (256, 2))
    for cap in ((), (96,), (112,))]
# --set idotpdl (2026-12-04, twenty-sixth session): the integer-dot read pass with X's
# integers overlapping its first loads (form "idot_pdl": the read pass dependent on X's
# integers' launch, the products launch after it) against "idot", on the default tiles and
# their neighbours.
IDOTPDL_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + ((rb, rw, form),)
    for rb, rw in ((64, 1), (128, 1), (256, 2))
    for form in ("idot", "idot_pdl")]
# --set glrec (2026-12-04, twenty-sixth session): GDN's lean records launch (_step_out_kernel,
# one program per sequence and value heads, the draft row's correction solved in it) after
# the integer-dot read pass, against the records kernel's launch; Mamba-2's default rows for
# comparison.
GLREC_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + ((64, 1, form), None, None, None, None, None, lr)
    for form in ("idot", "idot_pdl")
    # (early changes nothing after "idot_pdl": its products launch lets the records start)
    for lr in ((1, 1), (1, 2), (2, 2)) + (((1, 1, True), (1, 2, True), (2, 2, True))
                                          if form == "idot" else ())]
# --set glrec2 (2026-12-04, twenty-sixth session): after glrec, GDN's lean records launch on
# the read-pass tiles of --set idotpdl (128 x 1 had become the fastest).
GLREC2_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + ((rb, rw, "idot"), None, None, None, None, None, lr)
    for rb, rw in ((64, 1), (128, 1), (256, 2))
    for lr in ((1, 1, True), (1, 2, True))] + [
    (None,) * 13 + ((128, 1, "idot_pdl"), None, None, None, None, None, (1, 1))]
# --set lean32 (2026-12-04, twenty-sixth session): FP32 read copies' step as a lean read pass
# (_f32_read_kernel: Y = R X and nothing else) with PDL, then the lean records launch
# (_step_out_kernel), against the one-launch default.
LEAN32_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + ((rb, rw, "lean"), True, None, None, None, None, lr)
    for rb, rw in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4))
    for lr in ((1, 1, True),)] + [
    (None,) * 13 + ((32, 2, "lean"), True, None, None, None, None, lr)
    for lr in ((1, 1), (1, 2, True), (2, 2, True))]
# --set lout (2026-12-05, thirty-first session): the FP32 step's records work inside the lean
# FP32 read pass (read-pass form "lean_out", _f32_step_kernel: no records launch), against
# the defaults (GDN: the lean read pass, then the lean records launch; Mamba-2: one launch).
LOUT_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + ((rb, rw, "lean_out"),)
    for rb, rw in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4))]
# --set one (2026-12-05, thirty-second session): the decode step in one launch. FP32 copies:
# "lean_out" without the products launch (read-pass form "lean_one": each program forms its
# products with the record keys), beside "lean_out" at its best H100 tile (32 x 1); nvfp4
# copies: "idot_one" (the integer-dot read pass with X's integers formed in the program, the
# products with the keys and the records work on its rows). Each beside the defaults.
ONE_STEP_CANDIDATES = [_P, (None,) * 13 + ((32, 1, "lean_out"),)] + [
    (None,) * 13 + ((rb, rw, "lean_one"),)
    for rb, rw in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4))] + [
    (None,) * 13 + ((rb, rw, "idot_one"),)
    for rb, rw in ((16, 1), (32, 1), (64, 1), (64, 2), (128, 1), (128, 2), (128, 4))]
# --set iout (2026-12-05, thirty-third session): "idot_out" from nvfp4 copies (the step kernel
# after the X integers' and products launches: "idot" without its records launch, as
# "lean_out" from FP32), beside the defaults.
IOUT_STEP_CANDIDATES = [_P] + [
    (None,) * 13 + ((rb, rw, "idot_out"),)
    for rb, rw in ((32, 1), (64, 1), (64, 2), (128, 1), (128, 2), (128, 4))]
# A candidate sets the fields it lists; the rest take the wrappers' defaults, so the verify
# rows of the older sets (5 or 6 fields) run solve="inverse", the default since 2026-12-01.
KEYS = ("block_v", "num_warps", "k_chunk", "num_stages", "use_dot", "prefetch", "solve",
        "fuse_shared_anchor", "skip_shared_anchor", "anchor_block_v", "keys_first",
        "shared_products", "e2m1_decode", "read_pass", "pdl", "solve_precision", "late_sum",
        "split_x", "fold_x", "lean_records")
# which lists cases() uses: "all" (STEP_/VERIFY_CANDIDATES) or "tf32" (TF32_*); --set, passed
# on to the compile workers
CANDIDATE_SET = "all"


# --set NAME: its read copies where they are not POLICIES (fp32, nvfp4)
POLICY_SETS = {"b16": {"bf16": "read:bf16/rec:fp32", "fp8": "read:fp8e4m3/rec:fp32",
                       "fp16": "read:fp16/rec:fp32"},
               "b16b": {"bf16": "read:bf16/rec:fp32", "fp8": "read:fp8e4m3/rec:fp32"},
               "fp8step": {"fp8": "read:fp8e4m3/rec:fp32"},
               "f16c": {"fp16": "read:fp16/rec:fp32"},
               "lean": {"nvfp4": "read:nvfp4/rec:fp16+sr"},
               "rtiles": {"nvfp4": "read:nvfp4/rec:fp16+sr"},
               "leanheads": {"nvfp4": "read:nvfp4/rec:fp16+sr"},
               "idot": {"nvfp4": "read:nvfp4/rec:fp16+sr"},
               "idot2": {"nvfp4": "read:nvfp4/rec:fp16+sr"},
               "idotpdl": {"nvfp4": "read:nvfp4/rec:fp16+sr"},
               "glrec": {"nvfp4": "read:nvfp4/rec:fp16+sr"},
               "lean32": {"fp32": "fp32"},
               "glrec2": {"nvfp4": "read:nvfp4/rec:fp16+sr"}}


def geometries(tiny: bool):
    if tiny:
        return [rk.Model("gdn", 2, 4, 2, 16, 64, 4), rk.Model("mamba2", 2, 4, 1, 16, 64, 4)], 2
    return [rk.Model("gdn", 256, 32, 16, 128, 128, 16),
            rk.Model("mamba2", 256, 128, 1, 64, 128, 16)], 8


# --set NAME: (step candidates, verify candidates); "all" takes STEP_/VERIFY_CANDIDATES
CANDIDATE_SETS = {"tf32": (TF32_STEP_CANDIDATES, TF32_VERIFY_CANDIDATES),
                  "prefetch": (PREFETCH_STEP_CANDIDATES, PREFETCH_VERIFY_CANDIDATES),
                  "verify2": (VERIFY2_STEP_CANDIDATES, VERIFY2_VERIFY_CANDIDATES),
                  "keys": (KEYS_STEP_CANDIDATES, []),
                  "shared": (SHARED_STEP_CANDIDATES, SHARED_VERIFY_CANDIDATES),
                  "verify3": ([_D], VERIFY3_VERIFY_CANDIDATES),
                  "lut": (LUT_STEP_CANDIDATES, LUT_VERIFY_CANDIDATES),
                  "lut2": (LUT2_STEP_CANDIDATES, LUT2_VERIFY_CANDIDATES),
                  "readpass": (READPASS_STEP_CANDIDATES, []),
                  "half": (HALF_STEP_CANDIDATES, HALF_VERIFY_CANDIDATES),
                  "f16": (F16_STEP_CANDIDATES, F16_VERIFY_CANDIDATES),
                  "f16split": (F16SPLIT_STEP_CANDIDATES, []),
                  "pdl": (PDL_STEP_CANDIDATES, PDL_VERIFY_CANDIDATES),
                  "verifyrp": ([], VERIFYRP_VERIFY_CANDIDATES),
                  "verify4": ([], VERIFY4_VERIFY_CANDIDATES),
                  "step5": (STEP5_STEP_CANDIDATES, []),
                  "verify5": ([], VERIFY5_VERIFY_CANDIDATES),
                  "verify6": ([], VERIFY6_VERIFY_CANDIDATES),
                  "late": (LATE_STEP_CANDIDATES, LATE_VERIFY_CANDIDATES),
                  "nx8": ([], NX8_VERIFY_CANDIDATES),
                  "split": ([], SPLIT_VERIFY_CANDIDATES),
                  "fold": ([], FOLD_VERIFY_CANDIDATES),
                  "fold2": ([], FOLD2_VERIFY_CANDIDATES),
                  "b16": (B16_STEP_CANDIDATES, B16_VERIFY_CANDIDATES),
                  "b16b": ([], B16B_VERIFY_CANDIDATES),
                  "fp8step": (FP8STEP_STEP_CANDIDATES, []),
                  "f16c": (F16C_STEP_CANDIDATES, F16C_VERIFY_CANDIDATES),
                  "lean": (LEAN_STEP_CANDIDATES, []),
                  "lrec": (LREC_STEP_CANDIDATES, []),
                  "rtiles": (RTILES_STEP_CANDIDATES, []),
                  "leanheads": (LEANHEADS_STEP_CANDIDATES, []),
                  "idot": (IDOT_STEP_CANDIDATES, []),
                  "idot2": (IDOT2_STEP_CANDIDATES, []),
                  "idotpdl": (IDOTPDL_STEP_CANDIDATES, []),
                  "glrec": (GLREC_STEP_CANDIDATES, []),
                  "lean32": (LEAN32_STEP_CANDIDATES, []),
                  "glrec2": (GLREC2_STEP_CANDIDATES, []),
                  "lout": (LOUT_STEP_CANDIDATES, []),
                  "one": (ONE_STEP_CANDIDATES, []),
                  "iout": (IOUT_STEP_CANDIDATES, [])}


def cases(M, T):
    """(case name, candidate list, h): step at h = 7, verify at h = 0 and h = L - T."""
    hs = min(7, M.L - 2)
    step, ver = CANDIDATE_SETS.get(CANDIDATE_SET, (STEP_CANDIDATES, VERIFY_CANDIDATES))
    return [("step", step, hs), ("verify", ver, 0), ("verify", ver, M.L - T)]


def cfg_label(c) -> str:
    """``block_v/num_warps/k_chunk/num_stages/use_dot/...`` (use_dot 0, 1 or tf32x3; a field
    left to the wrapper's default: -; a read-pass tile: its block_v x num_warps)."""
    return "/".join("-" if v is None else v if isinstance(v, str) else
                    "x".join(map(str, v)) if isinstance(v, tuple) else str(int(v)) for v in c)


def cfg_dict(c):
    """The fields a candidate sets (None: left to the wrapper's default)."""
    return {k: v for k, v in zip(KEYS[:len(c)], c, strict=True) if v is not None}


def skip(M, c, fmt):
    if len(c) > 13 and c[13] and len(c[13]) > 2 and c[13][2] in ("lean_out", "lean_one") and (
            fmt != "fp32" or M.V % c[13][0]):
        return True  # the records work in the lean FP32 read pass: FP32 copies, tiles in a head
    if len(c) > 13 and c[13] and len(c[13]) > 2 and c[13][2] in ("idot_one", "idot_out") and (
            fmt != "nvfp4" or M.V % c[13][0]):
        return True  # the nvfp4 step in one launch: nvfp4 copies, tiles in a head
    if (len(c) > 19 and c[19] is not None and M.gdn
            and CANDIDATE_SET not in ("glrec", "glrec2", "lean32")):
        return True  # lean_records: Mamba-2's step (GDN's in --set glrec, glrec2, lean32)
    if CANDIDATE_SET in ("glrec", "glrec2") and c is not _P and not M.gdn:
        return True  # GDN's rows
    if CANDIDATE_SET == "lrec" and c is not _P and M.gdn:
        return True
    if CANDIDATE_SET == "lrec" and c is not _P and fmt != "nvfp4":
        return True  # after the nvfp4 step's lean read pass
    if CANDIDATE_SET == "rtiles" and c is not _P and (c[13] == _GDN_RP) != M.gdn:
        return True  # GDN's rows keep its read pass, Mamba-2's the lean one (or a capped one)
    if CANDIDATE_SET == "b16b" and (len(c) == 16 if M.gdn else len(c) == 5 or fmt == "bf16"):
        return True  # GDN: the defaults and the 5-field row; Mamba-2: the rest, from fp8
    if len(c) > 4 and c[4] == "bf16x3" and fmt not in ("bf16", "fp8"):
        return True  # bfloat16 products of exact values: bf16 and fp8 read copies only
    if CANDIDATE_SET == "fold2" and not M.gdn:
        return True  # GDN's verify only
    if len(c) > 18 and c[18] and not M.gdn:
        return True  # fold_x: GDN's matrix form
    if CANDIDATE_SET == "fold" and c is not _P and M.gdn == (len(c) == 16):
        return True  # the 16-field rows (FMA small products) are Mamba-2's, the rest GDN's
    if len(c) > 2 and c[2] is not None and c[2] < 32 and fmt == "nvfp4":
        return True  # chunks of 16 columns: unblocked copies only
    if len(c) > 17 and c[17] and not M.gdn:
        return True  # split_x: GDN's matrix form
    if CANDIDATE_SET == "nx8" and (M.gdn or (fmt == "nvfp4" and any(v is not None for v in c))):
        return True  # only Mamba-2's X has fewer than 16 columns (its nvfp4 default: f16x3)
    if len(c) > 16 and c[16] and fmt == "nvfp4":
        return True  # late_sum: unblocked copies only (a blocked one ignores it)
    if len(c) > 14 and c[14] and DEV != "cuda":
        return True  # programmatic dependent launch: CUDA only (refused by the interpreter)
    if len(c) > 12 and c[12] is not None and fmt != "nvfp4":
        return True  # the E2M1 decoder: only an nvfp4 read copy decodes E2M1 codes
    if len(c) > 4 and c[4] == "f16x3" and fmt not in ("nvfp4", "fp16"):
        return True  # float16 products of exact values: nvfp4 and fp16 read copies only
    if len(c) > 13 and c[13] and M.V >= 64 and c[13][0] > M.V * (
            M.H // M.G if len(c[13]) > 2 and c[13][2] in rec.LEAN_FORMS else 1):
        return True  # a read-pass tile larger than its rows (the lean one: a key group's
        # heads): same work, masked
    if len(c) > 7 and c[7] and not (M.gdn and fmt == "fp32"):
        return True  # fusing needs A is R (the fp32 policy) and GDN's recompute path
    if len(c) > 8 and c[8] is False and (M.gdn or fmt != "fp32"):
        return True  # the skip changes only Mamba-2 under a single checkpoint
    if len(c) > 9 and c[9] is not None and not M.gdn:
        return True  # anchor_block_v: GDN's anchor launch
    if not M.gdn and (len(c) == 6 or (len(c) > 6 and (c[5] or c[6] == "doubling"))):
        return True  # prefetch and the inverse's form change only GDN's solve
    # value tile larger than the value dim: same work, masked
    return M.V >= 64 and c[0] is not None and c[0] > M.V


def op(M, case, st, h, cfg):
    """The timed operation on input set ``st``: returns its outputs (step: o and the new
    correction row source ring; verify: o (and uR))."""
    r = st["ring"]
    hv = torch.full((M.B,), h, dtype=torch.int64, device=DEV)
    if case == "step":
        return dc.run_step(M, st, hv, **cfg)
    if M.gdn:
        return kr.gdn_verify_kernel(st["R"], st["A"], r["la"], r["beta"], r["v"], r["k"],
                                    st["qT"], r["uR"], hv, M.L, **cfg)
    cfg = {k: v for k, v in cfg.items() if k not in ("fuse_shared_anchor", "anchor_block_v")}
    # (GDN only; skip() drops the Mamba-2 rows that set them)
    return kr.mamba2_verify_kernel(st["R"], st["A"], r["la"], r["v"], r["k"], st["qT"], hv, M.L,
                                   **cfg)


def reference(M, case, st, h, s):
    """Torch reference on the first ``s`` sequences (after one kernel step, so the ring holds
    the appended record; the append is idempotent)."""
    r = {n: t[:s] for n, t in st["ring"].items()}
    R, A = dc.deq(dc.sub(st["R"], s)), dc.deq(dc.sub(st["A"], s))
    hv = torch.full((s,), h, dtype=torch.int64, device=DEV)
    if case == "step":
        J = h + 1
        if M.gdn:
            o, uR = gdn_step_output(R, r["la"][:, :J], r["beta"][:, :J], r["v"][:, :J],
                                    r["k"][:, :J], st["q"][:s], r["uR"][:, :J], hv + 1)
            return {"output": o, "u_new": uR[:, h]}
        return {"output": mamba2_step_output(R, r["la"][:, :J], r["v"][:, :J], r["k"][:, :J],
                                             st["q"][:s], hv + 1)}
    if M.gdn:
        o, uR = gdn_verify(R, A, r["la"], r["beta"], r["v"], r["k"], st["qT"][:s], r["uR"], hv,
                           M.L)
        return {"output": o, "corrections": uR}
    return {"output": mamba2_verify(R, A, r["la"], r["v"], r["k"], st["qT"][:s], hv, M.L)}


def got_parts(M, case, out, st, h, s):
    if case == "step":
        res = {"output": out[:s]}
        if M.gdn:
            res["u_new"] = st["ring"]["uR"][:s, h]
        return res
    if M.gdn:
        return {"output": out[0][:s], "corrections": out[1][:s]}
    return {"output": out[:s]}


def check(M, case, st, h, cfg, ref, s):
    out = op(M, case, st, h, cfg)
    res = {k: dc.stats(v, ref[k]) for k, v in got_parts(M, case, out, st, h, s).items()}
    return {"passed": all(v["passed"] for v in res.values()),
            "mismatch": sum(v["mismatch"] for v in res.values()),
            "max_abs": max(v["max_abs"] for v in res.values())}


def tasks(models, T):
    """Every (model index, format, case, h, config), in a fixed order."""
    out = []
    for mi, M in enumerate(models):
        for fmt in POLICIES:
            for case, cands, h in cases(M, T):
                for c in cands:
                    if not skip(M, c, fmt):
                        out.append((mi, fmt, case, h, c))
    return out


def warm_worker(args, models, T, part):
    """Compile (and run once) this worker's share of the configurations (Triton's disk cache
    then serves the timing process)."""
    i, n = part
    todo = tasks(models, T)[i::n]
    sets = {}
    for mi, fmt, case, h, c in todo:
        M = models[mi]
        key = (mi, fmt)
        if key not in sets:
            gen = torch.Generator(device=DEV).manual_seed(dc.SEED + mi)
            sets = {key: dc.make_set(M, gen, StatePolicy.parse(POLICIES[fmt]), T, False)}
        op(M, case, sets[key], h, cfg_dict(c))
    if DEV == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, CPU interpreter")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ref-seqs", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=8, help="compile workers (0: none)")
    ap.add_argument("--set", default="all",
                    choices=("all", *CANDIDATE_SETS),
                    help="candidate lists: all (STEP_/VERIFY_CANDIDATES), tf32 (the tensor-core "
                         "use_dot='tf32x3' configurations against the current defaults), "
                         "prefetch (GDN's solve with v/beta prefetched, against the defaults), "
                         "verify2 (verify's matrix forms, solve='inverse'/'doubling', against "
                         "the defaults, plus the default steps) or keys (the step with the "
                         "record keys loaded before C, keys_first, against the defaults) or "
                         "shared (the products with the record keys once per sequence and key "
                         "group, shared_products, against the defaults) or verify3 (verify "
                         "launches with shared products: whole-K chunks, tensor cores, tiles) "
                         "or lut (nvfp4 read copy: the E2M1 decoders, e2m1_decode, and the "
                         "step's tiles with the table lookup) or lut2 (narrower tiles) or "
                         "readpass (the step's products with R in a launch of their own, "
                         "read_pass, with wide records tiles) or half (nvfp4: the packed-half "
                         "E2M1 decoder against the defaults) or f16 (nvfp4: C's products on "
                         "float16 tensor cores, use_dot='f16x3', in the step's read pass and "
                         "verify) or f16split (the step's read pass with f16x3 and X split once "
                         "per sequence and key group) or pdl (programmatic dependent launch "
                         "between one call's launches, off and on, step and verify) or "
                         "verifyrp (verify with its products with the read copy in a read "
                         "pass of its own) or verify4 (verify's tiles again, tf32x3 and FP32 "
                         "reductions) or step5 (the step without the products launch) or verify5 "
                         "(verify on 1- and 2-warp tiles, tf32x3 and f16x3) or verify6 (around "
                         "verify5's winners) or late (C X by element-wise sums, late_sum) or "
                         "nx8 (Mamba-2's verify with X padded to 8 columns) or split (GDN's "
                         "verify with X in two tiles, split_x) or fold (GDN's verify with its "
                         "coefficients folded into X, fold_x, and K in chunks of 16) or "
                         "fold2 (fold_x='launch': the coefficients in a launch of their own) "
                         "or b16 (bf16 and fp8e4m3 read copies: C's products on bfloat16 "
                         "tensor cores, use_dot='bf16x3', against the defaults) or b16b "
                         "(GDN's bf16x3 default against tf32x3; Mamba-2's verify from fp8 on "
                         "2-warp tiles) or fp8step (the step from an fp8e4m3 copy: tiles, "
                         "read pass) or f16c (fp16 read copies: C's products on float16 "
                         "tensor cores, use_dot='f16x3', against the defaults) or lean (the "
                         "nvfp4 step's read pass in the lean form, read_pass=(block_v, "
                         "num_warps, 'lean'), against the default) or rtiles (the nvfp4 "
                         "step's records launch on other tiles; Mamba-2's lean read pass with "
                         "a register cap) or lrec (Mamba-2's step with the lean records "
                         "launch, lean_records)")
    ap.add_argument("--timing", default="eager", choices=dc.TIMING_MODES,
                    help="decode.timer's mode: eager (Python launches per call), graph "
                         "(CUDA-graph replays: the kernels' GPU time) or both")
    ap.add_argument("--warm", default=None, help=argparse.SUPPRESS)  # worker: "i/n"
    args = ap.parse_args(argv)
    dc.TIMING = args.timing
    global CANDIDATE_SET, POLICIES
    CANDIDATE_SET = args.set
    POLICIES = POLICY_SETS.get(args.set, POLICIES)
    models, T = geometries(args.tiny)
    if args.tiny:  # the interpreter: every path once, timings meaningless
        args.reps, args.pool, args.warmup = min(args.reps, 2), min(args.pool, 2), 0
    if args.warm:
        i, n = (int(x) for x in args.warm.split("/"))
        warm_worker(args, models, T, (i, n))
        return 0
    t0 = time.time()
    log = print
    if args.jobs > 0 and DEV == "cuda":
        base = [sys.executable, os.path.abspath(__file__), "--set", args.set] + (
            ["--tiny"] if args.tiny else [])
        procs = [subprocess.Popen(base + ["--warm", f"{i}/{args.jobs}"])
                 for i in range(args.jobs)]
        rcs = [p.wait() for p in procs]
        log(f"compiled in {args.jobs} workers: {time.time() - t0:.0f} s, rc {rcs}")
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (interpreter)",
              "triton": __import__("triton").__version__, "torch": torch.__version__,
              "defaults": {n: getattr(rec, n) for n in (
                  "STEP_CONFIG", "GDN_STEP_WIDE_CONFIG", "GDN_STEP_F32_CONFIG",
                  "GDN_STEP_BLOCKED_CONFIG",
                  "GDN_STEP_FP4_CONFIG", "MAMBA2_STEP_WIDE_CONFIG", "MAMBA2_STEP_FP4_CONFIG",
                  "MAMBA2_STEP_NVFP4_CONFIG", "GDN_STEP_NVFP4_CONFIG", "VERIFY_CONFIG",
                  "GDN_VERIFY_CONFIG",
                  "GDN_VERIFY_BLOCKED_CONFIG", "MAMBA2_VERIFY_BLOCKED_CONFIG",
                  "GDN_VERIFY_NVFP4_CONFIG", "MAMBA2_VERIFY_NVFP4_CONFIG",
                  "GDN_VERIFY_B16_CONFIG", "MAMBA2_VERIFY_FP8_CONFIG", "GDN_STEP_FP8_CONFIG",
                  "MAMBA2_VERIFY_WIDE_CONFIG")},
              "keys": list(KEYS), "reps": args.reps, "pool": args.pool, "rows": []}
    l2 = dc.l2_bytes()
    for mi, M in enumerate(models):
        for fmt, pol in POLICIES.items():
            gen = torch.Generator(device=DEV).manual_seed(dc.SEED + mi)
            policy = StatePolicy.parse(pol)
            probe = dc.make_set(M, gen, policy, T, False)
            n = max(args.pool, -(-dc.POOL_L2_MULTIPLE * l2 // dc.set_bytes(probe)))
            n = args.pool if args.tiny else n
            pool = [probe] + [dc.make_set(M, gen, policy, T, False) for _ in range(n - 1)]
            for case, cands, h in cases(M, T):
                if not cands:  # a set that times the step only
                    continue
                op(M, case, probe, h, cfg_dict(cands[0]))  # step: the ring holds the record
                ref = reference(M, case, probe, h, min(args.ref_seqs, M.B))
                for c in cands:
                    if skip(M, c, fmt):
                        continue
                    cfg = cfg_dict(c)
                    row = {"model": M.name, "B": M.B, "read": fmt, "case": case, "h": h,
                           "config": cfg}
                    try:
                        row["check"] = check(M, case, probe, h, cfg, ref,
                                             min(args.ref_seqs, M.B))
                        row.update(dc.timer(lambda i, cfg=cfg, p=pool: op(M, case, p[i], h, cfg),
                                            len(pool), args.reps, args.warmup))
                    except Exception as e:  # a configuration that does not compile / run
                        row["error"] = f"{type(e).__name__}: {e}"[:500]
                    result["rows"].append(row)
                    t = row.get("median_us")
                    log(f"{M.name:7s} {fmt:6s} {case:7s} h={h:2d} "
                        f"{cfg_label(c):16s} "
                        + (f"{t:9.1f} us" if t is not None else row.get("error", "")[:80])
                        + ("" if row.get("check", {}).get("passed", False)
                           else f"  CHECK FAILED {row.get('check')}"))
            del pool, probe
            if DEV == "cuda":
                torch.cuda.empty_cache()
    best = {}
    for row in result["rows"]:
        if "median_us" not in row or not row["check"]["passed"]:
            continue
        key = f"{row['model']}|{row['read']}|{row['case']}|h{row['h']}"
        if key not in best or row["median_us"] < best[key]["median_us"]:
            best[key] = {"median_us": row["median_us"], "config": row["config"]}
    result["best"] = best
    result["all_checks_passed"] = all(r.get("check", {}).get("passed", False)
                                      for r in result["rows"])
    result["wall_s"] = time.time() - t0
    log("\nbest per case (median us; the fields the configuration sets, the rest are the "
        "wrapper's defaults):")
    for k, v in best.items():
        log(f"  {k:28s} {v['median_us']:9.1f}  "
            + ", ".join(f"{n}={x}" for n, x in v["config"].items()))
    log(f"all checks passed: {result['all_checks_passed']}; wall {result['wall_s']:.0f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["all_checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

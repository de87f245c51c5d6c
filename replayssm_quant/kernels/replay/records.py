"""The records kernel: everything that reads a checkpoint plus buffer records in output-only
form -- decode step (with the ring append), verify, and the GDN correction solve.

``_records_kernel``, one program per (sequence, head, tile of ``BV`` value rows):

* outputs ``o_p = gamma_{1:p} (C q) + sum_{j<=p} gamma_{j+1:p} (k_j . q) w_j`` for ``TQ`` query
  positions ``p = os .. os + TQ - 1`` (decode step: ``TQ = 1``; verify: ``T``);
* (GDN) the unit lower-triangular solve for the corrections of rows ``ss .. n - 1``
  ``u_p = beta_p (v_p - gamma_{1:p} C k_p) - sum_{i<p} beta_p gamma_{i+1:p} (k_i . k_p) u_i``
  with the rows before ``ss`` taken from the ring (the cached read-path corrections) (step: one
  row against R; verify: T rows against R; flush: every row against the anchor A);
* (decode step) the append: the new record is written into the ring in the same launch.

Rows are separable along the value axis (``C k``, ``C q`` and every ``u``/``w`` are per value
row), so a program never needs another program's rows and S is never formed. With a read pass
(``records_outputs(read_pass=...)``, the decode step's default from E2M1 copies) the same
kernel is launched twice: first with ``YOUT`` (only ``Y = C X`` of its rows, stored), then with
``YPRE`` (Y loaded instead of streaming C, and everything below). A program first
issues its record loads (``la``, ``w`` of its rows), then streams C along K in chunks of ``KC``
columns (``tl.range`` with ``num_stages``) and forms ``Y = C X`` for all the vectors it needs at
once: X holds the k of the rows it solves (GDN) and the queries (``[BV, NX]``; ``tl.dot`` with
``input_precision=PREC`` (FP32 FMA or tf32x3) for verify / the flush solve, per-vector
reductions for the step; from nvfp4 and fp16, ``use_dot="f16x3"``: float16 tensor cores on
exact float16 values of C and X in three float16 terms, the verify default from nvfp4 and
GDN's from fp16; from bf16 and fp8, ``"bf16x3"``: the same on bfloat16 tensor cores, GDN's
verify default from them), then ``Z = K X``
over the record keys (or, with ``shared_products``, reads ``Z`` from a small launch before it,
``_key_products_kernel``, that forms it once per (sequence, key group)); the solve and the
outputs then work on these small products. Codes are decoded by the decoders of ``codec``
(``_e2m1_value``, ``_e4m3_value``, ``_e5m2_value``; on CUDA E2M1 pairs by the inline-PTX
table lookup or packed-half decoders); blocked formats are read as scaling blocks (FP4: the
even and the odd element of each block, as the nibbles hold them) with the block scale applied
to each block's partial sum (dot path: to each element) and the matrix scale (fp8, nvfp4)
applied to ``Y`` after the sum (an output-only reassociation). Verify's draft on the flush
slot is a second launch over the anchor whose programs return unless ``rows == window``
(checked on the device; no host synchronisation); it is not made when the anchor is the read
copy and would recompute the first launch's values (``skip_shared_anchor``).

``solve="inverse"`` / ``"doubling"`` (launch option; ``records_outputs`` defaults to
``"substitution"``, the verify wrappers' configurations to ``"inverse"``): after the
products, the GDN system is inverted once per program on ``[NX, NX]`` scalars and applied to
the value rows, and the outputs of all queries are formed, as small FP32 products
(``_matrix_outputs``, ``_unit_upper_inverse``).

Torch references: :func:`replayssm_quant.replay.mamba2.mamba2_step_output`,
:func:`~replayssm_quant.replay.mamba2.mamba2_verify`,
:func:`replayssm_quant.replay.gdn.gdn_step_output`, :func:`~replayssm_quant.replay.gdn.gdn_verify`,
:func:`replayssm_quant.replay.core.solve_corrections`; the state-object entry points at the end
have the signatures of ``replay.mamba2.mamba2_state_*`` / ``replay.gdn.gdn_state_*``.
Tests: ``tests/test_replay_kernels.py``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...checkpoints import Checkpoints, length_mask
from ...packed import PackedTensor
from ...philox import as_int
from .codec import (KERNELS_INTERPRETED, _assert_ranges, _check_devices, _check_f32,
                    _check_index, _kind,
                    _check_maxnreg, _check_records, _maxnreg_launch,
                    _check_supported, _decode_code, _decode_consts, _e2m1_pairs_half,
                    _e2m1_dot8_1, _e2m1_dot8_2, _e2m1_idot16_1, _e2m1_idot16_2,
                    _e2m1_idot16_int,
                    _e2m1_pairs_half16, _e2m1_pairs_lut, _e2m1_value,
                    _e4m3_value, _e4m3_value_cvt, _e4m3_value_f16, _e5m2_value,
                    _e8m0_value, _K_FLOAT, _K_NVFP4,
                    _stored_args,
                    E2M1_HALF_SCALE)

# Launch configuration of the records kernel (value rows per program, warps, K chunk streamed
# per loop iteration, software-pipeline stages, tl.dot for the C X products or per-column
# reductions). ``benchmarks/records_tune.py`` sweeps them on the device; the defaults are the
# step / verify choices of the last sweep (docs/kernels-replay.md). ``DEFAULT_BV`` /
# ``DEFAULT_WARPS`` are kept for the callers that pass them (GDN flush corrections).
DEFAULT_BV = 64
DEFAULT_WARPS = 4
# Forms of a separate read pass (records_outputs(read_pass=(block_v, num_warps, form))):
# "records" (the records kernel's YOUT path: any copy, any columns), "lean"
# (_nvfp4_read_kernel for nvfp4 copies, _f32_read_kernel for FP32 ones: at most two columns of
# X, as a decode step has) and "lean_out" (FP32 copies, a decode step: _f32_step_kernel, the
# lean read pass that also does the records work on its rows, so no records launch follows)
# and "lean_one" ("lean_out" that also forms its own products with the record keys, so no
# products launch comes before it: the decode step in one launch); "idot_one" (nvfp4 copies,
# a decode step: _nvfp4_step_kernel, "idot"'s read pass with X's integers formed in the
# program, then "lean_one"'s products with the keys and records work: one launch);
# "idot_out" (nvfp4 copies, a decode step: _nvfp4_step_kernel with "idot"'s X integers'
# launch and the products launch before it, the records work on its rows: no records launch,
# as "lean_out" from FP32).
READ_FORMS = ("records", "lean", "idot", "idot_pdl", "lean_out", "lean_one", "idot_one",
              "idot_out", "idot_in")
# the lean forms: Y = R X and nothing else, in a launch of its own ("lean" from nvfp4 or FP32;
# "idot": _nvfp4_read_kernel's integer-dot form, IDOT; "idot_pdl": the same with the read pass
# dependent (PDL) on X's integers' launch and the products launch after it, so that X's
# integers overlap the read pass's first loads; "idot_in": the same read pass forming X's
# integers itself, so no launch of their own), and "lean_out", "lean_one" and "idot_one"
# (above)
LEAN_FORMS = ("lean", "idot", "idot_pdl", "lean_out", "lean_one", "idot_one", "idot_out",
              "idot_in")
# the read-pass forms that do the records work in the read pass: FP32 copies
# (_f32_step_kernel) and nvfp4 ones (_nvfp4_step_kernel)
F32_STEP_FORMS = ("lean_out", "lean_one")
NVFP4_STEP_FORMS = ("idot_one", "idot_out")
STEP_FORMS = F32_STEP_FORMS + NVFP4_STEP_FORMS
IDOT_FORMS = ("idot", "idot_pdl", "idot_in")
# Launch defaults: the fastest of benchmarks/records_tune.py on the H200 at B = 256 (results
# benchmarks/results/records_tune_h200.json and records_tune_tf32_h200.json,
# docs/kernels-replay.md): the whole key dim as one chunk for the step (until the sixth
# session GDN reading an FP32/half copy took chunks of 32, 3 stages: 230 vs 255 us then);
# verify: tensor-core products (tf32x3; f16x3 from an nvfp4 copy and GDN's from fp16; GDN's
# bf16x3 from bf16 and fp8 copies; details below).
# shared_products (2026-12-01, sixth session): the products with the record keys once per
# (sequence, key group) in a small launch before the step; GPU time per step at B = 256, h = 7
# (torch.profiler, benchmarks/results/step_shared_products_h200.json): GDN fp32 226 -> 15 +
# 172 us, GDN nvfp4 283 -> 11 + 187 us, Mamba-2 fp32 314 -> 2 + 295 us, Mamba-2 nvfp4 253 ->
# 2 + 209 us. With it, the FP32-read steps take other tiles (records_tune --set shared
# --timing both, records_tune_shared_graph_h200.json, CUDA-graph medians at h = 7): GDN one
# 128-row tile, whole K (183 against 193 us with the former 64-row, 32-column chunks);
# Mamba-2 K in two chunks, two stages (281 against 302 us).
# GDN from an FP32/half copy (2026-12-02, tenth session, records_tune --set readpass --timing
# graph at ce45531, records_tune_readpass2_h200.json, B = 256, h = 7): one launch on 64-row
# tiles with 2 warps, 170.8 us (the former 128 x 4 tile 207.1 us; with a read pass 175.6 us).
STEP_CONFIG = dict(block_v=64, num_warps=4, k_chunk=128, num_stages=1, use_dot=False,
                   shared_products=True)
# Without programmatic dependent launch (pdl=False): with it this step (the products launch,
# then one records launch that streams C) was slower, 171.6 -> 193.6 us (records_tune --set
# pdl --timing graph, records_tune_pdl_h200.json, 2026-12-03, B = 256, h = 7), where the
# other steps with a products launch gained 2.1-2.6 us (GDN nvfp4 with its read pass, Mamba-2
# fp32 and nvfp4) and Mamba-2's verify 2.4-4.2 us; GDN's verify has no products launch (no
# shared_products) and no read pass, so PDL does not apply to it, except from an nvfp4 copy
# since 2026-12-03 (seventeenth session): its coefficients launch (fold_x="launch") comes
# before a dependent records launch, timed with PDL on (the default).
GDN_STEP_WIDE_CONFIG = dict(block_v=64, num_warps=2, k_chunk=128, num_stages=1, use_dot=False,
                            shared_products=True, pdl=False)
MAMBA2_STEP_WIDE_CONFIG = dict(STEP_CONFIG, k_chunk=64, num_stages=2)
# GDN from an mx/nvfp4 copy before the E2M1 table lookup (kept for mxfp8, whose E4M3 codes the
# lookup does not touch and whose tiles were never swept on their own): the solved row's v and
# beta loaded before the solve (prefetch; records_tune --set prefetch,
# records_tune_prefetch_h200.json: 293 -> 279 us at B = 256 from nvfp4). The record keys
# before C (keys_first; records_tune --set keys) is no longer set: since shared_products (sixth
# session) the step reads Z from the products launch and loads no record keys.
GDN_STEP_BLOCKED_CONFIG = dict(STEP_CONFIG, prefetch=True)
# From an E2M1 copy (nvfp4, mxfp4) with the table lookup (2026-12-02, records_tune --set lut /
# lut2 --timing both, records_tune_lut_h200.json / records_tune_lut2_h200.json, nvfp4, B = 256,
# h = 7): both models take 32-row tiles with 2 warps and GDN no prefetch: GDN 196 -> 149-151
# us, Mamba-2 170 -> 157 us (with the integer decoder and the former tiles: 201 / 214 us).
# Since the tenth session (2026-12-02, records_tune --set readpass at ce45531,
# records_tune_readpass2_h200.json) both take the read pass: the products with R in a launch of
# 32-row tiles with 2 warps, the records launch on 128 (GDN) / 64 (Mamba-2) rows with 2 warps:
# GDN 138.5 -> 119.6 us, Mamba-2 163.6 -> 150.3 us (one launch at the former tiles -> read pass).
# Since 2026-12-04 (twenty-third / twenty-fourth sessions, benchmarks/records_maxnreg.py,
# records_maxnreg_h200.json and records_maxnreg_mxfp4_h200.json, B = 256, h = 7) the read pass
# has its registers capped at 96 per thread (it takes 112 uncapped: 9 two-warp programs per
# SM, 10 capped): nvfp4 115.1 -> 108.7 us, mxfp4 109.6 -> 102.3 us; the same bits.
GDN_STEP_FP4_CONFIG = dict(STEP_CONFIG, block_v=128, num_warps=2, read_pass=(32, 2, "records", 96))
# GDN from an fp8 copy since 2026-12-03 (eighteenth session, records_tune --set fp8step --timing
# graph, records_tune_fp8step_h200.json, B = 256, h = 7; never swept before): the read pass on
# 32-row tiles with one warp, the records launch on 128 x 2: 156.2 -> 136.8 us (one launch on
# any tile 146.5 us at best). Mamba-2's fp8 step keeps STEP_CONFIG (221.1 us; 220.3 at best).
GDN_STEP_FP8_CONFIG = dict(STEP_CONFIG, block_v=128, num_warps=2, read_pass=(32, 1))
MAMBA2_STEP_FP4_CONFIG = dict(STEP_CONFIG, block_v=64, num_warps=2, read_pass=(32, 2))
# Mamba-2 from an nvfp4 copy since 2026-12-04 (twenty-first session, records_tune --set lean
# --timing graph, records_tune_lean_h200.json, B = 256, h = 7): the lean read pass
# (_nvfp4_read_kernel) on one 64-row tile per matrix with one warp: 147.5 -> 125.2 us. GDN's
# best lean tile (64 x 1) was 113.4 against its default's 115.4 us, within a run's spread:
# GDN keeps the records kernel's read pass.
# Since the twenty-fourth session (records_tune --set lrec --timing graph,
# records_tune_lrec_h200.json / records_tune_lrec2_h200.json, B = 256, h = 7): the records
# launch after the lean read pass is the lean one (_step_out_kernel), one program per
# (sequence, value head) on one warp, started as the read pass's last wave starts (early):
# 125.9 / 125.2 -> 112.6 / 112.4 us, early 110.4 us (2 or more heads per program, or more
# warps, 114.0-253.6 us).
# Since the twenty-fifth session (records_tune --set idot --timing graph,
# records_tune_idot_h200.json, B = 256, h = 7): the read pass's integer-dot form on 128-row
# tiles (two value heads; its programs tile a key group's rows since then) with one warp:
# 116.9 -> 104.7 us (the FMA-chain form on that tile 113.2 us); 98.9 us after the form's later
# changes (records_tune_idot3_h200.json; decode.py's window mean at 37526c6: 100.9 us).
# Since the twenty-sixth session (records_tune --set idotpdl --timing graph,
# records_tune_idotpdl_h200.json, B = 256, h = 7): X's integers overlapping the read pass's
# first loads (form "idot_pdl"): 98.3 -> 95.2 us on the same tile (256 x 2: 95.5). (early
# changes nothing after "idot_pdl"; kept for callers that pass another form.)
MAMBA2_STEP_NVFP4_CONFIG = dict(MAMBA2_STEP_FP4_CONFIG, read_pass=(128, 1, "idot_pdl"),
                                lean_records=(1, 1, True))
# GDN from an nvfp4 copy: until the twenty-fifth session GDN_STEP_FP4_CONFIG (its read pass
# capped at 96 registers since the twenty-third session; mxfp4's since the twenty-fourth);
# since then the lean read pass's integer-dot form on 64-row tiles with one warp, the records
# launch as before: 108.8 -> 97.3 us (records_tune_idot_h200.json; the FMA-chain lean form on
# that tile 109.6); 88.9 us after the form's later changes (records_tune_idot3_h200.json;
# decode.py's window mean at 37526c6: 88.0 us). Mamba-2's mxfp4 step gains nothing from a cap (135.6 us uncapped,
# 135.2-142.0 at 64-128; records_maxnreg_mxfp4_h200.json).
# Since the twenty-sixth session (records_tune --set glrec --timing graph,
# records_tune_glrec_h200.json, B = 256, h = 7): the lean records launch (_step_out_kernel,
# one program per (sequence, value head) on one warp, started as the read pass's last wave
# starts): 89.4 -> 78.5 us. The 128-row read tiles had become the fastest with the records
# kernel's launch after them (83.9 against 89.5 us at 64 x 1,
# records_tune_idotpdl_h200.json; 84.0 against 89.1 on 466336d's code,
# records_tune_idot2_base_h200.json: the per-block PTX of 37526c6 had moved the best tile);
# records_tune --set glrec2 timed them with the lean records launch (below). "idot_pdl" is
# slower for GDN (85.7 against 83.9 us at 128 x 1; 81.7 with the lean records launch against
# 78.5): its products launch (14 us) then runs after the read pass.
# Twenty-ninth session (records_tune --set glrec2 --timing graph, two runs,
# records_tune_glrec2{,_r2}_bfde448_h200.json, B = 256, h = 7): with the lean records launch
# the 128-row read tiles on one warp take 75.8 / 76.1 us against 78.4-78.6 at 64 x 1 (256 x 2:
# 75.6 / 76.3; the records launch on 2 warps 5.6-6.4 us slower on every tile).
GDN_STEP_NVFP4_CONFIG = dict(GDN_STEP_FP4_CONFIG, read_pass=(128, 1, "idot"),
                             lean_records=(1, 1, True))
# GDN from an FP32 copy since the twenty-sixth session (records_tune --set lean32 --timing
# graph, records_tune_lean32_h200.json, B = 256, h = 7): the lean read pass of FP32 rows
# (_f32_read_kernel) on 32-row tiles with 2 warps, dependent on the products launch (PDL),
# then the lean records launch: 171.5 -> 164.4 us (every tile 164.4-165.8). Mamba-2's FP32
# step keeps its one launch (284.8 us; 289.1-303.6 this way). Half copies keep
# GDN_STEP_WIDE_CONFIG (the lean FP32 read pass reads float32 rows only).
# Since the thirty-second session (2026-12-05), on H100 evidence (no H200 was lent): the
# records work in the lean FP32 read pass (read-pass form "lean_out", 32-row tiles, 1 warp),
# so no records launch follows the products launch and the read pass: records_tune --set lout
# / --set one, B = 256, h = 7, 221.0 / 221.2 -> 217.0 / 216.8 us (records_tune_lout_f5091d7_h100,
# records_tune_one_1dc4f92_h100); decode.py GDN B = 256, fp32 step mean 222.2 -> 215.7 us,
# amortised 1.526x -> 1.566x fla (decode_gdn_lout32x1_1dc4f92_h100). Forming the products with
# the keys in the same launch ("lean_one") lost: 251.6 us at best.
GDN_STEP_F32_CONFIG = dict(GDN_STEP_WIDE_CONFIG, read_pass=(32, 1, "lean_out"), pdl=None)
# GDN_STEP_F32_CONFIG's form needs tiles within a value head; where its tile does not divide
# the head dim V, the step takes the previous default (the lean read pass on tiles that may
# span heads, then the lean records launch; 164.4 us on the H200 at B = 256, h = 7)
GDN_STEP_F32_SPAN_CONFIG = dict(GDN_STEP_WIDE_CONFIG, read_pass=(32, 2, "lean"),
                                lean_records=(1, 1, True), pdl=None)
# Verify (2026-12-01, records_tune --set verify2, records_tune_verify2_h200.json, B = 256, h = 0 /
# h = 8): the matrix form of the solve and the outputs (solve="inverse") in every case. GDN
# 128 rows, tf32x3: 615 / 1335 us from an FP32 copy (forward substitution, 64 rows: 982 /
# 1706) and 796 / 1531 us from nvfp4 (1182 / 1887); Mamba-2 from FP32 with reductions for C X:
# 780 / 786 us (1592 at h = 8 before skip_shared_anchor); from nvfp4 with tf32x3: 1200 / 1517
# us (1580 / 1857). "doubling" and fuse_shared_anchor were slower everywhere.
VERIFY_CONFIG = dict(block_v=64, num_warps=4, k_chunk=32, num_stages=2, use_dot=False,
                     solve="inverse", shared_products=True)
# GDN from an FP32 or half copy since 2026-12-03 (fifteenth session, records_tune --set verify5
# --timing graph, records_tune_verify5_h200.json, B = 256): 128-row tiles with 2 warps, K in
# chunks of 32 (was 4 warps, chunks of 64): h = 0 539.6 -> 405.5 us, h = 8 1255.7 -> 1118.0 us.
# On sm_90 Triton lowers tl.dot to warpgroup MMA (wgmma) only when num_warps is a multiple of
# 4; with 1-2 warps it takes mma.sync on register operands. It needs both: 128 x 2 with chunks
# of 64 was slower (568.5 us). The launch still holds 255 registers (ncu at 42ea31d; spill
# requests halved). Only fp32 and nvfp4 copies were timed: fp8, bf16 and fp16 copies take this
# tile untimed; mx copies keep the former one.
# Since 2026-12-03 (seventeenth session, records_tune --set fold --timing graph,
# records_tune_fold_h200.json, B = 256): K in chunks of 16 with 3 stages (the tf32x3 operand
# tiles a thread holds halve): h = 0 401.8 -> 396.9 us, h = 8 (the re-solving anchor launch,
# split) 832.6 -> 751.6 us. The coefficients folded into X (fold_x) on top were slower here
# (430.2 / 788.4 us; with chunks of 32 395.6 / 828.1), so this copy does not fold.
GDN_VERIFY_CONFIG = dict(block_v=128, num_warps=2, k_chunk=16, num_stages=3, use_dot="tf32x3",
                         solve="inverse")
GDN_VERIFY_BLOCKED_CONFIG = dict(GDN_VERIFY_CONFIG, num_warps=4, k_chunk=64, num_stages=2)
# GDN from a bf16 or fp8 copy since 2026-12-03 (eighteenth session, records_tune --set b16
# --timing graph, records_tune_b16_h200.json, B = 256, h = 0 / h = 8): the FP32 tile with C's
# products on bfloat16 tensor cores (use_dot="bf16x3", the copy's exact values; the FP32 anchor
# launch stays tf32x3): bf16 379.2 / 742.7 -> 334.9 / 696.4 us, fp8e4m3 438.4 / 799.7 ->
# 384.7 / 745.7 us (chunks of 32 with 3 stages: 318.1 / 752.5 from bf16, a worse h = 8; the
# small products in FP32 FMA, 64-row and 4-warp tiles slower). fp16 copies (not exact in
# bfloat16) kept GDN_VERIFY_CONFIG (378.8 / 738.7 us; since the nineteenth session
# GDN_VERIFY_F16_CONFIG, below). The step with it was slower on every
# tile tried (bf16 111.3 -> 198.3-241.2 us: its 2 columns padded to 16).
GDN_VERIFY_B16_CONFIG = dict(GDN_VERIFY_CONFIG, use_dot="bf16x3")
# GDN from an fp16 copy since 2026-12-03 (nineteenth session, records_tune --set f16c --timing
# graph, records_tune_f16c_h200.json, B = 256, h = 0 / h = 8): the FP32 tile with C's products
# on float16 tensor cores (use_dot="f16x3", the copy's values as stored; the FP32 anchor launch
# stays tf32x3): 375.6 / 734.5 -> 341.0 / 700.1 us (chunks of 32 with 3 stages: 325.0 / 756.5,
# a worse h = 8; 64-row tiles and the small products in FP32 FMA slower). Mamba-2's verify and
# both steps from fp16 were slower with it (Mamba-2 verify 294.7 / 556.6 -> 324.5 / 587.1 at
# best, X padded from 8 to 16 columns; steps: GDN 111.1 -> 172.6, Mamba-2 189.7 -> 308.7).
GDN_VERIFY_F16_CONFIG = dict(GDN_VERIFY_CONFIG, use_dot="f16x3")
# Mamba-2's verify with shared_products (its 128 heads share one key group): records_tune
# --set shared --timing both, B = 256, CUDA-graph medians (records_tune_shared_graph_h200.json):
# fp32 790 / 796 -> 577 / 582 us (h = 0 / 8), nvfp4 1228 / 1546 -> 834 / 1071 us; GDN's
# verify (2 value heads per key group) stays without it: h = 0 614 -> 679 us with it (h = 8
# 1357 -> 1228). From an nvfp4/mx copy, whole-K tf32x3 products (records_tune --set verify3,
# records_tune_verify3_h200.json): 837 / 1070 -> 561 / 792 us.
# The E2M1 table lookup slows this tensor-core verify (records_tune --set lut / lut2: h = 0 /
# h = 8 553-557 / 784-789 us with the integer decoder, 676 / 905 us with the lookup), so it
# keeps the integer decoder; GDN's verify is the same with either (794-799 / 1527-1537 us).
MAMBA2_VERIFY_BLOCKED_CONFIG = dict(VERIFY_CONFIG, use_dot="tf32x3", k_chunk=128, num_stages=1,
                                    e2m1_decode="integer")
# From an nvfp4 copy (2026-12-02, eleventh session, records_tune --set f16 --timing graph,
# records_tune_f16_h200.json, B = 256, h = 0 / 8): C's products on float16 tensor cores
# (use_dot="f16x3": exact float16 values of E2M1 x E4M3, X in three float16 terms) with the
# packed-half decoder's float16 pairs: Mamba-2 557 / 789 -> 396 / 628 us (the lookup's
# values converted: 428 / 662), GDN 792 / 1537 -> 774 / 1506 us. Other blocked copies (mx)
# keep the configurations above. The step's read pass with it was slower (GDN 119 -> 145 us
# at best, Mamba-2 149 -> 279 us): on its narrow tiles the per-program split of X costs more
# than the decode and FMAs it replaces; with X split once per (sequence, key group)
# (_x_split_kernel, what a read pass with use_dot="f16x3" now does; records_tune --set f16split,
# records_tune_f16split_h200.json) still slower: GDN 118.7 -> 122.8 us (64 x 2 read tiles),
# Mamba-2 149.6 -> 178.0 us (32 x 1).
# 2026-12-03 (fourteenth session, records_tune --set verify4 --timing graph,
# records_tune_verify4_h200.json, after verify's corrections became the kernel's output): GDN
# from nvfp4 on 64-row tiles with 2 warps and tf32x3 (the E2M1 table lookup) instead of 128 x 4
# f16x3: h = 0 693.0 -> 561.1 us, h = 8 1414.0 -> 1396.7 us. (Then the 128 x 4 FP32 default
# held 255 registers and spilled, 2 blocks per SM; from an FP32 copy 64 x 2 was within 2% at
# h = 0 and slower at h = 8, so it stayed until the fifteenth session, above.)
# Since 2026-12-03 (fifteenth session, records_tune --set verify5): GDN from nvfp4 on
# GDN_VERIFY_CONFIG's 128 x 2 tile with 32-column chunks and f16x3 products (the packed-half
# decoder): h = 0 558.8 -> 410.0 us, h = 8 1392.3 -> 1072.9 us (tf32x3 on that tile: 423.2 /
# 1088.8 us).
# Since 2026-12-03 (seventeenth session, records_tune --set fold, records_tune_fold_h200.json):
# the read-copy launch with the coefficients folded into X (fold_x; the anchor launch stays
# split): h = 0 413.2 -> 381.6 us, h = 8 800.1 -> 770.6 us. (Chunks of 16 need an unblocked
# copy: this one keeps 32.) Then the coefficients in a launch of their own (fold_x="launch",
# records_tune --set fold2, records_tune_fold2_h200.json): 379.6 -> 363.0 us, 770.0 -> 753.2.
GDN_VERIFY_NVFP4_CONFIG = dict(GDN_VERIFY_CONFIG, k_chunk=32, num_stages=2, use_dot="f16x3",
                               fold_x="launch")
# Since 2026-12-03 (fifteenth session, records_tune --set verify6 --timing graph,
# records_tune_verify6_h200.json): the matrix forms' small products in FP32 FMA
# (solve_precision="ieee"; f16x3 otherwise takes tf32x3 there): h = 0 389.8 -> 380.0 us,
# h = 8 620.2 -> 558.5 us.
MAMBA2_VERIFY_NVFP4_CONFIG = dict(MAMBA2_VERIFY_BLOCKED_CONFIG, use_dot="f16x3", e2m1_decode=None,
                                  solve_precision="ieee")
# Mamba-2 from an FP32 or half copy (2026-12-03, records_tune --set verify4,
# records_tune_verify4_h200.json): tf32x3 products on 64-row tiles with 2 warps, K in chunks of
# 64, 2 stages, instead of FP32 reductions at 64 x 4 with 32-column chunks: h = 0 573.0 ->
# 487.9 us, h = 8 579.0 -> 496.4 us (fp8 copies, never swept, keep VERIFY_CONFIG)
# Since 2026-12-03 (fifteenth session, records_tune --set verify5 then verify6,
# records_tune_verify{5,6}_h200.json): 2 warps per 64-row tile, K in chunks of 32, 3 stages,
# and the matrix forms' small products in FP32 FMA (solve_precision="ieee"; with tf32x3
# products they default to tf32x3): h = 0 486.8 -> 408.6 us, h = 8 495.7 -> 414.2 us (one warp,
# 2 stages, tf32x3 small products: 440.7 / 449.0 us). Since 2026-12-03 (sixteenth session,
# records_tune --set nx8, records_tune_nx8_h200.json) X has 8 columns here, not 16 (_min_nx:
# Mamba-2's 8 queries are only ever a product's N): 409.5 / 414.9 -> 303.1 / 318.2 us at this
# tile, which stayed the fastest of its neighbours.
MAMBA2_VERIFY_WIDE_CONFIG = dict(VERIFY_CONFIG, num_warps=2, k_chunk=32, num_stages=3,
                                 use_dot="tf32x3", solve_precision="ieee")
# Mamba-2 from an fp8 copy since 2026-12-03 (eighteenth session, records_tune --set b16b
# --timing graph, records_tune_b16b_h200.json, B = 256, h = 0 / h = 8; never swept before):
# MAMBA2_VERIFY_WIDE_CONFIG's products on one warp instead of VERIFY_CONFIG's FP32 reductions:
# 542.1 / 849.7 -> 381.1 / 642.6 us (2 warps 393.1 / 659.0; bf16x3, X padded to 16 columns,
# 459.8 / 723.6 at best).
MAMBA2_VERIFY_FP8_CONFIG = dict(MAMBA2_VERIFY_WIDE_CONFIG, num_warps=1)
# records_outputs(solve=...): forward substitution (default) or the matrix forms
SOLVE_FORMS = ("substitution", "inverse", "doubling")
# records_outputs(e2m1_decode=...): the E2M1 decoders (the same values; "lookup" and "half"
# CUDA only, "half" nvfp4 only)
E2M1_DECODES = ("lookup", "integer", "half")
MIN_LP = 16  # smallest register tile of record slots (and of tl.dot's M)
MIN_DOT = 16  # smallest tl.dot N / K
MIN_DOT_F32 = 8  # smallest N of a tl.dot with 32-bit operands (its K: MIN_DOT on Triton 3.6)
# use_dot values with C's products on 16-bit tensor cores (X in three 16-bit terms)
X16_DOTS = ("f16x3", "bf16x3")
# Triton's interpreter multiplies the bit patterns of bfloat16 tl.dot operands (it stores them as
# uint16; triton-lang/triton#11584, "not supported yet"): under it _dot_b16 takes the same
# exact values as float32 operands (their products are exact in float32 either way)
_B16_AS_F32 = tl.constexpr(KERNELS_INTERPRETED)


# ----------------------------------------------------------------------------------------
# records kernel: step / verify / GDN correction solve, output-only
# ----------------------------------------------------------------------------------------


@triton.jit
def _elem_value(x, D: tl.constexpr):
    """Float32 values of stored elements before any scale (fp32 values, bf16/fp16 values,
    minifloat codes: E2M1 / E4M3 / E5M2 through the fast decoders of ``codec``, others through
    the generic ``_decode_code``)."""
    if D.KIND == 0:
        val = x
    elif D.KIND == 1:
        val = x.to(tl.float32)
    elif D.FP4:
        val = _e2m1_value(x)
    elif D.NANF * 100 + D.EB * 10 + D.MB == 143:  # E4M3FN (one comparison: the compiler
        val = _e4m3_value(x)  # takes no chained ``and``)
    elif D.NANF * 100 + D.EB * 10 + D.MB == 252:  # E5M2
        val = _e5m2_value(x)
    else:
        val = _decode_code(x, D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF)
    return val


@triton.jit
def _c_rows(c_ptr, rowg, rmask, k0, K: tl.constexpr, KC: tl.constexpr, D: tl.constexpr):
    """Unblocked copies (fp32, bf16/fp16, fp8 codes): element values ``[BV, KC]`` of columns
    ``k0 .. k0 + KC - 1`` (fp8: before the matrix scale)."""
    kk = k0 + tl.arange(0, KC)
    x = tl.load(c_ptr + rowg[:, None] * K + kk[None, :], mask=rmask[:, None], other=0)
    return _elem_value(x, D)


@triton.jit
def _c_rows_16(c_ptr, rowg, rmask, k0, K: tl.constexpr, KC: tl.constexpr, D: tl.constexpr):
    """``_c_rows`` as bfloat16 ``[BV, KC]`` for copies whose values bfloat16 holds exactly
    (bf16 values as stored; fp8 E4M3 / E5M2 codes decoded, before the matrix scale: 3 or 2
    mantissa bits and exponents well inside bfloat16's), for ``_dot_b16``; an fp16 copy's
    values as stored (float16), for ``_dot_h16``."""
    kk = k0 + tl.arange(0, KC)
    x = tl.load(c_ptr + rowg[:, None] * K + kk[None, :], mask=rmask[:, None], other=0)
    if D.KIND == 1:
        val = x
    else:
        val = _elem_value(x, D).to(tl.bfloat16)
    return val


@triton.jit
def _c_blocks(c_ptr, bs_ptr, rowg, rmask, k0, K: tl.constexpr, BLK: tl.constexpr,
              NBC: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
    """Blocked copies (nvfp4, mxfp8, mxfp4): the ``NBC`` scaling blocks from column ``k0`` as
    element values ``[BV, NBC, W]`` (FP4: ``xe``/``xo`` the even/odd elements of each block, as
    the nibbles hold them, W = BLK / 2; otherwise ``xo`` is ``xe``) and the block scales
    ``[BV, NBC]`` (nvfp4: the E4M3 block scale without the matrix scale; mx: E8M0)."""
    nb = tl.arange(0, NBC)
    jj = tl.arange(0, W)
    m3 = rmask[:, None, None]
    if D.FP4:
        col = k0 // 2 + nb[:, None] * W + jj[None, :]
        byte = tl.load(c_ptr + rowg[:, None, None] * (K // 2) + col[None, :, :], mask=m3,
                       other=0)
        if D.LUT:
            xe, xo = _e2m1_pairs_lut(byte)
        elif D.HALF:  # the values times 2^-14; the block scale times 2^14 below
            xe, xo = _e2m1_pairs_half(byte)
        else:
            byte = byte.to(tl.int32)
            xe = _e2m1_value(byte)
            xo = _e2m1_value(byte >> 4)
    else:
        col = k0 + nb[:, None] * W + jj[None, :]
        x = tl.load(c_ptr + rowg[:, None, None] * K + col[None, :, :], mask=m3, other=0)
        xe = _elem_value(x, D)
        xo = xe
    sbc = tl.load(bs_ptr + rowg[:, None] * (K // BLK) + (k0 // BLK + nb)[None, :],
                  mask=rmask[:, None], other=0).to(tl.int32)
    if D.KIND == 3:
        sc = _e4m3_value(sbc)
        if D.HALF:
            sc = sc * E2M1_HALF_SCALE  # exact: an E4M3 value times 2^14
    else:
        sc = _e8m0_value(sbc)
    return xe, xo, sc


@triton.jit
def _c_blocks_f16(c_ptr, bs_ptr, rowg, rmask, k0, K: tl.constexpr, BLK: tl.constexpr,
                  NBC: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
    """An nvfp4 copy's ``NBC`` scaling blocks from column ``k0`` as float16 ``(even, odd)``
    element values ``[BV, NBC, W]`` (W = BLK / 2), each times its E4M3 block scale and times
    2^-14, exactly: an E2M1 value times 2^-14 is a multiple of 2^-15 with 2 significant bits,
    an E4M3 value one of 2^-9 with 4, so their product is a multiple of 2^-24 (float16's
    smallest subnormal) with at most 6 significant bits and at most 448 * 6 * 2^-14 < 0.17 in
    magnitude: representable, so the float16 multiply rounds nothing. The matrix scale is
    left out (applied to the sum). The packed-half decoder (``D.HALF``) gives the float16
    values directly (``_e2m1_pairs_half16``); the others are scaled and converted (exact)."""
    nb = tl.arange(0, NBC)
    jj = tl.arange(0, W)
    col = k0 // 2 + nb[:, None] * W + jj[None, :]
    byte = tl.load(c_ptr + rowg[:, None, None] * (K // 2) + col[None, :, :],
                   mask=rmask[:, None, None], other=0)
    if D.HALF:
        xe, xo = _e2m1_pairs_half16(byte)
    else:
        if D.LUT:
            xe, xo = _e2m1_pairs_lut(byte)
        else:
            bi = byte.to(tl.int32)
            xe = _e2m1_value(bi)
            xo = _e2m1_value(bi >> 4)
        xe = (xe * 0.00006103515625).to(tl.float16)  # times 2^-14: exact
        xo = (xo * 0.00006103515625).to(tl.float16)
    sbc = tl.load(bs_ptr + rowg[:, None] * (K // BLK) + (k0 // BLK + nb)[None, :],
                  mask=rmask[:, None], other=0).to(tl.int32)
    sc = _e4m3_value(sbc).to(tl.float16)[:, :, None]  # exact (E4M3 values are float16 values)
    return xe * sc, xo * sc


@triton.jit
def _dot_c16(a, x, acc):
    """``acc + 2^14 a x`` (``[R, NX]`` float32) for float16 ``a [R, KC]`` (values times 2^-14,
    ``_c_blocks_f16``) and float32 ``x [KC, NX]``, on float16 tensor cores with float32
    accumulation: each column of x scaled by a power of two s (its largest magnitude into
    [2^14, 2^15)) and split into three float16 terms, ``x s = hi + mid + lo`` to about 33
    significant bits (hi rounds x s to 11 bits, mid the rest, lo what mid leaves); a's
    products with each are exact in float32, so the error is the tensor cores' float32
    accumulation plus what the split drops: at most about 2^-39 times the column's largest
    magnitude per element (elements below about 2^-14 of it lose low bits to float16's
    subnormals, below about 2^-38 of it they vanish), so the bound is relative to
    ``max|x| sum|a|``, not ``sum |a||x|``. The three products accumulate lo
    first; the result is multiplied by ``2^14 / s`` (a power of two) per column. Columns
    whose largest magnitude is below 2^-113 are scaled as if it were 2^-113. A non-finite
    element makes its column's products non-finite."""
    d, inv = _dot_split16(a, x)
    return acc + d * inv[None, :]


@triton.jit
def _dot_split16(a, x):
    """The float16 tensor-core products shared by ``_dot_c16`` and ``_dot_h16``: ``x [KC, NX]``
    split by ``_split_f16`` (each column times a power of two s, three float16 terms) and
    float16 ``a [R, KC]`` times each term, accumulated in float32 lo first. Returns
    ``(a (x s) [R, NX], 2^14 / s [NX])``; the callers scale the columns back."""
    hi, mid, lo, inv = _split_f16(x)
    d = tl.dot(a, lo)
    d = tl.dot(a, mid, d)
    d = tl.dot(a, hi, d)
    return d, inv


@triton.jit
def _dot_h16(a, x, acc):
    """``acc + a x`` (``[R, NX]`` float32) for float16 ``a [R, KC]`` (an fp16 copy's values as
    stored) and float32 ``x [KC, NX]``, on float16 tensor cores with float32 accumulation
    (``use_dot="f16x3"`` from an fp16 copy): ``_dot_c16``'s split of x (each column scaled
    by a power of two s, three float16 terms) and products (a float16 value times a float16
    term is exact in float32: at most 22 significant bits, magnitudes 2^-48 .. 2^31), the sum
    scaled by ``1 / s`` (a power of two) instead of ``2^14 / s``, since a holds the copy's
    values themselves. The error bound is ``_dot_c16``'s: relative to ``max|x| sum|a|`` per
    column (elements below about 2^-14 of their column's largest lose low bits to float16's
    subnormals)."""
    d, inv = _dot_split16(a, x)
    # times 1 / s = (2^14 / s) 2^-14, exact while the result is a normal float32: in one
    # multiplication where 1 / s is normal, else (a column scaled as if its largest were
    # 2^-113: 1 / s = 2^-127, subnormal) as 2^14 / s, then 2^-14; 2^14 / s first everywhere
    # would overflow for columns near float32's top
    big = inv >= 1.0e-30
    f1 = tl.where(big, inv * 0.00006103515625, inv)
    f2 = tl.where(big, 1.0, 0.00006103515625)
    return acc + (d * f1[None, :]) * f2[None, :]


@triton.jit
def _dot_b16(a, x, acc):
    """``acc + a x`` (``[R, NX]`` float32) for bfloat16 ``a [R, KC]`` (exact values of a
    bf16 or fp8 copy, ``_c_rows_16``) and float32 ``x [KC, NX]``, on bfloat16 tensor cores
    with float32 accumulation (``use_dot="bf16x3"``): x split into three bfloat16 terms
    ``x = hi + mid + lo + e`` (hi rounds x to 8 significant bits, mid the rest, lo what mid
    leaves; e = 0 for a float32 x (24 significant bits in three terms of 8), bfloat16 having
    float32's exponent range: no scale, so the bound is relative per element, not per column as
    ``_dot_c16``'s; only terms below float32's normal range lose bits, for |x| below about
    2^-102). Each product of a
    bfloat16 a with a term is exact in float32 (16 significant bits), so the error is the
    tensor cores' float32 accumulation (its error grows with the number of accumulation
    steps, 3 K / 16 per chunk): about FP32 accuracy, within a few float32 ulps of
    ``sum |a| |x|`` at the chunk sizes used (16-64). The three products accumulate lo first. A
    non-finite element of x makes its column's products non-finite, as does a finite one whose
    rounding to 8 bits overflows (|x| >= 2^128 (1 - 2^-9))."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)  # exact (x minus its rounding)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    if _B16_AS_F32:  # the interpreter (_B16_AS_F32): the same values as float32
        a = a.to(tl.float32)
        hi = hi.to(tl.float32)
        mid = mid.to(tl.float32)
        lo = lo.to(tl.float32)
    d = tl.dot(a, lo)
    d = tl.dot(a, mid, d)
    d = tl.dot(a, hi, d)
    return acc + d


@triton.jit
def _cols(ptr, base, ok, e, K: tl.constexpr):
    """``[len(e), len(base)]``: element ``e`` of the vectors at offsets ``base`` (zero where
    not ``ok``)."""
    return tl.load(ptr + base[None, :] + e[:, None], mask=ok[None, :] & (e[:, None] < K),
                   other=0.0)


@triton.jit
def _x_cols(dk_ptr, q_ptr, kbase, isk, qbase, isq, e, K: tl.constexpr):
    """Columns of X (the vectors C is multiplied with) at element indices ``e`` ``[R]``:
    ``[R, NX]``; column c is k of a solved row (``isk``, offset ``kbase``) or a query
    (``isq``, ``qbase``), zero when neither."""
    return _cols(dk_ptr, kbase, isk, e, K) + _cols(q_ptr, qbase, isq, e, K)


@triton.jit
def _xw(dk_ptr, q_ptr, kbase, isk, qbase, isq, e, K: tl.constexpr, XW, FOLD: tl.constexpr,
        PREC: tl.constexpr):
    """``_x_cols`` at element indices ``e``, times ``XW [NX, NX]`` with ``FOLD`` (``fold_x``:
    the matrix form's coefficients folded into X, ``_fold_matrices``), as one ``tl.dot``."""
    x = _x_cols(dk_ptr, q_ptr, kbase, isk, qbase, isq, e, K)
    if FOLD:
        x = tl.dot(x, XW, input_precision=PREC)
    return x


@triton.jit
def _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e, c: tl.constexpr, NS: tl.constexpr,
           K: tl.constexpr, D_REL: tl.constexpr):
    """Column ``c`` (static) of X at element indices ``e`` (any shape): k of solved row
    ``ss + c`` for ``c < NS``, else query ``c - NS``."""
    if c < NS:
        if D_REL:
            d = c
        else:
            d = ss + c
        x = tl.load(dk_ptr + ((b * TD + d) * G + g) * K + e, mask=(e < K) & (e * 0 + n > ss + c),
                    other=0.0)
    else:
        x = tl.load(q_ptr + ((b * TQ + (c - NS)) * G + g) * K + e, mask=(e < K) & (e * 0 + TQ > c - NS),
                    other=0.0)
    return x


@triton.jit
def _add_times_x(Y, m, e, cx, dk_ptr, q_ptr, kbase, isk, qbase, isq, b, g, ss, n, G, TD, TQ,
                 NC: tl.constexpr, NS: tl.constexpr, K: tl.constexpr, D_REL: tl.constexpr,
                 DOT: tl.constexpr, PREC: tl.constexpr, XW=0, FOLD: tl.constexpr = False):
    """``Y + m X[e]``: a tile ``m [R, KC]`` (rows of C, or record keys) times the rows ``e``
    ``[KC]`` of X (``_x_cols``; ``FOLD``: of ``X XW``, ``_xw``), as one ``tl.dot`` (``DOT``)
    or one reduction per column (not with ``FOLD``)."""
    if DOT:
        Y += tl.dot(m, _xw(dk_ptr, q_ptr, kbase, isk, qbase, isq, e, K, XW, FOLD, PREC),
                    input_precision=PREC)
    else:
        for c in tl.static_range(NC):
            xv = _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e, c, NS, K, D_REL)
            yc = tl.sum(m * xv[None, :], axis=1)
            Y += tl.where(cx[None, :] == c, yc[:, None], 0.0)
    return Y


@triton.jit
def _col(Y, cx, j):
    """Column ``j`` of ``Y [R, NX]``: ``[R]``."""
    return tl.sum(tl.where(cx[None, :] == j, Y, 0.0), axis=1)


@triton.jit
def _unit_upper_inverse(MT, cx, n_rows, NX: tl.constexpr, SOLVE: tl.constexpr,
                        NSQ: tl.constexpr, SPREC: tl.constexpr):
    """``(I + MT)^{-1}`` of a strictly upper-triangular ``MT [NX, NX]`` (the transpose of the
    unit lower-triangular system's ``I + M``), FP32 on per-program scalars (no value rows).

    ``SOLVE == 1``: the columns of ``L^T`` in order, ``L^T[:, i] = -MT[:, i] - L^T MT[:, i]``
    (row ``i`` of ``(I + M)^{-1} = I + L`` by forward substitution, ``n_rows - 1`` steps; the
    recursion of fla's ``solve_tril`` on one block). ``SOLVE == 2``: doubling,
    ``(I + M)^{-1} = (I - M)(I + M^2)(I + M^4)...`` (``M`` is nilpotent, ``M^NS = 0``), ``NSQ``
    squarings of ``NX x NX`` products and no sequential reductions."""
    eye = tl.where(cx[:, None] == cx[None, :], 1.0, 0.0)
    if SOLVE == 1:
        LT = tl.zeros([NX, NX], tl.float32)
        for i in range(1, n_rows):
            m = tl.sum(tl.where(cx[None, :] == i, MT, 0.0), axis=1)  # MT[:, i], by row j
            col = -m - tl.sum(LT * m[None, :], axis=1)
            LT = tl.where(cx[None, :] == i, col[:, None], LT)
        inv = eye + LT
    else:
        inv = eye - MT
        P = MT
        for _ in tl.static_range(NSQ):
            P = tl.dot(P, P, input_precision=SPREC)
            inv = inv + tl.dot(inv, P, input_precision=SPREC)
    return inv


@triton.jit
def _columns(cx, ss, n, cs, TQ, NS: tl.constexpr):
    """The matrix forms' column masks: ``dload`` (key columns with records), ``dvalid``
    (solved rows, ``ss <= cs + c < n``) and ``qvalid`` (queries)."""
    dload = (cx < NS) & (cs + cx < n)  # key rows with records
    dvalid = dload & (cs + cx >= ss)  # solved rows (read path)
    qvalid = (cx >= NS) & (cx < NS + TQ)  # queries
    return dload, dvalid, qvalid


@triton.jit
def _draft_index(cx, dload, cs, D_REL: tl.constexpr):
    """Each key column's index into the draft tensors (by slot, or relative with D_REL)."""
    if D_REL:
        dic = tl.where(dload, cx, 0).to(tl.int64)
    else:
        dic = tl.where(dload, cs + cx, 0)
    return dic


@triton.jit
def _matrix_coefficients(Z, cvec, idx, ring, cx, ss, n, o0, cs, TQ, NS: tl.constexpr,
                         GDN: tl.constexpr):
    """The matrix forms' columns and the known records' output coefficients (per-program
    scalars; the notation of ``_matrix_outputs``): ``dload`` (key columns with records),
    ``dvalid`` (solved rows), ``qvalid`` (queries), ``pos`` / ``cpos`` (each column's slot and
    cumulative log decay), ``known`` (the rows of ``U``), ``dlt [LP, NX] = c_{p_c} - c_i``,
    ``Dk [LP, NX]`` (``[i <= p_c] gamma_{i+1:p_c} (k_i . q_c)``) and ``eq [NX]``
    (``gamma_{1:p_c}`` on query columns)."""
    col_d = cx < NS
    dload, dvalid, qvalid = _columns(cx, ss, n, cs, TQ, NS)
    pos = tl.where(col_d, cs + cx, o0 + cx - NS)  # slot of each column
    cpos = tl.sum(tl.where(idx[:, None] == pos[None, :], cvec[:, None], 0.0), axis=0)  # [NX]
    if GDN:
        known = ring
    else:
        known = idx < n
    # coefficient matrices first (per-program scalars), then the [BV, *] products
    dlt = cpos[None, :] - cvec[:, None]  # [LP, NX]: c_{p_c} - c_i
    okq = qvalid[None, :] & known[:, None] & (idx[:, None] <= pos[None, :])
    Dk = tl.where(okq, tl.exp(tl.where(okq, dlt, 0.0)) * Z, 0.0)
    eq = tl.where(qvalid, tl.exp(cpos), 0.0)
    return dload, dvalid, qvalid, pos, cpos, known, dlt, Dk, eq


@triton.jit
def _gdn_system(Zd, Z, cpos, dlt, known, dload, dvalid, qvalid, pos, cx, b, h, cs, n,
                dbeta_ptr, H, TD, NX: tl.constexpr, D_REL: tl.constexpr,
                SOLVE: tl.constexpr, NSQ: tl.constexpr, SPREC: tl.constexpr):
    """GDN's system in the matrix forms (per-program scalars; ``_matrix_outputs``): ``dic``
    (each key column's draft index), ``bcol`` (its beta), ``Rk [LP, NX]`` (the known rows'
    part of the right-hand side, ``-beta_d gamma_{i+1:s_d} (k_i . k_d)``), ``ec``
    (``gamma_{1:s_d}``), ``bR`` (beta on solved rows), ``dd [NX, NX] = c_{p_c} - c_{p_r}``,
    ``inv = (I + M^T)^{-1}`` and ``Ds [NX, NX]`` (``[s_d <= p_c] gamma_{s_d+1:p_c}
    (k_d . q_c)``)."""
    dic = _draft_index(cx, dload, cs, D_REL)
    bcol = tl.load(dbeta_ptr + (b * TD + dic) * H + h, mask=dload, other=0.0)  # [NX]
    okk = dvalid[None, :] & known[:, None]  # i < ss <= s_c
    Rk = tl.where(okk, -bcol[None, :] * tl.exp(tl.where(okk, dlt, 0.0)) * Z, 0.0)
    ec = tl.where(dvalid, tl.exp(cpos), 0.0)
    bR = tl.where(dvalid, bcol, 0.0)
    # MT[d', d] = beta_d gamma_{s_d'+1:s_d} (k_d' . k_d), d' < d (both solved rows)
    okm = dvalid[:, None] & dvalid[None, :] & (cx[:, None] < cx[None, :])
    dd = cpos[None, :] - cpos[:, None]
    MT = tl.where(okm, bcol[None, :] * tl.exp(tl.where(okm, dd, 0.0)) * Zd, 0.0)
    inv = _unit_upper_inverse(MT, cx, n - cs, NX, SOLVE, NSQ, SPREC)
    oks = dvalid[:, None] & qvalid[None, :] & (pos[:, None] <= pos[None, :])
    Ds = tl.where(oks, tl.exp(tl.where(oks, dd, 0.0)) * Zd, 0.0)
    return dic, bcol, Rk, ec, bR, dd, inv, Ds


@triton.jit
def _a_path_system(Zd, cpos, dd, bcol, dload, pos, cx, n, TQ, NS: tl.constexpr,
                   NX: tl.constexpr, SOLVE: tl.constexpr, NSQ: tl.constexpr,
                   SPREC: tl.constexpr):
    """The fused A path's system (``FUSED``, a sequence at the window: every key row with
    records re-solved against C, none cached; the notation of ``_gdn_system``): ``last`` (the
    last query's column), ``ecA`` (``gamma_{1:s_d}`` on those rows), ``invA`` (the inverse of
    their ``n x n`` system) and ``DsA`` (their decayed products with the last query)."""
    last = cx == NS + TQ - 1
    ecA = tl.where(dload, tl.exp(cpos), 0.0)
    okmA = dload[:, None] & dload[None, :] & (cx[:, None] < cx[None, :])
    MTA = tl.where(okmA, bcol[None, :] * tl.exp(tl.where(okmA, dd, 0.0)) * Zd, 0.0)
    invA = _unit_upper_inverse(MTA, cx, n, NX, SOLVE, NSQ, SPREC)
    oksA = dload[:, None] & last[None, :] & (pos[:, None] <= pos[None, :])
    DsA = tl.where(oksA, tl.exp(tl.where(oksA, dd, 0.0)) * Zd, 0.0)
    return last, ecA, invA, DsA


@triton.jit
def _matrix_outputs(Y, Z, Zd, U, cvec, idx, ring, cx, rows, rmask, b, h, ss, n, o0, cs,
                    window, dv_ptr, dbeta_ptr, wout_ptr, o_ptr, H, V, TD, TQ, WCAP, OT, OT0,
                    NS: tl.constexpr, NX: tl.constexpr, GDN: tl.constexpr,
                    D_REL: tl.constexpr, WRITE_W: tl.constexpr, SOLVE: tl.constexpr,
                    NSQ: tl.constexpr, FUSED: tl.constexpr, SPREC: tl.constexpr):
    """Matrix form of the records kernel's solve and outputs (``solve="inverse"`` /
    ``"doubling"``): the coefficients are built once per program on scalars and applied to the
    ``BV`` value rows as small products (FP32 ``tl.dot``, ``input_precision=SPREC``).

    Columns ``c`` of ``Y [BV, NX] = C X``, ``Z [LP, NX] = K X`` (and ``Zd [NX, NX]``, GDN: the
    key columns' keys times X) index key rows ``s_c = cs + c`` for ``c < NS`` (solved when
    ``ss <= s_c < n``; ``cs = ss``, or 0 with ``FUSED``) and queries at
    ``p_c = o0 + c - NS`` for ``NS <= c < NS + TQ``; ``U [LP, BV]`` holds the known records
    ``w_i`` (GDN: rows ``< ss``; Mamba-2: rows ``< n``); ``cvec [LP]`` the cumulative log decays
    ``c_i`` (so ``gamma_{i+1:p} = exp(c_p - c_i)``, DESIGN.md section 3).

    GDN (DESIGN.md section 3, the unit lower-triangular system; the UT-transform form of the
    chunked DeltaNet kernels, Yang et al. 2024, "Parallelizing Linear Transformers with the
    Delta Rule over Sequence Length", section 3): with
    ``M[d, d'] = beta_d gamma_{s_d'+1:s_d} (k_d' . k_d)`` (``d' < d``, solved rows only),
    ``rhs_d = beta_d (v_d - gamma_{1:s_d} C k_d) - sum_{i<ss} beta_d gamma_{i+1:s_d}
    (k_i . k_d) u_i``, the corrections are ``u = (I + M)^{-1} rhs``: per value row
    ``U_s^T [BV, NX] = rhs^T (I + M^T)^{-1}`` (``_unit_upper_inverse``).
    Outputs ``o_p = gamma_{1:p} (C q) + sum_{j<=p} gamma_{j+1:p} (k_j . q) w_j`` as
    ``O^T = Y diag(gamma_{1:p}) + U^T D_known + U_s^T D_solved`` with the masked decay matrices
    ``D[j, c] = [j <= p_c] gamma_{j+1:p_c} (k_j . q_c)``.
    ``FUSED`` (C is both the read copy and the anchor; key columns are slots ``0..NS-1``): a
    sequence with ``n == window`` also solves the whole ``n x n`` system against C with no
    cached rows (the A path of DESIGN.md section 3's speculative decoding, as
    :func:`replay.gdn.gdn_verify` recomputes it) and its last query's output is the A path's.
    Writes the outputs (and, ``WRITE_W``, the corrections of rows ``ss..n-1``)."""
    dload, dvalid, qvalid, pos, cpos, known, dlt, Dk, eq = _matrix_coefficients(
        Z, cvec, idx, ring, cx, ss, n, o0, cs, TQ, NS, GDN)
    Ut = tl.trans(U)  # [BV, LP]
    if GDN:
        dic, bcol, Rk, ec, bR, dd, inv, Ds = _gdn_system(Zd, Z, cpos, dlt, known, dload, dvalid,
                                                         qvalid, pos, cx, b, h, cs, n, dbeta_ptr,
                                                         H, TD, NX, D_REL, SOLVE, NSQ, SPREC)
        Vd = tl.load(dv_ptr + ((b * TD + dic) * H + h)[None, :] * V + rows[:, None],
                     mask=dload[None, :] & rmask[:, None], other=0.0)  # [BV, NX]
        rhs = bR[None, :] * (Vd - Y * ec[None, :]) + tl.dot(Ut, Rk, input_precision=SPREC)
        Us = tl.dot(rhs, inv, input_precision=SPREC)  # [BV, NX]: u of the solved rows
        if WRITE_W:
            tl.store(wout_ptr + ((b * WCAP + cs + cx) * H + h)[None, :] * V + rows[:, None], Us,
                     mask=dvalid[None, :] & rmask[:, None])
        Ot = Y * eq[None, :] + tl.dot(Ut, Dk, input_precision=SPREC)
        Ot += tl.dot(Us, Ds, input_precision=SPREC)
        if FUSED:
            if n == window:  # the A path: every row re-solved against C, no cached rows
                last, ecA, invA, DsA = _a_path_system(Zd, cpos, dd, bcol, dload, pos, cx, n,
                                                      TQ, NS, NX, SOLVE, NSQ, SPREC)
                rhsA = bcol[None, :] * (Vd - Y * ecA[None, :])
                UsA = tl.dot(rhsA, invA, input_precision=SPREC)
                OtA = Y * tl.where(last, tl.exp(cpos), 0.0)[None, :] + \
                    tl.dot(UsA, DsA, input_precision=SPREC)
                Ot = tl.where(last[None, :], OtA, Ot)
    else:
        Ot = Y * eq[None, :] + tl.dot(Ut, Dk, input_precision=SPREC)
    tl.store(o_ptr + ((b * OT + OT0 + cx - NS) * H + h)[None, :] * V + rows[:, None], Ot,
             mask=qvalid[None, :] & rmask[:, None])


@triton.jit
def _fold_matrices(Z, Zd, cvec, idx, ring, cx, b, h, ss, n, o0, cs, window, dbeta_ptr, H, TD,
                   TQ, NS: tl.constexpr, NX: tl.constexpr, D_REL: tl.constexpr,
                   SOLVE: tl.constexpr, NSQ: tl.constexpr, FUSED: tl.constexpr,
                   SPREC: tl.constexpr):
    """GDN's matrix form with its coefficients folded into X (``fold_x``): the same system and
    outputs as ``_matrix_outputs`` (same notation), written as one linear map of ``Y = C X``,
    the solved rows' values ``Vd [BV, NX]`` and the known corrections ``U^T [BV, LP]``. From
    ``U_s^T = Y By + Vd Bv + U^T Bu`` with ``By = -diag(beta gamma_{1:s}) inv``,
    ``Bv = diag(beta) inv`` and ``Bu = Rk inv`` (the right-hand side times the inverse), and
    ``O^T = Y diag(gamma_{1:p}) + U^T Dk + U_s^T Ds``: the result ``R = U_s^T`` on the key
    columns and ``O^T`` on the query columns (each product is zero outside its block: ``By``,
    ``Bv``, ``Bu`` on key columns, ``Ds`` and ``Dk`` on query columns) is

        ``R = C (X Wy) + Vd Wv + U^T Wu``,  ``E = I + Ds``,
        ``Wy = diag(gamma_{1:p}) + By E``,  ``Wv = Bv E``,  ``Wu = Dk + Bu E``.

    All three are per-program scalars, known before C is read, so ``Wy`` multiplies X before
    the stream of C (``_xw``) and no ``[BV, NX]`` intermediate of the solve is formed.
    ``FUSED`` with ``n == window``: the last query column is the A path's, ``Wy = diag(gamma)
    - diag(beta gamma) invA DsA``, ``Wv = diag(beta) invA DsA``, ``Wu = 0`` there.
    Returns ``Wy [NX, NX]``, ``Wv [NX, NX]``, ``Wu [LP, NX]`` and the column masks and draft
    indices of the outputs (``dic``, ``dload``, ``dvalid``, ``qvalid``). The sums are
    reassociated against ``_matrix_outputs``: the same values within the outputs'
    tolerance, not bit for bit."""
    dload, dvalid, qvalid, pos, cpos, known, dlt, Dk, eq = _matrix_coefficients(
        Z, cvec, idx, ring, cx, ss, n, o0, cs, TQ, NS, True)
    dic, bcol, Rk, ec, bR, dd, inv, Ds = _gdn_system(Zd, Z, cpos, dlt, known, dload, dvalid,
                                                     qvalid, pos, cx, b, h, cs, n, dbeta_ptr, H,
                                                     TD, NX, D_REL, SOLVE, NSQ, SPREC)
    eye = cx[:, None] == cx[None, :]
    E = tl.where(eye, 1.0, 0.0) + Ds
    Bu = tl.dot(Rk, inv, input_precision=SPREC)  # [LP, NX]
    Wy = tl.where(eye, eq[None, :], 0.0) + \
        tl.dot(-(bR * ec)[:, None] * inv, E, input_precision=SPREC)
    Wv = tl.dot(bR[:, None] * inv, E, input_precision=SPREC)
    Wu = Dk + tl.dot(Bu, E, input_precision=SPREC)
    if FUSED:
        if n == window:  # the A path: every row re-solved against C, no cached rows
            last, ecA, invA, DsA = _a_path_system(Zd, cpos, dd, bcol, dload, pos, cx, n, TQ, NS,
                                                  NX, SOLVE, NSQ, SPREC)
            WyA = tl.where(eye, tl.where(last, tl.exp(cpos), 0.0)[None, :], 0.0) + \
                tl.dot(-(bcol * ecA)[:, None] * invA, DsA, input_precision=SPREC)
            WvA = tl.dot(bcol[:, None] * invA, DsA, input_precision=SPREC)
            Wy = tl.where(last[None, :], WyA, Wy)
            Wv = tl.where(last[None, :], WvA, Wv)
            Wu = tl.where(last[None, :], 0.0, Wu)
    return Wy, Wv, Wu, dic, dload, dvalid, qvalid


@triton.jit
def _fold_outputs(Y, Wv, Wu, U, dic, dload, dvalid, qvalid, cx, rows, rmask, b, h, cs, dv_ptr,
                  wout_ptr, o_ptr, H, V, TD, WCAP, OT, OT0, NS: tl.constexpr,
                  WRITE_W: tl.constexpr, SPREC: tl.constexpr):
    """The outputs of ``fold_x`` (``_fold_matrices``): ``R = Y + Vd Wv + U^T Wu`` for ``Y = C
    (X Wy) [BV, NX]``; its key columns are the solved rows' corrections (to ``wout`` with
    ``WRITE_W``), its query columns the outputs."""
    Vd = tl.load(dv_ptr + ((b * TD + dic) * H + h)[None, :] * V + rows[:, None],
                 mask=dload[None, :] & rmask[:, None], other=0.0)  # [BV, NX]
    R = tl.dot(Vd, Wv, Y, input_precision=SPREC)
    R = tl.dot(tl.trans(U), Wu, R, input_precision=SPREC)
    if WRITE_W:
        tl.store(wout_ptr + ((b * WCAP + cs + cx) * H + h)[None, :] * V + rows[:, None], R,
                 mask=dvalid[None, :] & rmask[:, None])
    tl.store(o_ptr + ((b * OT + OT0 + cx - NS) * H + h)[None, :] * V + rows[:, None], R,
             mask=qvalid[None, :] & rmask[:, None])


@triton.jit
def _record_keys(rk_ptr, dk_ptr, krow, kdrow, ring, drf, kk):
    """The record keys ``[LP, len(kk)]`` at key columns ``kk``: ring slots (``ring``, rows
    ``krow``) and draft slots (``drf``, rows ``kdrow``), zero elsewhere."""
    return tl.load(rk_ptr + krow[:, None] + kk[None, :], mask=ring[:, None], other=0.0) + \
        tl.load(dk_ptr + kdrow[:, None] + kk[None, :], mask=drf[:, None], other=0.0)


@triton.jit
def _record_la(rla_ptr, dla_ptr, ring, drf, di, ri, b, h, H, CAP, TD):
    """The log decays ``la [LP]`` of the record slots: ring rows (< ss), then draft rows."""
    return tl.where(ring, tl.load(rla_ptr + (b * CAP + ri) * H + h, mask=ring, other=0.0),
                    tl.load(dla_ptr + (b * TD + di) * H + h, mask=drf, other=0.0))


@triton.jit
def _slots(idx, ss, n, D_REL: tl.constexpr):
    """Record slots ``idx [LP]``: ``ring`` (rows < ss, from the ring), ``drf`` (rows
    ss..n-1, from the draft tensors), and the clamped indices ``di`` / ``ri`` into the draft
    tensors (by slot, or relative to ss with ``D_REL``) and the ring."""
    ring = idx < ss
    drf = (idx >= ss) & (idx < n)
    if D_REL:
        di = idx - ss  # draft tensors hold rows ss.. at index 0..
    else:
        di = idx  # draft tensors are indexed by slot
    return ring, drf, tl.where(drf, di, 0), tl.where(ring, idx, 0)


@triton.jit
def _x_setup(cx, ss, n, b, g, G, TD, TQ, K: tl.constexpr, NS: tl.constexpr,
             D_REL: tl.constexpr, FUSED: tl.constexpr):
    """Columns ``cx [NX]`` of X for sequence ``b``, key group ``g``: ``cs`` (the slot of key
    column 0: ss, or 0 with FUSED), ``isk``/``kbase`` (k of solved row ``cs + c``, c < NS,
    offsets into the draft keys) and ``isq``/``qbase`` (query ``c - NS``, offsets into q)."""
    if FUSED:
        cs = ss * 0
    else:
        cs = ss
    isk = (cx < NS) & (cs + cx < n)
    if D_REL:
        dcol = cx.to(tl.int64)
    else:
        dcol = cs + cx
    kbase = tl.where(isk, ((b * TD + dcol) * G + g) * K, 0)
    isq = (cx >= NS) & (cx < NS + TQ)
    qbase = tl.where(isq, ((b * TQ + (cx - NS)) * G + g) * K, 0)
    return cs, isk, kbase, isq, qbase


@triton.jit
def _key_products(rk_ptr, dk_ptr, q_ptr, krow, kdrow, ring, drf, kfirst, kbase, isk, qbase, isq,
                  cx, b, g, cs, n, G, TD, TQ, K: tl.constexpr, KC: tl.constexpr,
                  STAGES: tl.constexpr, LP: tl.constexpr, NC: tl.constexpr, NS: tl.constexpr,
                  NX: tl.constexpr, D_REL: tl.constexpr, DOT: tl.constexpr,
                  PREC: tl.constexpr, KFIRST: tl.constexpr, SOLVE: tl.constexpr,
                  GDN: tl.constexpr):
    """``Z = Kmat X [LP, NX]`` (``k_i . x_c`` for every record slot i: ring rows < ss, then
    drafts) and, for GDN's matrix forms, ``Zd [NX, NX]`` (k of solved row d . x_c); the
    record keys streamed along K in chunks of KC (``kfirst``: the whole ``[LP, K]`` tile,
    loaded already, with KFIRST). Depends on (sequence, key group) only."""
    Z = tl.zeros([LP, NX], tl.float32)
    Zd = tl.zeros([NX, NX], tl.float32)
    for k0 in tl.range(0, K, KC, num_stages=STAGES):
        kk = k0 + tl.arange(0, KC)
        if KFIRST:
            km = kfirst
        else:
            km = _record_keys(rk_ptr, dk_ptr, krow, kdrow, ring, drf, kk)
        Z = _add_times_x(Z, km, kk, cx, dk_ptr, q_ptr, kbase, isk, qbase, isq, b, g, cs, n, G,
                         TD, TQ, NC, NS, K, D_REL, DOT, PREC)
        if SOLVE > 0 and GDN and NS > 0:  # Gram of the solved rows' keys with X
            kdt = tl.load(dk_ptr + kbase[:, None] + kk[None, :], mask=isk[:, None], other=0.0)
            Zd += tl.dot(kdt, _x_cols(dk_ptr, q_ptr, kbase, isk, qbase, isq, kk, K),
                         input_precision=PREC)
    return Z, Zd


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _x_int_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, c: tl.constexpr, K: tl.constexpr,
               NS: tl.constexpr, D_REL: tl.constexpr):
    """Column ``c`` of X (``_x_col``) as the integer-dot read pass takes it, in registers:
    per block j of 16 elements, E the largest float32 exponent field among the block's
    elements (at least 24), each element times ``s = 2^(148 - E)`` (exact) rounded to the
    nearest integer ``X`` (ties to even; ``|X| <= 2^22``, an error of at most 2^-22 of the
    block's largest magnitude) as three byte limbs ``X = X0 2^16 + U1 2^8 + U2``, each
    ``[K/16, 4]`` int32 (four elements per register, byte i the element 4r + i of the
    block's row r), the per-block bias ``128 sum X`` modulo 2^32 (``[K/16]``) and ``xs =
    1 / (2 s) = 2^(E - 149)`` (``[K/16]``: the doubled E2M1 values' and the scaling's
    inverse). A block with a NaN or an infinity gets ``X = 0`` and ``xs = NaN`` (its outputs
    are NaN); elements below about 2^-125 of magnitude in a block whose largest is below
    2^-103 round to zero."""
    NB: tl.constexpr = K // 16
    jb = tl.arange(0, NB)
    r4 = tl.arange(0, 4)
    i4 = tl.arange(0, 4)
    e = jb[:, None, None] * 16 + r4[None, :, None] * 4 + i4[None, None, :]  # [NB, 4, 4]
    x = _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e, c, NS, K, D_REL)
    E = tl.max(tl.max((x.to(tl.int32, bitcast=True) >> 23) & 255, axis=2), axis=1)  # [NB]
    ok = E < 255
    E = tl.maximum(E, 24)
    s = ((275 - E) << 23).to(tl.float32, bitcast=True)  # 2^(148 - E)
    v = x * s[:, None, None]  # |v| < 2^22
    v = (v + 12582912.0) - 12582912.0  # to the nearest integer (1.5 * 2^23)
    X = tl.where(ok[:, None, None], v, 0.0).to(tl.int32)
    sh = (i4 * 8)[None, None, :]
    l0 = tl.reduce(((X >> 16) & 255) << sh, 2, _bit_or)
    l1 = tl.reduce(((X >> 8) & 255) << sh, 2, _bit_or)
    l2 = tl.reduce((X & 255) << sh, 2, _bit_or)
    bias = tl.sum(tl.sum(X, axis=2), axis=1) << 7  # 128 sum X (|sum X| <= 2^26)
    xs = tl.where(ok, ((E - 22) << 23).to(tl.float32, bitcast=True), float("nan"))
    return l0, l1, l2, bias, xs


@triton.jit
def _x_int_store(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, xi_ptr, xs_ptr, bg, K: tl.constexpr,
                 NC: tl.constexpr, NS: tl.constexpr, D_REL: tl.constexpr):
    """X of sequence ``b`` and key group ``g`` (``_x_col``'s NC columns) as the integer-dot
    read pass takes it (``_x_int_col``), written to ``xi [B*G, NC, 3 K/4 + K/16]`` int32
    (limb l of elements 4r .. 4r + 3 at ``l K/4 + r``; then the per-block bias) and ``xs
    [B*G, NC, K/16]``."""
    NB: tl.constexpr = K // 16
    jb = tl.arange(0, NB)
    r4 = tl.arange(0, 4)
    XW: tl.constexpr = 3 * (K // 4) + NB  # int32 words per column
    for c in tl.static_range(NC):
        l0, l1, l2, bias, xs = _x_int_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, c, K, NS,
                                          D_REL)
        base = (bg * NC + c) * XW + jb[:, None] * 4 + r4[None, :]  # [NB, 4]
        tl.store(xi_ptr + base, l0)
        tl.store(xi_ptr + base + K // 4, l1)
        tl.store(xi_ptr + base + 2 * (K // 4), l2)
        tl.store(xi_ptr + (bg * NC + c) * XW + 3 * (K // 4) + jb, bias)
        tl.store(xs_ptr + (bg * NC + c) * NB + jb, xs)


@triton.jit
def _x_int_kernel(dk_ptr, q_ptr, ss_ptr, n_ptr, xi_ptr, xs_ptr, G, TD, TQ, K: tl.constexpr,
                  NC: tl.constexpr, NS: tl.constexpr, D_REL: tl.constexpr,
                  PDL: tl.constexpr = False,
                  SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
                  OS_ADD: tl.constexpr = 0):
    """``_x_int_store`` of (sequence, key group) ``program_id(0) = b * G + g``: the first
    launch of a step with the integer-dot read pass. ``PDL`` (form ``"idot_pdl"``): let the
    read pass after it (launched with PDL; it waits for this grid before it reads X's
    integers) start at once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    bg = tl.program_id(0).to(tl.int64)
    b = bg // G
    g = bg - b * G
    ss = tl.load(ss_ptr + b) + SS_ADD
    n = tl.load(n_ptr + b) + N_ADD
    _x_int_store(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, xi_ptr, xs_ptr, bg, K, NC, NS, D_REL)


@triton.jit
def _key_products_kernel(
        rk_ptr, dk_ptr, q_ptr, ss_ptr, n_ptr, z_ptr, zd_ptr, G, CAP, TD, TQ,
        K: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr, LP: tl.constexpr,
        NC: tl.constexpr, NS: tl.constexpr, NX: tl.constexpr, DOT: tl.constexpr,
        PREC: tl.constexpr, D_REL: tl.constexpr, SOLVE: tl.constexpr, GDN: tl.constexpr,
        FUSED: tl.constexpr, PDL: tl.constexpr = False, WAIT: tl.constexpr = False,
        SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
        OS_ADD: tl.constexpr = 0):
    """The records kernel's ``Z`` (and ``Zd``) once per (sequence, key group) (program
    ``b * G + g``), written to ``z_ptr [B*G, LP, NX]`` / ``zd_ptr [B*G, NX, NX]`` for the
    records kernel launched with ZPRE: every program of that launch for the same sequence and
    key group (the value heads of a group, the value-row tiles) reads them instead of
    recomputing the products with the record keys. PDL: let the next launch (the records
    kernel or its read pass, launched with ``launch_pdl``) start at once; it waits for this
    grid (``gdc_wait``) before it reads Z or writes anything. ``WAIT`` (read-pass form
    ``"idot_pdl"``: this launch is a dependent one after the read pass): wait for the read
    pass's grid before the stores, so that the records launch, waiting on this grid, also
    waits on the read pass."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0).to(tl.int64)
    b = pid // G
    g = pid - b * G
    ss = tl.load(ss_ptr + b) + SS_ADD
    n = tl.load(n_ptr + b) + N_ADD
    idx = tl.arange(0, LP).to(tl.int64)
    cx = tl.arange(0, NX)
    ring, drf, di, ri = _slots(idx, ss, n, D_REL)
    cs, isk, kbase, isq, qbase = _x_setup(cx, ss, n, b, g, G, TD, TQ, K, NS, D_REL, FUSED)
    krow = ((b * CAP + ri) * G + g) * K
    kdrow = ((b * TD + di) * G + g) * K
    Z, Zd = _key_products(rk_ptr, dk_ptr, q_ptr, krow, kdrow, ring, drf, 0, kbase, isk, qbase,
                          isq, cx, b, g, cs, n, G, TD, TQ, K, KC, STAGES, LP, NC, NS, NX,
                          D_REL, DOT, PREC, False, SOLVE, GDN)
    if WAIT:
        tl.extra.cuda.gdc_wait()
    tl.store(z_ptr + (pid * LP + idx[:, None]) * NX + cx[None, :], Z)
    if SOLVE > 0 and GDN and NS > 0:
        tl.store(zd_ptr + (pid * NX + cx[:, None]) * NX + cx[None, :], Zd)


@triton.jit
def _z_from_launch(z_ptr, zd_ptr, bg, idx, cx, LP: tl.constexpr, NX: tl.constexpr,
                   ZD: tl.constexpr):
    """``Z [LP, NX]`` and (``ZD``; else zeros) ``Zd [NX, NX]`` of sequence and key group
    ``bg`` as ``_key_products_kernel`` wrote them."""
    Z = tl.load(z_ptr + (bg * LP + idx[:, None]) * NX + cx[None, :])
    if ZD:
        Zd = tl.load(zd_ptr + (bg * NX + cx[:, None]) * NX + cx[None, :])
    else:
        Zd = tl.zeros([NX, NX], tl.float32)
    return Z, Zd


@triton.jit
def _fold_coeffs_kernel(
        rla_ptr, rk_ptr, dla_ptr, dk_ptr, dbeta_ptr, q_ptr, ss_ptr, n_ptr, os_ptr, w_ptr,
        H, G, CAP, TD, TQ, window,
        K: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr, LP: tl.constexpr,
        NC: tl.constexpr, NS: tl.constexpr, NX: tl.constexpr, PREC: tl.constexpr,
        D_REL: tl.constexpr, SOLVE: tl.constexpr, NSQ: tl.constexpr, FUSED: tl.constexpr,
        SPREC: tl.constexpr, AT_WINDOW: tl.constexpr = False, PDL: tl.constexpr = False,
        SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
        OS_ADD: tl.constexpr = 0):
    """``fold_x="launch"``: the coefficients of ``_fold_matrices`` once per (sequence, value
    head) (program ``b * H + h``), written to ``w_ptr [B*H, 2 NX + LP, NX]`` (``Wy``, ``Wv``,
    ``Wu``) for the records kernel launched with WPRE, so its programs start the stream of C
    at once instead of after the products with the keys and the solve's coefficients. The
    same code as the records kernel's in-launch fold. PDL: let the records launch start at
    once (it waits before it reads the coefficients). AT_WINDOW: only the sequences whose
    rows end on the flush slot (the records launch's other programs return at once)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    mat = tl.program_id(0).to(tl.int64)
    b = mat // H
    h = mat - b * H
    g = h // (H // G)
    ss = tl.load(ss_ptr + b) + SS_ADD
    n = tl.load(n_ptr + b) + N_ADD
    if AT_WINDOW:
        if n != window:
            return
    o0 = tl.load(os_ptr + b) + OS_ADD
    idx = tl.arange(0, LP).to(tl.int64)
    cx = tl.arange(0, NX)
    ring, drf, di, ri = _slots(idx, ss, n, D_REL)
    la = _record_la(rla_ptr, dla_ptr, ring, drf, di, ri, b, h, H, CAP, TD)
    krow = ((b * CAP + ri) * G + g) * K
    kdrow = ((b * TD + di) * G + g) * K
    cs, isk, kbase, isq, qbase = _x_setup(cx, ss, n, b, g, G, TD, TQ, K, NS, D_REL, FUSED)
    Z, Zd = _key_products(rk_ptr, dk_ptr, q_ptr, krow, kdrow, ring, drf, 0, kbase, isk, qbase,
                          isq, cx, b, g, cs, n, G, TD, TQ, K, KC, STAGES, LP, NC, NS, NX, D_REL,
                          True, PREC, False, SOLVE, True)
    cvec = tl.cumsum(la, axis=0)
    Wy, Wv, Wu, _, _, _, _ = _fold_matrices(Z, Zd, cvec, idx, ring, cx, b, h, ss, n, o0, cs,
                                            window, dbeta_ptr, H, TD, TQ, NS, NX, D_REL, SOLVE,
                                            NSQ, FUSED, SPREC)
    wrow = mat * (2 * NX + LP)
    tl.store(w_ptr + (wrow + cx[:, None]) * NX + cx[None, :], Wy)
    tl.store(w_ptr + (wrow + NX + cx[:, None]) * NX + cx[None, :], Wv)
    tl.store(w_ptr + (wrow + 2 * NX + idx[:, None]) * NX + cx[None, :], Wu)


@triton.jit
def _c_times_x_late(c_ptr, cms_ptr, mat, rowg, rmask, cx, dk_ptr, q_ptr, b, g, cs, n, G, TD, TQ,
                    K: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr, BV: tl.constexpr,
                    NS: tl.constexpr, NX: tl.constexpr, NCP: tl.constexpr,
                    D_REL: tl.constexpr, FUSED: tl.constexpr, C: tl.constexpr):
    """``Y = C X [BV, NX]`` by FP32 FMA with one reduction at the end (``late_sum``;
    unblocked copies: fp32, bf16/fp16, fp8): the products ``C[v, k] X[k, c]`` of each chunk of
    ``KC`` columns are added element-wise into an accumulator ``[BV, NCP, KC]`` (``NCP`` the
    columns of X that are not padding, rounded up to a power of two), so the sum over a
    chunk's lanes (the cross-lane shuffles of ``tl.sum``) runs once per program instead of
    once per chunk and column. Column c of X as in ``_x_setup`` (key of solved row ``cs + c``
    for c < NS, then the queries). The sum over k: each accumulator element adds its
    ``K / KC`` products in order, then ``tl.sum`` over the ``KC`` lanes; a fixed order per
    program, the same for every batch. fp8: the matrix scale after the sum."""
    cp = tl.arange(0, NCP)
    # (cs: the slot of key column 0, the ss of _x_setup, which keeps it as it is)
    _, isk, kbase, isq, qbase = _x_setup(cp, cs, n, b, g, G, TD, TQ, K, NS, D_REL, FUSED)
    acc = tl.zeros([BV, NCP, KC], tl.float32)
    for k0 in tl.range(0, K, KC, num_stages=STAGES):
        kk = k0 + tl.arange(0, KC)
        x = _c_rows(c_ptr, rowg, rmask, k0, K, KC, C)  # [BV, KC]
        xk = tl.load(dk_ptr + kbase[:, None] + kk[None, :], mask=isk[:, None], other=0.0)
        xq = tl.load(q_ptr + qbase[:, None] + kk[None, :], mask=isq[:, None], other=0.0)
        acc += x[:, None, :] * (xk + xq)[None, :, :]
    R = tl.sum(acc, axis=2)  # [BV, NCP]
    if C.KIND == 2:
        R = R * tl.load(cms_ptr + mat)  # fp8 matrix scale, after the sum
    if NCP == NX:
        Y = R
    else:
        Y = tl.zeros([BV, NX], tl.float32)
        for c in tl.static_range(NCP):
            Y += tl.where(cx[None, :] == c, _col(R, cp, c)[:, None], 0.0)
    return Y


@triton.jit
def _c_times_x(c_ptr, cbs_ptr, cms_ptr, mat, rowg, rmask, cx, dk_ptr, q_ptr, kbase, isk, qbase,
               isq, b, g, cs, n, G, TD, TQ, K: tl.constexpr, KC: tl.constexpr,
               STAGES: tl.constexpr, BLK: tl.constexpr, BV: tl.constexpr, NC: tl.constexpr,
               NS: tl.constexpr, NX: tl.constexpr, D_REL: tl.constexpr, DOT: tl.constexpr,
               PREC: tl.constexpr, C: tl.constexpr, LATE: tl.constexpr = 0,
               NCP: tl.constexpr = 1, FUSED: tl.constexpr = False, XW=0,
               FOLD: tl.constexpr = False):
    """``Y = C X [BV, NX]`` for the rows ``rowg`` of the stored checkpoint (matrix ``mat``):
    C streamed along K in chunks of ``KC`` columns, decoded, times the ``NC`` columns of X
    (``_x_col`` / ``_x_cols``); blocked formats by scaling blocks with the block scale applied
    to each block's partial sum (dot path: to each element), the matrix scale (fp8, nvfp4)
    after the sum. Used by the records kernel, in the same launch or as its read pass
    (``YOUT``). ``FOLD`` (``fold_x``, products only): ``C (X XW)``, each chunk of X times
    ``XW`` before its product with C (``_xw``)."""
    Y = tl.zeros([BV, NX], tl.float32)
    if LATE > 0 and C.KIND <= 2 and not DOT:
        Y = _c_times_x_late(c_ptr, cms_ptr, mat, rowg, rmask, cx, dk_ptr, q_ptr, b, g, cs, n,
                            G, TD, TQ, K, LATE, STAGES, BV, NS, NX, NCP, D_REL, FUSED, C)
    elif C.KIND <= 2:
        for k0 in tl.range(0, K, KC, num_stages=STAGES):
            if DOT == 3:  # bf16 / fp8 values on bfloat16 tensor cores (use_dot="bf16x3")
                Y = _dot_b16(_c_rows_16(c_ptr, rowg, rmask, k0, K, KC, C),
                             _xw(dk_ptr, q_ptr, kbase, isk, qbase, isq, k0 + tl.arange(0, KC),
                                 K, XW, FOLD, PREC), Y)
            elif DOT == 2:  # fp16 values on float16 tensor cores (use_dot="f16x3")
                Y = _dot_h16(_c_rows_16(c_ptr, rowg, rmask, k0, K, KC, C),
                             _xw(dk_ptr, q_ptr, kbase, isk, qbase, isq, k0 + tl.arange(0, KC),
                                 K, XW, FOLD, PREC), Y)
            else:
                x = _c_rows(c_ptr, rowg, rmask, k0, K, KC, C)
                Y = _add_times_x(Y, x, k0 + tl.arange(0, KC), cx, dk_ptr, q_ptr, kbase, isk,
                                 qbase, isq, b, g, cs, n, G, TD, TQ, NC, NS, K, D_REL, DOT, PREC,
                                 XW, FOLD)
        if C.KIND == 2:
            Y = Y * tl.load(cms_ptr + mat)  # fp8 matrix scale, after the sum
    else:
        NBC: tl.constexpr = KC // BLK
        if C.FP4:
            W: tl.constexpr = BLK // 2
            ES: tl.constexpr = 2  # element stride of a nibble half
        else:
            W: tl.constexpr = BLK
            ES: tl.constexpr = 1
        for k0 in tl.range(0, K, KC, num_stages=STAGES):
            if DOT == 2:  # nvfp4 on float16 tensor cores (use_dot="f16x3"), one product per half
                ve, vo = _c_blocks_f16(c_ptr, cbs_ptr, rowg, rmask, k0, K, BLK, NBC, W, C)
                jf = tl.arange(0, NBC * W)
                Y = _dot_c16(tl.reshape(ve, [BV, NBC * W]),
                             _xw(dk_ptr, q_ptr, kbase, isk, qbase, isq, k0 + 2 * jf, K, XW,
                                 FOLD, PREC), Y)
                Y = _dot_c16(tl.reshape(vo, [BV, NBC * W]),
                             _xw(dk_ptr, q_ptr, kbase, isk, qbase, isq, k0 + 2 * jf + 1, K, XW,
                                 FOLD, PREC), Y)
            else:
                xe, xo, sc = _c_blocks(c_ptr, cbs_ptr, rowg, rmask, k0, K, BLK, NBC, W, C)
                if DOT:  # block scale per element, then one product per half
                    jf = tl.arange(0, NBC * W)
                    ve = tl.reshape(xe * sc[:, :, None], [BV, NBC * W])
                    Y += tl.dot(ve, _xw(dk_ptr, q_ptr, kbase, isk, qbase, isq, k0 + ES * jf, K,
                                        XW, FOLD, PREC), input_precision=PREC)
                    if C.FP4:
                        vo = tl.reshape(xo * sc[:, :, None], [BV, NBC * W])
                        Y += tl.dot(vo, _xw(dk_ptr, q_ptr, kbase, isk, qbase, isq,
                                            k0 + ES * jf + 1, K, XW, FOLD, PREC),
                                    input_precision=PREC)
                else:  # block partial sums, the block scale applied to each
                    e3 = k0 + ES * (tl.arange(0, NBC)[:, None] * W + tl.arange(0, W)[None, :])
                    for c in tl.static_range(NC):
                        xv = _x_col(dk_ptr, q_ptr, b, g, cs, n, G, TD, TQ, e3, c, NS, K, D_REL)
                        part = tl.sum(xe * xv[None, :, :], axis=2)
                        if C.FP4:
                            xv1 = _x_col(dk_ptr, q_ptr, b, g, cs, n, G, TD, TQ, e3 + 1, c, NS, K,
                                         D_REL)
                            part += tl.sum(xo * xv1[None, :, :], axis=2)
                        yc = tl.sum(part * sc, axis=1)
                        Y += tl.where(cx[None, :] == c, yc[:, None], 0.0)
        if C.KIND == 3:
            Y = Y * tl.load(cms_ptr + mat)  # nvfp4 matrix scale, after the sum
    return Y


@triton.jit
def _split_f16(x):
    """Each column of ``x [R, N]`` (float32) scaled by a power of two s (its largest magnitude
    into [2^14, 2^15); below 2^-113 scaled as if it were 2^-113) and split into three float16
    terms ``x s = hi + mid + lo`` (about 33 significant bits; an element's error is at most
    about 2^-39 of the column's largest magnitude: elements below about 2^-14 of it lose low
    bits to float16's subnormals): ``(hi, mid, lo, 2^14 / s [N])``."""
    m = tl.max(tl.abs(x), axis=0)
    e = tl.maximum((m.to(tl.int32, bitcast=True) >> 23) & 255, 14)  # biased exponent of max
    s = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2^(14 - (e - 127))
    inv = (e << 23).to(tl.float32, bitcast=True)  # 2^14 / s = 2^(e - 127)
    xs = x * s[None, :]
    hi = xs.to(tl.float16)
    r = xs - hi.to(tl.float32)
    mid = r.to(tl.float16)
    lo = (r - mid.to(tl.float32)).to(tl.float16)
    return hi, mid, lo, inv


@triton.jit
def _x_split_kernel(dk_ptr, q_ptr, ss_ptr, n_ptr, x16_ptr, xinv_ptr, G, TD, TQ,
                    K: tl.constexpr, NS: tl.constexpr, NXS: tl.constexpr, D_REL: tl.constexpr,
                    FUSED: tl.constexpr,
                    SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
                    OS_ADD: tl.constexpr = 0):
    """X of one (sequence, key group) (program ``b * G + g``; the columns of ``_x_setup``:
    the solved rows' keys, then the queries) split for the float16 read pass
    (``_c_times_x16``): ``x16 [K, 16]`` float16 with column ``t * NXS + c`` the term t (hi,
    mid, lo of ``_split_f16``) of column c (``c < NXS``; zero columns from ``3 * NXS`` on),
    and ``xinv [NXS]`` each column's ``2^14 / s``. Depends on the sequence's own keys and
    queries only."""
    bg = tl.program_id(0).to(tl.int64)
    b = bg // G
    g = bg - b * G
    ss = tl.load(ss_ptr + b) + SS_ADD
    n = tl.load(n_ptr + b) + N_ADD
    j = tl.arange(0, 16)
    cs, isk, kbase, isq, qbase = _x_setup(j % NXS, ss, n, b, g, G, TD, TQ, K, NS, D_REL, FUSED)
    live = j < 3 * NXS
    kk = tl.arange(0, K)
    x = _x_cols(dk_ptr, q_ptr, kbase, isk & live, qbase, isq & live, kk, K)  # [K, 16]
    hi, mid, lo, inv = _split_f16(x)
    t = (j // NXS)[None, :]
    v = tl.where(t == 0, hi, tl.where(t == 1, mid, lo))
    tl.store(x16_ptr + (bg * K + kk[:, None]) * 16 + j[None, :], v)
    tl.store(xinv_ptr + bg * NXS + j, inv, mask=j < NXS)


@triton.jit
def _x8(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e, c: tl.constexpr, NS: tl.constexpr,
        K: tl.constexpr, D_REL: tl.constexpr):
    """Column ``c`` of X (``_x_col``) at the eight element indices ``e + 0 .. e + 7``."""
    return (_x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e, c, NS, K, D_REL),
            _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e + 1, c, NS, K, D_REL),
            _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e + 2, c, NS, K, D_REL),
            _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e + 3, c, NS, K, D_REL),
            _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e + 4, c, NS, K, D_REL),
            _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e + 5, c, NS, K, D_REL),
            _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e + 6, c, NS, K, D_REL),
            _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e + 7, c, NS, K, D_REL))


@triton.jit
def _e2m1_dot8_int(word, x0, x1, x2, x3, x4, x5, x6, x7):
    """``codec._e2m1_dot8_1`` without PTX (the interpreter, ``e2m1_decode="integer"``): the
    eight codes of each int32 ``word`` by the integer decoder, times 2^-14 (exact), and the
    same float32 operations in the same order (a product, then seven FMAs), so the same
    bits."""
    s = 0.00006103515625  # 2^-14
    p = (_e2m1_value(word & 15) * s) * x0
    p = tl.fma(_e2m1_value((word >> 4) & 15) * s, x1, p)
    p = tl.fma(_e2m1_value((word >> 8) & 15) * s, x2, p)
    p = tl.fma(_e2m1_value((word >> 12) & 15) * s, x3, p)
    p = tl.fma(_e2m1_value((word >> 16) & 15) * s, x4, p)
    p = tl.fma(_e2m1_value((word >> 20) & 15) * s, x5, p)
    p = tl.fma(_e2m1_value((word >> 24) & 15) * s, x6, p)
    return tl.fma(_e2m1_value((word >> 28) & 15) * s, x7, p)


@triton.jit
def _x_limbs(xi_ptr, xl, L4: tl.constexpr):
    """The three limbs (``_x_int_store``'s layout) of the four groups of four elements of the
    blocks starting at ``xl [NB]``, each ``[1, NB]``: X0 of groups 0-3, U1 of 0-3, U2 of
    0-3."""
    return (tl.load(xi_ptr + xl)[None, :], tl.load(xi_ptr + xl + 1)[None, :],
            tl.load(xi_ptr + xl + 2)[None, :], tl.load(xi_ptr + xl + 3)[None, :],
            tl.load(xi_ptr + xl + L4)[None, :], tl.load(xi_ptr + xl + L4 + 1)[None, :],
            tl.load(xi_ptr + xl + L4 + 2)[None, :], tl.load(xi_ptr + xl + L4 + 3)[None, :],
            tl.load(xi_ptr + xl + 2 * L4)[None, :], tl.load(xi_ptr + xl + 2 * L4 + 1)[None, :],
            tl.load(xi_ptr + xl + 2 * L4 + 2)[None, :],
            tl.load(xi_ptr + xl + 2 * L4 + 3)[None, :])


@triton.jit
def _x_int_stored(xi_ptr, xs_ptr, bg, c: tl.constexpr, NC: tl.constexpr, K: tl.constexpr):
    """Column ``c`` of X's integers for (sequence, key group) ``bg`` as ``_x_int_kernel``
    stored them (``_x_int_store``'s layout: per column three limbs of ``K/4`` words, then a
    bias word per block; ``xs`` per block): the twelve limbs ``[1, K/16]`` (``_x_limbs``), the
    bias and ``xs`` ``[1, K/16]``, the form ``_x_int_limbs`` returns them in."""
    NB: tl.constexpr = K // 16
    L4: tl.constexpr = K // 4
    XW: tl.constexpr = 3 * L4 + NB  # _x_int_store's int32 words per column
    jb = tl.arange(0, NB)
    col = bg * NC + c
    l0, l1, l2, l3, m0, m1, m2, m3, n0, n1, n2, n3 = _x_limbs(xi_ptr, col * XW + jb * 4, L4)
    bias = tl.load(xi_ptr + col * XW + 3 * L4 + jb)[None, :]
    xs = tl.load(xs_ptr + col * NB + jb)[None, :]
    return l0, l1, l2, l3, m0, m1, m2, m3, n0, n1, n2, n3, bias, xs


@triton.jit
def _key_group_tile(H, G, V: tl.constexpr, BV: tl.constexpr):
    """The lean read passes' tile of program ``program_id(0) = (b * G + g) * tiles + t``:
    ``BV`` rows of a (sequence, key group)'s ``H // G`` matrices, head after head (a tile may
    span heads, which share X). Returns ``(HG, bg, b, g, off, row0, rl, rmask)``: value heads
    per key group, ``b * G + g``, the sequence and key group, the tile's first row within
    the group (int32) and among all value rows (int64, once per program), the rows' int32
    offsets from it and their mask (rows past the group), so per-row addresses are 32-bit
    offsets from scalar bases; V is a constexpr, so a row's head is a division by a
    constant."""
    pid = tl.program_id(0).to(tl.int64)
    HG = H // G  # value heads per key group: their (HG * V) rows share X
    nt = tl.cdiv(HG * V, BV)
    bg = pid // nt
    vt = pid - bg * nt
    b = bg // G
    g = bg - b * G
    off = (vt * BV).to(tl.int32)  # the tile's first row within the group
    row0 = (b * H + g * HG) * V + vt * BV  # its index among all value rows
    rl = tl.arange(0, BV)
    return HG, bg, b, g, off, row0, rl, rl < HG * V - off


@triton.jit
def _nvfp4_tile_codes(c_ptr, cbs_ptr, cms_ptr, b, g, H, HG, off, row0, rl, rmask,
                      V: tl.constexpr, K: tl.constexpr):
    """A lean nvfp4 read pass's tile (``_key_group_tile``'s rows ``rl`` from ``row0``, mask
    ``rmask``): the codes as 32-bit words of eight ``wrd [BV, K/16, 2]`` int32, the E4M3
    block-scale codes ``[BV, K/16]`` and each row's matrix scale ``ms [BV]`` (its head's)."""
    NB: tl.constexpr = K // 16
    jb = tl.arange(0, NB)
    wi = tl.arange(0, 2)
    wrd = tl.load(c_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + row0 * (K // 8)
                  + (rl[:, None, None] * (K // 8) + (jb[:, None] * 2 + wi[None, :])[None]),
                  mask=rmask[:, None, None], other=0)
    scode = tl.load(cbs_ptr + row0 * NB + (rl[:, None] * NB + jb[None, :]), mask=rmask[:, None],
                    other=0)
    ms = tl.load(cms_ptr + (b * H + g * HG) + (off + rl) // V, mask=rmask,
                 other=0.0)  # each row's matrix scale
    return wrd, scode, ms


@triton.jit
def _idot_rows(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3, xc0, xs0,
               d0, d1, d2, d3, g0, g1, g2, g3, h0, h1, h2, h3, xc1, xs1, sc, ms,
               NC: tl.constexpr, PTX: tl.constexpr):
    """The integer-dot read pass's rows (``_nvfp4_read_kernel``'s ``IDOT``): ``(y0, y1)``
    ``[BV]``, ``y_c = sum_j ((I_cj - bias_cj) xs_cj) s_j`` times the matrix scale ``ms``, each
    block's integer ``I_cj = sum_k 2 e_k X_k`` from the words ``w0, w1 [BV, K/16]`` and X's
    limbs (column 0: ``a*, b*, f*``, bias ``xc0``, ``xs0``; column 1 (NC = 2): ``d*, g*,
    h*``, ``xc1``, ``xs1``; with NC = 1 they are not read and ``y1`` is ``y0``) by
    ``_e2m1_idot16_1`` / ``_e2m1_idot16_2`` (``PTX``) or ``_e2m1_idot16_int``; ``sc
    [BV, K/16]`` the block scales' values."""
    if NC == 1:
        if PTX:
            i0 = _e2m1_idot16_1(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3)
        else:
            i0 = _e2m1_idot16_int(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3)
        y0 = tl.sum(((i0 - xc0).to(tl.float32) * xs0) * sc, axis=1) * ms
        y1 = y0
    else:
        if PTX:
            i0, i1 = _e2m1_idot16_2(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3,
                                    d0, d1, d2, d3, g0, g1, g2, g3, h0, h1, h2, h3)
        else:
            i0 = _e2m1_idot16_int(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3)
            i1 = _e2m1_idot16_int(w0, w1, d0, d1, d2, d3, g0, g1, g2, g3, h0, h1, h2, h3)
        y0 = tl.sum(((i0 - xc0).to(tl.float32) * xs0) * sc, axis=1) * ms
        y1 = tl.sum(((i1 - xc1).to(tl.float32) * xs1) * sc, axis=1) * ms
    return y0, y1


@triton.jit
def _nvfp4_read_kernel(c_ptr, cbs_ptr, cms_ptr, dk_ptr, q_ptr, ss_ptr, n_ptr, y_ptr, xi_ptr,
                       xs_ptr, H, G, TD, TQ, V: tl.constexpr, K: tl.constexpr, NC: tl.constexpr,
                       NS: tl.constexpr, D_REL: tl.constexpr, BV: tl.constexpr,
                       PTX: tl.constexpr, PDL: tl.constexpr = False,
                       EARLY: tl.constexpr = False, IDOT: tl.constexpr = False,
                       SCVT: tl.constexpr = False, WAITX: tl.constexpr = False,
                       SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
                       OS_ADD: tl.constexpr = 0, XIN: tl.constexpr = False):
    """The lean read pass (``records_outputs(read_pass=(block_v, num_warps, "lean"))``):
    ``Y = C X`` ``[BV, NC]`` (NC = 1 or 2; float32 to ``y [B*H*V, NC]``) of an nvfp4 copy for
    ``BV`` value rows of one (sequence, key group): its ``H // G`` matrices' rows, head after
    head, in tiles of ``BV`` (a tile may span heads, which share X; program ``(b * G + g) *
    tiles + t``), X the columns of ``_x_col`` (the solved rows' keys, then the queries), and
    nothing else. Per value row
    and scaling block j (16 codes): ``sum_k e_k x_k`` over the block, times the E4M3 block
    scale, summed over the blocks, times the matrix scale (Eq. of the nvfp4 dequantisation,
    DESIGN.md "Formats", reassociated: the scales multiply the block sums). ``PTX`` (CUDA):
    each 32-bit word of 8 codes decoded and multiplied in one inline-PTX FMA chain per column
    (``codec._e2m1_dot8_1`` / ``_e2m1_dot8_2``, values times 2^-14, 2^14 folded into the block
    scale, exact unless a product falls below 2^-112 in magnitude, as with the half decoder);
    otherwise (the interpreter, ``e2m1_decode="integer"``) the integer decoder in the same
    float32 operations (``_e2m1_dot8_int``), so the same bits. Each row
    depends on its own codes and its sequence's X only. ``PDL``: a dependent launch of the
    products launch; it waits for that grid before its stores, so that the records launch
    after it, waiting on it, also waits on the products launch. ``EARLY``: let the dependent
    launch after it (launched with PDL) start once every program of this one has started
    (``gdc_launch_dependents``), so its loads before its ``gdc_wait`` overlap this launch's
    last wave. ``IDOT`` (``read_pass`` form ``"idot"``): X as integers from the launch before
    (``_x_int_store``: per column and block of 16 elements 24-bit integers ``X`` and a power
    of two ``xs``), each block's ``sum_k 2 e_k X_k`` exact in int32 (``codec._e2m1_idot16_1``
    / ``_e2m1_idot16_2``: byte-permute lookups and dp4a over the block's two words;
    ``_e2m1_idot16_int`` the same integer without PTX), converted to float32 and
    multiplied by ``xs`` then by the E4M3 block scale (the words' sums carry a bias of
    ``128 sum X``, taken away per block before the conversion, after which each block's sum
    is exact); the blocks' sum times the matrix
    scale. X's rounding (at most 2^-22 of each block's largest element; see ``_x_int_col``
    for blocks below 2^-103) is the form's only error beyond FP32's; X's integers come from
    the call's first launch (``_x_int_kernel``), so with PDL it waits only before its
    stores. ``SCVT``: the block scales by the hardware's E4M3 conversion
    (``codec._e4m3_value_cvt``, sm_89 and later), else ``codec._e4m3_value_f16`` (the same
    values). ``WAITX`` (form ``"idot_pdl"``, with ``PDL``): this launch is the dependent of
    X's integers' launch (the products launch comes after it): it issues its loads of the
    codes and scales, then waits for that grid before it reads X's integers. ``XIN`` (form
    ``"idot_in"``, with ``IDOT``): X's integers formed in the program (``_x_int_limbs``, the
    integers ``_x_int_kernel`` would store, so the same bits), so the step has no launch for
    them."""
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    HG, bg, b, g, off, row0, rl, rmask = _key_group_tile(H, G, V, BV)
    ss = tl.load(ss_ptr + b) + SS_ADD
    n = tl.load(n_ptr + b) + N_ADD
    NB: tl.constexpr = K // 16
    jb = tl.arange(0, NB)
    wi = tl.arange(0, 2)
    e0 = jb[:, None] * 16 + wi[None, :] * 8  # [NB, 2]: the first code of each word
    # the codes first: nothing the compiler cannot move loads across (a layout conversion's
    # barrier) comes before them
    wrd, scode, ms = _nvfp4_tile_codes(c_ptr, cbs_ptr, cms_ptr, b, g, H, HG, off, row0, rl,
                                       rmask, V, K)
    if IDOT:
        if SCVT:  # the hardware's E4M3 conversion (sm_89 and later)
            sc = _e4m3_value_cvt(scode)
        else:
            sc = _e4m3_value_f16(scode)
    else:
        sc = _e4m3_value(scode.to(tl.int32))
    yb = y_ptr + row0 * NC  # the tile's first row of y
    if IDOT:  # X's integers: from the call's first launch, complete before this one's
        # predecessor began, so no wait (PDL: it waits before its stores); WAITX: that
        # launch is this one's predecessor: wait for it here, after the loads of the codes
        if WAITX:
            tl.extra.cuda.gdc_wait()
        w0, w1 = tl.split(wrd)  # [BV, NB]: each block's codes 0-7 and 8-15
        a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3, xc0, xs0 = _x_int_of(
            XIN, dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, xi_ptr, xs_ptr, bg, 0, NC, K, NS, D_REL)
        if NC == 1:
            y0, _ = _idot_rows(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3, xc0, xs0,
                               a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3, xc0, xs0, sc,
                               ms, NC, PTX)
            if PDL and not WAITX:
                tl.extra.cuda.gdc_wait()
            tl.store(yb + rl, y0, mask=rmask)
        else:
            d0, d1, d2, d3, g0, g1, g2, g3, h0, h1, h2, h3, xc1, xs1 = _x_int_of(
                XIN, dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, xi_ptr, xs_ptr, bg, 1, NC, K, NS,
                D_REL)
            y0, y1 = _idot_rows(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3, xc0,
                                xs0, d0, d1, d2, d3, g0, g1, g2, g3, h0, h1, h2, h3, xc1, xs1,
                                sc, ms, NC, PTX)
            if PDL and not WAITX:
                tl.extra.cuda.gdc_wait()
            tl.store(yb + rl * 2, y0, mask=rmask)
            tl.store(yb + rl * 2 + 1, y1, mask=rmask)
        return
    sc = sc * E2M1_HALF_SCALE  # exact: an E4M3 value times 2^14
    a0, a1, a2, a3, a4, a5, a6, a7 = _x8(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e0, 0, NS, K,
                                         D_REL)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if NC == 1:
        if PTX:
            p0 = _e2m1_dot8_1(wrd, a0[None], a1[None], a2[None], a3[None], a4[None], a5[None],
                              a6[None], a7[None])
        else:
            p0 = _e2m1_dot8_int(wrd, a0[None], a1[None], a2[None], a3[None], a4[None],
                                a5[None], a6[None], a7[None])
        y0 = tl.sum(tl.sum(p0, axis=2) * sc, axis=1) * ms
        tl.store(yb + rl, y0, mask=rmask)
    else:
        c0, c1, c2, c3, c4, c5, c6, c7 = _x8(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, e0, 1, NS,
                                             K, D_REL)
        if PTX:
            p0, p1 = _e2m1_dot8_2(wrd, a0[None], a1[None], a2[None], a3[None], a4[None],
                                  a5[None], a6[None], a7[None], c0[None], c1[None], c2[None],
                                  c3[None], c4[None], c5[None], c6[None], c7[None])
        else:
            p0 = _e2m1_dot8_int(wrd, a0[None], a1[None], a2[None], a3[None], a4[None],
                                a5[None], a6[None], a7[None])
            p1 = _e2m1_dot8_int(wrd, c0[None], c1[None], c2[None], c3[None], c4[None],
                                c5[None], c6[None], c7[None])
        y0 = tl.sum(tl.sum(p0, axis=2) * sc, axis=1) * ms
        y1 = tl.sum(tl.sum(p1, axis=2) * sc, axis=1) * ms
        tl.store(yb + rl * 2, y0, mask=rmask)
        tl.store(yb + rl * 2 + 1, y1, mask=rmask)


@triton.jit
def _f32_read_kernel(c_ptr, dk_ptr, q_ptr, ss_ptr, n_ptr, y_ptr, H, G, TD, TQ,
                     V: tl.constexpr, K: tl.constexpr, NC: tl.constexpr, NS: tl.constexpr,
                     D_REL: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False,
                     EARLY: tl.constexpr = False,
                     SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
                     OS_ADD: tl.constexpr = 0):
    """The lean read pass of an FP32 copy (``records_outputs(read_pass=(block_v, num_warps,
    "lean"))`` with C float32): ``Y = C X`` ``[BV, NC]`` (NC = 1 or 2; float32 to ``y
    [B*H*V, NC]``) for ``BV`` value rows of one (sequence, key group), tiled as
    ``_nvfp4_read_kernel`` tiles them (head after head; program ``(b * G + g) * tiles +
    t``), X the columns of ``_x_col``: per row one float32 reduction over K of the products
    (the FP32 state read, the step's ``R k`` / ``R q``, Eq. of the output-only form). Each
    row depends on its own values and its sequence's X only. ``PDL`` / ``EARLY``: as
    ``_nvfp4_read_kernel``'s (wait for the products launch before the stores; let the
    launch after this one start once every program of this one has started)."""
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    _, _, b, g, _, row0, rl, rmask = _key_group_tile(H, G, V, BV)
    kk = tl.arange(0, K)
    c = tl.load(c_ptr + row0 * K + (rl[:, None] * K + kk[None, :]), mask=rmask[:, None],
                other=0.0)  # [BV, K]
    ss = tl.load(ss_ptr + b) + SS_ADD
    n = tl.load(n_ptr + b) + N_ADD
    yb = y_ptr + row0 * NC  # the tile's first row of y
    x0 = _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, kk, 0, NS, K, D_REL)
    y0 = tl.sum(c * x0[None, :], axis=1)
    if NC == 1:
        if PDL:
            tl.extra.cuda.gdc_wait()
        tl.store(yb + rl, y0, mask=rmask)
    else:
        x1 = _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, kk, 1, NS, K, D_REL)
        y1 = tl.sum(c * x1[None, :], axis=1)
        if PDL:
            tl.extra.cuda.gdc_wait()
        tl.store(yb + rl * 2, y0, mask=rmask)
        tl.store(yb + rl * 2 + 1, y1, mask=rmask)


@triton.jit
def _step_rows_load(ss_ptr, n_ptr, os_ptr, rla_ptr, rw_ptr, dla_ptr, dv_ptr, dbeta_ptr, b, h, vr,
                    rmask, H, CAP, TD, V: tl.constexpr, LP: tl.constexpr,
                    D_REL: tl.constexpr, GDN: tl.constexpr,
                    SS_ADD: tl.constexpr, N_ADD: tl.constexpr, OS_ADD: tl.constexpr):
    """What the records work of a decode step's read pass (``_f32_step_kernel``,
    ``_nvfp4_step_kernel``) loads for value rows ``vr [BV]`` (mask ``rmask``) of value head
    ``h`` of sequence ``b``, before the rows' products with R: ``(ss, n, o0, idx, ring, drf,
    di, ri, la, U, pd, vp, bp)``: the sequence's draft row, rows and output slot, the record
    slots (``_slots``), their log decays ``la [LP]``, the cached corrections (GDN; Mamba-2:
    v, the draft row's too) ``U [LP, BV]``, the draft row's index, its v ``[BV]`` and (GDN)
    beta."""
    ss = tl.load(ss_ptr + b) + SS_ADD
    n = tl.load(n_ptr + b) + N_ADD
    o0 = tl.load(os_ptr + b) + OS_ADD
    idx = tl.arange(0, LP).to(tl.int64)
    ring, drf, di, ri = _slots(idx, ss, n, D_REL)
    la = tl.where(ring, tl.load(rla_ptr + (b * CAP + ri) * H + h, mask=ring, other=0.0),
                  tl.load(dla_ptr + (b * TD + di) * H + h, mask=drf, other=0.0))  # [LP]
    m2 = ring[:, None] & rmask[None, :]
    U = tl.load(rw_ptr + ((b * CAP + ri)[:, None] * H + h) * V + vr[None, :], mask=m2,
                other=0.0)  # [LP, BV]
    if D_REL:
        pd = ss * 0
    else:
        pd = ss
    rstep = rmask & (vr * 0 + n > ss)
    vp = tl.load(dv_ptr + ((b * TD + pd) * H + h) * V + vr, mask=rstep, other=0.0)  # [BV]
    if GDN:
        bp = tl.load(dbeta_ptr + (b * TD + pd) * H + h, mask=n > ss, other=0.0)
    else:  # Mamba-2: w = v for the draft row too
        bp = 0.0
        U += tl.load(dv_ptr + ((b * TD + di)[:, None] * H + h) * V + vr[None, :],
                     mask=drf[:, None] & rmask[None, :], other=0.0)
    return ss, n, o0, idx, ring, drf, di, ri, la, U, pd, vp, bp


@triton.jit
def _step_products(z_ptr, rk_ptr, dk_ptr, q_ptr, b, g, ss, n, idx, ring, drf, di, ri, G, CAP,
                   TD, TQ, K: tl.constexpr, LP: tl.constexpr, NX: tl.constexpr,
                   NC: tl.constexpr, NS: tl.constexpr, D_REL: tl.constexpr,
                   GDN: tl.constexpr, PDL: tl.constexpr, ZIN: tl.constexpr,
                   KC: tl.constexpr, STAGES: tl.constexpr, DOT: tl.constexpr,
                   PREC: tl.constexpr):
    """A decode step's products with the record keys for sequence ``b``, key group ``g``:
    ``(kq, kkp)``, ``k_j . q`` and (GDN; else zeros) ``k_i . k_p`` ``[LP]``: from the products
    launch's ``Z`` (``PDL``: after waiting for it) or, with ``ZIN``, formed here from the
    record keys by ``_key_products`` (``_key_products_kernel``'s products, the same chunks
    ``KC`` / ``STAGES`` and ``DOT`` / ``PREC``)."""
    if ZIN:
        cx = tl.arange(0, NX)
        cs, isk, kbase, isq, qbase = _x_setup(cx, ss, n, b, g, G, TD, TQ, K, NS, D_REL, False)
        Z, _ = _key_products(rk_ptr, dk_ptr, q_ptr, ((b * CAP + ri) * G + g) * K,
                             ((b * TD + di) * G + g) * K, ring, drf, 0, kbase, isk, qbase, isq,
                             cx, b, g, cs, n, G, TD, TQ, K, KC, STAGES, LP, NC, NS, NX, D_REL,
                             DOT, PREC, False, 0, GDN)
        kq = _col(Z, cx, NC - 1)
        if GDN:
            kkp = _col(Z, cx, 0)
        else:
            kkp = kq * 0.0
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        zrow = ((b * G + g) * LP + idx) * NX  # [LP]
        kq = tl.load(z_ptr + zrow + (NC - 1))
        if GDN:
            kkp = tl.load(z_ptr + zrow)
        else:
            kkp = kq * 0.0
    return kq, kkp


@triton.jit
def _step_rows_finish(y0, cq, kq, kkp, la, U, vp, bp, b, g, h, hl, off, vr, rmask, ss, n, o0,
                      idx, pd, dk_ptr, dla_ptr, o_ptr, wo_ptr, ala_ptr, ak_ptr, av_ptr,
                      abeta_ptr, H, G, CAP, TD, OT, OT0, WCAP, V: tl.constexpr,
                      K: tl.constexpr, GDN: tl.constexpr):
    """The records work of a decode step's read pass on value rows ``vr`` of head ``h``
    (``hl`` within its key group, the tile's first row ``off`` within the group), given
    ``y0 = R k_p`` (GDN; Mamba-2: ``R q``) and ``cq = R q`` ``[BV]``, the products with the
    keys (``_step_products``) and what ``_step_rows_load`` loaded: GDN's correction of the
    draft row ``u_p = beta_p (v_p - gamma_{1:p} R k_p) - sum_{i<p} beta_p gamma_{i+1:p}
    (k_i . k_p) u_i`` (written to ``wo`` at slot p), the output of query 0 at slot ``o``,
    ``o_o = gamma_{1:o} (R q) + sum_{j<=o} gamma_{j+1:o} (k_j . q) w_j`` (the output-only
    form, ``replay.gdn.gdn_step_output`` / ``replay.mamba2.mamba2_step_output``), and the
    append of the draft row (v on every tile; la, beta on the head's first tile; k on the
    key group's first tile)."""
    step = n > ss  # the decode step's draft row ss (one at most)
    cvec = tl.cumsum(la, axis=0)  # c_p = sum_{j<=p} la_j
    if GDN:
        if step:
            sel = idx == ss
            cp = tl.sum(tl.where(sel, cvec, 0.0), axis=0)
            before = idx < ss
            coef = tl.where(before, (bp * tl.exp(tl.where(before, cp - cvec, 0.0))) * kkp, 0.0)
            u = bp * (vp - tl.exp(cp) * y0) - tl.sum(coef[:, None] * U, axis=0)  # [BV]
            tl.store(wo_ptr + ((b * WCAP + ss) * H + h) * V + vr, u, mask=rmask)
            U = tl.where(sel[:, None], u[None, :], U)
    cp = tl.sum(tl.where(idx == o0, cvec, 0.0), axis=0)
    upto = idx <= o0
    m = tl.where(upto, tl.exp(tl.where(upto, cp - cvec, 0.0)), 0.0)
    o = tl.exp(cp) * cq + tl.sum((m * kq)[:, None] * U, axis=0)
    tl.store(o_ptr + ((b * OT + OT0) * H + h) * V + vr, o, mask=rmask)
    if step:  # the decode step's append of row ss
        tl.store(av_ptr + ((b * CAP + ss) * H + h) * V + vr, vp, mask=rmask)
        if off - hl * V == 0:  # the head's first tile: its scalars
            tl.store(ala_ptr + (b * CAP + ss) * H + h, tl.load(dla_ptr + (b * TD + pd) * H + h))
            if GDN:
                tl.store(abeta_ptr + (b * CAP + ss) * H + h, bp)
            if off == 0:  # the key group's first tile: its key
                kk = tl.arange(0, K)
                kp = tl.load(dk_ptr + ((b * TD + pd) * G + g) * K + kk)
                tl.store(ak_ptr + ((b * CAP + ss) * G + g) * K + kk, kp)


@triton.jit
def _f32_step_kernel(c_ptr, dk_ptr, q_ptr, ss_ptr, n_ptr, os_ptr, rla_ptr, rw_ptr, dla_ptr,
                     dv_ptr, dbeta_ptr, o_ptr, wo_ptr, ala_ptr, ak_ptr, av_ptr, abeta_ptr,
                     z_ptr, rk_ptr, H, G, CAP, TD, TQ, OT, OT0, WCAP, V: tl.constexpr,
                     K: tl.constexpr, LP: tl.constexpr, NX: tl.constexpr, NC: tl.constexpr,
                     NS: tl.constexpr, D_REL: tl.constexpr, BV: tl.constexpr,
                     GDN: tl.constexpr, PDL: tl.constexpr = False, ZIN: tl.constexpr = False,
                     KC: tl.constexpr = 128, STAGES: tl.constexpr = 1, DOT: tl.constexpr = False,
                     PREC: tl.constexpr = "ieee",
                     SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
                     OS_ADD: tl.constexpr = 0):
    """The lean FP32 read pass with the decode step's records work on its own rows (read-pass
    form ``"lean_out"``; no records launch): ``_f32_read_kernel``'s tile and products (``Y = C
    X``, one float32 reduction over K per row and column) and then, for the tile's ``BV``
    value rows of one value head (``V % BV == 0``), what ``_step_out_kernel`` does for them:
    GDN's correction of the draft row ``u_p = beta_p (v_p - gamma_{1:p} R k_p) - sum_{i<p}
    beta_p gamma_{i+1:p} (k_i . k_p) u_i`` (written to ``wo`` at slot p), the output of query 0
    at slot ``o``, ``o_o = gamma_{1:o} (R q) + sum_{j<=o} gamma_{j+1:o} (k_j . q) w_j`` (the
    output-only form, ``replay.gdn.gdn_step_output`` / ``replay.mamba2.mamba2_step_output``),
    and the append of the draft row (v on every tile; la, beta on the head's first tile; k
    on the first tile of each key group). Every operation is per row once the head's scalars
    (decays, ``Z`` of the products with the keys) are known, so no other program's rows are read.
    ``PDL``: launched after the products launch; it reads C, the records and X first and
    waits for the products launch before it reads ``Z``. ``ZIN`` (read-pass form
    ``"lean_one"``): no products launch; the program forms ``Z`` itself from the record keys
    (``rk_ptr``, the draft key) with ``_key_products``, as ``_key_products_kernel`` does with
    the same ``KC``, ``STAGES``, ``DOT`` and ``PREC`` (a reduction's order follows the
    launch's ``num_warps``, so the last bits of ``Z`` may differ from the products launch's;
    they depend on the (sequence, key group) alone)."""
    _, _, b, g, off, row0, rl, rmask = _key_group_tile(H, G, V, BV)
    HG = H // G
    hl = off // V  # the tile's head within the key group (V % BV == 0: one head per tile)
    h = g * HG + hl
    vr = off - hl * V + rl  # the tile's rows within its head
    kk = tl.arange(0, K)
    c = tl.load(c_ptr + row0 * K + (rl[:, None] * K + kk[None, :]), mask=rmask[:, None],
                other=0.0)  # [BV, K]
    ss, n, o0, idx, ring, drf, di, ri, la, U, pd, vp, bp = _step_rows_load(
        ss_ptr, n_ptr, os_ptr, rla_ptr, rw_ptr, dla_ptr, dv_ptr, dbeta_ptr, b, h, vr, rmask, H,
        CAP, TD, V, LP, D_REL, GDN, SS_ADD, N_ADD, OS_ADD)
    x0 = _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, kk, 0, NS, K, D_REL)
    y0 = tl.sum(c * x0[None, :], axis=1)  # R k_p (GDN) or R q (Mamba-2)
    if NC == 2:
        x1 = _x_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, kk, 1, NS, K, D_REL)
        cq = tl.sum(c * x1[None, :], axis=1)  # R q
    else:
        cq = y0
    kq, kkp = _step_products(z_ptr, rk_ptr, dk_ptr, q_ptr, b, g, ss, n, idx, ring, drf, di, ri,
                             G, CAP, TD, TQ, K, LP, NX, NC, NS, D_REL, GDN, PDL, ZIN, KC,
                             STAGES, DOT, PREC)
    _step_rows_finish(y0, cq, kq, kkp, la, U, vp, bp, b, g, h, hl, off, vr, rmask, ss, n, o0,
                      idx, pd, dk_ptr, dla_ptr, o_ptr, wo_ptr, ala_ptr, ak_ptr, av_ptr,
                      abeta_ptr, H, G, CAP, TD, OT, OT0, WCAP, V, K, GDN)


@triton.jit
def _x_int_limbs(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, c: tl.constexpr, K: tl.constexpr,
                 NS: tl.constexpr, D_REL: tl.constexpr):
    """Column ``c`` of X as integers (``_x_int_col``) in the form ``_x_limbs`` loads them
    from ``_x_int_store``'s buffer, in registers: the twelve limbs ``[1, K/16]`` (X0, U1, U2
    of groups 0-3), the per-block bias and ``xs`` ``[1, K/16]``; the same integers."""
    l0, l1, l2, bias, xs = _x_int_col(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, c, K, NS, D_REL)
    r4 = tl.arange(0, 4)[None, :]
    return (tl.sum(tl.where(r4 == 0, l0, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 1, l0, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 2, l0, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 3, l0, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 0, l1, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 1, l1, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 2, l1, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 3, l1, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 0, l2, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 1, l2, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 2, l2, 0), axis=1)[None, :],
            tl.sum(tl.where(r4 == 3, l2, 0), axis=1)[None, :],
            bias[None, :], xs[None, :])


@triton.jit
def _x_int_of(IN: tl.constexpr, dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, xi_ptr, xs_ptr, bg,
              c: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, NS: tl.constexpr,
              D_REL: tl.constexpr):
    """Column ``c`` of X's integers for the integer-dot read pass, in ``_x_int_limbs``'s form:
    formed in the program (``IN``: ``_x_int_limbs``) or loaded from ``_x_int_kernel``'s
    buffers (``_x_int_stored``); the same integers either way."""
    if IN:
        return _x_int_limbs(dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, c, K, NS, D_REL)
    else:
        return _x_int_stored(xi_ptr, xs_ptr, bg, c, NC, K)


@triton.jit
def _nvfp4_step_kernel(c_ptr, cbs_ptr, cms_ptr, dk_ptr, q_ptr, ss_ptr, n_ptr, os_ptr, rla_ptr,
                       rw_ptr, dla_ptr, dv_ptr, dbeta_ptr, o_ptr, wo_ptr, ala_ptr, ak_ptr,
                       av_ptr, abeta_ptr, rk_ptr, z_ptr, xi_ptr, xs_ptr, H, G, CAP, TD, TQ,
                       OT, OT0, WCAP,
                       V: tl.constexpr, K: tl.constexpr, LP: tl.constexpr, NX: tl.constexpr,
                       NC: tl.constexpr, NS: tl.constexpr, D_REL: tl.constexpr,
                       BV: tl.constexpr, GDN: tl.constexpr, PTX: tl.constexpr,
                       SCVT: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr,
                       DOT: tl.constexpr, PREC: tl.constexpr, ONE: tl.constexpr = True,
                       PDL: tl.constexpr = False,
                       SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
                       OS_ADD: tl.constexpr = 0):
    """A decode step from an nvfp4 read copy in one launch (read-pass form ``"idot_one"``):
    ``_nvfp4_read_kernel``'s integer-dot products ``Y = C X`` (``IDOT``, ``PTX`` / ``SCVT`` as
    there) for ``BV`` value rows of one value head (``V % BV == 0``), with X's integers
    formed in the program (``_x_int_limbs``: the integers ``_x_int_kernel`` would store, so
    the same Y bits as ``"idot"``), then the products with the record keys
    (``_step_products`` with ``ZIN``) and the records work on the tile's rows
    (``_step_rows_finish``: GDN's draft-row correction, the output, the append), as
    ``_f32_step_kernel`` does for FP32 rows. Each row depends on its own codes, its
    sequence's records and X only. ``ONE`` False (read-pass form ``"idot_out"``): X's
    integers from ``_x_int_kernel``'s buffers (``xi``, ``xs``: complete before the products
    launch began) and the products with the keys from the products launch's ``Z``
    (``z_ptr``; ``PDL``: this launch depends on it and waits for it before reading ``Z``),
    as ``"idot"``'s read pass and lean records launch have them: the same ``Y`` as
    ``"idot"``'s read pass, and its records work within float32 rounding of the lean records
    launch's (the sums over the record slots follow this launch's layout), one launch
    fewer."""
    HG, bg, b, g, off, row0, rl, rmask = _key_group_tile(H, G, V, BV)
    hl = off // V  # the tile's head within the key group (V % BV == 0: one head per tile)
    h = g * HG + hl
    vr = off - hl * V + rl  # the tile's rows within its head
    # the codes first (as in _nvfp4_read_kernel)
    wrd, scode, ms = _nvfp4_tile_codes(c_ptr, cbs_ptr, cms_ptr, b, g, H, HG, off, row0, rl,
                                       rmask, V, K)
    if SCVT:  # the hardware's E4M3 conversion (sm_89 and later)
        sc = _e4m3_value_cvt(scode)
    else:
        sc = _e4m3_value_f16(scode)
    ss, n, o0, idx, ring, drf, di, ri, la, U, pd, vp, bp = _step_rows_load(
        ss_ptr, n_ptr, os_ptr, rla_ptr, rw_ptr, dla_ptr, dv_ptr, dbeta_ptr, b, h, vr, rmask, H,
        CAP, TD, V, LP, D_REL, GDN, SS_ADD, N_ADD, OS_ADD)
    w0, w1 = tl.split(wrd)  # [BV, NB]: each block's codes 0-7 and 8-15
    a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3, xc0, xs0 = _x_int_of(
        ONE, dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, xi_ptr, xs_ptr, bg, 0, NC, K, NS, D_REL)
    if NC == 1:
        y0, _ = _idot_rows(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3, xc0, xs0,
                           a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3, xc0, xs0, sc, ms, NC,
                           PTX)
        cq = y0
    else:
        d0, d1, d2, d3, g0, g1, g2, g3, h0, h1, h2, h3, xc1, xs1 = _x_int_of(
            ONE, dk_ptr, q_ptr, b, g, ss, n, G, TD, TQ, xi_ptr, xs_ptr, bg, 1, NC, K, NS, D_REL)
        y0, cq = _idot_rows(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, f0, f1, f2, f3, xc0, xs0,
                            d0, d1, d2, d3, g0, g1, g2, g3, h0, h1, h2, h3, xc1, xs1, sc, ms, NC,
                            PTX)
    kq, kkp = _step_products(z_ptr, rk_ptr, dk_ptr, q_ptr, b, g, ss, n, idx, ring, drf, di, ri,
                             G, CAP, TD, TQ, K, LP, NX, NC, NS, D_REL, GDN, PDL, ONE, KC,
                             STAGES, DOT, PREC)
    _step_rows_finish(y0, cq, kq, kkp, la, U, vp, bp, b, g, h, hl, off, vr, rmask, ss, n, o0,
                      idx, pd, dk_ptr, dla_ptr, o_ptr, wo_ptr, ala_ptr, ak_ptr, av_ptr,
                      abeta_ptr, H, G, CAP, TD, OT, OT0, WCAP, V, K, GDN)


@triton.jit
def _c_times_x16(c_ptr, cbs_ptr, cms_ptr, mat, rowg, rmask, cx, x16_ptr, xinv_ptr, bg,
                 K: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr, BLK: tl.constexpr,
                 BV: tl.constexpr, NC: tl.constexpr, NXS: tl.constexpr, NX: tl.constexpr,
                 C: tl.constexpr):
    """``Y = C X [BV, NX]`` from an nvfp4 copy on float16 tensor cores with X split once per
    (sequence, key group) (``_x_split_kernel``): ``D = C16 x16`` accumulated over K in one
    ``[BV, 16]`` float32 tile (``_c_blocks_f16``'s exact float16 values, the even and the odd
    elements against x16's even and odd rows), then per column ``Y_c = ((D_lo + D_mid) +
    D_hi) 2^14 / s_c`` times the matrix scale. The same products as ``_dot_c16`` with one
    scale per column over the whole key dim."""
    NBC: tl.constexpr = KC // BLK
    W: tl.constexpr = BLK // 2
    jf = tl.arange(0, NBC * W)
    j16 = tl.arange(0, 16)
    D = tl.zeros([BV, 16], tl.float32)
    xrow = x16_ptr + bg * K * 16
    for k0 in tl.range(0, K, KC, num_stages=STAGES):
        ve, vo = _c_blocks_f16(c_ptr, cbs_ptr, rowg, rmask, k0, K, BLK, NBC, W, C)
        xe = tl.load(xrow + (k0 + 2 * jf)[:, None] * 16 + j16[None, :])
        xo = tl.load(xrow + (k0 + 2 * jf + 1)[:, None] * 16 + j16[None, :])
        D = tl.dot(tl.reshape(ve, [BV, NBC * W]), xe, D)
        D = tl.dot(tl.reshape(vo, [BV, NBC * W]), xo, D)
    inv = tl.load(xinv_ptr + bg * NXS + cx, mask=cx < NXS, other=0.0)
    Y = tl.zeros([BV, NX], tl.float32)
    for c in tl.static_range(NC):
        lo = tl.sum(tl.where(j16[None, :] == 2 * NXS + c, D, 0.0), axis=1)
        mid = tl.sum(tl.where(j16[None, :] == NXS + c, D, 0.0), axis=1)
        hi = tl.sum(tl.where(j16[None, :] == c, D, 0.0), axis=1)
        Y += tl.where(cx[None, :] == c, ((lo + mid) + hi)[:, None], 0.0)
    return Y * inv[None, :] * tl.load(cms_ptr + mat)


@triton.jit
def _solve_row(p, U, Y, Z, cvec, idx, cx, vd, bd, rows, rmask, b, h, ss, dv_ptr, dbeta_ptr,
               wout_ptr, H, V, TD, WCAP, D_REL: tl.constexpr, PREFETCH: tl.constexpr,
               WRITE_W: tl.constexpr):
    """GDN forward substitution, row ``p``: ``u_p = beta_p (v_p - gamma_{1:p} C k_p) -
    sum_{i<p} beta_p gamma_{i+1:p} (k_i . k_p) u_i`` for this program's value rows; returns
    ``U`` with row ``p`` set (and writes it to ``wout`` with WRITE_W)."""
    if D_REL:
        pd = p - ss
    else:
        pd = p
    ck = _col(Y, cx, p - ss)  # C k_p
    kkp = _col(Z, cx, p - ss)  # k_i . k_p
    sel = idx == p
    cp = tl.sum(tl.where(sel, cvec, 0.0), axis=0)
    if PREFETCH:
        bp = tl.sum(tl.where(sel, bd, 0.0), axis=0)
        vp = tl.sum(tl.where(sel[:, None], vd, 0.0), axis=0)
    else:
        bp = tl.load(dbeta_ptr + (b * TD + pd) * H + h)
        vp = tl.load(dv_ptr + ((b * TD + pd) * H + h) * V + rows, mask=rmask, other=0.0)
    before = idx < p
    coef = tl.where(before, (bp * tl.exp(tl.where(before, cp - cvec, 0.0))) * kkp, 0.0)
    u = bp * (vp - tl.exp(cp) * ck) - tl.sum(coef[:, None] * U, axis=0)
    if WRITE_W:
        tl.store(wout_ptr + ((b * WCAP + p) * H + h) * V + rows, u, mask=rmask)
    return tl.where(sel[:, None], u[None, :], U)


@triton.jit
def _append_row(p, b, h, g, vt, ss, rows, rmask, dla_ptr, dk_ptr, dv_ptr, dbeta_ptr, ala_ptr,
                ak_ptr, av_ptr, abeta_ptr, H, G, V, CAP, TD, K: tl.constexpr, GDN: tl.constexpr,
                D_REL: tl.constexpr):
    """The decode step's append of record row ``p`` into ring slot ``p``: this program's rows
    of v; la (and GDN's beta) from the first row tile; k from the first value head of the key
    group as well."""
    if D_REL:
        pd = p - ss
    else:
        pd = p
    vp = tl.load(dv_ptr + ((b * TD + pd) * H + h) * V + rows, mask=rmask, other=0.0)
    tl.store(av_ptr + ((b * CAP + p) * H + h) * V + rows, vp, mask=rmask)
    if vt == 0:
        tl.store(ala_ptr + (b * CAP + p) * H + h, tl.load(dla_ptr + (b * TD + pd) * H + h))
        if GDN:
            tl.store(abeta_ptr + (b * CAP + p) * H + h, tl.load(dbeta_ptr + (b * TD + pd) * H + h))
        if (h % (H // G)) == 0:
            kk = tl.arange(0, K)
            kp = tl.load(dk_ptr + ((b * TD + pd) * G + g) * K + kk)
            tl.store(ak_ptr + ((b * CAP + p) * G + g) * K + kk, kp)


@triton.jit
def _split_setup(ss, n, b, g, G, TD, TQ, K: tl.constexpr, NS: tl.constexpr,
                 NXK: tl.constexpr, NXQ: tl.constexpr, D_REL: tl.constexpr):
    """X in two tiles (``split_x``): the key columns ``ck [NXK]`` (k of solved row ``ss + c``,
    ``c < NS``; ``isk``/``kbase`` as in ``_x_setup``) and the query columns ``cq [NXQ]``
    (query ``c < TQ``; ``isq``/``qbase``)."""
    ck = tl.arange(0, NXK)
    cq = tl.arange(0, NXQ)
    _, isk, kbase, _, _ = _x_setup(ck, ss, n, b, g, G, TD, TQ, K, NS, D_REL, False)
    _, _, _, isq, qbase = _x_setup(NS + cq, ss, n, b, g, G, TD, TQ, K, NS, D_REL, False)
    return ck, cq, isk, kbase, isq, qbase


@triton.jit
def _c_times_x_split(c_ptr, cbs_ptr, cms_ptr, mat, rowg, rmask, dk_ptr, q_ptr, kbase, isk, qbase,
                     isq, K: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr,
                     BLK: tl.constexpr, BV: tl.constexpr, NXK: tl.constexpr,
                     NXQ: tl.constexpr, PREC: tl.constexpr, C: tl.constexpr):
    """``C X`` as two tiles, ``Yk = C Xk [BV, NXK]`` (the solved rows' keys) and ``Yq = C Xq
    [BV, NXQ]`` (the queries), from one stream of C (``split_x``): each chunk of C, decoded
    (blocked copies: the block scale on each element), times both as ``tl.dot``
    (``input_precision=PREC``); the matrix scale (fp8, nvfp4) after the sum."""
    Yk = tl.zeros([BV, NXK], tl.float32)
    Yq = tl.zeros([BV, NXQ], tl.float32)
    if C.KIND <= 2:
        for k0 in tl.range(0, K, KC, num_stages=STAGES):
            x = _c_rows(c_ptr, rowg, rmask, k0, K, KC, C)
            e = k0 + tl.arange(0, KC)
            Yk += tl.dot(x, _cols(dk_ptr, kbase, isk, e, K), input_precision=PREC)
            Yq += tl.dot(x, _cols(q_ptr, qbase, isq, e, K), input_precision=PREC)
    else:
        NBC: tl.constexpr = KC // BLK
        if C.FP4:
            W: tl.constexpr = BLK // 2
            ES: tl.constexpr = 2
        else:
            W: tl.constexpr = BLK
            ES: tl.constexpr = 1
        for k0 in tl.range(0, K, KC, num_stages=STAGES):
            xe, xo, sc = _c_blocks(c_ptr, cbs_ptr, rowg, rmask, k0, K, BLK, NBC, W, C)
            e = k0 + ES * tl.arange(0, NBC * W)
            ve = tl.reshape(xe * sc[:, :, None], [BV, NBC * W])
            Yk += tl.dot(ve, _cols(dk_ptr, kbase, isk, e, K), input_precision=PREC)
            Yq += tl.dot(ve, _cols(q_ptr, qbase, isq, e, K), input_precision=PREC)
            if C.FP4:
                vo = tl.reshape(xo * sc[:, :, None], [BV, NBC * W])
                Yk += tl.dot(vo, _cols(dk_ptr, kbase, isk, e + 1, K), input_precision=PREC)
                Yq += tl.dot(vo, _cols(q_ptr, qbase, isq, e + 1, K), input_precision=PREC)
    if C.KIND == 2 or C.KIND == 3:
        s = tl.load(cms_ptr + mat)  # fp8 / nvfp4 matrix scale, after the sum (mx: none)
        Yk = Yk * s
        Yq = Yq * s
    return Yk, Yq


@triton.jit
def _key_products_split(rk_ptr, dk_ptr, q_ptr, krow, kdrow, ring, drf, kbase, isk, qbase, isq,
                        K: tl.constexpr, KC: tl.constexpr, STAGES: tl.constexpr,
                        LP: tl.constexpr, NXK: tl.constexpr, NXQ: tl.constexpr,
                        PREC: tl.constexpr):
    """The products with the keys for ``split_x``: ``Zk [LP, NXK]`` / ``Zq [LP, NXQ]`` (record
    key ``k_i`` . each key / query column) and ``Zkk [NXK, NXK]`` / ``Zkq [NXK, NXQ]`` (the
    solved rows' keys . each key / query column); record keys streamed along K."""
    Zk = tl.zeros([LP, NXK], tl.float32)
    Zq = tl.zeros([LP, NXQ], tl.float32)
    Zkk = tl.zeros([NXK, NXK], tl.float32)
    Zkq = tl.zeros([NXK, NXQ], tl.float32)
    for k0 in tl.range(0, K, KC, num_stages=STAGES):
        kk = k0 + tl.arange(0, KC)
        km = _record_keys(rk_ptr, dk_ptr, krow, kdrow, ring, drf, kk)  # [LP, KC]
        xk = _cols(dk_ptr, kbase, isk, kk, K)  # [KC, NXK]
        xq = _cols(q_ptr, qbase, isq, kk, K)  # [KC, NXQ]
        kdt = tl.trans(xk)  # [NXK, KC]
        Zk += tl.dot(km, xk, input_precision=PREC)
        Zq += tl.dot(km, xq, input_precision=PREC)
        Zkk += tl.dot(kdt, xk, input_precision=PREC)
        Zkq += tl.dot(kdt, xq, input_precision=PREC)
    return Zk, Zq, Zkk, Zkq


@triton.jit
def _matrix_outputs_split(Yk, Yq, Zk, Zq, Zkk, Zkq, U, cvec, idx, ring, ck, cq, rows, rmask, b,
                          h, ss, n, o0, dv_ptr, dbeta_ptr, wout_ptr, o_ptr, H, V, TD, TQ,
                          WCAP, OT, OT0, NS: tl.constexpr, NXK: tl.constexpr,
                          NXQ: tl.constexpr, D_REL: tl.constexpr, WRITE_W: tl.constexpr,
                          SOLVE: tl.constexpr, NSQ: tl.constexpr, SPREC: tl.constexpr):
    """GDN's matrix form (``_matrix_outputs``, the same formulas) on X in two tiles
    (``split_x``): key columns ``ck`` (solved rows ``ss + c``) and query columns ``cq``
    (positions ``o0 + c``). The products of ``_matrix_outputs`` are zero outside one block
    of columns each (``Rk``, the inverse and ``U_s``: key columns; ``Dk``, the outputs: query
    columns; ``Ds``: key rows by query columns), so here each is formed on its own block:
    ``U_s^T = (beta (v - gamma C k) + U^T Rk) (I + M^T)^{-1}`` ``[BV, NXK]`` and
    ``O^T = Yq diag(gamma_{1:p}) + U^T Dk + U_s^T Ds`` ``[BV, NXQ]``."""
    dload = (ck < NS) & (ss + ck < n)  # key rows with records
    dvalid = dload  # split_x: no FUSED, so every key column's row is solved (cs == ss)
    qvalid = cq < TQ
    posk = ss + ck
    posq = o0 + cq
    cposk = tl.sum(tl.where(idx[:, None] == posk[None, :], cvec[:, None], 0.0), axis=0)
    cposq = tl.sum(tl.where(idx[:, None] == posq[None, :], cvec[:, None], 0.0), axis=0)
    known = ring
    okq = qvalid[None, :] & known[:, None] & (idx[:, None] <= posq[None, :])
    Dk = tl.where(okq, tl.exp(tl.where(okq, cposq[None, :] - cvec[:, None], 0.0)) * Zq, 0.0)
    eq = tl.where(qvalid, tl.exp(cposq), 0.0)
    Ut = tl.trans(U)  # [BV, LP]
    if D_REL:
        dic = tl.where(dload, ck, 0).to(tl.int64)
    else:
        dic = tl.where(dload, ss + ck, 0)
    bcol = tl.load(dbeta_ptr + (b * TD + dic) * H + h, mask=dload, other=0.0)  # [NXK]
    okk = dvalid[None, :] & known[:, None]
    Rk = tl.where(okk, -bcol[None, :] * tl.exp(tl.where(okk, cposk[None, :] - cvec[:, None],
                                                        0.0)) * Zk, 0.0)
    ec = tl.where(dvalid, tl.exp(cposk), 0.0)
    bR = tl.where(dvalid, bcol, 0.0)
    okm = dvalid[:, None] & dvalid[None, :] & (ck[:, None] < ck[None, :])
    MT = tl.where(okm, bcol[None, :] * tl.exp(tl.where(okm, cposk[None, :] - cposk[:, None],
                                                       0.0)) * Zkk, 0.0)
    inv = _unit_upper_inverse(MT, ck, n - ss, NXK, SOLVE, NSQ, SPREC)
    oks = dvalid[:, None] & qvalid[None, :] & (posk[:, None] <= posq[None, :])
    Ds = tl.where(oks, tl.exp(tl.where(oks, cposq[None, :] - cposk[:, None], 0.0)) * Zkq, 0.0)
    Vd = tl.load(dv_ptr + ((b * TD + dic) * H + h)[None, :] * V + rows[:, None],
                 mask=dload[None, :] & rmask[:, None], other=0.0)  # [BV, NXK]
    rhs = bR[None, :] * (Vd - Yk * ec[None, :]) + tl.dot(Ut, Rk, input_precision=SPREC)
    Us = tl.dot(rhs, inv, input_precision=SPREC)  # [BV, NXK]
    if WRITE_W:
        tl.store(wout_ptr + ((b * WCAP + ss + ck) * H + h)[None, :] * V + rows[:, None], Us,
                 mask=dvalid[None, :] & rmask[:, None])
    Ot = Yq * eq[None, :] + tl.dot(Ut, Dk, input_precision=SPREC)
    Ot += tl.dot(Us, Ds, input_precision=SPREC)
    tl.store(o_ptr + ((b * OT + OT0 + cq) * H + h)[None, :] * V + rows[:, None], Ot,
             mask=qvalid[None, :] & rmask[:, None])


@triton.jit
def _write_known(wout_ptr, U, ring, idx, ss, n, b, h, rows, rmask, H, V, WCAP):
    """``W_KNOWN``: the slots of ``wout`` a launch does not solve, the known corrections
    (slots < ss, from the ring: ``U``) and zeros (slots >= n)."""
    keep = ((idx < ss) | (idx >= n)) & (idx < WCAP)
    tl.store(wout_ptr + ((b * WCAP + idx) * H + h)[:, None] * V + rows[None, :],
             tl.where(ring[:, None], U, 0.0), mask=keep[:, None] & rmask[None, :])


@triton.jit
def _output(p, t, Y, Z, U, cvec, idx, cx, rows, rmask, b, h, o_ptr, H, V, OT, OT0,
            NS: tl.constexpr):
    """Output of query ``t`` at slot ``p``: ``o_p = gamma_{1:p} (C q) + sum_{j<=p}
    gamma_{j+1:p} (k_j . q) w_j`` for this program's rows, written at ``OT0 + t``."""
    cq = _col(Y, cx, NS + t)  # C q
    kq = _col(Z, cx, NS + t)  # k_j . q
    cp = tl.sum(tl.where(idx == p, cvec, 0.0), axis=0)
    upto = idx <= p
    m = tl.where(upto, tl.exp(tl.where(upto, cp - cvec, 0.0)), 0.0)
    o = tl.exp(cp) * cq + tl.sum((m * kq)[:, None] * U, axis=0)
    tl.store(o_ptr + ((b * OT + OT0 + t) * H + h) * V + rows, o, mask=rmask)


@triton.jit
def _step_out_kernel(rla_ptr, rw_ptr, dla_ptr, dk_ptr, dv_ptr, dbeta_ptr, o_ptr, wo_ptr, ss_ptr,
                     n_ptr, os_ptr, ala_ptr, ak_ptr, av_ptr, abeta_ptr, z_ptr, y_ptr, H, G, V,
                     CAP, TD, OT, OT0, WCAP, K: tl.constexpr, LP: tl.constexpr,
                     NX: tl.constexpr, HB: tl.constexpr, VP: tl.constexpr,
                     D_REL: tl.constexpr, GDN: tl.constexpr = False,
                     PDL: tl.constexpr = False,
                     SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
                     OS_ADD: tl.constexpr = 0):
    """The lean records launch of a decode step (``records_outputs(lean_records=(HB,
    num_warps))``), after the read pass (``Y = R X``: Mamba-2 ``R q``; GDN ``R k_p`` and ``R
    q``, ``y [B*H*V, NC]``) and the products launch (``Z``: column 0 ``k_j . k_p`` (GDN) or
    ``k_j . q`` (Mamba-2), GDN's column 1 ``k_j . q``): one program per sequence ``b`` and
    ``HB`` value heads (``[HB, VP]`` value rows; the per-head decays and products with the
    keys as ``[LP, HB]``, the records' w as ``[LP, HB, VP]``), which reads the records of its
    heads (la, w: ring slots ``< ss``; the draft row at ``ss``), ``Y`` and ``Z``. GDN first
    solves the draft row's correction (forward substitution, the records kernel's
    ``_solve_row`` with the same operations per row): ``u_p = beta_p (v_p - gamma_{1:p} R
    k_p) - sum_{i<p} beta_p gamma_{i+1:p} (k_i . k_p) u_i``, written to ``wo`` at slot p
    (the ring's corrections); Mamba-2's draft w is its v. Then the output of query 0 at slot
    ``o = out_start[b]``, ``o_o = gamma_{1:o} (R q) + sum_{j<=o} gamma_{j+1:o} (k_j . q)
    w_j`` (the output-only form, ``replay.mamba2.mamba2_step_output`` /
    ``replay.gdn.gdn_step_output``; the records kernel's ``_output`` with the same
    operations per row), and appends the draft row (``_append_row``: v, la, GDN's beta; k
    from the first value head of each key group). Each row depends on its own sequence's
    records only. ``PDL``: launched after the read pass or the products launch; it loads
    the records first and waits before it reads Y or Z and before its first store."""
    pid = tl.program_id(0).to(tl.int64)
    nhb = tl.cdiv(H, HB)
    b = pid // nhb
    h0 = (pid - b * nhb) * HB
    ss = tl.load(ss_ptr + b) + SS_ADD
    n = tl.load(n_ptr + b) + N_ADD
    o0 = tl.load(os_ptr + b) + OS_ADD
    hh = h0 + tl.arange(0, HB)  # [HB] value heads
    hok = hh < H
    gh = hh // (H // G)
    vr = tl.arange(0, VP)
    rmask = hok[:, None] & (vr < V)[None, :]  # [HB, VP]
    rowo = (b * H + hh)[:, None] * V + vr[None, :]  # [HB, VP] rows of y (and of o's slot)
    idx = tl.arange(0, LP).to(tl.int64)
    ring, drf, di, ri = _slots(idx, ss, n, D_REL)
    # per (slot, head): la [LP, HB]; per (slot, head, row): w [LP, HB, VP]
    la = tl.where(ring[:, None],
                  tl.load(rla_ptr + (b * CAP + ri)[:, None] * H + hh[None, :],
                          mask=ring[:, None] & hok[None, :], other=0.0),
                  tl.load(dla_ptr + (b * TD + di)[:, None] * H + hh[None, :],
                          mask=drf[:, None] & hok[None, :], other=0.0))
    m3 = ring[:, None, None] & rmask[None, :, :]
    U = tl.load(rw_ptr + ((b * CAP + ri)[:, None, None] * H + hh[None, :, None]) * V
                + vr[None, None, :], mask=m3, other=0.0)
    if D_REL:
        pd = ss * 0
    else:
        pd = ss
    step = n > ss  # the decode step's draft row ss (one at most)
    hstep = hok & (hh * 0 + n > ss)  # [HB]: the heads' rows of a sequence that steps
    vrow = ((b * TD + pd) * H + hh)[:, None] * V + vr[None, :]
    vp = tl.load(dv_ptr + vrow, mask=rmask & hstep[:, None], other=0.0)  # [HB, VP]
    if GDN:
        bp = tl.load(dbeta_ptr + (b * TD + pd) * H + hh, mask=hstep, other=0.0)  # [HB]
    else:  # Mamba-2: w = v for the draft row too
        md3 = drf[:, None, None] & rmask[None, :, :]
        U += tl.load(dv_ptr + ((b * TD + di)[:, None, None] * H + hh[None, :, None]) * V
                     + vr[None, None, :], mask=md3, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    NC: tl.constexpr = 2 if GDN else 1  # columns of Y
    cq = tl.load(y_ptr + rowo * NC + (NC - 1), mask=rmask, other=0.0)  # R q [HB, VP]
    zrow = ((b * G + gh)[None, :] * LP + idx[:, None]) * NX  # [LP, HB]
    kq = tl.load(z_ptr + zrow + (NC - 1), mask=hok[None, :], other=0.0)  # k_j . q [LP, HB]
    cvec = tl.cumsum(la, axis=0)  # c_p = sum_{j<=p} la_j, per head
    if GDN:
        if step:
            ck = tl.load(y_ptr + rowo * NC, mask=rmask, other=0.0)  # R k_p [HB, VP]
            kkp = tl.load(z_ptr + zrow, mask=hok[None, :], other=0.0)  # k_i . k_p [LP, HB]
            sel = idx == ss
            cp = tl.sum(tl.where(sel[:, None], cvec, 0.0), axis=0)  # [HB]
            before = (idx < ss)[:, None]
            coef = tl.where(before, (bp[None, :] * tl.exp(tl.where(before, cp[None, :] - cvec,
                                                                     0.0))) * kkp, 0.0)
            u = (bp[:, None] * (vp - tl.exp(cp)[:, None] * ck)
                 - tl.sum(coef[:, :, None] * U, axis=0))  # [HB, VP]
            tl.store(wo_ptr + ((b * WCAP + ss) * H + hh)[:, None] * V + vr[None, :], u,
                     mask=rmask)
            U = tl.where(sel[:, None, None], u[None, :, :], U)
    cp = tl.sum(tl.where(idx[:, None] == o0, cvec, 0.0), axis=0)  # [HB]
    upto = (idx <= o0)[:, None]
    m = tl.where(upto, tl.exp(tl.where(upto, cp[None, :] - cvec, 0.0)), 0.0)
    o = tl.exp(cp)[:, None] * cq + tl.sum((m * kq)[:, :, None] * U, axis=0)
    tl.store(o_ptr + ((b * OT + OT0) * H + hh)[:, None] * V + vr[None, :], o, mask=rmask)
    if step:  # the decode step's append of row ss
        tl.store(av_ptr + ((b * CAP + ss) * H + hh)[:, None] * V + vr[None, :], vp, mask=rmask)
        tl.store(ala_ptr + (b * CAP + ss) * H + hh,
                 tl.load(dla_ptr + (b * TD + pd) * H + hh, mask=hok, other=0.0), mask=hok)
        if GDN:
            tl.store(abeta_ptr + (b * CAP + ss) * H + hh, bp, mask=hok)
        lead = hok & (hh % (H // G) == 0)  # the first value head of its key group
        kk = tl.arange(0, K)
        kp = tl.load(dk_ptr + ((b * TD + pd) * G + gh)[:, None] * K + kk[None, :],
                     mask=lead[:, None], other=0.0)
        tl.store(ak_ptr + ((b * CAP + ss) * G + gh)[:, None] * K + kk[None, :], kp,
                 mask=lead[:, None])


@triton.jit
def _records_kernel(
        c_ptr, cbs_ptr, cms_ptr,  # checkpoint C (stored)
        rla_ptr, rk_ptr, rw_ptr,  # ring: la [B,CAP,H], k [B,CAP,G,K], w [B,CAP,H,V] (rows < ss)
        dla_ptr, dk_ptr, dv_ptr, dbeta_ptr,  # rows >= ss: [B,TD,H], [B,TD,G,K], [B,TD,H,V], [B,TD,H]
        q_ptr, o_ptr,  # q [B,TQ,G,K], o [B,OT,H,V] (written at slots OT0 + t)
        ss_ptr, n_ptr, os_ptr,  # int64 [B]: first solved/draft row, rows, first output position
        wout_ptr,  # [B,WCAP,H,V]: solved rows ss..n-1 (WRITE_W)
        ala_ptr, ak_ptr, av_ptr, abeta_ptr,  # ring outputs of the append (APPEND)
        z_ptr, zd_ptr,  # [B*G, LP, NX], [B*G, NX, NX]: Z and Zd of the products launch (ZPRE)
        y_ptr,  # [B*H*V, NC]: Y = C X of the read pass (written with YOUT, read with YPRE)
        x16_ptr, xinv_ptr,  # [B*G, K, 16] float16, [B*G, NXS]: X split once (XS, _x_split_kernel)
        H, G, V, CAP, TD, TQ, WCAP, OT, OT0, window,
        K: tl.constexpr, BLK: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
        NS: tl.constexpr, NC: tl.constexpr, NX: tl.constexpr, KC: tl.constexpr,
        STAGES: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr,
        KFIRST: tl.constexpr, ZPRE: tl.constexpr, YOUT: tl.constexpr, YPRE: tl.constexpr,
        GDN: tl.constexpr, D_REL: tl.constexpr, WRITE_W: tl.constexpr, APPEND: tl.constexpr,
        AT_WINDOW: tl.constexpr, SOLVE: tl.constexpr, NSQ: tl.constexpr, FUSED: tl.constexpr,
        SPREC: tl.constexpr, ONE: tl.constexpr, XS: tl.constexpr, NXS: tl.constexpr,
        C: tl.constexpr, PDL: tl.constexpr = False, W_KNOWN: tl.constexpr = False,
        LATE: tl.constexpr = 0, NCP: tl.constexpr = 1, SPLIT: tl.constexpr = False,
        NXK: tl.constexpr = 8, NXQ: tl.constexpr = 8, FOLD: tl.constexpr = False,
        WPRE: tl.constexpr = False,
        SS_ADD: tl.constexpr = 0, N_ADD: tl.constexpr = 0,
        OS_ADD: tl.constexpr = 0):
    # C: the stored checkpoint's DecodeConsts; ONE: TD == 1
    # W_KNOWN (with WRITE_W): also write the corrections' other slots of wout, the known ones
    # (< ss, as read from the ring) and zeros from n on, so wout needs no copy before and no
    # mask after (verify's returned corrections)
    # PDL: launched with launch_pdl after a launch of this call (the products launch or the
    # read pass), so it may start before that grid ends: everything it reads before gdc_wait
    # (C, the ring, the drafts, q, start / rows) was written before that launch began; it
    # waits before it reads Y or Z and before its first store (the read pass: before storing
    # Y, so that the records launch after it, waiting on it, also waits on the products launch)
    # SOLVE: 0 row-by-row forward substitution and per-query reductions; 1 / 2 matrix form
    # (``_matrix_outputs``) with the inverse by row recursion (1) or by doubling (2).
    # FUSED (GDN, matrix form, C is both R and A): the key columns of X are slots 0..NS-1
    # (not ss..), and a sequence with rows == window also gets its A-path last output here.
    # YOUT: the read pass (Y of this program's rows to y_ptr, nothing else); YPRE: Y from it.
    # (sequence, head) index math in int64: the same in int32 made Mamba-2's nvfp4 verify
    # (tf32x3 products) 23% slower on the H200 (556 -> 684 us at B = 256, triton 3.6,
    # benchmarks/results/verify_ab2_h200.json, 2026-12-02) for 1-2% elsewhere
    mat = tl.program_id(0).to(tl.int64)
    vt = tl.program_id(1)
    b = mat // H
    h = mat - b * H
    g = h // (H // G)
    ss = tl.load(ss_ptr + b) + SS_ADD
    n = tl.load(n_ptr + b) + N_ADD
    if AT_WINDOW:  # only the sequences whose rows end on the flush slot (verify's A path)
        if n != window:
            if PDL:  # no grid of this call left running behind a program that returns
                tl.extra.cuda.gdc_wait()
            return
    o0 = tl.load(os_ptr + b) + OS_ADD
    rows = vt * BV + tl.arange(0, BV)
    rmask = rows < V
    rowg = mat * V + rows.to(tl.int64)
    idx = tl.arange(0, LP).to(tl.int64)
    cx = tl.arange(0, NX)
    if YOUT:  # the read pass: the only part of the step that reads C
        if XS:  # nvfp4 on float16 tensor cores with X split once per (sequence, key group)
            Y = _c_times_x16(c_ptr, cbs_ptr, cms_ptr, mat, rowg, rmask, cx, x16_ptr, xinv_ptr,
                             b * G + g, K, KC, STAGES, BLK, BV, NC, NXS, NX, C)
        else:
            cs, isk, kbase, isq, qbase = _x_setup(cx, ss, n, b, g, G, TD, TQ, K, NS, D_REL,
                                                  FUSED)
            Y = _c_times_x(c_ptr, cbs_ptr, cms_ptr, mat, rowg, rmask, cx, dk_ptr, q_ptr, kbase,
                           isk, qbase, isq, b, g, cs, n, G, TD, TQ, K, KC, STAGES, BLK, BV, NC,
                           NS, NX, D_REL, DOT, PREC, C, LATE, NCP, FUSED)
        if PDL:
            tl.extra.cuda.gdc_wait()
        tl.store(y_ptr + rowg[:, None] * NC + cx[None, :], Y,
                 mask=rmask[:, None] & (cx[None, :] < NC))
        return

    # ---- records of this (sequence, head): la, w of this program's rows (issued before the
    # C stream; consumed after it)
    ring, drf, di, ri = _slots(idx, ss, n, D_REL)
    la = _record_la(rla_ptr, dla_ptr, ring, drf, di, ri, b, h, H, CAP, TD)
    krow = ((b * CAP + ri) * G + g) * K
    kdrow = ((b * TD + di) * G + g) * K
    if FOLD:  # GDN's matrix form with its coefficients folded into X (fold_x): the products
        # with the keys and the coefficients first, then C (X Wy), then the outputs
        cs, isk, kbase, isq, qbase = _x_setup(cx, ss, n, b, g, G, TD, TQ, K, NS, D_REL, FUSED)
        if WPRE:  # the coefficients from their own launch (_fold_coeffs_kernel)
            if PDL:
                tl.extra.cuda.gdc_wait()
            wrow = mat * (2 * NX + LP)
            Wy = tl.load(z_ptr + (wrow + cx[:, None]) * NX + cx[None, :])
            Wv = tl.load(z_ptr + (wrow + NX + cx[:, None]) * NX + cx[None, :])
            Wu = tl.load(z_ptr + (wrow + 2 * NX + idx[:, None]) * NX + cx[None, :])
            dload, dvalid, qvalid = _columns(cx, ss, n, cs, TQ, NS)
            dic = _draft_index(cx, dload, cs, D_REL)
        else:
            if ZPRE:
                if PDL:
                    tl.extra.cuda.gdc_wait()
                Z, Zd = _z_from_launch(z_ptr, zd_ptr, b * G + g, idx, cx, LP, NX, True)
            else:
                Z, Zd = _key_products(rk_ptr, dk_ptr, q_ptr, krow, kdrow, ring, drf, 0, kbase,
                                      isk, qbase, isq, cx, b, g, cs, n, G, TD, TQ, K, KC, STAGES,
                                      LP, NC, NS, NX, D_REL, DOT, PREC, False, SOLVE, GDN)
            cvec = tl.cumsum(la, axis=0)
            Wy, Wv, Wu, dic, dload, dvalid, qvalid = _fold_matrices(
                Z, Zd, cvec, idx, ring, cx, b, h, ss, n, o0, cs, window, dbeta_ptr, H, TD, TQ,
                NS, NX, D_REL, SOLVE, NSQ, FUSED, SPREC)
        Y = _c_times_x(c_ptr, cbs_ptr, cms_ptr, mat, rowg, rmask, cx, dk_ptr, q_ptr, kbase, isk,
                       qbase, isq, b, g, cs, n, G, TD, TQ, K, KC, STAGES, BLK, BV, NC, NS, NX,
                       D_REL, DOT, PREC, C, 0, NCP, FUSED, XW=Wy, FOLD=True)
        # the known corrections after the stream (not live across it)
        U = tl.load(rw_ptr + ((b * CAP + ri) * H + h)[:, None] * V + rows[None, :],
                    mask=ring[:, None] & rmask[None, :], other=0.0)
        if W_KNOWN:
            _write_known(wout_ptr, U, ring, idx, ss, n, b, h, rows, rmask, H, V, WCAP)
        _fold_outputs(Y, Wv, Wu, U, dic, dload, dvalid, qvalid, cx, rows, rmask, b, h, cs,
                      dv_ptr, wout_ptr, o_ptr, H, V, TD, WCAP, OT, OT0, NS, WRITE_W, SPREC)
        return
    m2 = ring[:, None] & rmask[None, :]
    U = tl.load(rw_ptr + ((b * CAP + ri) * H + h)[:, None] * V + rows[None, :], mask=m2,
                other=0.0)
    if not GDN:  # Mamba-2: w = v for the draft rows too
        md = drf[:, None] & rmask[None, :]
        U += tl.load(dv_ptr + ((b * TD + di) * H + h)[:, None] * V + rows[None, :], mask=md,
                     other=0.0)

    if SPLIT:  # GDN's matrix form on X in two tiles, key columns and query columns (split_x)
        ck, cq, iskk, kbk, isqq, qbq = _split_setup(ss, n, b, g, G, TD, TQ, K, NS, NXK, NXQ,
                                                    D_REL)
        Yk, Yq = _c_times_x_split(c_ptr, cbs_ptr, cms_ptr, mat, rowg, rmask, dk_ptr, q_ptr, kbk,
                                  iskk, qbq, isqq, K, KC, STAGES, BLK, BV, NXK, NXQ, PREC, C)
        Zk, Zq, Zkk, Zkq = _key_products_split(rk_ptr, dk_ptr, q_ptr, krow, kdrow, ring, drf,
                                               kbk, iskk, qbq, isqq, K, KC, STAGES, LP, NXK,
                                               NXQ, PREC)
        cvec = tl.cumsum(la, axis=0)
        if W_KNOWN:
            _write_known(wout_ptr, U, ring, idx, ss, n, b, h, rows, rmask, H, V, WCAP)
        _matrix_outputs_split(Yk, Yq, Zk, Zq, Zkk, Zkq, U, cvec, idx, ring, ck, cq, rows, rmask,
                              b, h, ss, n, o0, dv_ptr, dbeta_ptr, wout_ptr, o_ptr, H, V, TD, TQ,
                              WCAP, OT, OT0, NS, NXK, NXQ, D_REL, WRITE_W, SOLVE, NSQ, SPREC)
        return

    # ---- X: the NC vectors C is multiplied with, columns 0..NS-1 the k of the solved rows
    # ss.. (GDN), then the TQ queries; padded to NX columns (zero)
    cs, isk, kbase, isq, qbase = _x_setup(cx, ss, n, b, g, G, TD, TQ, K, NS, D_REL, FUSED)
    if KFIRST and not ZPRE:  # the record keys [LP, K] as one tile (KC == K), issued before
        # the C stream so that their latency overlaps it; consumed by the Z pass below
        kfirst = _record_keys(rk_ptr, dk_ptr, krow, kdrow, ring, drf, tl.arange(0, K))
    else:
        kfirst = 0

    # ---- Y = C X [BV, NX]: streamed here, or from the read pass (YPRE)
    if YPRE:
        if PDL:
            tl.extra.cuda.gdc_wait()
        Y = tl.load(y_ptr + rowg[:, None] * NC + cx[None, :],
                    mask=rmask[:, None] & (cx[None, :] < NC), other=0.0)
    else:
        Y = _c_times_x(c_ptr, cbs_ptr, cms_ptr, mat, rowg, rmask, cx, dk_ptr, q_ptr, kbase, isk,
                       qbase, isq, b, g, cs, n, G, TD, TQ, K, KC, STAGES, BLK, BV, NC, NS, NX,
                       D_REL, DOT, PREC, C, LATE, NCP, FUSED)
        if PDL:  # the stream of C overlapped the products launch; Z is read below
            tl.extra.cuda.gdc_wait()

    # ---- Z = Kmat X [LP, NX]: k_i . x for every record slot i (ring rows < ss, then drafts);
    # per (sequence, key group): from the products launch (ZPRE) or here
    if ZPRE:
        Z, Zd = _z_from_launch(z_ptr, zd_ptr, b * G + g, idx, cx, LP, NX,
                               SOLVE > 0 and GDN and NS > 0)
    else:
        Z, Zd = _key_products(rk_ptr, dk_ptr, q_ptr, krow, kdrow, ring, drf, kfirst, kbase, isk,
                              qbase, isq, cx, b, g, cs, n, G, TD, TQ, K, KC, STAGES, LP, NC, NS,
                              NX, D_REL, DOT, PREC, KFIRST, SOLVE, GDN)

    cvec = tl.cumsum(la, axis=0)  # c_p = sum_{j<=p} la_j

    if W_KNOWN:
        _write_known(wout_ptr, U, ring, idx, ss, n, b, h, rows, rmask, H, V, WCAP)

    if SOLVE > 0:  # matrix form: the solve and the outputs as small products
        _matrix_outputs(Y, Z, Zd, U, cvec, idx, ring, cx, rows, rmask, b, h, ss, n, o0, cs,
                        window, dv_ptr, dbeta_ptr, wout_ptr, o_ptr, H, V, TD, TQ, WCAP, OT,
                        OT0, NS, NX, GDN, D_REL, WRITE_W, SOLVE, NSQ, FUSED, SPREC)

    # ---- GDN: solve rows ss..n-1 (forward substitution, one row at a time; ONE: at most one
    # row, the decode step, without the loop)
    if GDN and SOLVE == 0:
        if PREFETCH:  # the solved rows' v and beta as tiles before the loop (no loads in it)
            vd = tl.load(dv_ptr + ((b * TD + di) * H + h)[:, None] * V + rows[None, :],
                         mask=drf[:, None] & rmask[None, :], other=0.0)  # [LP, BV] by slot
            bd = tl.load(dbeta_ptr + (b * TD + di) * H + h, mask=drf, other=0.0)
        else:
            vd = 0
            bd = 0
        if ONE:
            if n > ss:
                U = _solve_row(ss, U, Y, Z, cvec, idx, cx, vd, bd, rows, rmask, b, h, ss, dv_ptr,
                               dbeta_ptr, wout_ptr, H, V, TD, WCAP, D_REL, PREFETCH, WRITE_W)
        else:
            for p in range(ss, n):
                U = _solve_row(p, U, Y, Z, cvec, idx, cx, vd, bd, rows, rmask, b, h, ss, dv_ptr,
                               dbeta_ptr, wout_ptr, H, V, TD, WCAP, D_REL, PREFETCH, WRITE_W)

    # ---- append the new records (decode step): slots ss..n-1 of the ring (ONE: at most one)
    if APPEND:
        if ONE:
            if n > ss:
                _append_row(ss, b, h, g, vt, ss, rows, rmask, dla_ptr, dk_ptr, dv_ptr, dbeta_ptr,
                            ala_ptr, ak_ptr, av_ptr, abeta_ptr, H, G, V, CAP, TD, K, GDN, D_REL)
        else:
            for p in range(ss, n):
                _append_row(p, b, h, g, vt, ss, rows, rmask, dla_ptr, dk_ptr, dv_ptr, dbeta_ptr,
                            ala_ptr, ak_ptr, av_ptr, abeta_ptr, H, G, V, CAP, TD, K, GDN, D_REL)

    # ---- outputs at positions o0 .. o0 + TQ - 1
    if SOLVE == 0:  # (the matrix forms write theirs in _matrix_outputs)
        for t in tl.static_range(NC - NS):  # NC - NS == TQ
            _output(o0 + t, t, Y, Z, U, cvec, idx, cx, rows, rmask, b, h, o_ptr, H, V, OT, OT0,
                    NS)


# ----------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------


def _lp(cap: int) -> int:
    return max(MIN_LP, triton.next_power_of_2(cap))


def records_outputs(checkpoint, *, ring_la, ring_k, ring_w, q, start, rows, out_start,
                    draft=None, draft_relative: bool = True, gdn: bool = False,
                    w_out=None, append=None, solved: int | None = None, out=None,
                    out_slot: int = 0, at_window: int | None = None,
                    block_v: int = DEFAULT_BV, num_warps: int = DEFAULT_WARPS,
                    k_chunk: int | None = None, num_stages: int | None = None,
                    use_dot: "bool | str | None" = None,
                    prefetch: bool = False, keys_first: bool = False,
                    shared_products: bool = False,
                    solve: str = "substitution",
                    fused_window: int | None = None,
                    solve_precision: str | None = None,
                    e2m1_decode: str | None = None,
                    read_pass: "tuple[int, int] | tuple[int, int, str] | bool | None" = None,
                    pdl: bool | None = None, w_out_known: bool = False,
                    late_sum: int | None = None, split_x: bool = False,
                    fold_x: "bool | str" = False,
                    lean_records: "tuple[int, int] | bool | None" = None) -> torch.Tensor:
    """Launch ``_records_kernel`` (low-level; see the model-specific wrappers below).

    Args:
        checkpoint: stored C ``[B, H, V, K]`` (PackedTensor or float32 tensor).
        ring_la, ring_k, ring_w: ``[B, CAP, H]``, ``[B, CAP, G, K]``, ``[B, CAP, H, V]``: the
            records of slots ``< start[b]`` (w: Mamba-2 v, GDN cached corrections).
        q: ``[B, TQ, G, K]``; outputs at slots ``out_start[b] + t``.
        start, rows, out_start: int64 (or int32) ``[B]``: rows ``start..rows-1`` come from
            ``draft`` (GDN: their corrections are solved against C). Each may also be ``(t,
            d)``: the ``[B]`` tensor ``t`` plus a Python int ``d >= 0``, added in the kernels
            as they load ``t`` (no tensor ``t + d`` is formed: one small launch less in a
            decode step's chain; each distinct ``d`` compiles its own specialisation);
            ``rows`` and ``out_start`` may be a plain int ``d >= 0``, meaning ``start + d``.
        draft: dict ``la [B,TD,H]``, ``k [B,TD,G,K]``, ``v [B,TD,H,V]``, ``beta [B,TD,H]``
            (GDN), indexed by ``slot - start`` (``draft_relative``) or by slot.
        w_out: ``[B, WCAP, H, V]`` receives the solved corrections of rows ``start..rows-1``.
        w_out_known: GDN with ``w_out`` and a ring ``ring_w`` of ``WCAP`` slots: ``w_out`` also
            receives the other slots, ``ring_w``'s for slots ``< start`` and zeros from
            ``rows`` on (the complete corrections, where the caller would otherwise copy
            ``ring_w`` into ``w_out`` before and mask it after). Every sequence's rows
            ``start..rows-1`` must be solved (``solved >= rows - start``, as verify passes;
            not checked on the host, which would synchronise); refused with ``at_window``
            (the programs of other sequences write nothing) and ``fused_window``.
        append: dict of ring tensors ``la, k, v, beta`` that receive the draft rows at their
            slots (decode step's append).
        solved: GDN: the most rows any sequence solves (``rows - start``; default TD).
        out: float32 ``[B, OT, H, V]`` to write the outputs into, at ``out_slot + t`` (default:
            a new ``[B, TQ, H, V]``, ``out_slot`` 0).
        at_window: only the sequences with ``rows[b] == at_window`` run (checked on the
            device; the others' programs return at once and write nothing).
        block_v, num_warps, k_chunk, num_stages, use_dot: launch configuration (value rows per
            program, warps, K columns per streamed chunk (a power of two, >= 16 for an
            unblocked copy, >= 32 for a blocked one (nvfp4, mx); the whole key dim at most;
            16 halves the tensor-core operand tiles a thread holds: GDN's verify on 128 x 2
            tiles compiles to 195 registers with ``fold_x`` instead of 255 with spills,
            static sm_90 SASS), software-pipeline stages, ``use_dot``: ``tl.dot`` for the products
            with C and the keys instead of per-vector reductions (``True`` or ``"ieee"``: FP32
            FMA; ``"tf32x3"``: three TF32 tensor-core products with the split operands, about
            FP32 accuracy (error ~2^-21 relative per product, within the outputs' 1e-5
            tolerance); ``"f16x3"``, nvfp4 and fp16 copies: C's products on float16 tensor
            cores from exact float16 values of its codes times their block scales (nvfp4) or
            its values as stored (fp16) and three float16 terms of X (``_c_blocks_f16``,
            ``_dot_c16``; fp16: ``_c_rows_16``, ``_dot_h16``; an nvfp4 read pass with at
            most 4 vectors takes X split once per (sequence, key group) by
            ``_x_split_kernel`` and ``_c_times_x16``; about FP32 accuracy, the error relative
            to ``max|x| sum|a|`` per column; any other copy,
            such as verify's FP32 anchor, the products with the keys and the matrix forms'
            small products then take ``"tf32x3"``; the step and verify wrappers refuse it
            for a read copy that is neither); ``"bf16x3"``, copies whose values bfloat16
            holds exactly (bf16; fp8e4m3 and fp8e5m2 codes, before their matrix scale): C's
            products on bfloat16 tensor cores, C loaded as bfloat16 and X in three bfloat16
            terms (``_c_rows_16``, ``_dot_b16``; the split is exact for float32 X, so the
            error is the tensor cores' float32 accumulation, per element, about FP32
            accuracy); any other copy of the call (verify's FP32 anchor) and the small
            products take ``"tf32x3"``; the wrappers refuse it for other read copies);
            default
            ``"ieee"`` with four or more vectors, else reductions).
        prefetch: GDN: load the solved rows' ``v`` and ``beta`` as ``[LP, BV]`` / ``[LP]``
            tiles before the forward substitution instead of one row per iteration (the loop
            then has no memory operations; the same values). Timed by ``records_tune.py --set
            prefetch`` (``records_tune_prefetch_h200.json``): slower for every verify and the
            fp32 step, faster for the GDN step from an nvfp4 copy (293 -> 279 us at B = 256),
            whose default set it until the E2M1 table lookup and its narrower tiles
            (2026-12-02: 151 us with it, 149 us without); now only the GDN step from an
            mxfp8 copy sets it (``GDN_STEP_BLOCKED_CONFIG``).
        keys_first: load the record keys ``[LP, K]`` as one tile before the stream of C
            (their latency then overlaps it) instead of after it, where C is streamed in one
            chunk (``k_chunk`` equal to the key dim; ignored otherwise). The same formula and
            summation code; the compiler may lay the key tile out differently when it is loaded
            first, so last bits can differ (they do for Mamba-2 on the H200, 2026-12-02),
            within the outputs' tolerance.
        shared_products: form the products with the record keys (``Z = Kmat X``, ``k_i . q``
            and GDN's ``k_i . k_p``; the matrix forms' ``Zd``) once per (sequence, key group)
            in a small launch before the records kernel (``_key_products_kernel``, the same
            code), instead of in every program: they do not depend on the value head or the
            value rows, so a launch with ``H / G`` value heads per key group and
            ``V / block_v`` row tiles otherwise forms them that many times (Mamba-2's single
            group: 128 times per sequence). Applied only where something is shared
            (``H / G * cdiv(V, block_v) > 1``, a property of the shape and the launch, never of
            the batch). The same formula and summation code; last bits can differ from the
            fused form (the compiler may lay the tiles out differently in the two kernels),
            within the outputs' tolerance; ``keys_first`` then has no effect.
        solve: how the GDN solve and the outputs are formed after the products with C and the
            keys. ``"substitution"`` (default): forward substitution one solved row at a time
            on ``[BV, LP]`` tiles, then one masked reduction per query. ``"inverse"``: the
            matrix form of ``_matrix_outputs``: the unit lower-triangular system's
            coefficients (``k_i . k_p``, decays, beta) built once per program on ``[NX, NX]``
            scalars, its inverse by row recursion (``_unit_upper_inverse``), applied to the
            value rows as small FP32 products, and the outputs as products with masked decay
            matrices (Mamba-2: only the latter). ``"doubling"``: the same with the inverse as
            ``(I - M)(I + M^2)(I + M^4)...`` (products instead of a sequential recursion).
            Same formula as the reference; the sums are reassociated (last bits differ from
            ``"substitution"``, within the outputs' 1e-5 tolerance). Timed by
            ``records_tune.py --set verify2`` (``records_tune_verify2_h200.json``): ``"inverse"``
            is the verify default since 2026-12-01.
        solve_precision: the matrix forms' small products (``tl.dot``): ``"ieee"`` (FP32
            FMA) or ``"tf32x3"`` (tensor cores, about FP32 accuracy, fewer registers: the FMA
            form holds its operands' whole K extent in registers); default: ``"tf32x3"`` when
            ``use_dot`` is ``"tf32x3"``, ``"f16x3"`` or ``"bf16x3"``, else ``"ieee"``.
        fused_window: GDN, matrix forms only, ``checkpoint`` being both the read copy and the
            anchor (single-checkpoint policies): the key columns are slots ``0..solved-1``
            and a sequence with ``rows == fused_window`` also gets its last output from the
            A path (every row re-solved against the checkpoint), so verify needs no second
            launch (see ``_matrix_outputs``).
        e2m1_decode: how an nvfp4/mxfp4 copy's E2M1 codes become float32 values (the same
            values bit for bit, so the same outputs): ``"lookup"`` byte-permute table lookups
            in inline PTX, four bytes per instruction group (``codec._e2m1_pairs_lut``; CUDA
            only), ``"integer"`` integer arithmetic per code (``codec._e2m1_value``), or
            ``"half"`` (nvfp4 only, CUDA only; 2026-12-02, not yet timed on the device): two
            codes per register as float16 values times 2^-14 (``codec._e2m1_pairs_half``,
            about 2.9 instructions per code against the lookup's 4.6), with 2^14 folded into
            the E4M3 block scale, so the products and sums scale exactly and the outputs are
            the other decoders' (unless a product falls below 2^-112 in magnitude); default
            ``"lookup"`` on NVIDIA CUDA and ``"integer"`` under the Triton interpreter, which
            cannot run inline PTX. Copies without E2M1 codes ignore it, but an explicit
            ``"lookup"`` or ``"half"`` where it cannot run is refused for any copy, and
            ``"half"`` for an mxfp4 copy (E8M0 scales times 2^14 can overflow).
        read_pass: ``(block_v, num_warps)``: form ``Y = C X`` (the products of the stored
            checkpoint with the solved rows' keys and the queries, the only part that reads
            C) in a launch of its own with this tile, which writes ``Y`` (float32
            ``[B*H*V, NC]``, 4 NC bytes per value row) and nothing else; the records kernel
            then reads ``Y`` instead of streaming C and does the solve, the append and the
            outputs with its own tile (``block_v``, ``num_warps``). The read pass's programs
            carry none of the per-program work on the records (their loads, the solve, the
            append, the outputs), which on a narrow tile is most of a program's instructions
            (2026-12-02, ncu of the GDN nvfp4 step: about 470 of 1280 per warp were the
            products). The same code forms Y in both places, but the two launches' tiles can
            lay the sums out differently, so the outputs equal the single launch's within
            the outputs' tolerance, not bit for bit. ``k_chunk``, ``num_stages`` and
            ``use_dot`` then apply to the read pass's stream of C (and, without
            ``shared_products``, to the records launch's products with the keys; with
            ``"f16x3"`` or ``"bf16x3"`` the records launch and the products launch form those
            by reductions), ``block_v``
            and ``num_warps`` to the records launch; ``keys_first`` has no stream of C left to
            overlap. Ignored where nothing multiplies C (no solved rows and no queries). None
            or False (default): one launch.
            ``(block_v, num_warps, form)``: ``form`` "records" (the above) or "lean"
            (from an FP32 copy, ``_f32_read_kernel``: the copy's rows times X, one float32
            reduction over K per row and column, nothing else, tiled as below; from an nvfp4
            one ``_nvfp4_read_kernel``; both: at most two columns of X, as a decode
            step has, no ``fused_window`` and no ``use_dot`` of ``X16_DOTS``; refused
            otherwise): a kernel that only reads the codes and block scales, decodes each
            32-bit word of eight codes and multiplies it with X in one inline-PTX FMA chain
            per column (the interpreter, or ``e2m1_decode="integer"``: the integer decoder
            in the same float32 operations, so the same bits); its tile may be any power of
            two >= 16 rows and may span the value heads of a key group (its programs tile a
            (sequence, key group)'s rows head after head); the codes are read as 32-bit
            words, so their storage must start on a 4-byte boundary (refused otherwise).
            Mamba-2's nvfp4 step default from the twenty-first to the twenty-fourth session.
            ``"idot"``: the same kernel and conditions with integer dot products
            (``_nvfp4_read_kernel``'s IDOT: X rounded per block of 16 elements to 24-bit
            integers by a launch of its own, the call's first; each block's sum exact in
            int32 by byte-permute lookups and dp4a; X's rounding, at most 2^-22 of each
            block's largest element (in a block whose largest is below 2^-103, up to
            2^-125 absolute), the only error beyond FP32's; a block of X with a NaN or an
            infinity gives NaN outputs where it reaches (the torch reference gives NaN or
            +-inf there; the FMA-chain form also NaN); the interpreter and
            ``e2m1_decode="integer"`` the same integers, so the same bits): both models'
            nvfp4 step default since 2026-12-04 (twenty-fifth session). ``"idot_pdl"``:
            the same kernels and bits; with dependent launches (``pdl``) and a products
            launch, X's integers' launch comes first and lets the read pass start at once
            (the read pass waits for it after issuing its loads of the codes), and the
            products launch comes after the read pass, dependent on it (it waits for it
            before its stores); otherwise the launches of ``"idot"``. ``"idot_in"``
            (2026-12-05, thirty-fourth session): ``"idot"``'s read pass forming X's integers
            in each program (``_x_int_limbs``: the same integers, so the same bits), so no
            launch for them precedes the products launch. ``"lean_out"`` (an
            FP32 copy, a decode step under the conditions of ``lean_records``, with
            ``shared_products``; 2026-12-05): ``_f32_step_kernel``, the ``"lean"`` read pass
            of FP32 rows that then does the records work of ``lean_records``'s launch on its
            own rows (the draft row's correction, the output, the append), per row once the
            head's decays and the products launch's ``Z`` are known, so no records launch
            follows and no Y is stored; its tiles must lie within a value head (``block_v``
            divides V; refused otherwise) and ``lean_records`` must be None. The same
            operations per element as ``"lean"`` with the lean records launch, summed in
            another layout: within the outputs' tolerance of it, not bit for bit.
            ``"lean_one"`` (2026-12-05, thirty-second session): ``"lean_out"`` without the
            products launch, so the decode step is one launch: each program forms its
            (sequence, key group)'s products with the record keys itself (the products
            launch's ``_key_products``, the same chunking and products; its reductions'
            order follows the read pass's ``num_warps``, so within the outputs' tolerance of
            ``"lean_out"``, not bit for bit); ``shared_products`` and ``pdl`` do not apply
            (one ordinary launch). ``"idot_one"`` (an nvfp4 copy, the same decode-step
            conditions; 2026-12-05): ``_nvfp4_step_kernel``, the decode step from an nvfp4
            copy in one launch: ``"idot"``'s integer-dot products with X's integers formed
            in the program (the integers ``_x_int_kernel`` stores, so the same Y), then
            ``"lean_one"``'s products with the record keys and records work on its rows
            (tiles within a value head; ``lean_records`` must be None; ``shared_products``
            and ``pdl`` do not apply). ``"idot_out"`` (an nvfp4 copy, the same conditions;
            2026-12-05, thirty-third session): ``_nvfp4_step_kernel`` after ``"idot"``'s X
            integers' launch and the products launch (``shared_products`` must be True;
            with ``pdl`` dependent on the products launch), so the records launch of
            ``"idot"`` is folded into the read pass, as ``"lean_out"`` folds it from FP32
            (``"idot"``'s products ``Y``; the records work within float32 rounding of its
            lean records launch).
            ``(block_v, num_warps, form, maxnreg)``: the same with the read pass's registers
            per thread capped at ``maxnreg`` (None or an int in [16, 255]; on CUDA only, the
            same bits): GDN's mxfp4 step default since 2026-12-04 (``(32, 2, "records",
            96)``; its nvfp4 step's until the integer-dot form).
        lean_records: ``(heads, num_warps)`` or ``(heads, num_warps, early)``: a decode
            step (one draft row, one query, ``append`` given, no ``at_window``,
            ``fused_window`` or ``w_out_known``, the substitution form; ``w_out`` given for
            GDN, which receives the draft row's correction, and only for GDN) with a read
            pass: the records launch after it is
            ``_step_out_kernel``, one program per sequence and ``heads`` value heads (a
            power of two in [1, 64]) on ``num_warps`` warps, in place of the records kernel's
            one program per (sequence, value head, row tile); the same formula per row (within
            the outputs' tolerance of the records kernel's launch, not bit for bit). Where no
            products launch runs (one value head per key group and one row tile), the records
            kernel's launch. Refused (ValueError naming the option) for any other call. None or
            False (default): the records kernel's launch. ``early`` (after the lean read pass,
            with ``pdl``): the read pass lets the lean records launch start once all its
            programs have started, so the records' loads overlap its last wave (the same
            bits: the records launch still waits for it before it reads Y and Z). Under
            read-pass form ``"idot_pdl"`` the launch before the records launch is the
            products launch, which lets it start at once anyway: ``early`` changes nothing
            there.
        pdl: programmatic dependent launch (CUDA, compute capability 9.0 or later) between
            the launches of this call: the launch after the products launch (the read pass,
            or the records launch) starts while the products launch runs and streams C
            before it waits for it (``gdc_wait``: before it reads Z or Y and before its first
            store); the records launch after a read pass starts as the read pass ends, and
            after ``fold_x="launch"``'s coefficients launch it waits before its stream (it
            needs the coefficients first), so only the launch latency overlaps. The
            first launch of the call is an ordinary launch, so everything made before the
            call is complete when any of them reads it. The same instructions on the same
            values, so the same outputs. None (default): on where it can run (CUDA with
            compute capability >= 9.0, not the interpreter); True there too (refused
            elsewhere); False: ordinary launches.
        late_sum: None (default) or a power of two >= 4: C X by FP32 FMA on chunks of this
            many columns of C, the products added element-wise into a ``[BV, columns of X,
            late_sum]`` accumulator and summed across it once per program (instead of one
            cross-lane reduction per chunk and column). Unblocked copies with ``use_dot``
            False only (elsewhere ignored). Slower than the defaults in every timed case
            (2026-12-03, ``records_tune --set late``): kept for other devices' sweeps.
        split_x: GDN's matrix forms (``solve`` "inverse" / "doubling") with X in two tiles, the
            solved rows' keys (``max(16, NS)`` columns, rounded up to a power of two) and the
            queries (``max(8, TQ)``), each small product formed on the block where it is
            nonzero (``_matrix_outputs_split``); the same formulas, other tile shapes, so the
            outputs agree within their tolerance, not bit for bit. Applies to one launch that
            forms its own products with the keys (no products launch, no ``read_pass``), with
            32-bit products (not the 16-bit products of ``"f16x3"`` / ``"bf16x3"``),
            without ``fused_window`` and without ``append``; ignored elsewhere. Default
            False.
        fold_x: GDN's matrix forms with the coefficients folded into X
            (``_fold_matrices``): the corrections and outputs are one linear map
            ``C (X Wy) + Vd Wv + U^T Wu`` of the stored checkpoint, the solved rows' values
            and the known corrections, whose ``[NX, NX]`` coefficients depend on the keys,
            decays and betas only; so they are formed before C is read, each chunk of X is
            multiplied by ``Wy`` before its product with C, and the epilogue is two small
            products instead of the solve's ``[BV, NX]`` intermediates (right-hand side,
            corrections, outputs). The same formulas reassociated, so the outputs agree
            within their tolerance, not bit for bit. Applies to a launch with products
            (``use_dot``) and no ``read_pass`` or ``append``, where ``split_x`` does not;
            ignored elsewhere. ``"launch"``: the coefficients (and the products with the
            keys they need) in a launch of their own before, once per (sequence, value head)
            (``_fold_coeffs_kernel``; no products launch then), so the records launch starts
            its stream of C at once. Default False.
    Returns ``o`` (``out`` when given).
    Raises ``ValueError`` naming a bad launch option (block_v, num_warps, k_chunk,
    num_stages, use_dot, prefetch, keys_first, shared_products, solve, solve_precision,
    fused_window, e2m1_decode, read_pass, pdl, w_out_known, late_sum, split_x, fold_x,
    lean_records), a bad slot index (``start`` not an int64 / int32 tensor or a ``(tensor,
    int)`` pair, ``rows`` / ``out_start`` not one of those or an int, or a negative offset)
    or an
    output
    that is not float32
    (w_out, out).
    """
    start, ss_add = _slot_index("start", start)
    rows, n_add = _slot_index("rows", rows, (start, ss_add))
    out_start, os_add = _slot_index("out_start", out_start, (start, ss_add))
    adds = dict(SS_ADD=ss_add, N_ADD=n_add, OS_ADD=os_add)  # every launch below takes them
    (c, cbs, cms), spec = _stored_args(checkpoint)
    ring_la, ring_k, ring_w = ring_la.contiguous(), ring_k.contiguous(), ring_w.contiguous()
    for name, t in [("w_out", w_out), ("out", out)] + list((append or {}).items()):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel writes it in place)")
    _check_flags("", w_out_known=w_out_known, prefetch=prefetch, keys_first=keys_first,
                 shared_products=shared_products, split_x=split_x)
    if not (isinstance(fold_x, bool) or fold_x == "launch"):
        raise ValueError(f"fold_x must be True, False or 'launch', got {fold_x!r}")
    if late_sum is not None and not (isinstance(late_sum, int) and not isinstance(late_sum, bool)
                                     and _pow2(late_sum) and 4 <= late_sum):
        raise ValueError(f"late_sum must be None or a power of two >= 4 (the columns of C per "
                         f"step of its element-wise sums), got {late_sum!r}")
    for name, t in (("w_out", w_out), ("out", out)):
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (the kernel writes float32), got {t.dtype}")
    if w_out_known and (w_out is None or not gdn or w_out.shape[1] != ring_w.shape[1]
                        or fused_window is not None or at_window is not None):
        raise ValueError(f"w_out_known=True needs gdn=True, no fused_window or at_window and "
                         f"a w_out with the ring's {ring_w.shape[1]} slots, got gdn={gdn!r}, "
                         f"fused_window={fused_window!r}, at_window={at_window!r}, w_out of "
                         f"shape {None if w_out is None else tuple(w_out.shape)}")
    B, CAP, G, K = ring_k.shape
    H = ring_la.shape[2]
    V = ring_w.shape[3]
    _check_supported(K, q.dtype)
    TQ = q.shape[1]
    if draft is None:
        draft = {"la": ring_la, "k": ring_k, "v": ring_w, "beta": ring_la}
        draft_relative = False
    TD = draft["la"].shape[1]
    beta = draft.get("beta", draft["la"])
    o = out if out is not None else torch.empty(B, TQ, H, V, dtype=torch.float32,
                                                device=q.device)
    if TQ == 0:  # nothing to output: hand the kernel valid (unused) pointers
        q = ring_k
        o_arg = ring_k
    else:
        o_arg = o
    wo = w_out if w_out is not None else o_arg
    ap = append or {}
    a_la, a_k, a_v = ap.get("la", o_arg), ap.get("k", o_arg), ap.get("v", o_arg)
    a_beta = ap.get("beta", o_arg)
    NS = (TD if solved is None else int(solved)) if gdn else 0
    NC = NS + TQ
    if use_dot is None:
        use_dot = NC >= 4
    _check_launch(block_v=block_v, num_warps=num_warps, k_chunk=k_chunk, num_stages=num_stages,
                  use_dot=use_dot, solve=solve)
    prec = "tf32x3" if use_dot in X16_DOTS else (use_dot if isinstance(use_dot, str) else "ieee")
    matrix = SOLVE_FORMS.index(solve)
    if solve_precision is not None and not matrix:
        raise ValueError(f"solve_precision applies to the matrix forms (solve='inverse' or "
                         f"'doubling'), got solve_precision={solve_precision!r} with "
                         f"solve={solve!r}")
    if solve_precision is None:
        solve_precision = "tf32x3" if prec == "tf32x3" else "ieee"
    if solve_precision not in ("ieee", "tf32x3"):
        raise ValueError(f"solve_precision must be 'ieee' or 'tf32x3' (or None), got "
                         f"{solve_precision!r}")
    if fused_window is not None and not (gdn and matrix and not draft_relative):
        raise ValueError(f"fused_window needs gdn=True, draft_relative=False and a matrix form "
                         f"of solve, got gdn={gdn!r}, draft_relative={draft_relative!r}, "
                         f"solve={solve!r}")
    KC = min(K, triton.next_power_of_2(k_chunk or K))
    if read_pass is False:
        read_pass = None
    read_form = "records"
    read_maxnreg = None
    if read_pass is not None:
        if not (isinstance(read_pass, (tuple, list)) and len(read_pass) in (2, 3, 4)):
            raise ValueError(f"read_pass must be None, False, (block_v, num_warps), "
                             f"(block_v, num_warps, form) or (block_v, num_warps, form, "
                             f"maxnreg), got {read_pass!r}")
        if len(read_pass) >= 3:
            read_form = read_pass[2]
            if read_form not in READ_FORMS:
                raise ValueError(f"read_pass form must be one of {READ_FORMS}, got "
                                 f"{read_form!r}")
        if len(read_pass) == 4:
            read_maxnreg = _check_maxnreg("read_pass maxnreg", read_pass[3])
        try:
            _check_tile(*read_pass[:2])
        except ValueError as e:
            raise ValueError(f"read_pass {tuple(read_pass)!r}: {e}") from None
    ypre = read_pass is not None and NC > 0  # Y = C X in a launch of its own
    if lean_records is False:
        lean_records = None
    if lean_records is not None:
        if not (isinstance(lean_records, (tuple, list)) and len(lean_records) in (2, 3)
                and all(isinstance(x, int) and not isinstance(x, bool)
                        for x in lean_records[:2])
                and _pow2(lean_records[0]) and 1 <= lean_records[0] <= 64
                and _pow2(lean_records[1]) and lean_records[1] <= 8
                and (len(lean_records) == 2 or isinstance(lean_records[2], bool))):
            raise ValueError(f"lean_records must be None or (heads, num_warps[, early]) with "
                             f"heads a power of two in [1, 64], num_warps 1, 2, 4 or 8 and "
                             f"early a bool, got {lean_records!r}")
    if lean_records is not None or read_form in STEP_FORMS:
        what = ("lean_records" if lean_records is not None else
                f"read_pass form {read_form!r}")
        if (TD != 1 or TQ != 1 or NS != (1 if gdn else 0) or matrix or append is None
                or (w_out is not None) != gdn or w_out_known or at_window is not None
                or fused_window is not None or not ypre or not draft_relative):
            raise ValueError(f"{what} is the option of a decode step after a read pass "
                             f"(one draft row given as draft, indexed relative to start "
                             f"(draft_relative=True), one query, append, "
                             f"solve='substitution', read_pass given, no at_window / "
                             f"fused_window / w_out_known; GDN: w_out given and solved=1; "
                             f"Mamba-2: no w_out, no solved rows); got gdn={gdn!r}, "
                             f"draft_relative={draft_relative!r}, {TD} draft rows, {TQ} queries, "
                             f"solved={NS}, solve={solve!r}, "
                             f"append={'given' if append is not None else None}, "
                             f"w_out={'given' if w_out is not None else None}, "
                             f"w_out_known={w_out_known!r}, read_pass={read_pass!r}")
    # with a read pass, "f16x3" is the read pass's only: the records launch (and the products
    # launch before it) form the products with the keys by reductions (no 16-column padding)
    main_dot = False if ypre and use_dot in X16_DOTS else use_dot
    NX = max(_min_nx(main_dot, matrix, main_dot, gdn), triton.next_power_of_2(max(NC, 1)))
    keys_first = keys_first and KC == K  # one [slots, K] tile: only with one chunk of K
    bv = max(MIN_DOT, triton.next_power_of_2(block_v))
    grid = (B * H, triton.cdiv(V, bv))
    blk = spec.info.block or 1
    LP = _lp(max(CAP, TD))
    if lean_records is not None:  # its [slots, heads, V] tile: Triton's 2^20-element limit
        cells = LP * lean_records[0] * triton.next_power_of_2(V)
        if cells > 2 ** 20:
            raise ValueError(f"lean_records heads={lean_records[0]}: the launch's [slots, heads, "
                             f"V] tile would hold {LP} x {lean_records[0]} x "
                             f"{triton.next_power_of_2(V)} = {cells} elements, above Triton's "
                             f"{2 ** 20}; use fewer heads per program")
    if KC < 32 and blk > 1:
        raise ValueError(f"k_chunk {k_chunk} is below this {spec} copy's 32 (each chunk holds "
                         f"whole scaling blocks); 16 suits unblocked copies")
    C = _decode_consts(spec)
    mode = _e2m1_mode(e2m1_decode, q.device,
                      "half" if use_dot == "f16x3" and C.KIND == _K_NVFP4 else "lookup")
    if mode == "half" and C.FP4 and C.KIND != _K_NVFP4:
        raise ValueError(f"e2m1_decode='half' folds 2^14 into E4M3 block scales (nvfp4); this "
                         f"copy is {spec}")
    C = C._replace(LUT=mode == "lookup" and C.FP4, HALF=mode == "half" and C.FP4)
    # the lean read pass's conditions, checked before any launch of this call
    lean = ypre and read_form in LEAN_FORMS
    # the lean read pass of an FP32 copy (forms "lean", "lean_out" and "lean_one")
    lean32 = lean and C.KIND == _K_FLOAT and read_form in ("lean",) + F32_STEP_FORMS
    if read_form in F32_STEP_FORMS and not lean32:
        raise ValueError(f"read_pass form {read_form!r} takes an fp32 copy, got {spec}")
    if read_form in NVFP4_STEP_FORMS and C.KIND != _K_NVFP4:
        raise ValueError(f"read_pass form {read_form!r} takes an nvfp4 copy, got {spec}")
    if read_form in ("lean_out", "idot_out") and not shared_products:
        raise ValueError(f"read_pass form {read_form!r} reads the products with the keys from "
                         f"the products launch: it needs shared_products=True ('lean_one' / "
                         f"'idot_one' form them themselves)")
    if read_form in STEP_FORMS and lean_records is not None:
        raise ValueError(f"read_pass form {read_form!r} does the records work in the read "
                         f"pass: lean_records must be None, got {lean_records!r}")
    if read_form in STEP_FORMS and V % triton.next_power_of_2(read_pass[0]):
        raise ValueError(f"read_pass form {read_form!r} needs tiles within one value head: "
                         f"block_v {triton.next_power_of_2(read_pass[0])} does not divide "
                         f"V = {V}")
    if lean and not ((C.KIND == _K_NVFP4 or lean32) and NC <= 2 and fused_window is None
                     and use_dot not in X16_DOTS):
        raise ValueError(f"read_pass form {read_form!r} takes an nvfp4 copy (forms 'lean', "
                         f"'lean_out' and 'lean_one' an fp32 one), at most 2 columns of X "
                         f"(a decode step's), no fused_window and no use_dot in {X16_DOTS}; "
                         f"got the copy {spec}, {NC} column{'s' if NC != 1 else ''} of X, "
                         f"fused_window={fused_window!r}, "
                         f"use_dot={use_dot!r}")
    if lean and not lean32 and c.data_ptr() % 4:
        raise ValueError(f"read_pass form {read_form!r} reads the nvfp4 codes as 32-bit words: their "
                         f"storage must start on a 4-byte boundary, got address "
                         f"{c.data_ptr():#x} (a view at an odd offset; pass a copy)")
    # C's products on float16 tensor cores: nvfp4 (E2M1 x E4M3 values, exact in float16)
    # or fp16 values as stored
    f16 = use_dot == "f16x3" and (C.KIND == _K_NVFP4 or _f16_exact(C))
    b16 = use_dot == "bf16x3" and _bf16_exact(C)  # C's products on bfloat16 tensor cores
    consts = dict(K=K, LP=LP, NS=NS, NC=NC, NX=NX, KC=KC, STAGES=num_stages or 1,
                  DOT=bool(main_dot), PREC=prec, GDN=gdn, D_REL=draft_relative,
                  SOLVE=matrix,
                  FUSED=fused_window is not None)
    # the C X forms of the records launches: late_sum, split_x
    forms = dict(LATE=min(K, late_sum or 0), NCP=triton.next_power_of_2(max(NC, 1)))
    # every input a launch of this call reads, made before its first launch: a dependent
    # launch (pdl) reads them before it waits, so no copy may run between the launches
    q_arg = q.contiguous()
    dk = draft["k"].contiguous()
    dla, dv, dbeta = draft["la"].contiguous(), draft["v"].contiguous(), beta.contiguous()
    # the products launch (Z once per (sequence, key group)); "lean_out" always takes it (its
    # read pass forms no products with the keys), "lean_one" and "idot_one" never (they form
    # them themselves)
    zpre = (shared_products and ((H // G) * grid[1] > 1 or read_form in ("lean_out", "idot_out"))
            and read_form not in ("lean_one", "idot_one"))
    # split_x: GDN's matrix form on X in two tiles (one launch that forms its own products
    # with the keys; 32-bit products; not the fused A path; no append)
    forms.update(SPLIT=bool(split_x and gdn and matrix and fused_window is None and not zpre
                            and not ypre and not f16 and not b16 and append is None),
                 NXK=max(MIN_DOT, triton.next_power_of_2(max(NS, 1))),  # also a K: >= 16
                 NXQ=max(MIN_DOT_F32, triton.next_power_of_2(max(TQ, 1))))
    # fold_x: GDN's matrix form with its coefficients folded into X (products, one launch
    # that streams C, no append; split_x first where both are asked)
    forms.update(FOLD=bool(fold_x and gdn and matrix and NS > 0 and main_dot and not ypre
                           and not forms["SPLIT"] and append is None))
    # fold_x="launch": the coefficients in a launch of their own (it forms the products with
    # the keys too, so no products launch)
    wpre = forms["FOLD"] and fold_x == "launch"
    zpre = zpre and not wpre
    pdl = _pdl_mode(pdl, q.device)
    # the integer-dot read pass: X as integers per (sequence, key group), by a launch of
    # their own first (form "idot_in": formed in the read pass instead, no such launch)
    # (an ordinary launch: complete before the products launch starts, so
    # the read pass, dependent on the products launch, reads them without waiting for it).
    # This holds only while the products launch (or, with none, the read pass itself) is an
    # ordinary launch directly after this one: a dependent (PDL) launch between them would
    # let the read pass start before X's integers are written.
    # Form "idot_pdl" (with PDL and a products launch): X's integers' launch lets the read
    # pass start at once (the read pass waits for it after issuing its loads of the codes),
    # and the products launch comes after the read pass, dependent on it, and waits for it
    # before its stores; the records launch, waiting on the products launch, so waits on
    # every launch before it. Without PDL or a products launch it is "idot" (the same bits).
    idot = lean and read_form in IDOT_FORMS + ("idot_out",)
    xwait = idot and read_form == "idot_pdl" and pdl and zpre
    xin = idot and read_form == "idot_in"  # X's integers formed in the read pass
    if idot and not xin:
        xi = torch.empty(B * G * NC * (3 * (K // 4) + K // 16), dtype=torch.int32,
                         device=q.device)
        xs = torch.empty(B * G * NC * (K // 16), dtype=torch.float32, device=q.device)
        _x_int_kernel[(B * G,)](dk, q_arg, start, rows, xi, xs, G, TD, TQ, K=K, NC=NC, NS=NS,
                                D_REL=draft_relative, PDL=xwait, num_warps=1, **adds)
    else:
        xi = xs = o_arg
    if zpre:  # Z (and Zd) once per (sequence, key group), read by the records kernel
        z = torch.empty(B * G, LP, NX, dtype=torch.float32, device=q.device)
        zd = (torch.empty(B * G, NX, NX, dtype=torch.float32, device=q.device)
              if gdn and matrix and NS > 0 else z)

        def products(after_read_pass: bool):
            _key_products_kernel[(B * G,)](ring_k, dk, q_arg, start, rows, z, zd, G, CAP, TD,
                                           TQ, num_warps=num_warps, PDL=pdl,
                                           WAIT=after_read_pass, **consts, **adds,
                                           **({"launch_pdl": True} if after_read_pass else {}))
        if not xwait:
            products(False)
    elif wpre:  # the folded form's coefficients once per (sequence, value head)
        z = zd = torch.empty(B * H, 2 * NX + LP, NX, dtype=torch.float32, device=q.device)
        _fold_coeffs_kernel[(B * H,)](
            ring_la, ring_k, dla, dk, dbeta, q_arg, start, rows, out_start, z, H, G, CAP, TD, TQ,
            at_window if at_window is not None else
            (-1 if fused_window is None else fused_window),
            K=K, KC=KC, STAGES=num_stages or 1, LP=LP, NC=NC, NS=NS, NX=NX, PREC=prec,
            D_REL=draft_relative, SOLVE=matrix, NSQ=max(0, (max(NS, 1) - 1).bit_length() - 1),
            FUSED=fused_window is not None, SPREC=solve_precision,
            AT_WINDOW=at_window is not None, PDL=pdl, num_warps=num_warps, **adds)
    else:
        z = zd = o_arg
    args = (c, cbs, cms, ring_la, ring_k, ring_w, dla, dk, dv, dbeta, q_arg, o_arg, start, rows,
            out_start, wo, a_la, a_k, a_v, a_beta, z, zd)
    nxs = triton.next_power_of_2(max(NC, 1))
    # X split once per (sequence, key group): nvfp4's read pass (_c_times_x16)
    xsplit = ypre and f16 and C.KIND == _K_NVFP4 and 3 * nxs <= MIN_DOT
    if xsplit:
        x16 = torch.empty(B * G, K, MIN_DOT, dtype=torch.float16, device=q.device)
        xinv = torch.empty(B * G, nxs, dtype=torch.float32, device=q.device)
        _x_split_kernel[(B * G,)](dk, q_arg, start, rows, x16, xinv, G, TD, TQ, K=K, NS=NS,
                                  NXS=nxs, D_REL=draft_relative, FUSED=fused_window is not None,
                                  num_warps=2, **adds)
    else:
        x16 = xinv = o_arg
    scalars = (H, G, V, CAP, TD, TQ, wo.shape[1] if w_out is not None else 1,
               o.shape[1] if TQ else 1, out_slot,
               at_window if at_window is not None else
               (-1 if fused_window is None else fused_window))
    flags = dict(BLK=blk, PREFETCH=bool(prefetch), KFIRST=keys_first, ZPRE=zpre,
                 WRITE_W=w_out is not None, APPEND=append is not None,
                 AT_WINDOW=at_window is not None, SPREC=solve_precision,
                 NSQ=max(0, (max(NS, 1) - 1).bit_length() - 1),
                 ONE=TD == 1,  # at most one draft row (rows - start <= TD, as the callers pass)
                 XS=False, NXS=nxs, C=C, WPRE=wpre, **consts, **forms)
    if lean:  # the lean read pass: Y = C X [B*H*V, NC], nothing else
        rbv = triton.next_power_of_2(read_pass[0])
        y = (o_arg if read_form in STEP_FORMS else  # (the fused launch stores no Y)
             torch.empty(B * H * V * NC, dtype=torch.float32, device=q.device))
        # EARLY: the lean records launch after it (with PDL) may start as its last wave does
        early = (pdl and zpre and lean_records is not None and len(lean_records) == 3
                 and lean_records[2])
        if read_form in NVFP4_STEP_FORMS:  # "idot_one": the call's only launch; "idot_out":
            # after X's integers' launch and the products launch (dependent on it with PDL)
            one = read_form == "idot_one"
            _nvfp4_step_kernel[(B * G * triton.cdiv((H // G) * V, rbv),)](
                c, cbs, cms, dk, q_arg, start, rows, out_start, ring_la, ring_w, dla, dv, dbeta,
                o_arg, wo, a_la, a_k, a_v, a_beta, ring_k, z, xi, xs, H, G, CAP, TD, TQ,
                o.shape[1], out_slot, wo.shape[1] if w_out is not None else 1, V=V, K=K, LP=LP,
                NX=NX, NC=NC, NS=NS, D_REL=draft_relative, BV=rbv, GDN=gdn,
                PTX=mode != "integer", SCVT=mode != "integer" and _e4m3_cvt_runs(q.device),
                KC=KC, STAGES=num_stages or 1, DOT=bool(main_dot), PREC=prec, ONE=one,
                num_warps=read_pass[1], **adds,
                **_pdl_launch((not one) and pdl and zpre), **_maxnreg_launch(read_maxnreg))
            return o
        if read_form in STEP_FORMS:  # the records work in the read pass
            # "lean_one": the call's only launch (no dependent launch: nothing of this call
            # before it to wait for)
            zin = read_form == "lean_one"
            _f32_step_kernel[(B * G * triton.cdiv((H // G) * V, rbv),)](
                c, dk, q_arg, start, rows, out_start, ring_la, ring_w, dla, dv, dbeta, o_arg,
                wo, a_la, a_k, a_v, a_beta, z, ring_k, H, G, CAP, TD, TQ, o.shape[1],
                out_slot, wo.shape[1] if w_out is not None else 1, V=V, K=K, LP=LP, NX=NX,
                NC=NC, NS=NS, D_REL=draft_relative, BV=rbv, GDN=gdn, ZIN=zin, KC=KC,
                STAGES=num_stages or 1, DOT=bool(main_dot), PREC=prec,
                num_warps=read_pass[1], **adds, **_pdl_launch(pdl and zpre),
                **_maxnreg_launch(read_maxnreg))
            return o
        if lean32:
            _f32_read_kernel[(B * G * triton.cdiv((H // G) * V, rbv),)](
                c, dk, q_arg, start, rows, y, H, G, TD, TQ, V=V, K=K, NC=NC, NS=NS,
                D_REL=draft_relative, BV=rbv, num_warps=read_pass[1], EARLY=early, **adds,
                **_pdl_launch(pdl and zpre), **_maxnreg_launch(read_maxnreg))
        else:
            _nvfp4_read_kernel[(B * G * triton.cdiv((H // G) * V, rbv),)](
                c, cbs, cms, dk, q_arg, start, rows, y, xi, xs, H, G, TD, TQ, V=V, K=K, NC=NC,
                NS=NS, D_REL=draft_relative, BV=rbv, PTX=mode != "integer", num_warps=read_pass[1],
                EARLY=early or xwait, IDOT=idot, XIN=xin,
                SCVT=idot and mode != "integer" and _e4m3_cvt_runs(q.device), WAITX=xwait, **adds,
                **_pdl_launch(pdl and zpre), **_maxnreg_launch(read_maxnreg))
            if xwait:
                products(True)
    elif ypre:  # the read pass: Y = C X [B*H*V, NC] in its own launch (its own tile)
        rbv = max(MIN_DOT, triton.next_power_of_2(read_pass[0]))
        y = torch.empty(B * H * V * NC, dtype=torch.float32, device=q.device)
        rflags = dict(flags, DOT=2 if f16 else 3 if b16 else bool(use_dot), XS=xsplit,
                      NX=max(_min_nx(use_dot, matrix, use_dot, gdn),
                             triton.next_power_of_2(NC)))
        # (the read pass compiles the whole kernel, matrix forms included: NX as _min_nx asks)
        # dependent on the products launch only when it directly follows it (X split between
        # them: an ordinary launch, since it reads the split X at once)
        rpdl = pdl and zpre and not xsplit
        _records_kernel[(B * H, triton.cdiv(V, rbv))](
            *args, y, x16, xinv, *scalars, BV=rbv, YOUT=True, YPRE=False, num_warps=read_pass[1], **adds,
            **rflags, **_pdl_launch(rpdl), **_maxnreg_launch(read_maxnreg))
    else:
        y = o_arg
        flags["DOT"] = 2 if f16 else 3 if b16 else bool(use_dot)
    mpdl = pdl and (zpre or ypre or wpre)  # after a launch of this call
    if lean_records is not None and zpre:  # a decode step's lean records launch
        hb, lw = lean_records[:2]
        _step_out_kernel[(B * triton.cdiv(H, hb),)](
            ring_la, ring_w, dla, dk, dv, dbeta, o_arg, wo, start, rows, out_start, a_la, a_k,
            a_v, a_beta, z, y, H, G, V, CAP, TD, o.shape[1], out_slot,
            wo.shape[1] if w_out is not None else 1, K=K, LP=LP, NX=NX, HB=hb,
            VP=triton.next_power_of_2(V), D_REL=draft_relative, GDN=gdn, num_warps=lw, **adds,
            **_pdl_launch(mpdl))
        return o
    _records_kernel[grid](*args, y, x16, xinv, *scalars, BV=bv, YOUT=False, YPRE=ypre,
                          num_warps=num_warps, W_KNOWN=w_out_known, **flags, **adds,
                          **_pdl_launch(mpdl))
    return o


def _slot_index(name: str, x, start=None) -> "tuple[torch.Tensor, int]":
    """``(t, d)`` of a slot index of :func:`records_outputs` (``start``, ``rows``,
    ``out_start``): an int64 or int32 tensor ``t`` (``d = 0``), a pair ``(t, d)``, or, for
    ``rows`` and ``out_start`` (``start`` given as ``(t, d0)``), a plain int ``d`` meaning
    ``start + d``. The kernels add ``d`` (a ``tl.constexpr``, so each distinct ``d``, e.g. a
    verify's draft count, compiles its own specialisation) as they load ``t``. Raises
    ValueError naming ``name`` for anything else or a negative offset."""
    if isinstance(x, int) and not isinstance(x, bool) and start is not None:
        if x < 0:
            raise ValueError(f"{name}: the offset added to start must be >= 0, got {x}")
        t, d = start[0], start[1] + x
    elif (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], torch.Tensor)
          and isinstance(x[1], int) and not isinstance(x[1], bool)):
        t, d = x
    elif isinstance(x, torch.Tensor):
        t, d = x, 0
    else:
        raise ValueError(f"{name}: expected an int64 tensor [B]"
                         + (", an int (start + int)" if start is not None else "")
                         + f" or a (tensor, int) pair, got {x!r}")
    if t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: expected an int64 (or int32) tensor [B], got {t.dtype}")
    if d < 0:
        raise ValueError(f"{name}: the offset added to the tensor must be >= 0, got {d}")
    return t, d


def _min_nx(dot, matrix: bool, use_dot, gdn: bool) -> int:
    """Fewest columns of X (padded with zeros): 2 for reductions; for products (``dot``, or
    the matrix forms' small products) MIN_DOT_F32 where X's columns are only ever the N of a
    product with 32-bit operands (Triton's tl.dot takes any N >= 1 there), MIN_DOT where they
    are also a K (GDN's matrix forms: the inverse and the products with it; Triton 3.6 asks
    K >= 16) or the operands are 16-bit (``"f16x3"``, ``"bf16x3"``)."""
    if not (dot or matrix):
        return 2
    return MIN_DOT if use_dot in X16_DOTS or (gdn and matrix) else MIN_DOT_F32


def _check_flags(where: str, **flags) -> None:
    """ValueError naming the first of ``flags`` that is not a bool (a string such as "no" is
    truthy, so it would do the opposite of what it says); ``where`` prefixes the message."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"{where}{name} must be True or False, got {v!r}")


@functools.lru_cache(maxsize=None)
def _e4m3_cvt_runs(device: torch.device) -> bool:
    """Whether the hardware's E4M3 to float16 conversion (``cvt.rn.f16x2.e4m3x2``, PTX for
    sm_89 and later) runs on ``device``: NVIDIA CUDA, compute capability >= 8.9, kernels not
    interpreted. Elsewhere the integer-dot read pass decodes its block scales in Triton
    operations (the same values)."""
    return _nvidia_at_least(device, (8, 9))


@functools.lru_cache(maxsize=None)
def _pdl_runs(device: torch.device) -> bool:
    """Whether programmatic dependent launch runs on ``device`` (NVIDIA CUDA, compute
    capability >= 9.0, kernels not interpreted); asked once per device (the step's hot path)."""
    return _nvidia_at_least(device, (9, 0))


def _nvidia_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """Whether ``device`` is an NVIDIA CUDA device of compute capability ``>= capability``
    (major, minor) running compiled kernels (not the interpreter)."""
    return (device.type == "cuda" and not KERNELS_INTERPRETED and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= capability)


def _pdl_mode(pdl, device) -> bool:
    """``records_outputs(pdl=...)``: None -> on where it can run (:func:`_pdl_runs`); True
    where it cannot: ValueError."""
    if pdl is not None and not isinstance(pdl, bool):
        raise ValueError(f"pdl must be True, False or None, got {pdl!r}")
    can = _pdl_runs(device)
    if pdl and not can:
        raise ValueError(f"pdl=True needs NVIDIA CUDA with compute capability >= 9.0 and the "
                         f"kernels not interpreted; here: device {device}"
                         f"{', Triton interpreter' if KERNELS_INTERPRETED else ''}")
    return can if pdl is None else pdl


def _pdl_launch(on: bool) -> dict:
    """Launch keywords of a dependent launch (PDL) and its ``PDL`` constexpr."""
    return dict(PDL=True, launch_pdl=True) if on else {}


def _x16_not_kept(cfg: dict, read, anchor) -> bool:
    """Whether GDN's re-solving anchor launch drops the read copy's 16-bit products for
    tf32x3 (with its split X): ``bf16x3`` always, ``f16x3`` unless both copies are nvfp4 (the
    one case whose anchor launch took them before fp16 copies could; read:fp16/rec:nvfp4's
    anchor launch stays on tf32x3 as before)."""
    use_dot = cfg.get("use_dot")
    return use_dot == "bf16x3" or (use_dot == "f16x3"
                                   and not (_nvfp4(anchor) and _nvfp4(read)))


def _nvfp4(read) -> bool:
    """Whether a stored copy is nvfp4 (E2M1 codes with E4M3 block scales)."""
    return isinstance(read, PackedTensor) and _decode_consts(read.spec).KIND == _K_NVFP4


def _f16(read) -> bool:
    """Whether a stored copy holds float16 values (fp16: ``use_dot="f16x3"``)."""
    return isinstance(read, PackedTensor) and _f16_exact(_decode_consts(read.spec))


def _b16(read) -> bool:
    """Whether bfloat16 holds every value of a stored copy exactly (bf16, fp8e4m3, fp8e5m2:
    ``use_dot="bf16x3"``)."""
    return isinstance(read, PackedTensor) and _bf16_exact(_decode_consts(read.spec))


def _fp4(read) -> bool:
    """Whether a stored copy holds E2M1 codes (nvfp4, mxfp4)."""
    return isinstance(read, PackedTensor) and _decode_consts(read.spec).FP4


def _e2m1_mode(e2m1_decode, device, ptx_default: str = "lookup") -> str:
    """The records kernel's E2M1 decoder (``records_outputs(e2m1_decode=...)``):
    ``ptx_default`` (``"lookup"``; ``"half"`` for ``use_dot="f16x3"``, whose float16 pairs it
    gives directly) by default on NVIDIA CUDA, ``"integer"`` under the interpreter or
    elsewhere; a given one is checked (the inline-PTX ones need NVIDIA CUDA without the
    interpreter)."""
    ptx = device.type == "cuda" and torch.version.hip is None and not KERNELS_INTERPRETED
    if e2m1_decode is None:  # (ROCm reports "cuda" too: the PTX is NVIDIA's)
        return ptx_default if ptx else "integer"
    if e2m1_decode not in E2M1_DECODES:
        raise ValueError(f"e2m1_decode must be one of {E2M1_DECODES} (or None), got "
                         f"{e2m1_decode!r}")
    if e2m1_decode != "integer" and not ptx:
        raise ValueError(f"e2m1_decode={e2m1_decode!r} is inline PTX and needs NVIDIA CUDA "
                         f"without the Triton interpreter (device {device}, TRITON_INTERPRET="
                         f"{int(KERNELS_INTERPRETED)} when the kernels were imported); use "
                         f"'integer' or None")
    return e2m1_decode


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


def _check_tile(block_v, num_warps) -> None:
    """ValueError naming a bad value-row tile or warp count (records and flush kernels)."""
    if not (_pow2(block_v) and block_v >= MIN_DOT):
        raise ValueError(f"block_v must be a power of two >= {MIN_DOT}, got {block_v!r}")
    if not (_pow2(num_warps) and num_warps <= 32):
        raise ValueError(f"num_warps must be 1, 2, 4, 8, 16 or 32, got {num_warps!r}")


def _check_launch(*, block_v, num_warps, k_chunk, num_stages, use_dot,
                  solve="substitution") -> None:
    """ValueError naming a bad launch option of :func:`records_outputs`."""
    _check_tile(block_v, num_warps)
    if k_chunk is not None and not (_pow2(k_chunk) and k_chunk >= 16):
        raise ValueError(f"k_chunk must be a power of two >= 16 (or None: the key dim), "
                         f"got {k_chunk!r}")
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int)
                                   or num_stages < 1):
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if not (use_dot is True or use_dot is False or use_dot in ("ieee", "tf32x3", *X16_DOTS)):
        raise ValueError(f"use_dot must be False, True, 'ieee', 'tf32x3', 'f16x3' (nvfp4 and "
                         f"fp16 copies) or 'bf16x3' (bf16 and fp8 copies), got {use_dot!r}")
    if not (isinstance(solve, str) and solve in SOLVE_FORMS):
        raise ValueError(f"solve must be one of {', '.join(map(repr, SOLVE_FORMS))}, "
                         f"got {solve!r}")


def _check_x16_dot(read, cfg: dict) -> None:
    """ValueError when ``use_dot="f16x3"`` is asked of a step or verify whose read copy is not
    nvfp4 or fp16 (the float16 products need values float16 holds exactly: E2M1 times E4M3,
    or fp16's own), or ``"bf16x3"`` of one whose values bfloat16 does not hold exactly (bf16
    and fp8 copies do)."""
    use_dot = cfg.get("use_dot")
    if use_dot not in X16_DOTS:
        return
    spec = read.spec if isinstance(read, PackedTensor) else f"a {read.dtype} tensor"
    if use_dot == "f16x3" and not (_nvfp4(read) or _f16(read)):
        raise ValueError(f"use_dot='f16x3' needs an nvfp4 or fp16 read copy (float16 "
                         f"tensor-core products of its exact values), got {spec}; use "
                         f"'tf32x3'")
    if use_dot == "bf16x3" and not _b16(read):
        raise ValueError(f"use_dot='bf16x3' needs a bf16 or fp8 (fp8e4m3, fp8e5m2) read copy "
                         f"(bfloat16 tensor-core products of its exact values), got {spec}; "
                         f"use 'tf32x3'")


def _read_form(read_pass) -> str | None:
    """The form of a ``read_pass`` option (``"records"`` when it names none; None for no
    read pass)."""
    if not read_pass:
        return None
    return read_pass[2] if isinstance(read_pass, (tuple, list)) and len(read_pass) > 2 else "records"


def _check_verify_read_pass(read_pass) -> None:
    """ValueError for a verify's ``read_pass`` in the lean form: that form is the decode
    step's (at most two columns of X); a verify's launches have T queries (and GDN's anchor
    launch the window's keys)."""
    if _read_form(read_pass) in LEAN_FORMS:
        raise ValueError(f"read_pass form {read_pass[2]!r} is the decode step's (at most 2 columns of "
                         f"X); verify takes (block_v, num_warps) or (block_v, num_warps, "
                         f"'records'[, maxnreg]), got {tuple(read_pass)!r}")


def _f16_exact(C) -> bool:
    """Whether an unblocked stored copy (``DecodeConsts`` ``C``) holds float16 values (fp16)."""
    return C.KIND == 1 and not C.BF16


def _bf16_exact(C) -> bool:
    """Whether bfloat16 holds every value of an unblocked stored copy exactly (``DecodeConsts``
    ``C``): bf16 values, and fp8 codes (E4M3, E5M2) before their matrix scale."""
    return (C.KIND == 1 and C.BF16) or C.KIND == 2


def _config(defaults: dict, **given) -> dict:
    """Launch configuration: ``defaults`` overridden by the given (not None) values."""
    return {**defaults, **{k: v for k, v in given.items() if v is not None}}


def _chunks_for(cfg: dict, checkpoint) -> dict:
    """``cfg`` for a launch that streams ``checkpoint``: a ``k_chunk`` below 32 (the read
    copy's tile, unblocked) raised to 32 when this checkpoint is blocked (nvfp4, mx), whose
    chunks hold whole scaling blocks; a verify's anchor may be blocked where its read copy is
    not."""
    block = isinstance(checkpoint, PackedTensor) and (checkpoint.spec.info.block or 1) > 1
    if block and cfg.get("k_chunk") is not None and cfg["k_chunk"] < 32:
        return dict(cfg, k_chunk=32)
    return cfg


def _anchor_config(cfg: dict, anchor) -> dict:
    """The anchor launch of a verify that solves nothing (one output per sequence): FMA
    reductions for C X (``use_dot=False``); the matrix forms keep the first launch's precision
    of their small products (``solve_precision``); chunks of K as ``_chunks_for`` asks."""
    out = _chunks_for(_config(cfg, use_dot=False), anchor)
    if out.get("solve", "substitution") != "substitution" and out.get("solve_precision") is None:
        out["solve_precision"] = ("tf32x3" if cfg.get("use_dot") in ("tf32x3", *X16_DOTS)
                                  else "ieee")
    return out


def _x16_read_pass(cfg: dict, read_pass, records_pass) -> None:
    """A step configuration whose default read pass is a lean form (no 16-bit products) but
    whose caller asked for ``use_dot`` of 16-bit products (``X16_DOTS``) takes the records
    kernel's read pass ``records_pass``, which has them; a ``read_pass`` the caller gave is
    kept (and refused later if it cannot take them). Updates ``cfg`` in place."""
    if (read_pass is None and _read_form(cfg.get("read_pass")) in LEAN_FORMS
            and cfg["use_dot"] in X16_DOTS):
        cfg["read_pass"] = records_pass


def _fit_step_form(cfg: dict, read_pass, lean_records, V: int, fallback: dict) -> None:
    """A default read pass of ``STEP_FORMS`` (the caller gave no ``read_pass``) whose tile
    does not divide the head dim ``V`` is replaced by ``fallback``'s read pass, with its
    ``lean_records`` where the caller gave none. Updates ``cfg`` in place."""
    rp = cfg.get("read_pass")
    if (read_pass is None and _read_form(rp) in STEP_FORMS
            and V % triton.next_power_of_2(rp[0])):
        cfg["read_pass"] = fallback["read_pass"]
        if lean_records is None and "lean_records" in fallback:
            cfg["lean_records"] = fallback["lean_records"]


def _drop_default_lean_records(cfg: dict, lean_records, read_pass=None) -> None:
    """A step configuration's default ``lean_records`` (the caller gave None) is dropped where
    the step cannot take it: no read pass, a matrix form of ``solve``, or the read-pass form
    ``"lean_out"``, ``"lean_one"``, ``"idot_one"`` or ``"idot_out"`` (which do the records
    work in their read pass). Where the caller gave ``lean_records`` (a launch, or False for
    the records kernel's) but no ``read_pass`` and the default read pass is one of those
    forms, the default tile takes the form with a records launch after it (``"lean"``;
    ``"idot"`` for ``"idot_one"`` and ``"idot_out"``). Updates ``cfg`` in place."""
    form = _read_form(cfg.get("read_pass"))
    if lean_records is None and (not cfg.get("read_pass")
                                 or cfg.get("solve") not in (None, "substitution")
                                 or form in STEP_FORMS):
        cfg.pop("lean_records", None)
    elif lean_records is not None and read_pass is None and form in STEP_FORMS:
        rp = cfg["read_pass"]
        cfg["read_pass"] = (rp[0], rp[1], "idot" if form in NVFP4_STEP_FORMS else "lean")


# ---------------------------------------------------------------- decode step
def mamba2_step_kernel(read, ring: dict, la, v, k, q, h, *, block_v: int | None = None,
        num_warps: int | None = None, k_chunk: int | None = None,
        num_stages: int | None = None, use_dot: "bool | str | None" = None,
        prefetch: bool | None = None, solve: str | None = None,
        keys_first: bool | None = None, shared_products: bool | None = None,
        e2m1_decode: str | None = None, read_pass=None,
        pdl: bool | None = None, late_sum: int | None = None, lean_records=None):
    """Decode step of Mamba-2 (kernel of :func:`replay.mamba2.mamba2_step_output` plus the
    append): write the record ``(la [B,H], v [B,H,P], k [B,G,N])`` into ring slot ``h[b]``
    (ring dict ``la [B,CAP,H]``, ``v [B,CAP,H,P]``, ``k [B,CAP,G,N]``, updated in place) and
    return ``y = gamma_{1:h+1} (R q) + V (m * (K^T q))`` ``[B, H, P]`` (no ``D x``) from the
    stored read copy ``read`` and grouped ``q [B, G, N]``. ``h``: int64 ``[B]`` records before
    the append (the caller then does h += 1). Launch configuration: ``STEP_CONFIG``
    (``MAMBA2_STEP_WIDE_CONFIG`` for an FP32 or half read copy, ``MAMBA2_STEP_NVFP4_CONFIG``
    for an nvfp4 one (the lean read pass), ``MAMBA2_STEP_FP4_CONFIG`` for mxfp4) unless
    given (see :func:`records_outputs`; ``solve``: its matrix forms, untimed; ``read_pass``:
    ``(block_v, num_warps)`` or ``(block_v, num_warps, form)`` of a separate launch for the
    products with R (form ``"records"``, ``"lean"``, ``"idot"``, ``"idot_pdl"`` or
    ``"idot_in"``; an FP32
    copy takes ``"lean"``, ``"lean_out"`` and ``"lean_one"`` too; an nvfp4 one
    ``"idot_one"`` or ``"idot_out"``), or False for one launch;
    ``lean_records``: ``(heads, num_warps[, early])`` of the lean records launch after a
    read pass, or False for the records kernel's (:func:`records_outputs`); a default
    ``lean_records`` is dropped where the step has no read pass, takes a matrix form of
    ``solve`` or the read-pass forms ``"lean_out"``, ``"lean_one"``, ``"idot_one"`` and
    ``"idot_out"``; a given one without ``read_pass`` runs the default tile in ``"lean"`` /
    ``"idot"``)."""
    # FP32 and bf16/fp16 copies (element-wise formats; the tiles were swept on FP32 only)
    wide = not isinstance(read, PackedTensor) or read.spec.info.scaling == "none"
    cfg = _config(MAMBA2_STEP_WIDE_CONFIG if wide else
                  (MAMBA2_STEP_NVFP4_CONFIG if _nvfp4(read) else MAMBA2_STEP_FP4_CONFIG
                   if _fp4(read) else STEP_CONFIG), block_v=block_v,
                  num_warps=num_warps, k_chunk=k_chunk,
                  num_stages=num_stages, use_dot=use_dot, prefetch=prefetch, solve=solve,
                  keys_first=keys_first, shared_products=shared_products,
                  e2m1_decode=e2m1_decode, read_pass=read_pass, pdl=pdl, late_sum=late_sum,
                  lean_records=lean_records)
    _x16_read_pass(cfg, read_pass, MAMBA2_STEP_FP4_CONFIG["read_pass"])
    _drop_default_lean_records(cfg, lean_records, read_pass)
    _check_x16_dot(read, cfg)
    _check_devices("mamba2_step_kernel", read=read, la=la, v=v, k=k, q=q, h=h, ring=ring)
    draft = {"la": la[:, None], "k": k[:, None], "v": v[:, None]}
    y = records_outputs(read, ring_la=ring["la"], ring_k=ring["k"], ring_w=ring["v"],
                        q=q[:, None], start=h, rows=1, out_start=0, draft=draft,
                        append={"la": ring["la"], "k": ring["k"], "v": ring["v"]}, **cfg)
    return y[:, 0]


def gdn_step_kernel(read, ring: dict, q, k, v, g, beta, h, *, block_v: int | None = None,
        num_warps: int | None = None, k_chunk: int | None = None,
        num_stages: int | None = None, use_dot: "bool | str | None" = None,
        prefetch: bool | None = None, solve: str | None = None,
        keys_first: bool | None = None, shared_products: bool | None = None,
        e2m1_decode: str | None = None, read_pass=None,
        pdl: bool | None = None, late_sum: int | None = None, lean_records=None):
    """Decode step of GDN (kernel of :func:`replay.gdn.gdn_step_output` plus the append):
    write the record ``(g, beta [B,HV], v [B,HV,DV], k [B,HK,DK])`` into ring slot ``h[b]``,
    solve its read-path correction ``u_h = beta (v - gamma_{1:h} R k - sum_i gamma_{i+1:h}
    (k_i . k) u_i)`` against the stored read copy and the cached corrections, cache it in
    ``ring["uR"]`` and return ``o [B, HV, DV]`` in output-only form. Ring dict: ``la, beta
    [B,CAP,HV]``, ``v, uR [B,CAP,HV,DV]``, ``k [B,CAP,HK,DK]`` (updated in place). Launch
    configuration: ``STEP_CONFIG`` (``GDN_STEP_F32_CONFIG`` for an FP32 read copy: the
    products launch, then the lean FP32 read pass with the records work on its rows
    (``"lean_out"``; ``GDN_STEP_F32_SPAN_CONFIG`` where its tile does not divide DV);
    ``GDN_STEP_WIDE_CONFIG`` for a half one,
    ``GDN_STEP_NVFP4_CONFIG`` for an nvfp4 one, ``GDN_STEP_FP4_CONFIG`` for mxfp4,
    ``GDN_STEP_FP8_CONFIG`` for an
    fp8 one, ``GDN_STEP_BLOCKED_CONFIG`` for mxfp8) unless given (``solve``: the matrix forms
    of :func:`records_outputs`, untimed for the step; ``read_pass``: ``(block_v, num_warps)``
    or ``(block_v, num_warps, form[, maxnreg])`` of a separate launch for the products with
    R (form ``"records"``, ``"lean"``, ``"idot"``, ``"idot_pdl"``, ``"idot_in"`` or, from an
    FP32 copy,
    ``"lean_out"`` or ``"lean_one"``, from an nvfp4 one ``"idot_one"`` or ``"idot_out"``,
    :func:`records_outputs`; the nvfp4
    default ``(128, 1, "idot")``), or False for one launch; a default lean form with a
    caller's ``use_dot`` of 16-bit products takes the records kernel's read pass
    (``GDN_STEP_FP4_CONFIG``'s), which has them; ``lean_records``: ``(heads, num_warps[,
    early])`` of the lean records launch after a read pass (``_step_out_kernel``), or False
    for the records kernel's (:func:`records_outputs`); a default ``lean_records`` is
    dropped where the step has no read pass, takes a matrix form of ``solve`` or the
    read-pass forms ``"lean_out"``, ``"lean_one"``, ``"idot_one"`` and ``"idot_out"``; a given one without
    ``read_pass`` runs the default tile in ``"lean"`` / ``"idot"``)."""
    wide = not isinstance(read, PackedTensor) or read.spec.info.scaling == "none"
    blocked = isinstance(read, PackedTensor) and read.spec.info.scaling in ("nvfp4", "mx")
    f32 = not isinstance(read, PackedTensor) or _kind(read.spec) == _K_FLOAT
    cfg = _config(GDN_STEP_F32_CONFIG if f32 else GDN_STEP_WIDE_CONFIG if wide else
                  (GDN_STEP_NVFP4_CONFIG if _nvfp4(read) else GDN_STEP_FP4_CONFIG) if _fp4(read) else
                  GDN_STEP_FP8_CONFIG if _b16(read) else
                  (GDN_STEP_BLOCKED_CONFIG if blocked else STEP_CONFIG), block_v=block_v,
                  num_warps=num_warps, k_chunk=k_chunk,
                  num_stages=num_stages, use_dot=use_dot, prefetch=prefetch, solve=solve,
                  keys_first=keys_first, shared_products=shared_products,
                  e2m1_decode=e2m1_decode, read_pass=read_pass, pdl=pdl, late_sum=late_sum,
                  lean_records=lean_records)
    _x16_read_pass(cfg, read_pass, GDN_STEP_FP4_CONFIG["read_pass"])
    if f32:
        _fit_step_form(cfg, read_pass, lean_records, v.shape[-1], GDN_STEP_F32_SPAN_CONFIG)
    _drop_default_lean_records(cfg, lean_records, read_pass)
    if f32 and pdl is None and not cfg.get("read_pass"):
        cfg["pdl"] = GDN_STEP_WIDE_CONFIG["pdl"]  # one launch from FP32: its timed form
    _check_x16_dot(read, cfg)
    _check_devices("gdn_step_kernel", read=read, q=q, k=k, v=v, g=g, beta=beta, h=h, ring=ring)
    draft = {"la": g[:, None], "k": k[:, None], "v": v[:, None], "beta": beta[:, None]}
    o = records_outputs(read, ring_la=ring["la"], ring_k=ring["k"], ring_w=ring["uR"],
                        q=q[:, None], start=h, rows=1, out_start=0, draft=draft, gdn=True,
                        w_out=ring["uR"],
                        append={"la": ring["la"], "k": ring["k"], "v": ring["v"],
                                "beta": ring["beta"]}, **cfg)
    return o[:, 0]


def _check_verify(where, read, anchor, la, v, k, q, start, window, beta=None, u_known=None,
                  assert_range: bool = True):
    """Shapes and dtypes of a verify's inputs against the read copy ``[B, H, V, K]``: records
    ``la [B,J,H]``, ``v [B,J,H,V]``, ``k [B,J,G,K]`` (G dividing H), drafts ``q [B,T,G,K]``,
    ``start`` integer ``[B]`` (GDN: ``beta [B,J,H]``, ``u_known [B,J,H,V]``); the drafts must
    fit the ring (``start + T <= J``, checked on the device: no host synchronisation; with
    ``assert_range=False`` left to the caller's kernel, as the CUDA verify checks it itself).
    Raises ValueError naming the input (the kernels index by these extents)."""
    for name, t in (("read", read), ("anchor", anchor)):
        if not isinstance(t, (torch.Tensor, PackedTensor)):
            raise ValueError(f"{where}: {name} must be a stored checkpoint [B, H, V, K] (a "
                             f"float32 tensor or a PackedTensor), got {type(t).__name__}")
    _check_devices(where, read=read, anchor=anchor, la=la, v=v, k=k, q=q, start=start,
                   beta=beta, u_known=u_known)
    B, H, V, K = (int(x) for x in read.shape)
    if tuple(anchor.shape) != (B, H, V, K):
        raise ValueError(f"{where}: anchor has shape {tuple(anchor.shape)}, expected the read "
                         f"copy's {(B, H, V, K)}")
    J, G = _check_records(where, la, v, k, beta, B, H, V, K)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"{where}: q must be a [B, T, G, K] tensor, got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    T = q.shape[1]
    _check_f32(where, "q", q, (B, T, G, K))
    if u_known is not None:
        _check_f32(where, "u_known", u_known, (B, J, H, V))
    _check_index(where, "start", start, B)
    if as_int(window) is None or window < 1:
        raise ValueError(f"{where}: window must be an int >= 1, got {window!r}")
    msg = f"{where}: start + T must be in [T, J = {J}] (the drafts fit the ring)"
    if T > J:  # no start fits: known on the host
        raise ValueError(f"{msg}; T = {T} drafts exceed the J = {J} record slots")
    if assert_range:
        _assert_ranges(msg, (start, 0, J - T))  # one launch and one assertion (no host sync)


# ---------------------------------------------------------------- verify
# A draft on the flush slot (rows == window) reads the A path: a second launch over the anchor
# whose programs return at once unless rows[b] == window (checked on the device, no host sync),
# writing only the last draft's output into the same output tensor.
def mamba2_verify_kernel(read, anchor, la, v, k, q, start, window: int, *,
                         block_v: int | None = None, num_warps: int | None = None,
                         k_chunk: int | None = None, num_stages: int | None = None,
                         use_dot: "bool | str | None" = None, prefetch: bool | None = None,
                         solve: str | None = None, solve_precision: str | None = None,
                         skip_shared_anchor: bool = True,
                         shared_products: bool | None = None,
                         e2m1_decode: str | None = None,
                         pdl: bool | None = None,
                         read_pass: "tuple[int, int] | bool | None" = None,
                         late_sum: int | None = None):
    """Kernel of :func:`replay.mamba2.mamba2_verify` (same arguments, records already in the
    ring slices ``la [B,J,H]``, ``v [B,J,H,P]``, ``k [B,J,G,N]``; ``read``/``anchor`` stored).
    Returns ``y [B, T, H, P]``. Two records-kernel launches (one when ``skip_shared_anchor``
    applies; with ``shared_products`` each preceded by the small products launch), no host
    synchronisation (the second runs only for the sequences whose last draft is on the flush
    slot). Inputs are checked by :func:`_check_verify` (ValueError, or a device-side assertion
    for drafts past the ring). Launch configuration:
    ``MAMBA2_VERIFY_WIDE_CONFIG`` for an FP32 or half read copy,
    ``MAMBA2_VERIFY_FP8_CONFIG`` for an fp8 one, ``MAMBA2_VERIFY_NVFP4_CONFIG`` for an nvfp4
    one, ``MAMBA2_VERIFY_BLOCKED_CONFIG`` for an mx one) unless
    given (``read_pass``: ``(block_v, num_warps)`` of a launch of its own for the products
    with the read copy, see :func:`records_outputs`; ``pdl``: programmatic dependent launch
    between the launches of one records call); ``solve="inverse"`` / ``"doubling"`` (the same
    kernel for Mamba-2, which has no
    system): the T outputs as two small products instead of one reduction per query (see
    :func:`records_outputs`). ``skip_shared_anchor`` (default on): when ``anchor is read``
    (single-checkpoint policies: ``fp32``, ``shared:F``) the A path of the flush-slot draft is
    the R path's formula on the same bytes, which the first launch already computed, so the
    second launch is not made (the output is the first launch's value, within the outputs'
    tolerance of the second launch's; one launch fewer, never slower)."""
    blocked = isinstance(read, PackedTensor) and read.spec.info.scaling in ("nvfp4", "mx")
    wide = not isinstance(read, PackedTensor) or read.spec.info.scaling == "none"
    cfg = _config(MAMBA2_VERIFY_NVFP4_CONFIG if _nvfp4(read) else
                  MAMBA2_VERIFY_BLOCKED_CONFIG if blocked else
                  MAMBA2_VERIFY_WIDE_CONFIG if wide else
                  MAMBA2_VERIFY_FP8_CONFIG if _b16(read) else VERIFY_CONFIG, block_v=block_v,
                  num_warps=num_warps, k_chunk=k_chunk,
                  num_stages=num_stages, use_dot=use_dot, prefetch=prefetch, solve=solve,
                  solve_precision=solve_precision, shared_products=shared_products,
                  e2m1_decode=e2m1_decode, pdl=pdl, read_pass=read_pass,
                  late_sum=late_sum)
    _check_verify_read_pass(read_pass)
    _check_x16_dot(read, cfg)
    if solve_precision is None and cfg.get("solve", "substitution") == "substitution":
        cfg.pop("solve_precision", None)  # a default's; it applies to the matrix forms only
    _check_flags("mamba2_verify_kernel: ", skip_shared_anchor=skip_shared_anchor)
    if _nvfp4(read) and cfg.get("use_dot") != "f16x3" and e2m1_decode is None:
        cfg["e2m1_decode"] = "integer"  # MAMBA2_VERIFY_BLOCKED_CONFIG's (the lookup: slower)
    _check_verify("mamba2_verify_kernel", read, anchor, la, v, k, q, start, window)
    T = q.shape[1]
    B = q.shape[0]
    if T == 0:
        return q.new_zeros(B, 0, la.shape[2], v.shape[3])
    # rows = start + T, in the kernels as they load start (no tensor formed)
    kw = dict(ring_la=la, ring_k=k, ring_w=v, start=(start, T), rows=0)
    y = records_outputs(read, q=q, out_start=(start, 0), **kw, **cfg)
    if skip_shared_anchor and anchor is read:
        return y
    records_outputs(anchor, q=q[:, T - 1:], out_start=(start, T - 1), out=y, out_slot=T - 1,
                    at_window=window, **kw, **_anchor_config(cfg, anchor))
    return y


def gdn_verify_kernel(read, anchor, la, beta, v, k, q, u_known, start, window: int,
                      fold_cached_corrections: bool = False, *, block_v: int | None = None,
                      num_warps: int | None = None, k_chunk: int | None = None,
                      num_stages: int | None = None, use_dot: "bool | str | None" = None,
                      prefetch: bool | None = None, solve: str | None = None,
                      solve_precision: str | None = None,
                      skip_shared_anchor: bool = True, fuse_shared_anchor: bool = False,
                      anchor_block_v: int | None = None,
                      shared_products: bool | None = None,
                      e2m1_decode: str | None = None,
                      pdl: bool | None = None,
                      read_pass: "tuple[int, int] | bool | None" = None,
                      late_sum: int | None = None, split_x: bool | None = None,
                      fold_x: "bool | str | None" = None):
    """Kernel of :func:`replay.gdn.gdn_verify`: one T x T solve (rows ``start..start+T-1``)
    against the stored read copy with the cached corrections ``u_known [B,J,HV,DV]`` before,
    then the T outputs; a draft on the flush slot reads the A path (every row re-solved
    against A, or the cached corrections with ``fold_cached_corrections``) in a second launch
    that runs only for those sequences (no host synchronisation).
    Returns ``(o [B,T,HV,DV], uR [B,J,HV,DV])``. Launch configuration: ``GDN_VERIFY_CONFIG``
    (``GDN_VERIFY_NVFP4_CONFIG`` for an nvfp4 read copy, ``GDN_VERIFY_B16_CONFIG`` for a bf16
    or fp8 one, ``GDN_VERIFY_F16_CONFIG`` for an fp16 one, ``GDN_VERIFY_BLOCKED_CONFIG`` for
    an mx one) unless given (``read_pass``: ``(block_v, num_warps)`` of a launch of its own
    for the products with the stored copy, see :func:`records_outputs`; ``pdl``: programmatic
    dependent launch between the launches of one records call). ``solve``:
    ``"substitution"``, or the matrix forms ``"inverse"`` (the default configurations' form) /
    ``"doubling"``: the
    T x T system (and, in the anchor launch, the ``window`` x ``window`` one) inverted once
    per program on scalars and applied to the value rows as small products (see
    :func:`records_outputs`). ``skip_shared_anchor`` (default on): with
    ``fold_cached_corrections`` and ``anchor is read`` the A path is the R path's formula on the
    same bytes and corrections, already computed by the first launch: no second launch (the
    recompute path always re-solves against A). ``fuse_shared_anchor`` (default off; slower than
    two launches in every timed case, ``records_tune_verify2_h200.json``; needs
    ``start + T <= window``, a device-side assertion;
    needs a matrix form of ``solve``): for the recompute path with ``anchor is read``, one
    launch whose X holds the keys of slots ``0..window-1`` (not only the T drafts'; sized by
    the window, not by J, so the tiles do not depend on the batch; verify's contract
    ``start + T <= window`` keeps every row inside): the read-path
    solve as above, and for the sequences at the window the whole system re-solved against
    the same checkpoint in the same program (``records_outputs(fused_window=window)``);
    a wider C X product for every sequence instead of a second pass over the state for the
    ones at the window. With ``anchor is not read`` it has no effect. ``anchor_block_v``:
    value rows per program of the anchor launch (default ``block_v``; its system has
    ``window`` rows, so fewer value rows keep the matrix forms' anchor launch out of register
    spills). ``split_x`` (:func:`records_outputs`): None (default) for X in two tiles in the
    re-solving anchor launch only (its ``window`` solved keys and one query: 16 + 8 columns
    instead of 32; records_tune --set split, 2026-12-03, at B = 256, h = 8: from nvfp4, whose
    read-copy launch has float16 products and does not split, 1076 -> 799 us; from FP32 with
    both launches split 1130 -> 883 us; in the read-copy launch alone, 8 + 8 columns padded
    to 16 + 8, it was slower, h = 0 403 -> 439 us), True for both launches, False for
    neither. ``late_sum`` and ``fold_x`` (the coefficients folded into X; where both are
    asked, ``split_x`` wins, so by default the anchor launch stays split): see
    :func:`records_outputs`."""
    blocked = isinstance(read, PackedTensor) and read.spec.info.scaling in ("nvfp4", "mx")
    cfg = _config(GDN_VERIFY_NVFP4_CONFIG if _nvfp4(read) else
                  GDN_VERIFY_B16_CONFIG if _b16(read) else
                  GDN_VERIFY_F16_CONFIG if _f16(read) else
                  GDN_VERIFY_BLOCKED_CONFIG if blocked else GDN_VERIFY_CONFIG, block_v=block_v,
                  num_warps=num_warps, k_chunk=k_chunk,
                  num_stages=num_stages, use_dot=use_dot, prefetch=prefetch, solve=solve,
                  solve_precision=solve_precision, shared_products=shared_products,
                  e2m1_decode=e2m1_decode, pdl=pdl, read_pass=read_pass,
                  late_sum=late_sum, split_x=split_x, fold_x=fold_x)
    _check_verify_read_pass(read_pass)
    _check_x16_dot(read, cfg)
    _check_flags("gdn_verify_kernel: ", fold_cached_corrections=fold_cached_corrections,
                 skip_shared_anchor=skip_shared_anchor, fuse_shared_anchor=fuse_shared_anchor)
    if fuse_shared_anchor and cfg.get("solve", "substitution") == "substitution":
        raise ValueError("fuse_shared_anchor=True needs solve='inverse' or 'doubling', got "
                         f"solve={cfg.get('solve', 'substitution')!r}")
    if anchor_block_v is not None:
        try:
            _check_tile(anchor_block_v, cfg["num_warps"])
        except ValueError as e:
            raise ValueError(f"anchor_block_v: {e}") from None
        if fold_cached_corrections:
            raise ValueError("anchor_block_v applies to the re-solving anchor launch; with "
                             "fold_cached_corrections=True the anchor launch solves nothing")
    _check_verify("gdn_verify_kernel", read, anchor, la, v, k, q, start, window, beta=beta,
                  u_known=u_known)
    T = q.shape[1]
    B, J = la.shape[:2]
    if fuse_shared_anchor:
        if T > window:
            raise ValueError(f"gdn_verify_kernel: fuse_shared_anchor=True needs start + T <= "
                             f"window, but T = {T} > window = {window}")
        _assert_ranges("gdn_verify_kernel: fuse_shared_anchor=True needs start + T <= window",
                       (start, 0, window - T))  # (start >= 0: _check_verify's check)
    if T == 0:  # no drafts: the known corrections before start, zeros from start on
        return (q.new_zeros(B, 0, la.shape[2], v.shape[3]),
                torch.where(length_mask(start, J)[:, :, None, None], u_known, 0.0))
    draft = {"la": la, "k": k, "v": v, "beta": beta}
    if fuse_shared_anchor and anchor is read and not fold_cached_corrections:
        n = start + T
        uR = u_known.clone()
        o = records_outputs(read, ring_la=la, ring_k=k, ring_w=u_known, q=q, start=start,
                            rows=n, out_start=start, draft=draft, draft_relative=False,
                            gdn=True, w_out=uR, solved=window, fused_window=window, **cfg)
        return o, torch.where(length_mask(n, J)[:, :, None, None], uR, 0.0)
    # the corrections: the known ones before start, the solved ones, zeros from n on, all
    # written by the kernel (no copy of u_known before, no mask after)
    uR = torch.empty(u_known.shape, dtype=u_known.dtype, device=u_known.device)
    # rows = start + T (and the anchor launch's start + T - 1) in the kernels as they load
    # start: no tensor formed
    o = records_outputs(read, ring_la=la, ring_k=k, ring_w=u_known, q=q, start=start, rows=T,
                        out_start=0, draft=draft, draft_relative=False, gdn=True, w_out=uR,
                        solved=T, w_out_known=True, **cfg)
    last = dict(q=q[:, T - 1:], out_start=(start, T - 1), out=o, out_slot=T - 1,
                at_window=window)
    if fold_cached_corrections:
        if skip_shared_anchor and anchor is read:
            return o, uR
        records_outputs(anchor, ring_la=la, ring_k=k, ring_w=uR, start=(start, T), rows=0,
                        **last, **_anchor_config(cfg, anchor))
    else:
        # the anchor programs that run have rows == window and start 0: at most ``window``
        # solved rows (the matrix forms size their system by it; substitution loops on rows)
        solved = J if cfg.get("solve", "substitution") == "substitution" else min(J, window)
        # X in two tiles unless the caller said otherwise: this system has window solved rows
        # and one query (one 32-column tile -> 16 + 8; records_tune --set split); not folded
        # unless the caller asked (a default fold_x is the read-copy launch's: where this
        # launch cannot split, an nvfp4 anchor's float16 products, folding it was never
        # timed); chunks of K that this anchor can take; bfloat16 products (bf16x3) are the
        # read copy's launch's: this one keeps tf32x3 and its split X, also where the anchor
        # is that copy (shared:bf16, shared:fp8e4m3; bf16x3 would turn the split off, untimed);
        # so do float16 products (f16x3) but with both copies nvfp4 (shared:nvfp4, as before):
        # an fp16 anchor (read:nvfp4/rec:fp16, shared:fp16) keeps its timed tf32x3 form, and
        # an nvfp4 anchor under an fp16 read copy its former one
        acfg = _chunks_for(_config({"split_x": True, **cfg, "fold_x": fold_x or False,
                                    **({"use_dot": "tf32x3"} if _x16_not_kept(cfg, read, anchor)
                                       else {})},
                                   block_v=anchor_block_v), anchor)
        records_outputs(anchor, ring_la=la, ring_k=k, ring_w=u_known,
                        start=torch.zeros_like(start), rows=(start, T), draft=draft,
                        draft_relative=False, gdn=True, solved=solved, **last, **acfg)
    return o, uR


# ---------------------------------------------------------------- GDN flush corrections
def gdn_corrections_kernel(anchor, la, beta, v, k, length, *, block_v: int = DEFAULT_BV,
        num_warps: int = DEFAULT_WARPS):
    """Kernel of :func:`core.solve_corrections` for a flush: the corrections of rows
    ``0..length[b]-1`` against the stored anchor (records ``la, beta [B,J,HV]``,
    ``v [B,J,HV,DV]``, grouped ``k [B,J,HK,DK]``). Rows at or beyond ``length`` are zero.
    Returns ``u [B, J, HV, DV]``. Raises ValueError naming an input on another device (or
    on a device the kernels cannot run on)."""
    _check_devices("gdn_corrections_kernel", anchor=anchor, la=la, beta=beta, v=v, k=k,
                   length=length)
    B, J, H = la.shape
    u = torch.zeros_like(v)
    if J == 0:
        return u
    q = v.new_zeros(B, 0, k.shape[2], k.shape[3])
    zero = torch.zeros_like(length)
    records_outputs(anchor, ring_la=la, ring_k=k, ring_w=u, q=q, start=zero, rows=length,
                    out_start=zero, draft={"la": la, "k": k, "v": v, "beta": beta},
                    draft_relative=False, gdn=True, w_out=u, block_v=block_v, num_warps=num_warps)
    return u


# ---------------------------------------------------------------- state-object entry points
# The kernels of the state objects' operations, with the signatures of their torch references
# (replay/mamba2.py, replay/gdn.py: ``mamba2_state_step`` ...); the backend seam
# (replayssm_quant/backend.py) swaps one for the other. They read the stored checkpoints.
def mamba2_state_step(cps: Checkpoints, ring: dict, h, la, v, k, q):
    """Kernel of :func:`replay.mamba2.mamba2_state_step`: :func:`mamba2_step_kernel`."""
    return mamba2_step_kernel(cps.read_stored, ring, la, v, k, q, h)


def mamba2_state_verify(cps: Checkpoints, la, v, k, q, start, window: int):
    """Kernel of :func:`replay.mamba2.mamba2_state_verify`: :func:`mamba2_verify_kernel`."""
    return mamba2_verify_kernel(cps.read_stored, cps.anchor_stored, la, v, k, q, start, window)


def gdn_state_step(cps: Checkpoints, ring: dict, h, q, k, v, g, beta):
    """Kernel of :func:`replay.gdn.gdn_state_step`: :func:`gdn_step_kernel`."""
    return gdn_step_kernel(cps.read_stored, ring, q, k, v, g, beta, h)


def gdn_state_verify(cps: Checkpoints, la, beta, v, k, q, u_known, start, window: int,
                     fold_cached_corrections: bool = False):
    """Kernel of :func:`replay.gdn.gdn_state_verify`: :func:`gdn_verify_kernel`."""
    return gdn_verify_kernel(cps.read_stored, cps.anchor_stored, la, beta, v, k, q, u_known,
                             start, window, fold_cached_corrections)

// GDN flush with an FP16 recurrence anchor and an NVFP4 read copy (the policies
// read:nvfp4/rec:fp16 and read:nvfp4/rec:fp16+sr) as one CUDA C++ kernel (issue 15,
// forty-sixth pass). Built and called by replayssm_quant/kernels/replay/cuda_flush.py, which
// checks every input first, all but the per-sequence ranges, which the kernel asserts on the
// device; this file's host code checks nothing.
// The formula is replay/gdn.py's gdn_flush with fold=RECOMPUTE (the corrections re-solved
// against the anchor A, DESIGN.md section 3, "Flush"), then core.cast_checkpoints:
//
//   c_j = sum_{i<=j} la_i                                   (slots j < n = length[b])
//   u_p = beta_p (v_p - e^{c_p} A k_p) - sum_{i<p} beta_p e^{c_p - c_i} (k_i . k_p) u_i
//   S   = e^{c_{n-1}} A + sum_{j<n} e^{c_{n-1} - c_j} u_j k_j^T       (S = A for n = 0)
//   y   = S q                                     (the flush token's output; optional)
//   A'  = fp16(S) (RTN or SR),  R' = nvfp4(S) (RTN)    (cast independently from the same S)
//
// One CTA of 256 threads per (sequence b, value head hd); thread t holds value row r = t / 2,
// key columns 64 (t % 2) .. + 63 of A, then of S, in registers (A is read once, S never
// leaves the chip unless asked for). The products A k_p are FP32 FMAs over the thread's 64
// columns in column order, the two halves joined by one rounded add (__fadd_rn: the two
// threads of a row hold the same bits, a + b = b + a); the Gram terms k_i . k_p the same way
// (two threads a pair); both threads of a row then solve the row's corrections (the same
// operations on the same bits) and fold them into S. The order of every sum is fixed by the
// CTA's code alone: a sequence's bits do not depend on the batch, its position or its
// neighbours.
//
// The casts are those of replayssm_quant/kernels/quant.py's lean pair cast (_pair_lean_kernel,
// the default of the Triton split flush), operation for operation:
// * fp16 SR (_f16_sr_signed): draw r = word (e & 3) of Philox-4x32-10 with counter
//   (e >> 2, key lo, key hi, 0) and key (seed lo, seed hi), e = row * 128 + column
//   (replayssm_quant/philox.py); the key packs (flush index, sequence id, head, layer, copy 0)
//   as philox.stream_key does (STREAM_FIELDS: copy 1 bit, head 10, layer 8, sequence 20,
//   flush 24). fp16 RTN (_f16_rtn_signed): the hardware conversion of the value clamped to
//   +-65504, NaN as 0x7E00 with its sign.
// * NVFP4 (RTN, the default scale mode): s_g = RN(amax / 2688) over the finite |S| of the
//   matrix (1 where that is 0); per block of 16 key columns s_b = E4M3_RTN(RN(bamax /
//   RN(6 s_g))), scale = RN(s_b s_g), elements RN(x / scale) rounded to E2M1 (ties to even,
//   saturating at 6); a block with a NaN or inf gets scale code 0x7F and codes 0, a block with
//   scale 0 keeps the signs only.
//
// Tensors: A [B, H, 128, 128] fp16 codes (int16); la, beta [B, JS, H], v [B, JS, H, 128],
// k [B, JS, G, 128] float32, slots < n read (JS the ring's slots a sequence, n <= J <= 16);
// length, seq, fl int64 [B]; q [B, G, 128]; outputs A' [B, H, 128, 128] int16, codes
// [B, H, 128, 64] uint8, block scales [B, H, 128, 8] uint8, matrix scales [B, H] float32,
// y [B, H, 128], S [B, H, 128, 128] and w [B, J, H, 128] float32 (the last three optional).
#ifndef GDN_FLUSH_DEVICE_ONLY
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#endif
#include <cuda_fp16.h>

#include "replay_device.cuh"

namespace gdn_flush {

constexpr int D = 128;       // key and value dims
constexpr int NTH = 256;     // threads a CTA: two a value row
constexpr int HALF = 64;     // key columns a thread
constexpr int JF = 16;       // record slots (window)
constexpr int KP = D + 4;    // smem key row: columns 64.. shifted by 4 (no bank conflicts
                             // between a row's two halves)
constexpr int NPAIR = JF * (JF - 1) / 2;
static_assert(2 * NPAIR <= NTH, "two threads per Gram pair in one pass");

constexpr int F_SR = 1, F_Y = 2, F_S = 4, F_W = 8;  // flags

// stream-key fields (philox.STREAM_FIELDS)
constexpr int SH_HEAD = 1, SH_SEQ = 19, SH_FLUSH = 39;
constexpr long long SEQ_LIMIT = 1LL << 20, FLUSH_LIMIT = 1LL << 24;

__device__ __forceinline__ int kx(int c) { return c + ((c >> 6) << 2); }

struct Smem {
  float ks[JF][KP];     // the records' keys (key group of this head): slots < n, rows n.. +0
  float qs[KP];         // the flush token's query
  float vs[JF][D];      // the records' values (this value head), slots < n
  float la[JF], be[JF];
  float cum[JF];        // c_j
  float gram[JF][JF];   // [p][i]: k_i . k_p, i < p
  float mc[JF][JF];     // [p][i]: beta_p e^{c_p - c_i} k_i . k_p
  float dp[JF];         // beta_p e^{c_p}
  float fj[JF];         // e^{c_{n-1} - c_j}
  float en;             // e^{c_{n-1}}
  float wmax[NTH / 32];
};

using replay_device::cp16;

// Philox-4x32-10 (Triton's tl.philox round for round; replayssm_quant/philox.py); each
// round's two 32 x 32 -> 64-bit products as one mul.wide.u32 each (high and low words of
// one product, the bits of __umulhi and of the 32-bit product)
__device__ __forceinline__ uint4 philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                        uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    unsigned long long pb, pa;
    asm("mul.wide.u32 %0, %1, %2;" : "=l"(pb) : "r"(0xCD9E8D57u), "r"(c2));
    asm("mul.wide.u32 %0, %1, %2;" : "=l"(pa) : "r"(0xD2511F53u), "r"(c0));
    const uint32_t hb = static_cast<uint32_t>(pb >> 32), lb = static_cast<uint32_t>(pb);
    const uint32_t ha = static_cast<uint32_t>(pa >> 32), lo_a = static_cast<uint32_t>(pa);
    c0 = hb ^ c1 ^ k0;
    c1 = lb;
    c2 = ha ^ c3 ^ k1;
    c3 = lo_a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

// The fp16 SR code with sign of float32 x and draw r where |x| >= 2^-14 (the normal path;
// also inf and NaN): quant.py _f16_sr_signed / _f16_sr_code
__device__ __forceinline__ uint32_t f16_sr_normal(float x, uint32_t r) {
  const int bits = __float_as_int(x);
  const int m = bits & 0x7FFFFFFF;
  // (in unsigned arithmetic: a non-finite m would overflow an int; its code is replaced)
  const int nrm = static_cast<int>((static_cast<uint32_t>(m) + 0x1FFFu - (r >> 19)) >> 13) -
                  (112 << 10);
  int code = min(nrm, 0x7BFF);
  if (m >= 0x7F800000) code = m == 0x7F800000 ? 0x7C00 : 0x7E00;
  return static_cast<uint32_t>(code | ((bits >> 16) & 0x8000));
}

// The fp16 SR code with sign of float32 x and draw r, any x (the same): below 2^-14 the
// subnormal path (a code of at most 1024), both paths formed and one selected
__device__ __forceinline__ uint32_t f16_sr(float x, uint32_t r) {
  const int bits = __float_as_int(x);
  const int m = bits & 0x7FFFFFFF;
  const float t = __fmul_rn(__int_as_float(min(m, 0x38800000)), 16777216.0f);  // <= 1024
  const float fl = floorf(t);
  const uint32_t thr = __float2uint_rz(ceilf(__fmul_rn(__fsub_rn(t, fl), 4294967296.0f)));
  const int sub = static_cast<int>(fl) + (r < thr ? 1 : 0);
  return m < 0x38800000 ? static_cast<uint32_t>(sub | ((bits >> 16) & 0x8000))
                        : f16_sr_normal(x, r);
}

// The fp16 SR codes of four elements and one Philox call's draws, as two words (low half
// first): f16_sr's codes, with its subnormal path (|x| < 2^-14) run only where a lane of the
// warp has such an element (a warp vote; every lane of the warp must call it)
__device__ __forceinline__ uint2 f16_sr4(float x0, float x1, float x2, float x3, uint4 r) {
  const uint32_t m = min(min(__float_as_uint(x0) & 0x7FFFFFFFu, __float_as_uint(x1) & 0x7FFFFFFFu),
                         min(__float_as_uint(x2) & 0x7FFFFFFFu, __float_as_uint(x3) & 0x7FFFFFFFu));
  if (__any_sync(0xffffffffu, m < 0x38800000u))
    return make_uint2(f16_sr(x0, r.x) | (f16_sr(x1, r.y) << 16),
                      f16_sr(x2, r.z) | (f16_sr(x3, r.w) << 16));
  return make_uint2(f16_sr_normal(x0, r.x) | (f16_sr_normal(x1, r.y) << 16),
                    f16_sr_normal(x2, r.z) | (f16_sr_normal(x3, r.w) << 16));
}

// fp16 RTN code with sign (quant.py _f16_rtn_signed)
__device__ __forceinline__ uint32_t f16_rtn(float x) {
  const int bits = __float_as_int(x);
  if (x != x) return 0x7E00u | ((bits >> 16) & 0x8000);
  const float c = fabsf(x) < INFINITY ? fminf(fmaxf(x, -65504.f), 65504.f) : x;
  return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(c)));
}

// E4M3 RTN code of a finite float32 y >= 0, saturating at 448 (quant.py _e4m3_rtn): on sm_89
// and later the hardware conversion (round to nearest even, subnormals kept, satfinite
// clamping to 448 = code 0x7E), elsewhere in integers
__device__ __forceinline__ int e4m3_rtn_code(float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;  // (the second source goes to the low byte)
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(y));
  return r & 0xFF;
#else
  const int bits = __float_as_int(y);
  const int ex = (bits >> 23) & 0xFF, mant = bits & 0x7FFFFF;
  const int sig = ex == 0 ? mant : (mant | 0x800000);
  const int ea = ex == 0 ? -126 : ex - 127;
  const int e = max(ea, -6);
  const int sh = min(20 + (e - ea), 30);
  const int fl = sig >> sh, rem = sig & ((1 << sh) - 1), half = 1 << (sh - 1);
  const int up = (rem > half || (rem == half && (fl & 1))) ? 1 : 0;
  return min(((e + 6) << 3) + fl + up, 0x7E);
#endif
}

__device__ __forceinline__ float e4m3_value(int code) {  // code 0 .. 0x7E
  const int be = code >> 3, mt = code & 7;
  return be == 0 ? __fmul_rn(static_cast<float>(mt), 0.001953125f)
                 : __int_as_float(((be + 120) << 23) | (mt << 20));
}

// signed E2M1 RTN code of a finite float32 y (quant.py _e2m1_rtn_code_lean)
__device__ __forceinline__ uint32_t e2m1_code(float y) {
  const int b = __float_as_int(y);
  const int m = b & 0x7FFFFFFF;
  int n;
  if (m < 0x40000000) {
    n = __float_as_int(__fadd_rn(__fmul_rn(__int_as_float(m), 2.0f), 12582912.0f)) - 0x4B400000;
  } else {
    // (unsigned: y is finite wherever the code is kept, but a bad block's is not)
    const uint32_t um = static_cast<uint32_t>(m);
    n = min(static_cast<int>((um + 0x1FFFFFu + ((um >> 22) & 1u)) >> 22) - 252, 7);
  }
  return static_cast<uint32_t>(n | ((b >> 28) & 8));
}

__device__ __noinline__ void range_fail(int b, long long n, int J, long long seq, long long fl) {
  printf("gdn_flush_cuda: sequence %d: length %lld (expected 0..%d), sequence id %lld "
         "(0..%lld), flush index %lld (0..%lld)\n", b, n, J, seq, SEQ_LIMIT - 1, fl,
         FLUSH_LIMIT - 1);
  assert(0 && "gdn_flush_cuda: a per-sequence field is out of range");
}

// Sequence b's length n (0 .. J), sequence id and flush index (within their stream-key
// fields); false where one is out of range, after thread 0 has printed it and asserted
// (range_fail): the caller's CTA returns
__device__ __forceinline__ bool sequence_fields(const long long* __restrict__ length,
                                                const long long* __restrict__ seqid,
                                                const long long* __restrict__ flidx, int b,
                                                int J, int& n, long long& sq, long long& fi) {
  const long long nn = length[b];
  sq = seqid[b];
  fi = flidx[b];
  if (nn < 0 || nn > J || sq < 0 || sq >= SEQ_LIMIT || fi < 0 || fi >= FLUSH_LIMIT) {
    if (threadIdx.x == 0) range_fail(b, nn, J, sq, fi);
    return false;
  }
  n = static_cast<int>(nn);
  return true;
}

// RN(x / b) for divisors b in [2^-95, 2^95] given with y = RN(1 / b): quant.py's
// _div_by_rcp (a product and four FMAs; equal to __fdiv_rn wherever the quotient is at least
// 2^-3, and below that still below 2^-3 (1 + 2^-20), which is all an E2M1 RTN code reads)
__device__ __forceinline__ float div_by_rcp(float x, float b, float y) {
  float q = __fmul_rn(x, y);
  float r = fmaf(-q, b, x);
  q = fmaf(r, y, q);
  r = fmaf(-q, b, x);
  q = fmaf(r, y, q);
  return __int_as_float(__float_as_int(q) | (__float_as_int(x) & 0x80000000));
}

// whether a matrix scale lets its NVFP4 elements be divided by div_by_rcp (quant.py's
// RCP_MATRIX_SCALE_RANGE, 2^-86 .. 2^86: the block divisors then lie in 2^-95 .. 2^95)
__device__ __forceinline__ bool rcp_scale_ok(float sg) {
  return sg >= 0x1p-86f && sg <= 0x1p86f;
}

// The records' keys and values (and with F_Y the query) into shared memory by cp.async, the
// slots n.. of the keys +0, c_j (one serial sum, thread 0), the Gram terms k_i . k_p (i < p <
// n: two threads a pair, 64 columns each in column order, joined by one rounded add) and the
// coefficient tables; both forms of the kernel. load_anchor() issues the caller's anchor loads
// (after the cp.async group), tables_phase() runs beside the tables (the keys are still in
// shared memory); a barrier follows it.
template <class LoadAnchor, class TablesPhase>
__device__ __forceinline__ void records_prologue(
    Smem& sm, const float* __restrict__ rla, const float* __restrict__ rbe,
    const float* __restrict__ rv, const float* __restrict__ rk, const float* __restrict__ q,
    int b, int hd, int grp, int H, int G, int JS, int n, int flags, LoadAnchor&& load_anchor,
    TablesPhase&& tables_phase) {
  const int tid = threadIdx.x, hf = tid & 1, c0 = HALF * hf;
  for (int e = tid; e < n * (D / 4); e += NTH) {
    const int j = e / (D / 4), c4 = (e % (D / 4)) * 4;
    cp16(&sm.ks[j][kx(c4)], rk + (((size_t)b * JS + j) * G + grp) * D + c4);
    cp16(&sm.vs[j][c4], rv + (((size_t)b * JS + j) * H + hd) * D + c4);
  }
  if ((flags & F_Y) && tid < D / 4) cp16(&sm.qs[kx(4 * tid)], q + ((size_t)b * G + grp) * D + 4 * tid);
  asm volatile("cp.async.commit_group;\n" ::);
  // the rows of the slots n.. are +0: the products and the fold run over all JF slots
  // without predicates (the fold's terms of those slots add -0, which leaves every value as
  // it is; see the fold)
  for (int e = tid; e < (JF - n) * KP; e += NTH) (&sm.ks[n][0])[e] = 0.f;
  load_anchor();
  if (tid < JF) {
    sm.la[tid] = tid < n ? rla[((size_t)b * JS + tid) * H + hd] : 0.f;
    sm.be[tid] = tid < n ? rbe[((size_t)b * JS + tid) * H + hd] : 0.f;
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();

  // c_j (one serial sum, thread 0) and the Gram terms k_i . k_p, i < p < n: two threads a
  // pair, 64 columns each in column order, joined by one rounded add
  if (tid == 0) {
    float c = 0.f;
    for (int j = 0; j < JF; ++j) {
      c += sm.la[j];
      sm.cum[j] = c;
    }
  }
  {
    int x = tid >> 1, p = 1;
    while (p < JF && x >= p) {
      x -= p;
      ++p;
    }  // pair tid / 2 = (i = x, p), ordered by p then i
    float z = 0.f;
    const bool live = p < n;  // (p < JF too)
    if (live) {
      const float4* ki = reinterpret_cast<const float4*>(&sm.ks[x][kx(c0)]);
      const float4* kp = reinterpret_cast<const float4*>(&sm.ks[p][kx(c0)]);
#pragma unroll
      for (int i = 0; i < HALF / 4; ++i) {
        const float4 a = ki[i], c = kp[i];
        z = fmaf(a.x, c.x, z);
        z = fmaf(a.y, c.y, z);
        z = fmaf(a.z, c.z, z);
        z = fmaf(a.w, c.w, z);
      }
    }
    z = __fadd_rn(z, __shfl_xor_sync(0xffffffffu, z, 1));
    if (live && hf == 0) sm.gram[p][x] = z;
  }
  __syncthreads();
  // the coefficient tables
  {
    const float cn = n > 0 ? sm.cum[n - 1] : 0.f;
    if (tid < JF * JF) {
      const int p = tid / JF, i = tid % JF;
      if (i < p && p < n) sm.mc[p][i] = sm.be[p] * expf(sm.cum[p] - sm.cum[i]) * sm.gram[p][i];
    }
    if (tid < JF && tid < n) {
      sm.dp[tid] = sm.be[tid] * expf(sm.cum[tid]);
      sm.fj[tid] = expf(cn - sm.cum[tid]);
    }
    if (tid == 0) sm.en = n > 0 ? expf(cn) : 1.f;
  }
  tables_phase();
  __syncthreads();

}

// The matrix scale s_g = RN(amax / 2688) over the finite |S| of the CTA's matrix (1 where
// that is 0; a max, exact in any order), from each thread's 64 elements of S; every thread
// of the CTA calls it (a barrier inside; wmax: a word a warp in shared memory)
__device__ __forceinline__ float matrix_scale(const float (&s)[HALF], float* wmax, int warp,
                                              int lane) {
  float am = 0.f;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float a = fabsf(s[i]);
    am = fmaxf(am, a < INFINITY ? a : 0.f);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, off));
  if (lane == 0) wmax[warp] = am;
  __syncthreads();
  am = wmax[0];
#pragma unroll
  for (int w = 1; w < NTH / 32; ++w) am = fmaxf(am, wmax[w]);
  const float sg = __fdiv_rn(am, 2688.0f);
  return sg > 0.f ? sg : 1.0f;
}

// The SR stream key's two words (philox.stream_key: flush index, sequence id, head, and the
// layer and copy fields in kbits)
__device__ __forceinline__ uint2 stream_key_words(long long fi, long long sq, int hd,
                                                  long long kbits) {
  const long long key = (fi << SH_FLUSH) | (sq << SH_SEQ) | ((long long)hd << SH_HEAD) | kbits;
  return make_uint2(static_cast<uint32_t>(key & 0xFFFFFFFFLL),
                    static_cast<uint32_t>((key >> 32) & 0xFFFFFFFFLL));
}

// An NVFP4 block's E4M3 scale code and divisor (the lean pair cast's RTN rule) from the
// block's amax over its |x| and whether it holds a non-finite element: a bad block gets code
// 0x7F and codes 0, a block whose scale is 0 keeps its elements' signs only
struct Nvfp4Block {
  int code;    // the E4M3 scale code
  float safe;  // the divisor (the scale, 1 where it is not positive or NaN)
  bool ok, bad;
};
__device__ __forceinline__ Nvfp4Block nvfp4_block(float bm, bool bad, float sg, float sg6) {
  int sbc = e4m3_rtn_code(__fdiv_rn(bm, sg6));
  float scale = __fmul_rn(e4m3_value(sbc), sg);
  if (bad) {
    sbc = 0x7F;
    scale = NAN;
  }
  const bool ok = scale > 0.f;
  return {sbc, ok ? scale : 1.0f, ok, bad};
}

// an element's E2M1 code from its quotient RN(x / safe), under its block's rule
__device__ __forceinline__ uint32_t e2m1_in_block(float quotient, const Nvfp4Block& bk) {
  const uint32_t c = e2m1_code(quotient);
  return bk.ok ? c : bk.bad ? 0u : (c & 8u);
}

// an element's E2M1 code in its block: the quotient RN(x / safe) by div_by_rcp with rcp =
// RN(1 / safe) where use_rcp (rcp_scale_ok), else by __fdiv_rn (the same code either way)
__device__ __forceinline__ uint32_t e2m1_of(float x, const Nvfp4Block& bk, bool use_rcp,
                                            float rcp) {
  return e2m1_in_block(use_rcp ? div_by_rcp(x, bk.safe, rcp) : __fdiv_rn(x, bk.safe), bk);
}

// Launch variants (the same bits): MB CTAs an SM asked of ptxas (1: up to 255 registers, no
// spills; 2: 128 registers; the host launches MB = 2 only, 1 was slower); RCP divides the
// NVFP4 elements by div_by_rcp where the matrix scale is in quant.RCP_MATRIX_SCALE_RANGE
// (2^-86 .. 2^86; else __fdiv_rn), as the lean pair cast's "lean_rcp" form; ROLL: the casts'
// block loop unrolled 1 or 2 times. SR (the F_SR flag) is a template argument too, so that a
// kernel holds one cast path.
template <int MB, int RCP, int SR, int ROLL>
__global__ void __launch_bounds__(NTH, MB) flush_kernel(
    const __half* __restrict__ A, const float* __restrict__ rla, const float* __restrict__ rbe,
    const float* __restrict__ rv, const float* __restrict__ rk,
    const long long* __restrict__ length, const float* __restrict__ q,
    const long long* __restrict__ seqid, const long long* __restrict__ flidx,
    unsigned short* __restrict__ aout, uint8_t* __restrict__ codes,
    uint8_t* __restrict__ bscale, float* __restrict__ mscale, float* __restrict__ yout,
    float* __restrict__ sout, float* __restrict__ wout, int H, int G, int JS, int J,
    uint32_t seed_lo, uint32_t seed_hi, long long kbits, int flags) {
  __shared__ __align__(16) Smem sm;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int hd = blockIdx.x % H, b = blockIdx.x / H;
  const int grp = hd / (H / G);
  const int r = tid >> 1, hf = tid & 1, c0 = HALF * hf;
  const size_t mat = (size_t)b * H + hd;

  int n;
  long long sq, fi;
  if (!sequence_fields(length, seqid, flidx, b, J, n, sq, fi)) return;

  // the records and the coefficient tables (records_prologue); A's row half into registers
  uint4 araw[8];
  records_prologue(sm, rla, rbe, rv, rk, q, b, hd, grp, H, G, JS, n, flags, [&] {
    const uint4* ap = reinterpret_cast<const uint4*>(A + (mat * D + r) * D + c0);
#pragma unroll
    for (int i = 0; i < 8; ++i) araw[i] = __ldg(ap + i);
  }, [] {});

  // the products A k_p (the thread's half, then the row), the corrections. A stays in its
  // fp16 codes until the fold (32 registers, not 64), each group of four columns widened
  // where it is used (exact)
  const __half2* ah = reinterpret_cast<const __half2*>(araw);
  // (the thread's key columns in shared memory: kx(c0 + c) = c0 + 4 hf + c for c < 64, so
  // every address below is this base plus a constant)
  const float* kb = &sm.ks[0][c0 + 4 * hf];
  float u[JF];
#pragma unroll
  for (int p = 0; p < JF; ++p) u[p] = 0.f;
#pragma unroll
  for (int p0 = 0; p0 < JF; p0 += JF / 2)  // (two passes of 8 slots: fewer loads in flight)
#pragma unroll
  for (int c4 = 0; c4 < HALF / 4; ++c4) {
    const float2 a01 = __half22float2(ah[2 * c4]), a23 = __half22float2(ah[2 * c4 + 1]);
#pragma unroll
    for (int p = p0; p < p0 + JF / 2; ++p) {  // (slots p >= n: products with +0 keys, never read)
      const float4 kv = *reinterpret_cast<const float4*>(kb + p * KP + 4 * c4);
      float z = u[p];
      z = fmaf(a01.x, kv.x, z);
      z = fmaf(a01.y, kv.y, z);
      z = fmaf(a23.x, kv.z, z);
      z = fmaf(a23.y, kv.w, z);
      u[p] = z;
    }
  }
#pragma unroll
  for (int p = 0; p < JF; ++p) u[p] = __fadd_rn(u[p], __shfl_xor_sync(0xffffffffu, u[p], 1));
  // forward substitution: u[p] holds A k_p until it is replaced by u_p
#pragma unroll
  for (int p = 0; p < JF; ++p) {
    if (p < n) {
      float z = __fmul_rn(sm.be[p], sm.vs[p][r]);
      z = fmaf(-sm.dp[p], u[p], z);
#pragma unroll
      for (int i = 0; i < p; ++i) z = fmaf(-sm.mc[p][i], u[i], z);
      u[p] = z;
    }
  }
  if ((flags & F_W) && hf == 0) {
#pragma unroll
    for (int p = 0; p < JF; ++p)
      if (p < J) wout[(((size_t)b * J + p) * H + hd) * D + r] = p < n ? u[p] : 0.f;
  }
  // the fold: S = e^{c_{n-1}} A + sum_j (e^{c_{n-1} - c_j} u_j) k_j^T, slot order (n = 0: S
  // is A, untouched). The slots p >= n take u = -0 against +0 keys: fmaf(-0, +0, z) is z
  // exactly for every z (the exact product is -0, and z + -0 = z, also for z = +-0), and z is
  // already the output of an FP32 operation (a NaN already the canonical one), so the bits
  // are those of skipping the slot.
  float s[HALF];
  if (n > 0) {
    const float en = sm.en;
#pragma unroll
    for (int p = 0; p < JF; ++p) u[p] = p < n ? __fmul_rn(sm.fj[p], u[p]) : -0.0f;
#pragma unroll
    for (int c4 = 0; c4 < HALF / 4; ++c4) {
      const float2 a01 = __half22float2(ah[2 * c4]), a23 = __half22float2(ah[2 * c4 + 1]);
      float z0 = __fmul_rn(en, a01.x), z1 = __fmul_rn(en, a01.y);
      float z2 = __fmul_rn(en, a23.x), z3 = __fmul_rn(en, a23.y);
#pragma unroll
      for (int p = 0; p < JF; ++p) {
        const float4 kv = *reinterpret_cast<const float4*>(kb + p * KP + 4 * c4);
        z0 = fmaf(u[p], kv.x, z0);
        z1 = fmaf(u[p], kv.y, z1);
        z2 = fmaf(u[p], kv.z, z2);
        z3 = fmaf(u[p], kv.w, z3);
      }
      s[4 * c4] = z0;
      s[4 * c4 + 1] = z1;
      s[4 * c4 + 2] = z2;
      s[4 * c4 + 3] = z3;
    }
  } else {
#pragma unroll
    for (int c2 = 0; c2 < HALF / 2; ++c2) {
      const float2 a = __half22float2(ah[c2]);
      s[2 * c2] = a.x;
      s[2 * c2 + 1] = a.y;
    }
  }
  if (flags & F_S) {
    float4* so = reinterpret_cast<float4*>(sout + (mat * D + r) * D + c0);
#pragma unroll
    for (int i = 0; i < HALF / 4; ++i)
      so[i] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
  }
  if (flags & F_Y) {  // y = S q: the half in column order, then the row
    float z = 0.f;
#pragma unroll
    for (int i = 0; i < HALF / 4; ++i) {
      const float4 qv = *reinterpret_cast<const float4*>(&sm.qs[c0 + 4 * hf + 4 * i]);
      z = fmaf(s[4 * i], qv.x, z);
      z = fmaf(s[4 * i + 1], qv.y, z);
      z = fmaf(s[4 * i + 2], qv.z, z);
      z = fmaf(s[4 * i + 3], qv.w, z);
    }
    z = __fadd_rn(z, __shfl_xor_sync(0xffffffffu, z, 1));
    if (hf == 0) yout[mat * D + r] = z;
  }

  const float sg = matrix_scale(s, sm.wmax, warp, lane);
  if (tid == 0) mscale[mat] = sg;
  const float sg6 = __fmul_rn(sg, 6.0f);
  const bool use_rcp = RCP && rcp_scale_ok(sg);  // (the NVFP4 cast is RTN)

  // the casts, block by block (16 key columns: 4 Philox calls, 8 code bytes, 1 scale byte).
  // ROLL copies of a block's code, not four: blocks bk .. bk + ROLL - 1 are always
  // s[0 .. 16 ROLL - 1], the registers moving down 16 ROLL after each step (unrolled four
  // times, the casts overflowed the instruction cache: ncu, forty-seventh pass)
  const uint2 kw = stream_key_words(fi, sq, hd, kbits);
  const uint32_t klo = kw.x, khi = kw.y;
  uint4* ao = reinterpret_cast<uint4*>(aout + (mat * D + r) * D + c0);
  uint2* co = reinterpret_cast<uint2*>(codes + (mat * D + r) * (D / 2) + c0 / 2);
  uint32_t scw = 0;
#pragma unroll 1
  for (int b0 = 0; b0 < HALF / 16; b0 += ROLL) {
#pragma unroll
  for (int sub = 0; sub < ROLL; ++sub) {
    const int bk = b0 + sub;
    const float* x = s + 16 * sub;
    // the anchor: fp16 codes, two 16-byte stores
    uint32_t hw[8];
    if (SR) {
      const uint32_t call0 = static_cast<uint32_t>(r * (D / 4) + (c0 + 16 * bk) / 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 rw = philox(call0 + i, klo, khi, 0u, seed_lo, seed_hi);
        const uint2 cw = f16_sr4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3], rw);
        hw[2 * i] = cw.x;
        hw[2 * i + 1] = cw.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) hw[i] = f16_rtn(x[2 * i]) | (f16_rtn(x[2 * i + 1]) << 16);
    }
    ao[2 * bk] = make_uint4(hw[0], hw[1], hw[2], hw[3]);
    ao[2 * bk + 1] = make_uint4(hw[4], hw[5], hw[6], hw[7]);
    // the read copy: NVFP4
    float bm = 0.f;
    bool bad = false;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float a = fabsf(x[i]);
      bad |= !(a < INFINITY);
      bm = fmaxf(bm, a);
    }
    const Nvfp4Block blk = nvfp4_block(bm, bad, sg, sg6);
    const float rcp = use_rcp ? __fdiv_rn(1.0f, blk.safe) : 0.f;
    uint32_t w0 = 0, w1 = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t c = e2m1_of(x[i], blk, use_rcp, rcp);
      if (i < 8) w0 |= c << (4 * i);
      else w1 |= c << (4 * (i - 8));
    }
    co[bk] = make_uint2(w0, w1);
    scw |= static_cast<uint32_t>(blk.code) << (8 * bk);
  }
#pragma unroll
  for (int i = 0; i < HALF - 16 * ROLL; ++i) s[i] = s[i + 16 * ROLL];
  }
  *reinterpret_cast<uint32_t*>(bscale + (mat * D + r) * (D / 16) + c0 / 16) = scw;
}

// ------------------------------------------------------------------------------------------
// The tensor-core form (variants 4-7, 6 the default; issue 15, forty-ninth pass): the
// products A k_p and the fold S = e^{c_{n-1}} A + U' K on mma.sync m16n8k16 (bf16 operands,
// FP32 accumulation); the records, the solve and the casts as in flush_kernel, in another
// thread layout.
// * Layout: warp w holds rows 16 w .. 16 w + 15; lane (g, t) = (lane / 4, lane % 4) holds
//   rows r0 = 16 w + g and r0 + 8, columns 16 c + 4 t .. + 3 of every 16-column block c: the
//   A operand of the products (k-step c; its k indices 2t, 2t+1, 2t+8, 2t+9 taken as the
//   columns 4t .. 4t+3 of the block, the B operand permuted alike) and the accumulators of
//   the fold (n-tiles 2c and 2c+1: columns 4t, 4t+1 and 4t+2, 4t+3 of the block).
// * Exact operands: an fp16 element of A is hi + lo in bf16 (8 + 3 significant bits), a
//   float32 key or correction hi + mid + lo (8 + 8 + 8), each part rounded to nearest from the
//   remainder (exact unless a part falls below bf16's normal range, 2^-126, or hi rounds to
//   inf, |x| above about 3.39e38). Of the products of parts, those below about 2^-24 of the
//   largest are left out (A: lo x lo; the fold: mid x lo, lo x mid, lo x lo); the rest
//   accumulate in FP32, the smallest first.
// * Non-finite inputs: an inf in A (or a key or correction beyond 3.39e38) splits into inf
//   and NaN parts, so its row of S comes out NaN where flush_kernel's FMAs give +-inf there
//   (both non-finite: the row's NVFP4 blocks are bad either way; the fp16 anchor keeps NaN
//   codes instead of inf).
// * The products leave the accumulators through shared memory ([slot][row], in the keys'
//   buffer, which is free once the fragments are built), the lanes of a row solve as in
//   flush_kernel (two lanes a row, the same bits), and the corrections u'_j = e^{c_{n-1} -
//   c_j} u_j come back the same way as the fold's A operand. The fold's terms accumulate from
//   zero; S = fma(e^{c_{n-1}}, A, terms), one rounding.
// * The casts read S in this layout: a lane's four columns of a row are one Philox call (as
//   in flush_kernel), an NVFP4 block's amax is a max over the lane's quad (two shuffles; a
//   non-finite element counts as inf, so a block is bad where the max is not finite).
// The sums run in another order than flush_kernel's: this form's S has its own last bits, to
// FP32 tolerance of the reference; the copies are the torch casts of its own S, and the order
// is fixed by the CTA's code alone (a sequence's bits do not depend on the batch).

struct SmemTC {
  Smem c;
  uint2 pf[D / 16][JF / 8][3][32];  // the products' B fragments [k-step][n-tile][part][lane]
  uint2 ff[D / 8][3][32];           // the fold's B fragments [n-tile][part][lane]
};
constexpr int EXS = KP;  // the exchange [slot][row] in sm.ks: row stride (floats)
static_assert(JF * EXS <= JF * KP && D <= EXS, "the exchange fits the keys' buffer");

// two float32 as a bf16x2, each rounded to nearest even (x0 the low half)
__device__ __forceinline__ uint32_t bf16x2_rn(float x0, float x1) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
  return r;
}
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// x = h + m + l exactly (a pair of float32 as three bf16x2): each part the remainder rounded
__device__ __forceinline__ void split3(float x0, float x1, uint32_t& h, uint32_t& m,
                                       uint32_t& l) {
  h = bf16x2_rn(x0, x1);
  const float r0 = __fsub_rn(x0, bf16_lo(h)), r1 = __fsub_rn(x1, bf16_hi(h));
  m = bf16x2_rn(r0, r1);
  l = bf16x2_rn(__fsub_rn(r0, bf16_lo(m)), __fsub_rn(r1, bf16_hi(m)));
}

// an fp16 pair (a 32-bit word, low half first) as h + l exactly, two bf16x2
__device__ __forceinline__ void split2(uint32_t w, uint32_t& h, uint32_t& l) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
  h = bf16x2_rn(f.x, f.y);
  l = bf16x2_rn(__fsub_rn(f.x, bf16_lo(h)), __fsub_rn(f.y, bf16_hi(h)));
}

// d += A B on the tensor cores (replay_device::mma_bf16), A's four registers as an array and
// B's two as a uint2
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint2 bb) {
  replay_device::mma_bf16(d, a[0], a[1], a[2], a[3], bb.x, bb.y);
}

template <int SR, int RCP, int ROLL>
__global__ void __launch_bounds__(NTH, 2) flush_tc_kernel(
    const __half* __restrict__ A, const float* __restrict__ rla, const float* __restrict__ rbe,
    const float* __restrict__ rv, const float* __restrict__ rk,
    const long long* __restrict__ length, const float* __restrict__ q,
    const long long* __restrict__ seqid, const long long* __restrict__ flidx,
    unsigned short* __restrict__ aout, uint8_t* __restrict__ codes,
    uint8_t* __restrict__ bscale, float* __restrict__ mscale, float* __restrict__ yout,
    float* __restrict__ sout, float* __restrict__ wout, int H, int G, int JS, int J,
    uint32_t seed_lo, uint32_t seed_hi, long long kbits, int flags) {
  __shared__ __align__(16) SmemTC st;
  Smem& sm = st.c;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int hd = blockIdx.x % H, b = blockIdx.x / H;
  const int grp = hd / (H / G);
  const int r0 = 16 * warp + g;  // the lane's rows r0 and r0 + 8
  const size_t mat = (size_t)b * H + hd;

  int n;
  long long sq, fi;
  if (!sequence_fields(length, seqid, flidx, b, J, n, sq, fi)) return;

  // A's codes: ar[8 rs + c] holds columns 16 c + 4 t .. + 3 of row r0 + 8 rs (low half first)
  uint2 ar[16];
  records_prologue(sm, rla, rbe, rv, rk, q, b, hd, grp, H, G, JS, n, flags, [&] {
    const __half* ap = A + (mat * D + r0) * D + 4 * t;
#pragma unroll
    for (int i = 0; i < 16; ++i)
      ar[i] = __ldg(reinterpret_cast<const uint2*>(ap + (i >> 3) * 8 * D + 16 * (i & 7)));
  }, [&] {
    // the B fragments, three parts each, from the keys (slots n.. are +0)
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // products: (k-step c, n-tile nt, lane): slot 8 nt + g',
      const int i = tid + NTH * j;  // columns 16 c + 4 t' .. + 3
      const int ln = i & 31, nt = (i >> 5) & 1, c = i >> 6;
      const float4 kv = *reinterpret_cast<const float4*>(
          &sm.ks[8 * nt + (ln >> 2)][kx(16 * c + 4 * (ln & 3))]);
      uint32_t h0, m0, l0, h1, m1, l1;
      split3(kv.x, kv.y, h0, m0, l0);
      split3(kv.z, kv.w, h1, m1, l1);
      st.pf[c][nt][0][ln] = make_uint2(h0, h1);
      st.pf[c][nt][1][ln] = make_uint2(m0, m1);
      st.pf[c][nt][2][ln] = make_uint2(l0, l1);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // the fold: (n-tile nt = 2 c + hb, lane): column 16 c +
      const int i = tid + NTH * j;  // 4 (g' / 2) + 2 hb + g' % 2, slots 2t', 2t'+1, 2t'+8, 2t'+9
      const int ln = i & 31, nt = i >> 5, gg = ln >> 2, tt = ln & 3;
      const int col = kx(16 * (nt >> 1) + 4 * (gg >> 1) + 2 * (nt & 1) + (gg & 1));
      uint32_t h0, m0, l0, h1, m1, l1;
      split3(sm.ks[2 * tt][col], sm.ks[2 * tt + 1][col], h0, m0, l0);
      split3(sm.ks[2 * tt + 8][col], sm.ks[2 * tt + 9][col], h1, m1, l1);
      st.ff[nt][0][ln] = make_uint2(h0, h1);
      st.ff[nt][1][ln] = make_uint2(m0, m1);
      st.ff[nt][2][ln] = make_uint2(l0, l1);
    }
  });

  float s[64];  // S: s[8 c + 4 rs + e] = S[r0 + 8 rs][16 c + 4 t + e]
  const int rsol = 16 * warp + (lane >> 1), hf = lane & 1;  // the row this lane solves
  if (n > 0) {
    float* ex = &sm.ks[0][0];  // [slot][row], stride EXS
    // the products A k_p: 8 k-steps, 2 n-tiles of slots; big (hi x hi) and small sums apart
    {
      float pb[2][4], ps[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) pb[nt][e] = ps[nt][e] = 0.f;
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        uint32_t ah[4], al[4];
        split2(ar[c].x, ah[0], al[0]);      // row r0, columns 4t, 4t+1
        split2(ar[8 + c].x, ah[1], al[1]);  // row r0 + 8
        split2(ar[c].y, ah[2], al[2]);      // row r0, columns 4t+2, 4t+3
        split2(ar[8 + c].y, ah[3], al[3]);  // row r0 + 8
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint2 bh = st.pf[c][nt][0][lane], bm = st.pf[c][nt][1][lane],
                      bl = st.pf[c][nt][2][lane];
          mma_bf16(ps[nt], ah, bl);
          mma_bf16(ps[nt], al, bm);
          mma_bf16(ps[nt], ah, bm);
          mma_bf16(ps[nt], al, bh);
          mma_bf16(pb[nt], ah, bh);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {  // accumulators: rows g, g + 8; slots 8 nt + 2t, + 1
        const int p = 8 * nt + 2 * t;
        ex[p * EXS + r0] = __fadd_rn(pb[nt][0], ps[nt][0]);
        ex[(p + 1) * EXS + r0] = __fadd_rn(pb[nt][1], ps[nt][1]);
        ex[p * EXS + r0 + 8] = __fadd_rn(pb[nt][2], ps[nt][2]);
        ex[(p + 1) * EXS + r0 + 8] = __fadd_rn(pb[nt][3], ps[nt][3]);
      }
    }
    __syncwarp();
    // forward substitution (flush_kernel's, on the products from the exchange)
    float u[JF];
#pragma unroll
    for (int p = 0; p < JF; ++p) {
      u[p] = 0.f;
      if (p < n) {
        float z = __fmul_rn(sm.be[p], sm.vs[p][rsol]);
        z = fmaf(-sm.dp[p], ex[p * EXS + rsol], z);
#pragma unroll
        for (int i = 0; i < p; ++i) z = fmaf(-sm.mc[p][i], u[i], z);
        u[p] = z;
      }
    }
    if ((flags & F_W) && hf == 0) {
#pragma unroll
      for (int p = 0; p < JF; ++p)
        if (p < J) wout[(((size_t)b * J + p) * H + hd) * D + rsol] = u[p];
    }
    __syncwarp();  // (every lane has read its products)
#pragma unroll
    for (int p = 0; p < JF / 2; ++p) {  // u'_j into the exchange: lane hf writes 8 hf .. + 7
      const int j = p + (JF / 2) * hf;
      ex[j * EXS + rsol] = j < n ? __fmul_rn(sm.fj[j], hf ? u[p + JF / 2] : u[p]) : 0.f;
    }
    __syncwarp();
    // the fold's A operand: u' of rows r0, r0 + 8 at slots 2t, 2t+1 (registers 0, 1) and
    // 2t+8, 2t+9 (registers 2, 3), three parts
    uint32_t uh[4], um[4], ul[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = r0 + 8 * (i & 1), sl = 2 * t + 8 * (i >> 1);
      split3(ex[sl * EXS + row], ex[(sl + 1) * EXS + row], uh[i], um[i], ul[i]);
    }
    const float en = sm.en;
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
#pragma unroll
      for (int hb = 0; hb < 2; ++hb) {  // n-tile 2c + hb: columns 16 c + 4t + 2 hb, + 1
        const int nt = 2 * c + hb;
        float z[4] = {0.f, 0.f, 0.f, 0.f};
        const uint2 kh = st.ff[nt][0][lane], km = st.ff[nt][1][lane], kl = st.ff[nt][2][lane];
        mma_bf16(z, um, km);
        mma_bf16(z, uh, kl);
        mma_bf16(z, ul, kh);
        mma_bf16(z, um, kh);
        mma_bf16(z, uh, km);
        mma_bf16(z, uh, kh);
        const uint32_t w0 = hb ? ar[c].y : ar[c].x, w1 = hb ? ar[8 + c].y : ar[8 + c].x;
        const float2 a0 = __half22float2(*reinterpret_cast<const __half2*>(&w0));
        const float2 a1 = __half22float2(*reinterpret_cast<const __half2*>(&w1));
        s[8 * c + 2 * hb] = fmaf(en, a0.x, z[0]);
        s[8 * c + 2 * hb + 1] = fmaf(en, a0.y, z[1]);
        s[8 * c + 4 + 2 * hb] = fmaf(en, a1.x, z[2]);
        s[8 * c + 4 + 2 * hb + 1] = fmaf(en, a1.y, z[3]);
      }
    }
  } else {  // n = 0: S is A, untouched
    if ((flags & F_W) && hf == 0) {
#pragma unroll
      for (int p = 0; p < JF; ++p)
        if (p < J) wout[(((size_t)b * J + p) * H + hd) * D + rsol] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const float2 a0 = __half22float2(*reinterpret_cast<const __half2*>(&ar[i].x));
      const float2 a1 = __half22float2(*reinterpret_cast<const __half2*>(&ar[i].y));
      const int o = 8 * (i & 7) + 4 * (i >> 3);
      s[o] = a0.x;
      s[o + 1] = a0.y;
      s[o + 2] = a1.x;
      s[o + 3] = a1.y;
    }
  }
  if (flags & F_S) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {  // (block c = i % 8, row r0 + 8 (i / 8))
      const int o = 8 * (i & 7) + 4 * (i >> 3);
      *reinterpret_cast<float4*>(sout + (mat * D + r0 + 8 * (i >> 3)) * D + 16 * (i & 7) + 4 * t) =
          make_float4(s[o], s[o + 1], s[o + 2], s[o + 3]);
    }
  }
  if (flags & F_Y) {  // y = S q: the lane's columns in block order, then over the quad
    float y0 = 0.f, y1 = 0.f;
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
      const float4 qv = *reinterpret_cast<const float4*>(&sm.qs[kx(16 * c + 4 * t)]);
      y0 = fmaf(s[8 * c], qv.x, y0);
      y0 = fmaf(s[8 * c + 1], qv.y, y0);
      y0 = fmaf(s[8 * c + 2], qv.z, y0);
      y0 = fmaf(s[8 * c + 3], qv.w, y0);
      y1 = fmaf(s[8 * c + 4], qv.x, y1);
      y1 = fmaf(s[8 * c + 5], qv.y, y1);
      y1 = fmaf(s[8 * c + 6], qv.z, y1);
      y1 = fmaf(s[8 * c + 7], qv.w, y1);
    }
    // (a rounded add is commutative: after each step every lane of a pair holds the same bits)
    y0 = __fadd_rn(y0, __shfl_xor_sync(0xffffffffu, y0, 1));
    y1 = __fadd_rn(y1, __shfl_xor_sync(0xffffffffu, y1, 1));
    y0 = __fadd_rn(y0, __shfl_xor_sync(0xffffffffu, y0, 2));
    y1 = __fadd_rn(y1, __shfl_xor_sync(0xffffffffu, y1, 2));
    if (t == 0) yout[mat * D + r0] = y0;
    if (t == 1) yout[mat * D + r0 + 8] = y1;
  }

  const float sg = matrix_scale(s, sm.wmax, warp, lane);
  if (tid == 0) mscale[mat] = sg;
  const float sg6 = __fmul_rn(sg, 6.0f);
  const bool use_rcp = RCP && rcp_scale_ok(sg);  // (the NVFP4 cast is RTN)

  // the casts: 2 ROLL blocks a step (s[0 .. 16 ROLL - 1]: blocks 2 cp .. 2 cp + 2 ROLL - 1 of
  // both rows), the registers moving down 16 ROLL after each step (as flush_kernel's ROLL)
  const uint2 kw = stream_key_words(fi, sq, hd, kbits);
  const uint32_t klo = kw.x, khi = kw.y;
  unsigned long long scw0 = 0, scw1 = 0;  // the block scale codes of rows r0, r0 + 8
#pragma unroll 1
  for (int cp = 0; cp < D / 32; cp += ROLL) {
#pragma unroll
    for (int i = 0; i < 4 * ROLL; ++i) {
      const int c = 2 * cp + (i >> 1), rs = i & 1;  // block c, row r0 + 8 rs
      const float* x = s + 8 * (i >> 1) + 4 * rs;
      const int row = r0 + 8 * rs;
      // the anchor: four fp16 codes, one 8-byte store
      uint32_t hw0, hw1;
      if (SR) {
        const uint4 rw = philox(static_cast<uint32_t>(row * (D / 4) + 4 * c + t), klo, khi, 0u,
                                seed_lo, seed_hi);
        const uint2 cw = f16_sr4(x[0], x[1], x[2], x[3], rw);
        hw0 = cw.x;
        hw1 = cw.y;
      } else {
        hw0 = f16_rtn(x[0]) | (f16_rtn(x[1]) << 16);
        hw1 = f16_rtn(x[2]) | (f16_rtn(x[3]) << 16);
      }
      *reinterpret_cast<uint2*>(aout + (mat * D + row) * D + 16 * c + 4 * t) =
          make_uint2(hw0, hw1);
      // the read copy: the block's amax over the quad (a non-finite element as inf)
      float bm = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float a = fabsf(x[e]);
        bm = fmaxf(bm, a < INFINITY ? a : INFINITY);
      }
      bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 1));
      bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 2));
      const Nvfp4Block blk = nvfp4_block(bm, !(bm < INFINITY), sg, sg6);
      const float rcp = use_rcp ? __fdiv_rn(1.0f, blk.safe) : 0.f;
      uint32_t w = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) w |= e2m1_of(x[e], blk, use_rcp, rcp) << (4 * e);
      *reinterpret_cast<unsigned short*>(codes + (mat * D + row) * (D / 2) + 8 * c + 2 * t) =
          static_cast<unsigned short>(w);
      const unsigned long long sb = static_cast<unsigned long long>(blk.code) << (8 * c);
      if (rs) scw1 |= sb;
      else scw0 |= sb;
    }
#pragma unroll
    for (int i = 0; i < 64 - 16 * ROLL; ++i) s[i] = s[i + 16 * ROLL];
  }
  if (t < 2)
    *reinterpret_cast<unsigned long long*>(bscale + (mat * D + r0 + 8 * t) * (D / 16)) =
        t ? scw1 : scw0;
}

}  // namespace gdn_flush

#ifndef GDN_FLUSH_DEVICE_ONLY
void gdn_flush_cuda(torch::Tensor A, torch::Tensor la, torch::Tensor beta, torch::Tensor v,
                    torch::Tensor k, torch::Tensor length, torch::Tensor q, torch::Tensor seq,
                    torch::Tensor fl, torch::Tensor aout, torch::Tensor codes,
                    torch::Tensor bscale, torch::Tensor mscale, torch::Tensor y,
                    torch::Tensor S, torch::Tensor w, int64_t J, int64_t seed_lo,
                    int64_t seed_hi, int64_t kbits, int64_t flags, int64_t variant) {
  const int B = static_cast<int>(A.size(0)), H = static_cast<int>(A.size(1));
  const int G = static_cast<int>(k.size(2));
  const int JS = static_cast<int>(la.stride(0) / H);
  if (B == 0) return;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // (SR, the F_SR flag, is a template argument: one cast path a kernel)
  const bool sr = (flags & gdn_flush::F_SR) != 0;
  using Kern = decltype(&gdn_flush::flush_kernel<2, 0, 0, 1>);
  // [variant][sr]: cuda_flush.VARIANTS (MB, RCP, ROLL)
  static const Kern table[][2] = {
      {gdn_flush::flush_kernel<2, 0, 0, 1>, gdn_flush::flush_kernel<2, 0, 1, 1>},
      {gdn_flush::flush_kernel<2, 0, 0, 2>, gdn_flush::flush_kernel<2, 0, 1, 2>},
      {gdn_flush::flush_kernel<2, 1, 0, 1>, gdn_flush::flush_kernel<2, 1, 1, 1>},
      {gdn_flush::flush_kernel<2, 1, 0, 2>, gdn_flush::flush_kernel<2, 1, 1, 2>},
      {gdn_flush::flush_tc_kernel<0, 0, 1>, gdn_flush::flush_tc_kernel<1, 0, 1>},
      {gdn_flush::flush_tc_kernel<0, 1, 1>, gdn_flush::flush_tc_kernel<1, 1, 1>},
      {gdn_flush::flush_tc_kernel<0, 0, 2>, gdn_flush::flush_tc_kernel<1, 0, 2>},
      {gdn_flush::flush_tc_kernel<0, 1, 2>, gdn_flush::flush_tc_kernel<1, 1, 2>}};
  const Kern kern = table[variant][sr ? 1 : 0];
  kern<<<B * H, gdn_flush::NTH, 0, stream>>>(
      reinterpret_cast<const __half*>(A.data_ptr()), la.data_ptr<float>(),
      beta.data_ptr<float>(), v.data_ptr<float>(), k.data_ptr<float>(),
      reinterpret_cast<const long long*>(length.data_ptr<int64_t>()), q.data_ptr<float>(),
      reinterpret_cast<const long long*>(seq.data_ptr<int64_t>()),
      reinterpret_cast<const long long*>(fl.data_ptr<int64_t>()),
      reinterpret_cast<unsigned short*>(aout.data_ptr()), codes.data_ptr<uint8_t>(),
      bscale.data_ptr<uint8_t>(), mscale.data_ptr<float>(), y.data_ptr<float>(),
      S.data_ptr<float>(), w.data_ptr<float>(), H, G, JS, static_cast<int>(J),
      static_cast<uint32_t>(seed_lo), static_cast<uint32_t>(seed_hi),
      static_cast<long long>(kbits), static_cast<int>(flags));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif

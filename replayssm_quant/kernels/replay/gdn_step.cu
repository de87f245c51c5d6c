// GDN decode step (one token per sequence, the read copy FP32 or NVFP4) as one CUDA C++ kernel
// (issue 15, forty-fifth pass). Built with gdn_verify.cu into one extension and called by
// replayssm_quant/kernels/replay/cuda_step.py, which checks every input first, all but the
// ring position, which the kernel asserts on the device; this file's host code checks nothing.
// The formula is replay/gdn.py's gdn_step_output plus the append of gdn_state_step: with the
// new token's record written to ring slot p = h and c_j = sum_{i<=j} la_i over slots 0..p,
//
//   u_p = beta_p (v_p - e^{c_p} R k_p) - sum_{j<p} beta_p e^{c_p - c_j} (k_j . k_p) u_j
//   o   = e^{c_p} R q + sum_{j<p} e^{c_p - c_j} (k_j . q) u_j + (k_p . q) u_p
//
// (slots j < p: the ring's cached corrections). It is the verify's formula at T = 1 with the
// epilogue in the same order (gdn_verify.cu).
//
// One CTA of 128 threads per (sequence b, value head h); thread r forms the epilogue of value
// row r. In the launch forms 0-2 the products R[r] . k_p and R[r] . q are FP32 FMAs (two
// columns are two FMAs a loaded element) in one order for every such form: the
// row's 128 columns in 8 groups (FP32: group g is the float4s g, g + 8, g + 16, g + 24, a
// chain of FMAs in column order; NVFP4: group g is the 16-element block g, its E4M3 scale
// times the sum of its even and odd elements' chains), joined by a fixed tree
// ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)), the one an xor butterfly over 8 lanes
// leaves in every lane. Launch forms (ST): 0, each thread loads its own row (FP32: two
// 128-byte lines ahead); 1, the CTA copies its tile into padded shared memory by coalesced
// cp.async first; 2, 8 lanes a row (lane g: group g), 4 rows a warp an instruction, coalesced,
// two rows ahead, the groups joined by shuffles. Form 3 (NVFP4 only) forms the products on
// the tensor cores, every operand exact in bf16 (see there): another order, its own bits.
//
// An NVFP4 row (64 bytes of E2M1 codes, 8 E4M3 block scales, the head's FP32 matrix scale)
// is decoded exactly with integer operations: an E2M1 code placed in a float32's sign bit and
// bits 24..22 is the element times 2^-126, and an E4M3 code's seven bits at 20..26 are the
// scale times 2^-120 (0x7F: NaN). The key and query are stored pre-scaled by 2^(126 - e),
// with 2^e above their largest magnitude, so that the code's 2^-126 cancels and no product
// is subnormal; the row's sums are multiplied by the matrix scale and 2^e at the end.
// (Non-finite inputs give non-finite outputs, as the reference does, though not always the
// same ones: an infinite key element makes every other element's product overflow too.)
//
// The Gram terms k_j . k_p and k_j . q (j <= p) are formed all at once from the ring's keys in
// shared memory (cp.async, issued with R): 4 threads a slot, each a chain of FMAs over 32
// columns, joined by a fixed tree. The order of every sum is fixed by the CTA's code alone: a
// sequence's bits do not depend on the batch, its position or its neighbours.
//
// The ring tensors (la, beta [B, JS, H], v, u [B, JS, H, V], k [B, JS, G, K]) have JS slots
// a sequence (window + max drafts, at most JMAX); the kernel reads slots < p and writes slot
// p: la, beta, v and u of its head, and, in the first value head of each key group, k. The
// other heads of the group read the new key from the token's k, never from slot p.
#ifndef GDN_VERIFY_DEVICE_ONLY
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#endif
#include "replay_device.cuh"  // (its assert stays on under NDEBUG: the position check)

namespace gdn_step {

constexpr int V = 128;
constexpr int K = 128;
constexpr int JMAX = 32;  // ring slots a sequence (window + max drafts)
constexpr int NTH = 128;  // threads: one value row each

struct Smem {
  float ks[K];          // the new key (NVFP4: scaled by 2^(126 - e_k); ST 3: 2^(16 - e_k))
  float qs[K];          // the query (NVFP4: scaled by 2^(126 - e_q); ST 3: 2^(16 - e_q))
  float la[JMAX];       // log decays of slots 0..p
  float zq[JMAX];       // k_j . q (only j = p is kept: the coefficients take the rest)
  float ac[JMAX];       // beta_p e^{c_p - c_j} k_j . k_p, j < p
  float bc[JMAX];       // e^{c_p - c_j} k_j . q, j < p
  float yk[V];          // ST 2, 3: R k_p by row
  float yq[V];          // ST 2, 3: R q by row
  float qraw[K];        // the query, unscaled
};
// After Smem, sized by the launch's JS (the ring's slots a sequence; a decode state's is
// window + max drafts, 24 for L = 16, T = 8, against JMAX = 32: 8 KiB less a CTA): the
// ring's corrections of this head, slots < p, [JS][V] (cp.async); the ring's keys of this
// group, slots < p, and k_p, [max(JS, 4)][K + 4] (cp.async); then ST 1's tile. ST 3's B
// fragments [part][lane % 4][k-step][register] (2 KiB) reuse the keys' rows once the Gram
// terms have read them.
constexpr int KROW = K + 4;
using BFrag = uint32_t[4][8][2];
static_assert(4 * KROW * sizeof(float) >= 8 * sizeof(BFrag), "the B fragments fit in 4 key rows");
static_assert((V * sizeof(float)) % 16 == 0 && (KROW * sizeof(float)) % 16 == 0,
              "the ring's rows are 16-byte aligned");
__host__ __device__ constexpr int key_rows(int js) { return js > 4 ? js : 4; }
__host__ __device__ constexpr size_t ring_bytes(int js) {
  return sizeof(float) * ((size_t)js * V + (size_t)key_rows(js) * KROW);
}
static_assert(sizeof(Smem) % 16 == 0, "the staged tile after Smem is 16-byte aligned");

// A ring position outside 0 .. min(JS, JMAX) - 1: prints the sequence, then fails a
// device-side assert (RuntimeError at the host's next synchronisation). Called by thread 0 of
// every CTA of a bad sequence; out of line, to keep the printf's code out of the kernel.
__device__ __noinline__ void position_fail(int JS, int b, long long p) {
  printf("gdn_step_cuda: the ring position h must be in [0, %d) (the ring's slots, at most "
         "%d); sequence %d has h = %lld\n", JS < JMAX ? JS : JMAX, JMAX, b, p);
  assert(p >= 0 && p < JS && p < JMAX);
  __trap();
}

// E2M1 code n (0..7) of the 32-bit word w (element n in bits 4n .. 4n + 3, sign the top one),
// as float32 bits: the element times 2^-126 (code 1, 0.5, is the subnormal 2^-127).
template <int N>
__device__ __forceinline__ float e2m1_tiny(uint32_t w) {
  const uint32_t mag = N <= 5 ? (w << (22 - 4 * N)) : (w >> (4 * N - 22));
  const uint32_t sgn = w << (28 - 4 * N);
  return __uint_as_float((mag & 0x01C00000u) | (sgn & 0x80000000u));
}

// An E4M3 code as float32 (exact; 0x7F and 0xFF: NaN).
__device__ __forceinline__ float e4m3(uint32_t c) {
  const uint32_t m = c & 0x7Fu;
  if (m == 0x7Fu) return __uint_as_float(0x7FC00000u);
  return __uint_as_float(((c & 0x80u) << 24) | (m << 20)) * 0x1p120f;
}

// ST 3 (NVFP4 on the tensor cores). The pair N (0..3) of the word w's E2M1 codes N and N + 4
// as a bf16x2 (code N in the low half): each element times 2^-126 (code 1, 0.5, is the bf16
// subnormal 2^-127), by the float32 decode's trick at bf16's bit positions: the magnitude's
// three bits to 8..6 (and 24..22), the sign to 15 (and 31). Codes N and N + 4 are 16 bits
// apart, as the halves are, so one shift serves both.
template <int N>
__device__ __forceinline__ uint32_t e2m1x2_tiny_bf16(uint32_t w) {
  const uint32_t mag = N <= 1 ? (w << (6 - 4 * N)) : (w >> (4 * N - 6));
  const uint32_t sgn = w << (12 - 4 * N);
  return (mag & 0x01C001C0u) | (sgn & 0x80008000u);
}

// An E4M3 block scale code as a bf16x2 of (scale times 2^110) in both halves: exact (four
// significant bits; 2^101 .. 2^118.8, normal), NaN for 0x7F and 0xFF.
__device__ __forceinline__ uint32_t e4m3_bf16x2_2p110(uint32_t c) {
  const float s = e4m3(c) * 0x1p110f;
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(s), "f"(s));
  return r;
}

// a * b on bf16x2, rounded to nearest (here always exact: an E2M1 element times an E4M3
// scale has at most 6 significant bits); as fma with -0, which sm_80 has (mul.bf16x2 is
// sm_90's); subnormal inputs are not flushed (no .ftz exists for bf16)
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  return r;
}

using replay_device::mma_bf16;  // d += A B, m16n8k16 bf16, FP32 accumulation

// a float32 as bf16 bits, rounded to nearest even
__device__ __forceinline__ uint16_t bf16_rn(float x) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// Eight elements of a word against eight consecutive elements (ka, kb) of the key and (qa,
// qb) of the query, into the two pairs of partial sums (even and odd elements).
__device__ __forceinline__ void word8(uint32_t w, float4 ka, float4 kb, float4 qa, float4 qb,
                                      float& k0, float& k1, float& q0, float& q1) {
  float x;
  x = e2m1_tiny<0>(w); k0 = fmaf(x, ka.x, k0); q0 = fmaf(x, qa.x, q0);
  x = e2m1_tiny<1>(w); k1 = fmaf(x, ka.y, k1); q1 = fmaf(x, qa.y, q1);
  x = e2m1_tiny<2>(w); k0 = fmaf(x, ka.z, k0); q0 = fmaf(x, qa.z, q0);
  x = e2m1_tiny<3>(w); k1 = fmaf(x, ka.w, k1); q1 = fmaf(x, qa.w, q1);
  x = e2m1_tiny<4>(w); k0 = fmaf(x, kb.x, k0); q0 = fmaf(x, qb.x, q0);
  x = e2m1_tiny<5>(w); k1 = fmaf(x, kb.y, k1); q1 = fmaf(x, qb.y, q1);
  x = e2m1_tiny<6>(w); k0 = fmaf(x, kb.z, k0); q0 = fmaf(x, qb.z, q0);
  x = e2m1_tiny<7>(w); k1 = fmaf(x, kb.w, k1); q1 = fmaf(x, qb.w, q1);
}

// One 16-element block of an NVFP4 row (words w0, w1; E4M3 scale code sc) against the key's
// and query's 16 elements kk, qq: the block's products times its scale (the canonical
// per-block term; see products()).
__device__ __forceinline__ void nvfp4_block(uint32_t w0, uint32_t w1, uint32_t sc,
                                            const float4 (&kk)[4], const float4 (&qq)[4],
                                            float& tk, float& tq) {
  float k0 = 0.f, k1 = 0.f, q0 = 0.f, q1 = 0.f;
  word8(w0, kk[0], kk[1], qq[0], qq[1], k0, k1, q0, q1);
  word8(w1, kk[2], kk[3], qq[2], qq[3], k0, k1, q0, q1);
  const float s = e4m3(sc);
  tk = __fmul_rn(s, k0 + k1);  // (never contracted into the tree's first add: ST 2 cannot)
  tq = __fmul_rn(s, q0 + q1);
}

// One float4 of an FP32 row against the key's and query's four elements, into the partial
// sums of its column group (the canonical order; see products()).
__device__ __forceinline__ void f32x4(float4 x, float4 kk, float4 qq, float& ak, float& aq) {
  ak = fmaf(x.x, kk.x, ak); aq = fmaf(x.x, qq.x, aq);
  ak = fmaf(x.y, kk.y, ak); aq = fmaf(x.y, qq.y, aq);
  ak = fmaf(x.z, kk.z, ak); aq = fmaf(x.z, qq.z, aq);
  ak = fmaf(x.w, kk.w, ak); aq = fmaf(x.w, qq.w, aq);
}

// The fixed tree over the eight column groups: what an xor butterfly over 8 lanes (4, 2, 1)
// leaves in every lane.
// (Rounded adds: the forms must not differ by what the compiler contracts.)
__device__ __forceinline__ float tree8(const float (&t)[8]) {
  return __fadd_rn(__fadd_rn(__fadd_rn(t[0], t[4]), __fadd_rn(t[2], t[6])),
                   __fadd_rn(__fadd_rn(t[1], t[5]), __fadd_rn(t[3], t[7])));
}

__device__ __forceinline__ float lanes8(float x) {  // the same tree across 8 lanes
  x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 2));
  x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// The exponent e with |x| < 2^e for the largest magnitude m (0 for m = 0 or not finite).
__device__ __forceinline__ int above_exp(float m) {
  int e = 0;
  if (m > 0.f && m <= 3.402823466e38f) frexpf(m, &e);
  return e;
}

// The staged tile (ST = 1) after Smem: rows padded so that a thread's row reads from shared
// memory do not conflict (FMT 0: K + 4 floats; FMT 1: 64 bytes of codes, 8 of block scales,
// 8 of padding).
constexpr int F32_ROW = K + 4;   // floats
constexpr int FP4_ROW = 80;      // bytes
template <int FMT>
constexpr size_t staged_bytes() {
  return FMT == 0 ? sizeof(float) * V * F32_ROW : (size_t)V * FP4_ROW;
}

using replay_device::cp16;

__device__ __forceinline__ void cp8(void* dst, const void* src) {
  const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(sa), "l"(src));
}

// FMT 0: R is FP32 [B, H, V, K]. FMT 1: NVFP4, codes [B, H, V, K / 2] (element 2i in the low
// nibble), E4M3 block scales [B, H, V, K / 16], FP32 matrix scales [B, H]. ST 0: each thread
// loads its own row from global memory (32 rows of a warp in 32 lines an instruction); ST 1:
// the CTA copies the whole tile into shared memory first by cp.async, consecutive threads
// taking consecutive 16 bytes (coalesced), and each thread reads its row from there.
template <int FMT, int ST>
__global__ void __launch_bounds__(NTH, ST == 3 ? 7 : 0) step_kernel(
    const float* __restrict__ R, const uint8_t* __restrict__ codes,
    const uint8_t* __restrict__ bscale, const float* __restrict__ mscale,
    float* __restrict__ rla, float* __restrict__ rbeta, float* __restrict__ rv,
    float* __restrict__ rk, float* __restrict__ ru, const float* __restrict__ q,
    const float* __restrict__ kn, const float* __restrict__ vn, const float* __restrict__ gn,
    const float* __restrict__ bn, const int64_t* __restrict__ hp, float* __restrict__ o, int H,
    int G, int JS) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int mat = blockIdx.x, b = mat / H, hd = mat - b * H, grp = hd / (H / G);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, row = tid;
  const int gi = lane >> 3, li = lane & 7;  // ST 2: a warp's 4 rows at a time, 8 lanes a row
  const int64_t p64 = hp[b];
  if (p64 < 0 || p64 >= JS || p64 >= JMAX) {  // thread 0 prints and asserts; the others leave
    if (tid == 0) position_fail(JS, b, (long long)p64);
    return;
  }
  const int p = (int)p64;

  // the token's operands first (a few words each, on the critical path: the key's and
  // query's scaling exponents come before any product), and the epilogue's, so that no
  // load waits at the end; then R, the long pole
  const float* kg = kn + ((size_t)b * G + grp) * K;
  const float* qg = q + ((size_t)b * G + grp) * K;
  const float4 kl = __ldg(reinterpret_cast<const float4*>(kg) + lane);
  const float4 ql = __ldg(reinterpret_cast<const float4*>(qg) + lane);
  const float g_p = __ldg(gn + (size_t)b * H + hd), beta_p = __ldg(bn + (size_t)b * H + hd);
  const float la_t = tid < p && tid < JMAX ? rla[((size_t)b * JS + tid) * H + hd] : 0.f;
  // (the FP32 stage 2 keeps these two for the end: its loads ahead take the registers)
  constexpr bool EARLY = !(FMT == 0 && ST == 2);
  const bool first_head = hd % (H / G) == 0;  // (it appends the key to the ring)
  float vnew = EARLY ? __ldg(vn + ((size_t)b * H + hd) * V + row) : 0.f;
  float k_row = EARLY && first_head ? __ldg(kg + row) : 0.f;
  const float ms = FMT == 1 ? __ldg(mscale + mat) : 1.f;
  float4 fb[2][8];   // FMT 0, ST 0: the thread's row, two 128-byte lines ahead
  uint4 cw[4];       // FMT 1, ST 0 / 1: the row's codes
  uint2 sw;          // FMT 1, ST 0 / 1: its block scales
  float4 xb[2][4];   // FMT 0, ST 2: a lane's four float4 of a row, two rows ahead
  uint2 cb[2];       // FMT 1, ST 2: a lane's block (8 bytes of codes), two rows ahead
  uint32_t sb[2];    //                and its scale code
  uint4 c3[2][2];    // FMT 1, ST 3: [m-tile][row g, g + 8]: 16 bytes of codes (lane % 4's)
  uint32_t s3[2][2]; //                and their two block scale codes
  float* const ring_u = reinterpret_cast<float*>(smem_raw + sizeof(Smem));  // [JS][V]
  float* const ring_k = ring_u + (size_t)JS * V;                              // [.][KROW]
  unsigned char* tile = smem_raw + sizeof(Smem) + ring_bytes(JS);  // ST 1
  const float4* rr =
      FMT == 0 ? reinterpret_cast<const float4*>(R + ((size_t)mat * V + row) * K) : nullptr;
  // ST 2: row 32 warp + 4 it + gi of iteration it
  auto r2 = [&](int it) { return (size_t)mat * V + 32 * warp + 4 * it + gi; };
  auto load2 = [&](int it, int slot) {
    if constexpr (FMT == 0) {
      const float4* src = reinterpret_cast<const float4*>(R + r2(it) * K);
#pragma unroll
      for (int s4 = 0; s4 < 4; ++s4) xb[slot][s4] = __ldg(src + li + 8 * s4);
    } else {
      cb[slot] = __ldg(reinterpret_cast<const uint2*>(codes + r2(it) * (K / 2)) + li);
      sb[slot] = __ldg(bscale + r2(it) * (K / 16) + li);
    }
  };
  // the ring's keys of this group, slots < p: the Gram terms' operands, before R (they are
  // needed first), in their own group so that the Gram terms wait for them alone
  for (int e = tid; e < p * (K / 4); e += NTH) {
    const int slot = e / (K / 4), c4 = (e % (K / 4)) * 4;
    cp16(ring_k + slot * KROW + c4, rk + (((size_t)b * JS + slot) * G + grp) * K + c4);
  }
  asm volatile("cp.async.commit_group;\n" ::);
  static_assert(ST != 3 || FMT == 1, "ST 3 is the NVFP4 read copy's form");
  if constexpr (ST == 3) {  // rows 32 warp + 16 m + lane / 4 (+ 8): lane % 4's 16 bytes
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const size_t rw = (size_t)mat * V + 32 * warp + 16 * m + 8 * hh + (lane >> 2);
        c3[m][hh] = __ldg(reinterpret_cast<const uint4*>(codes + rw * (K / 2)) + (lane & 3));
        s3[m][hh] = __ldg(reinterpret_cast<const unsigned short*>(bscale + rw * (K / 16)) +
                          (lane & 3));
      }
  } else if constexpr (ST == 1) {
    if constexpr (FMT == 0) {
      const float* src = R + (size_t)mat * V * K;
#pragma unroll 4
      for (int e = tid; e < V * K / 4; e += NTH) {
        const int r = e / (K / 4), c4 = (e % (K / 4)) * 4;
        cp16(reinterpret_cast<float*>(tile) + r * F32_ROW + c4, src + (size_t)r * K + c4);
      }
    } else {
      const uint8_t* src = codes + (size_t)mat * V * (K / 2);
#pragma unroll
      for (int e = tid; e < V * K / 32; e += NTH) {
        const int r = e / (K / 32), c16 = (e % (K / 32)) * 16;
        cp16(tile + r * FP4_ROW + c16, src + (size_t)r * (K / 2) + c16);
      }
      cp8(tile + tid * FP4_ROW + K / 2, bscale + ((size_t)mat * V + tid) * (K / 16));
    }
  } else if constexpr (ST == 2) {
    load2(0, 0);
    load2(1, 1);
  } else if constexpr (FMT == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) fb[c][i] = __ldg(rr + 8 * c + i);
  } else {
    const uint4* cr = reinterpret_cast<const uint4*>(codes + ((size_t)mat * V + row) * (K / 2));
#pragma unroll
    for (int i = 0; i < 4; ++i) cw[i] = __ldg(cr + i);
    sw = __ldg(reinterpret_cast<const uint2*>(bscale + ((size_t)mat * V + row) * (K / 16)));
  }

  // then the ring's corrections of this head (their own group, with ST 1's tile: the
  // epilogue waits for them)
  const size_t HV = (size_t)H * V;
  for (int e = tid; e < p * (V / 4); e += NTH) {
    const int slot = e / (V / 4), c4 = (e % (V / 4)) * 4;
    cp16(ring_u + slot * V + c4, ru + ((size_t)b * JS + slot) * HV + (size_t)hd * V + c4);
  }
  asm volatile("cp.async.commit_group;\n" ::);

  // the token's key and query of this key group (four elements a lane, in every warp)
  int ek = 0, eq = 0;  // FMT 1: the scaling exponents (every warp computes them)
  if constexpr (FMT == 0) {
    if (warp == 0) reinterpret_cast<float4*>(sm.ks)[lane] = kl;
    if (warp == 1) reinterpret_cast<float4*>(sm.qs)[lane] = ql;
  } else {  // pre-scaled: see the header
    ek = above_exp(warp_max(fmaxf(fmaxf(fabsf(kl.x), fabsf(kl.y)), fmaxf(fabsf(kl.z), fabsf(kl.w)))));
    eq = above_exp(warp_max(fmaxf(fmaxf(fabsf(ql.x), fabsf(ql.y)), fmaxf(fabsf(ql.z), fabsf(ql.w)))));
    if (warp < 2) {  // (ST 3: by 2^(16 - e), see there)
      const float4 x = warp == 0 ? kl : ql;
      const int sh = (ST == 3 ? 16 : 126) - (warp == 0 ? ek : eq);
      reinterpret_cast<float4*>(warp == 0 ? sm.ks : sm.qs)[lane] =
          make_float4(ldexpf(x.x, sh), ldexpf(x.y, sh), ldexpf(x.z, sh), ldexpf(x.w, sh));
    }
  }
  if (warp == 2) reinterpret_cast<float4*>(ring_k + p * KROW)[lane] = kl;
  if (warp == 3) reinterpret_cast<float4*>(sm.qraw)[lane] = ql;
  if (tid < JMAX) sm.la[tid] = tid < p ? la_t : tid == p ? g_p : 0.f;
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // the ring's keys
  __syncthreads();

  // c_j, j <= p, by one serial sum in slot order, once (thread 0, in place of la: the slots'
  // loads all issued first, then the chain of adds; the slots past p add 0)
  if (tid == 0) {
    float c = 0.f;
#pragma unroll
    for (int j0 = 0; j0 < JMAX; j0 += 8) {  // (8 loads in flight at a time)
      float lr[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) lr[j] = sm.la[j0 + j];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c += lr[j];
        sm.la[j0 + j] = c;
      }
    }
  }
  float cp;  // c_p (read once the sum is in)
  // The Gram terms k_j . k_p and k_j . q, j <= p, all at once: 4 threads a slot (thread t:
  // slot t / 4, columns 32 (t % 4) .. + 31, one chain of FMAs in column order), joined by
  // (c0 + c1) + (c2 + c3); the slot's first thread then forms its coefficients (from the c_j
  // above, once they are in: the barrier also ends every read of the ring's keys).
  {
    const int j = tid >> 2, qq = tid & 3;
    float zk = 0.f, zq = 0.f;
    if (j <= p) {
      const float4* a = reinterpret_cast<const float4*>(ring_k + j * KROW + 32 * qq);
      const float4* kp = reinterpret_cast<const float4*>(ring_k + p * KROW + 32 * qq);
      const float4* qv = reinterpret_cast<const float4*>(&sm.qraw[32 * qq]);
#pragma unroll
      for (int i = 0; i < 8; ++i) f32x4(a[i], kp[i], qv[i], zk, zq);
    }
    zk = __fadd_rn(zk, __shfl_xor_sync(0xffffffffu, zk, 1));
    zq = __fadd_rn(zq, __shfl_xor_sync(0xffffffffu, zq, 1));
    zk = __fadd_rn(zk, __shfl_xor_sync(0xffffffffu, zk, 2));
    zq = __fadd_rn(zq, __shfl_xor_sync(0xffffffffu, zq, 2));
    __syncthreads();  // (c_j)
    cp = sm.la[p];
    if (qq == 0 && j < p) {
      const float d = expf(cp - sm.la[j]);
      sm.ac[j] = beta_p * d * zk;
      sm.bc[j] = d * zq;
    }
    if (qq == 0 && j == p) sm.zq[p] = zq;
  }

  // ST 3: the B fragments, [k_hi k_mid k_lo 0 q_hi q_mid q_lo 0] (the key and query, scaled,
  // each the exact sum of three bf16), thread c writing column c's six parts where the
  // fragment of its k-step holds them (see the products)
  if constexpr (ST == 3) {  // (after the (c_j) barrier: the Gram terms have read rkey)
    const int c = tid, tg = c >> 5, j = (c >> 3) & 3, n = c & 7;
    const int ks = 2 * j + ((n >> 1) & 1), rg = n & 1, half = n >> 2;
    uint16_t* bf = reinterpret_cast<uint16_t*>(ring_k);
    const float xs[2] = {sm.ks[c], sm.qs[c]};
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const uint16_t hi = bf16_rn(xs[w]);
      const float r1 = xs[w] - __uint_as_float((uint32_t)hi << 16);
      const uint16_t mid = bf16_rn(r1);
      const uint16_t lo = bf16_rn(r1 - __uint_as_float((uint32_t)mid << 16));
      const uint16_t part[4] = {hi, mid, lo, 0};
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4)
        bf[((((4 * w + q4) * 4 + tg) * 8 + ks) * 2 + rg) * 2 + half] = part[q4];
    }
  }

  // The row's products with the key and the query, in one order for every launch form: the
  // row's columns in 8 groups (FMT 0: group g = the float4s g, g + 8, g + 16, g + 24, each a
  // chain of FMAs in column order; FMT 1: group g = block g, its scale times the sum of its
  // even and odd elements' chains), then tree8 over the groups (FMT 1: times the matrix scale,
  // and 2^e).
  float rk_, rq_;
  if constexpr (ST == 1) {  // the tile is in shared memory
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
  }
  if constexpr (ST == 2) {  // 8 lanes a row, 4 rows a warp at a time; lane li: group li
    float4 kk[4], qq[4];
#pragma unroll
    for (int s4 = 0; s4 < 4; ++s4) {
      kk[s4] = reinterpret_cast<const float4*>(sm.ks)[FMT == 0 ? li + 8 * s4 : 4 * li + s4];
      qq[s4] = reinterpret_cast<const float4*>(sm.qs)[FMT == 0 ? li + 8 * s4 : 4 * li + s4];
    }
#pragma unroll
    for (int it = 0; it < 8; ++it) {
      const int slot = it & 1;
      float tk = 0.f, tq = 0.f;
      if constexpr (FMT == 0) {
#pragma unroll
        for (int s4 = 0; s4 < 4; ++s4) f32x4(xb[slot][s4], kk[s4], qq[s4], tk, tq);
      } else {
        nvfp4_block(cb[slot].x, cb[slot].y, sb[slot], kk, qq, tk, tq);
      }
      if (it + 2 < 8) load2(it + 2, slot);
      tk = lanes8(tk);
      tq = lanes8(tq);
      if (li == 0) {
        sm.yk[32 * warp + 4 * it + gi] = tk;
        sm.yq[32 * warp + 4 * it + gi] = tq;
      }
    }
  }
  if constexpr (ST == 3) {
    // The products on the tensor cores: Y [128, 8] = A [128, 128] B [128, 8], A the read copy's
    // elements times their block scales times 2^-16 as bf16 (exact), B the parts above. Warp w
    // takes rows 32 w .. + 31 as two m-tiles of 16; lane (g = lane / 4, t = lane % 4) holds
    // the 16 bytes t of rows g and g + 8 of each, columns 32 t .. 32 t + 31 (words j = 0..3,
    // blocks 2 t and 2 t + 1). The k-step 2 j + s takes word j's code pairs (2 s, 2 s + 4)
    // and (2 s + 1, 2 s + 5) as its registers a0 / a1 (k = 2 t, 2 t + 1) and a2 / a3 (k = 2 t
    // + 8, 2 t + 9): the MMA's K runs over the columns in that permuted order, and B's
    // fragments (written above) follow it. Each m-tile is one sum of the 128 columns in the
    // tensor cores' FP32 accumulation, over 8 k-steps in order; then per row and operand
    // hi + (mid + lo). Every sum's order is the CTA's own.
    __syncthreads();  // the B fragments
    const int g = lane >> 2, t = lane & 3;
    uint32_t bq[8][2];
    if ((g & 3) == 3) {  // the zero columns
#pragma unroll
      for (int i = 0; i < 8; ++i) bq[i][0] = bq[i][1] = 0u;
    } else {
      const BFrag* bfr = reinterpret_cast<const BFrag*>(ring_k);
      const uint4* src = reinterpret_cast<const uint4*>(&bfr[g][t][0][0]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 x = src[i];
        bq[2 * i][0] = x.x; bq[2 * i][1] = x.y; bq[2 * i + 1][0] = x.z; bq[2 * i + 1][1] = x.w;
      }
    }
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      const uint32_t wa[4] = {c3[m][0].x, c3[m][0].y, c3[m][0].z, c3[m][0].w};
      const uint32_t wb[4] = {c3[m][1].x, c3[m][1].y, c3[m][1].z, c3[m][1].w};
      const uint32_t sa[2] = {e4m3_bf16x2_2p110(s3[m][0] & 0xFFu), e4m3_bf16x2_2p110(s3[m][0] >> 8)};
      const uint32_t sg[2] = {e4m3_bf16x2_2p110(s3[m][1] & 0xFFu), e4m3_bf16x2_2p110(s3[m][1] >> 8)};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t ua = sa[j >> 1], ub = sg[j >> 1];
        mma_bf16(d, bf16x2_mul(e2m1x2_tiny_bf16<0>(wa[j]), ua),
                 bf16x2_mul(e2m1x2_tiny_bf16<0>(wb[j]), ub),
                 bf16x2_mul(e2m1x2_tiny_bf16<1>(wa[j]), ua),
                 bf16x2_mul(e2m1x2_tiny_bf16<1>(wb[j]), ub), bq[2 * j][0], bq[2 * j][1]);
        mma_bf16(d, bf16x2_mul(e2m1x2_tiny_bf16<2>(wa[j]), ua),
                 bf16x2_mul(e2m1x2_tiny_bf16<2>(wb[j]), ub),
                 bf16x2_mul(e2m1x2_tiny_bf16<3>(wa[j]), ua),
                 bf16x2_mul(e2m1x2_tiny_bf16<3>(wb[j]), ub), bq[2 * j + 1][0],
                 bq[2 * j + 1][1]);
      }
      // d: rows g (d0, d1) and g + 8 (d2, d3), columns 2 t and 2 t + 1: lane t = 0 holds
      // k_hi, k_mid, lane 1 k_lo, lane 2 q_hi, q_mid, lane 3 q_lo
      const float lo0 = __shfl_down_sync(0xffffffffu, d[0], 1);
      const float lo2 = __shfl_down_sync(0xffffffffu, d[2], 1);
      if ((t & 1) == 0) {
        float* y = t == 0 ? sm.yk : sm.yq;
        const int r0 = 32 * warp + 16 * m + g;
        y[r0] = __fadd_rn(d[0], __fadd_rn(d[1], lo0));
        y[r0 + 8] = __fadd_rn(d[2], __fadd_rn(d[3], lo2));
      }
    }
  }
  if constexpr (FMT == 0 && ST != 2) {
    float pk[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float pq[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const float4* tr = reinterpret_cast<const float4*>(reinterpret_cast<float*>(tile) + row * F32_ROW);
    const float4* ks4 = reinterpret_cast<const float4*>(sm.ks);
    const float4* qs4 = reinterpret_cast<const float4*>(sm.qs);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int i = 0; i < 8; ++i)  // float4 8 c + i: group i
        f32x4(ST == 1 ? tr[8 * c + i] : fb[c & 1][i], ks4[8 * c + i], qs4[8 * c + i], pk[i],
              pq[i]);
      if (ST == 0 && c < 2) {
#pragma unroll
        for (int i = 0; i < 8; ++i) fb[c & 1][i] = __ldg(rr + 8 * (c + 2) + i);
      }
    }
    rk_ = tree8(pk);
    rq_ = tree8(pq);
  } else if constexpr (FMT == 1 && ST != 2 && ST != 3) {
    if constexpr (ST == 1) {
      const uint4* tr = reinterpret_cast<const uint4*>(tile + row * FP4_ROW);
#pragma unroll
      for (int i = 0; i < 4; ++i) cw[i] = tr[i];
      sw = *reinterpret_cast<const uint2*>(tile + row * FP4_ROW + K / 2);
    }
    const uint32_t wd[16] = {cw[0].x, cw[0].y, cw[0].z, cw[0].w, cw[1].x, cw[1].y, cw[1].z,
                             cw[1].w, cw[2].x, cw[2].y, cw[2].z, cw[2].w, cw[3].x, cw[3].y,
                             cw[3].z, cw[3].w};
    const float4* ks4 = reinterpret_cast<const float4*>(sm.ks);
    const float4* qs4 = reinterpret_cast<const float4*>(sm.qs);
    float tk[8], tq[8];
#pragma unroll
    for (int blk = 0; blk < 8; ++blk) {
      const float4 kk[4] = {ks4[4 * blk], ks4[4 * blk + 1], ks4[4 * blk + 2], ks4[4 * blk + 3]};
      const float4 qq[4] = {qs4[4 * blk], qs4[4 * blk + 1], qs4[4 * blk + 2], qs4[4 * blk + 3]};
      nvfp4_block(wd[2 * blk], wd[2 * blk + 1],
                  ((blk < 4 ? sw.x : sw.y) >> (8 * (blk & 3))) & 0xFFu, kk, qq, tk[blk], tq[blk]);
    }
    rk_ = tree8(tk);
    rq_ = tree8(tq);
  }

  if constexpr (ST != 1) asm volatile("cp.async.wait_all;\n" ::: "memory");
  __syncthreads();
  if constexpr (ST == 2 || ST == 3) {
    rk_ = sm.yk[row];
    rq_ = sm.yq[row];
  }
  if constexpr (FMT == 1) {
    rk_ = ldexpf(rk_ * ms, ek);
    rq_ = ldexpf(rq_ * ms, eq);
  }

  // the row's correction and output (the verify's epilogue at T = 1)
  if constexpr (!EARLY) {
    vnew = __ldg(vn + ((size_t)b * H + hd) * V + row);
    if (first_head) k_row = __ldg(kg + row);
  }
  const float gk = expf(cp);
  float u = beta_p * (vnew - gk * rk_);
  float oo = gk * rq_;
#pragma unroll 4
  for (int j = 0; j < p; ++j) {
    const float uj = ring_u[j * V + row];
    u = fmaf(-sm.ac[j], uj, u);
    oo = fmaf(sm.bc[j], uj, oo);
  }
  oo = fmaf(sm.zq[p], u, oo);

  const size_t slot = ((size_t)b * JS + p) * HV + (size_t)hd * V + row;
  ru[slot] = u;
  rv[slot] = vnew;
  o[((size_t)b * H + hd) * V + row] = oo;
  if (tid == 0) {
    rla[((size_t)b * JS + p) * H + hd] = g_p;
    rbeta[((size_t)b * JS + p) * H + hd] = beta_p;
  }
  if (first_head) rk[((size_t)b * JS + p) * G * K + (size_t)grp * K + row] = k_row;
}

}  // namespace gdn_step

#ifndef GDN_VERIFY_DEVICE_ONLY
// No checks here (cuda_step.unsupported and the Python wrapper have checked shapes, dtypes,
// the device, contiguity, 16-byte alignment, H % G, JS <= JMAX); 0 <= h < JS is asserted by
// the kernel. fmt 0: R float32 [B, H, V, K] (codes, bscale, mscale unused); fmt 1: codes
// uint8 [B, H, V, K / 2], bscale uint8 [B, H, V, K / 16], mscale float32 [B, H] (R unused).
// Ring: rla, rbeta [B, JS, H]; rv, ru [B, JS, H, V]; rk [B, JS, G, K] (slot h written).
// Token: q, k [B, G, K]; v [B, H, V]; g, beta [B, H]; h int64 [B]; o [B, H, V] written.
// stage: 0, 1, 2 or (fmt 1) 3, the kernel's ST.
void gdn_step_cuda(torch::Tensor R, torch::Tensor codes, torch::Tensor bscale,
                   torch::Tensor mscale, int64_t fmt, torch::Tensor rla, torch::Tensor rbeta,
                   torch::Tensor rv, torch::Tensor rk, torch::Tensor ru, torch::Tensor q,
                   torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
                   torch::Tensor h, torch::Tensor o, int64_t stage) {
  const int B = (int)rla.size(0), JS = (int)rla.size(1), H = (int)rla.size(2);
  const int G = (int)rk.size(2);
  const dim3 grid(B * H);
  auto st = at::cuda::getCurrentCUDAStream();
#define GDN_STEP_LAUNCH(F, S)                                                                \
  {                                                                                          \
    auto fn = gdn_step::step_kernel<F, S>;                                                   \
    const size_t shm = sizeof(gdn_step::Smem) + gdn_step::ring_bytes(JS) +                  \
                       (S == 1 ? gdn_step::staged_bytes<F>() : 0);                          \
    cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shm);         \
    fn<<<grid, gdn_step::NTH, shm, st>>>(                                                    \
        static_cast<const float*>(R.data_ptr()), static_cast<const uint8_t*>(codes.data_ptr()), \
        static_cast<const uint8_t*>(bscale.data_ptr()),                                      \
        static_cast<const float*>(mscale.data_ptr()), static_cast<float*>(rla.data_ptr()),   \
        static_cast<float*>(rbeta.data_ptr()), static_cast<float*>(rv.data_ptr()),           \
        static_cast<float*>(rk.data_ptr()), static_cast<float*>(ru.data_ptr()),              \
        static_cast<const float*>(q.data_ptr()), static_cast<const float*>(k.data_ptr()),    \
        static_cast<const float*>(v.data_ptr()), static_cast<const float*>(g.data_ptr()),    \
        static_cast<const float*>(beta.data_ptr()),                                          \
        static_cast<const int64_t*>(h.data_ptr()), static_cast<float*>(o.data_ptr()), H, G,  \
        JS);                                                                                 \
  }
  if (fmt == 1) {
    if (stage == 3) GDN_STEP_LAUNCH(1, 3) else if (stage == 2) GDN_STEP_LAUNCH(1, 2)
    else if (stage == 1) GDN_STEP_LAUNCH(1, 1) else GDN_STEP_LAUNCH(1, 0)
  } else {
    if (stage == 2) GDN_STEP_LAUNCH(0, 2) else if (stage == 1) GDN_STEP_LAUNCH(0, 1)
    else GDN_STEP_LAUNCH(0, 0)
  }
#undef GDN_STEP_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif

// CUDA C++ forms of benchmarks/step_latency.py's stand-ins (issue 15, forty-first pass): does a
// hand-written kernel bring GDN's FP32 decode step closer to a bare read of the state than the
// Triton kernels do? Same inputs, layouts and formulas as the Triton stand-ins there
// (`bare`, `read2`, `epi`, `epi_z`); checked by that script against its float64 reference.
//
// One CTA per state matrix (sequence b, value head h): NW warps, each over R = 128 / NW
// consecutive rows. A lane reads 16 bytes of every row of its warp (one coalesced 512-byte
// load per row), forms its 4-term partial products with the columns, and the warp sums the
// partials with a reduce-scatter butterfly (N values per lane -> N / 32 per lane, about two
// shuffles per row and column instead of five per row and column for an all-reduce). Every
// row's sum has the same fixed order (lane's 4 terms, then the butterfly tree), so the result
// does not depend on the batch.
//
// `epi`: the ring's decays, corrections U and (ZIN) key products are loaded or formed before
// the stream; Z (the products with the ring keys) is either read from the products launch's
// buffer or (ZIN) formed in the CTA by its warps, NW / 16 slots each, and shared through
// shared memory, so no products launch is needed.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

#include "warp.cuh"

namespace {

constexpr int V = 128;
constexpr int K = 128;
constexpr int CAPMAX = 16;

// o = S q (one column).
template <int NW, bool CS>
__global__ void __launch_bounds__(NW * 32) bare_kernel(const float* __restrict__ S,
                                                      const float* __restrict__ q,
                                                      float* __restrict__ o, int H, int G) {
  constexpr int R = V / NW;
  const int mat = blockIdx.x, b = mat / H, h = mat - b * H, g = h / (H / G);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = warp * R;
  const float4* sm = reinterpret_cast<const float4*>(S + ((size_t)mat * V + row0) * K) + lane;
  const float4 q4 = reinterpret_cast<const float4*>(q + ((size_t)b * G + g) * K)[lane];
  float v[R];
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = dot4(ld_c<CS>(sm + r * (K / 4)), q4);
  rs<R, 16>(v, lane);
  // R >= 32: lane holds rows lane * R / 32 + j; R < 32: row lane >> (5 - log2 R), duplicated
  if constexpr (R >= 32) {
#pragma unroll
    for (int j = 0; j < R / 32; ++j) o[(size_t)mat * V + row0 + lane * (R / 32) + j] = v[j];
  } else {
    constexpr int SH = (R == 16) ? 1 : (R == 8) ? 2 : 3;
    if ((lane & ((1 << SH) - 1)) == 0) o[(size_t)mat * V + row0 + (lane >> SH)] = v[0];
  }
}

// The warp's two columns [k, q] over its R rows, from its C rows already in registers; returns
// (y0, y1) of the lane's row `rr`. Values are interleaved v[2r + c], so after the
// reduce-scatter: R = 32: lane l holds row l (both columns); R = 16: lane l holds row l >> 1,
// column l & 1 (the other from lane l ^ 1).
template <int R>
__device__ __forceinline__ void dots2(const float4 (&c)[R], float4 k4, float4 q4, int lane,
                                      float& y0, float& y1, int& rr) {
  float v[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    v[2 * r] = dot4(c[r], k4);
    v[2 * r + 1] = dot4(c[r], q4);
  }
  rs<2 * R, 16>(v, lane);
  if constexpr (R == 32) {
    y0 = v[0];
    y1 = v[1];
    rr = lane;
  } else {
    static_assert(R == 16, "R = 32 or 16");
    const float other = __shfl_xor_sync(FULL, v[0], 1);
    const bool odd = lane & 1;
    y0 = odd ? other : v[0];
    y1 = odd ? v[0] : other;
    rr = lane >> 1;
  }
}

template <int R, bool CS>
__device__ __forceinline__ void load_rows(const float4* sm, float4 (&c)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) c[r] = ld_c<CS>(sm + r * (K / 4));
}

template <int R, bool CS>
__device__ __forceinline__ void stream2(const float4* sm, float4 k4, float4 q4, int lane,
                                        float& y0, float& y1, int& rr) {
  float4 c[R];
  load_rows<R, CS>(sm, c);
  dots2<R>(c, k4, q4, lane, y0, y1, rr);
}

// y = S [k, q] (two columns, stored [.., V, 2]).
template <int NW, bool CS>
__global__ void __launch_bounds__(NW * 32) read2_kernel(const float* __restrict__ S,
                                                       const float* __restrict__ kn,
                                                       const float* __restrict__ q,
                                                       float* __restrict__ y, int H, int G) {
  constexpr int R = V / NW;
  const int mat = blockIdx.x, b = mat / H, h = mat - b * H, g = h / (H / G);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = warp * R;
  const float4* sm = reinterpret_cast<const float4*>(S + ((size_t)mat * V + row0) * K) + lane;
  const float4 k4 = reinterpret_cast<const float4*>(kn + ((size_t)b * G + g) * K)[lane];
  const float4 q4 = reinterpret_cast<const float4*>(q + ((size_t)b * G + g) * K)[lane];
  float y0, y1;
  int rr;
  stream2<R, CS>(sm, k4, q4, lane, y0, y1, rr);
  if (R == 32 || (lane & 1) == 0) {
    float2* yp = reinterpret_cast<float2*>(y + ((size_t)mat * V + row0 + rr) * 2);
    *yp = make_float2(y0, y1);
  }
}

// The stand-in step: y0 = C k, y1 = C q; ek / eq = sum_{i<hh} U_i dec_i zk_i / zq_i with
// dec_i = exp(ctot - c_i), c_i = sum_{j<=i} la_j, ctot = sum_{i<hh} la_i + lan; gam =
// exp(ctot); un = bn (vn - gam y0 - ek) into ring slot hh; o = gam y1 + eq + un (k . q).
template <int NW, bool ZIN, bool CS, bool CF>
__global__ void __launch_bounds__(NW * 32) epi_kernel(
    const float* __restrict__ S, float* __restrict__ U, const float* __restrict__ la,
    const float* __restrict__ rk, const float* __restrict__ kn, const float* __restrict__ q,
    const float* __restrict__ vn, const float* __restrict__ bn, const float* __restrict__ lan,
    const float* __restrict__ Z, const int64_t* __restrict__ hptr, float* __restrict__ o, int H,
    int G, int CAP) {
  constexpr int R = V / NW;
  constexpr int SLOTS = CAPMAX / NW;  // ZIN: ring slots whose products each warp forms
  __shared__ float zs[CAPMAX][2];
  const int mat = blockIdx.x, b = mat / H, h = mat - b * H, g = h / (H / G);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = warp * R;
  const float4* sm = reinterpret_cast<const float4*>(S + ((size_t)mat * V + row0) * K) + lane;
  // CF: the stream's loads first, so that the ring's loads and the key products overlap them
  // (else after those, as the Triton stand-in orders them)
  float4 c[R];
  if constexpr (CF) load_rows<R, CS>(sm, c);
  const int hh = (int)hptr[b];
  const float4 k4 = reinterpret_cast<const float4*>(kn + ((size_t)b * G + g) * K)[lane];
  const float4 q4 = reinterpret_cast<const float4*>(q + ((size_t)b * G + g) * K)[lane];
  // the lane's row for the epilogue (as stream2 leaves it)
  const int rr = (R == 32) ? lane : (lane >> 1);
  const int row = row0 + rr;
  // ring operands, before the stream
  float u[CAPMAX], lv[CAPMAX];
#pragma unroll
  for (int i = 0; i < CAPMAX; ++i) {
    const bool in = i < hh;
    u[i] = in ? U[(((size_t)b * CAP + i) * H + h) * V + row] : 0.f;
    lv[i] = in ? la[((size_t)b * CAP + i) * H + h] : 0.f;
  }
  const float vnr = vn[((size_t)b * H + h) * V + row];
  const float bnv = bn[(size_t)b * H + h];
  const float lanv = lan[(size_t)b * H + h];
  if constexpr (ZIN) {
    // this warp's SLOTS ring slots: products with k and q, all-reduced
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
      const int i = warp * SLOTS + j;
      float pk = 0.f, pq = 0.f;
      if (i < hh) {
        const float4 r4 =
            reinterpret_cast<const float4*>(rk + (((size_t)b * CAP + i) * G + g) * K)[lane];
        pk = dot4(r4, k4);
        pq = dot4(r4, q4);
      }
      pk = warp_sum(pk);
      pq = warp_sum(pq);
      if (lane == 0) {
        zs[i][0] = pk;
        zs[i][1] = pq;
      }
    }
  } else {
    if (threadIdx.x < 2 * CAPMAX) {
      const int i = threadIdx.x >> 1;
      zs[i][threadIdx.x & 1] =
          i < hh ? Z[(((size_t)b * G + g) * CAP + i) * 2 + (threadIdx.x & 1)] : 0.f;
    }
  }
  const float kq = warp_sum(dot4(k4, q4));
  if constexpr (!CF) load_rows<R, CS>(sm, c);
  float y0, y1;
  int rr2;
  dots2<R>(c, k4, q4, lane, y0, y1, rr2);
  __syncthreads();
  float cvec = 0.f, ctot = lanv;
#pragma unroll
  for (int i = 0; i < CAPMAX; ++i) ctot += lv[i];
  float ek = 0.f, eq = 0.f;
#pragma unroll
  for (int i = 0; i < CAPMAX; ++i) {
    cvec += lv[i];
    const float dec = i < hh ? expf(ctot - cvec) : 0.f;
    ek = fmaf(u[i], dec * zs[i][0], ek);
    eq = fmaf(u[i], dec * zs[i][1], eq);
  }
  const float gam = expf(ctot);
  const float un = bnv * (vnr - gam * y0 - ek);
  const float ov = gam * y1 + eq + un * kq;
  if (R == 32 || (lane & 1) == 0) {
    U[(((size_t)b * CAP + hh) * H + h) * V + row] = un;
    o[((size_t)b * H + h) * V + row] = ov;
  }
}

void check_mats(const torch::Tensor& S, int64_t H) {
  TORCH_CHECK(S.is_cuda() && S.scalar_type() == torch::kFloat32 && S.is_contiguous(),
              "S must be a contiguous float32 CUDA tensor");
  TORCH_CHECK(S.dim() == 4 && S.size(2) == V && S.size(3) == K && S.size(1) == H,
              "S must be [B, H, 128, 128], got ", S.sizes());
}

}  // namespace

void bare(torch::Tensor S, torch::Tensor q, torch::Tensor o, int64_t G, int64_t nw, bool cs) {
  const int64_t H = S.size(1);
  check_mats(S, H);
  const dim3 grid(S.size(0) * H);
  auto st = at::cuda::getCurrentCUDAStream();
#define L(NW, C) bare_kernel<NW, C><<<grid, NW * 32, 0, st>>>(S.data_ptr<float>(), \
      q.data_ptr<float>(), o.data_ptr<float>(), (int)H, (int)G)
  if (nw == 4) { if (cs) L(4, true); else L(4, false); }
  else if (nw == 8) { if (cs) L(8, true); else L(8, false); }
  else TORCH_CHECK(false, "nw must be 4 or 8, got ", nw);
#undef L
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void read2(torch::Tensor S, torch::Tensor kn, torch::Tensor q, torch::Tensor y, int64_t G,
           int64_t nw, bool cs) {
  const int64_t H = S.size(1);
  check_mats(S, H);
  const dim3 grid(S.size(0) * H);
  auto st = at::cuda::getCurrentCUDAStream();
#define L(NW, C) read2_kernel<NW, C><<<grid, NW * 32, 0, st>>>(S.data_ptr<float>(), \
      kn.data_ptr<float>(), q.data_ptr<float>(), y.data_ptr<float>(), (int)H, (int)G)
  if (nw == 4) { if (cs) L(4, true); else L(4, false); }
  else if (nw == 8) { if (cs) L(8, true); else L(8, false); }
  else TORCH_CHECK(false, "nw must be 4 or 8, got ", nw);
#undef L
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void epi(torch::Tensor S, torch::Tensor U, torch::Tensor la, torch::Tensor rk, torch::Tensor kn,
         torch::Tensor q, torch::Tensor vn, torch::Tensor bn, torch::Tensor lan, torch::Tensor Z,
         torch::Tensor h, torch::Tensor o, int64_t G, int64_t CAP, int64_t nw, bool zin,
         bool cs, bool cf) {
  const int64_t H = S.size(1);
  check_mats(S, H);
  TORCH_CHECK(CAP == CAPMAX, "CAP must be 16, got ", CAP);
  TORCH_CHECK(h.scalar_type() == torch::kInt64, "h must be int64");
  const dim3 grid(S.size(0) * H);
  auto st = at::cuda::getCurrentCUDAStream();
#define L(NW, ZI, C, F) epi_kernel<NW, ZI, C, F><<<grid, NW * 32, 0, st>>>(           \
      S.data_ptr<float>(), U.data_ptr<float>(), la.data_ptr<float>(), rk.data_ptr<float>(), \
      kn.data_ptr<float>(), q.data_ptr<float>(), vn.data_ptr<float>(), bn.data_ptr<float>(), \
      lan.data_ptr<float>(), Z.data_ptr<float>(), h.data_ptr<int64_t>(), o.data_ptr<float>(), \
      (int)H, (int)G, (int)CAP)
#define L2(NW, ZI, C) { if (cf) L(NW, ZI, C, true); else L(NW, ZI, C, false); }
  if (nw == 4) {
    if (zin) { if (cs) L2(4, true, true) else L2(4, true, false) }
    else { if (cs) L2(4, false, true) else L2(4, false, false) }
  } else if (nw == 8) {
    if (zin) { if (cs) L2(8, true, true) else L2(8, true, false) }
    else { if (cs) L2(8, false, true) else L2(8, false, false) }
  } else {
    TORCH_CHECK(false, "nw must be 4 or 8, got ", nw);
  }
#undef L2
#undef L
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

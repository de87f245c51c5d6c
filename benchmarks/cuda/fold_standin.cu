// CUDA C++ stand-in of GDN's FP32 flush that folds cached corrections (issue 15, forty-first
// pass; benchmarks/flush_cuda.py times it beside the shipped Triton flush): the same bytes and
// the same formula, the fold of ReplaySSM's window (paper Eq. of the flush, replay.gdn):
//   S_L = gamma_{1:L} C + sum_{i<L} gamma_{i+1:L} u_i k_i^T,   y = S_L q,
// with gamma_{i+1:L} = exp(c_{L-1} - c_i), c_i = sum_{j<=i} la_j.
// Inputs: C [B, H, V, K] float32 (the stored anchor), U [B, CAP, H, V] (the cached corrections),
// la [B, CAP, H] (log decays), rk [B, CAP, G, K] (record keys), q [B, G, K] (the flush token's
// query). Outputs: S_L [B, H, V, K] float32, y [B, H, V].
//
// One CTA per state matrix, NW warps of R = 128 / NW rows. The CTA first stages the weights
// w[r][i] = gamma_{i+1:L} u_i[r] in shared memory and holds the lane's 4 columns of every
// record key in registers; each warp then walks its rows in chunks of CH with the next chunk's
// loads in flight (a register double buffer), forms a row's new values as gamma C + 16 FMAs per
// element (slot order, fixed), stores them, and sums S_L q by a warp reduce-scatter per chunk.
// Nothing depends on the batch: every element's arithmetic is the same fixed sequence.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

#include "warp.cuh"

namespace {

constexpr int V = 128;
constexpr int K = 128;
constexpr int CAP = 16;

template <bool CS>
__device__ __forceinline__ void st_s(float4* p, float4 v) {
  if constexpr (CS) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

__device__ __forceinline__ float4 axpy4(float a, float4 x, float4 y) {
  return make_float4(fmaf(a, x.x, y.x), fmaf(a, x.y, y.y), fmaf(a, x.z, y.z), fmaf(a, x.w, y.w));
}

template <int NW, int CH, bool CS>
__global__ void __launch_bounds__(NW * 32) fold_kernel(
    const float* __restrict__ C, float* __restrict__ Snew, const float* __restrict__ U,
    const float* __restrict__ la, const float* __restrict__ rk, const float* __restrict__ q,
    float* __restrict__ y, int H, int G) {
  constexpr int R = V / NW;
  constexpr int NCH = R / CH;
  static_assert(R % CH == 0 && (CH == 4 || CH == 8), "CH = 4 or 8, dividing the warp's rows");
  __shared__ __align__(16) float ws[V][CAP];  // ws[r][i] = gamma_{i+1:L} u_i[r]
  const int mat = blockIdx.x, b = mat / H, h = mat - b * H, g = h / (H / G);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = warp * R;
  const float4* sm = reinterpret_cast<const float4*>(C + ((size_t)mat * V + row0) * K) + lane;
  float4* dm = reinterpret_cast<float4*>(Snew + ((size_t)mat * V + row0) * K) + lane;
  // the first chunk's loads before anything else
  float4 cb[2][CH];
#pragma unroll
  for (int r = 0; r < CH; ++r) cb[0][r] = ld_c<CS>(sm + r * (K / 4));
  // decays (every thread the same, in slot order)
  float cv[CAP];
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < CAP; ++i) {
    acc += la[((size_t)b * CAP + i) * H + h];
    cv[i] = acc;
  }
  const float ctot = acc;
  // the weights, one row per thread at a time
  for (int r = threadIdx.x; r < V; r += NW * 32) {
    float w[CAP];
#pragma unroll
    for (int i = 0; i < CAP; ++i)
      w[i] = expf(ctot - cv[i]) * U[(((size_t)b * CAP + i) * H + h) * V + r];
#pragma unroll
    for (int i = 0; i < CAP; i += 4)
      *reinterpret_cast<float4*>(&ws[r][i]) = make_float4(w[i], w[i + 1], w[i + 2], w[i + 3]);
  }
  float4 kr[CAP];
#pragma unroll
  for (int i = 0; i < CAP; ++i)
    kr[i] = reinterpret_cast<const float4*>(rk + (((size_t)b * CAP + i) * G + g) * K)[lane];
  const float4 q4 = reinterpret_cast<const float4*>(q + ((size_t)b * G + g) * K)[lane];
  const float gam = expf(ctot);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < NCH; ++j) {
    if (j + 1 < NCH) {
#pragma unroll
      for (int r = 0; r < CH; ++r) cb[(j + 1) & 1][r] = ld_c<CS>(sm + ((j + 1) * CH + r) * (K / 4));
    }
    float v[CH];
#pragma unroll
    for (int r = 0; r < CH; ++r) {
      const int row = row0 + j * CH + r;
      const float4 c = cb[j & 1][r];
      float4 s = make_float4(gam * c.x, gam * c.y, gam * c.z, gam * c.w);
      const float4* wr = reinterpret_cast<const float4*>(&ws[row][0]);
#pragma unroll
      for (int jj = 0; jj < CAP / 4; ++jj) {
        const float4 w = wr[jj];
        s = axpy4(w.x, kr[4 * jj], s);
        s = axpy4(w.y, kr[4 * jj + 1], s);
        s = axpy4(w.z, kr[4 * jj + 2], s);
        s = axpy4(w.w, kr[4 * jj + 3], s);
      }
      st_s<CS>(dm + (j * CH + r) * (K / 4), s);
      v[r] = dot4(s, q4);
    }
    rs<CH, 16>(v, lane);
    // CH = 8: lane l holds row l >> 2 of the chunk; CH = 4: row l >> 3
    constexpr int SH = (CH == 8) ? 2 : 3;
    if ((lane & ((1 << SH) - 1)) == 0) y[(size_t)mat * V + row0 + j * CH + (lane >> SH)] = v[0];
  }
}

}  // namespace

void fold(torch::Tensor C, torch::Tensor Snew, torch::Tensor U, torch::Tensor la,
          torch::Tensor rk, torch::Tensor q, torch::Tensor y, int64_t G, int64_t nw, int64_t ch,
          bool cs) {
  TORCH_CHECK(C.is_cuda() && C.scalar_type() == torch::kFloat32 && C.is_contiguous() &&
                  C.dim() == 4 && C.size(2) == V && C.size(3) == K,
              "C must be a contiguous float32 CUDA tensor [B, H, 128, 128], got ", C.sizes());
  TORCH_CHECK(U.dim() == 4 && U.size(1) == CAP, "U must be [B, 16, H, 128], got ", U.sizes());
  const int64_t H = C.size(1);
  const dim3 grid(C.size(0) * H);
  auto st = at::cuda::getCurrentCUDAStream();
#define L(NW, CH, CS) fold_kernel<NW, CH, CS><<<grid, NW * 32, 0, st>>>(                    \
      C.data_ptr<float>(), Snew.data_ptr<float>(), U.data_ptr<float>(), la.data_ptr<float>(), \
      rk.data_ptr<float>(), q.data_ptr<float>(), y.data_ptr<float>(), (int)H, (int)G)
#define L2(NW, CH) { if (cs) L(NW, CH, true); else L(NW, CH, false); }
  if (nw == 4 && ch == 8) L2(4, 8)
  else if (nw == 4 && ch == 4) L2(4, 4)
  else if (nw == 8 && ch == 8) L2(8, 8)
  else if (nw == 8 && ch == 4) L2(8, 4)
  else TORCH_CHECK(false, "(nw, ch) must be in {4, 8} x {4, 8}, got ", nw, ", ", ch);
#undef L2
#undef L
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

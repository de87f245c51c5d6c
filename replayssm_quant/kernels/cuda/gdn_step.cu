// GDN's decode step from an FP32 read copy, in CUDA C++ (issue 15, forty-first pass): what
// replayssm_quant.kernels.replay.gdn_step_kernel computes for an FP32 read copy, in one launch
// (the Triton path takes two: the products with the ring keys, then the read pass with the
// records work). Torch reference: replay.gdn.gdn_step_output and the ring append.
//
// For sequence b, value head hd (key group g = hd / (H / G)), p = h[b] (the new row's slot):
//   y0 = R k,  y1 = R q                                   (rows of the read copy R [V, K])
//   c_j = sum_{i<=j} la_i  (la_j: the ring's for j < p, g_new for j = p)
//   u   = beta (v - e^{c_p} y0) - sum_{j<p} beta e^{c_p - c_j} (k_j . k) u_j
//   o   = e^{c_p} y1 + sum_{j<p} e^{c_p - c_j} (k_j . q) u_j + (k . q) u
// then u is cached at ring slot p and the record (g_new, beta, v, k) appended there.
//
// One CTA per (b, hd): V / 16 warps of 16 rows. A lane loads 16 bytes of each of its warp's
// rows (one coalesced 512-byte load per row), all of them before anything else; the CTA's
// warps form the products with the ring keys (CAPMAX / NW slots each) while those loads are in
// flight and share them through shared memory; each warp sums its rows' partial products with
// a reduce-scatter butterfly, so lane l ends with row l >> 1 (both lanes of a pair compute it,
// the even one stores). Every value's arithmetic is a fixed sequence that depends on its own
// sequence's data only: results do not depend on the batch, its order or its size.
#include <cstdint>
#include <cuda_runtime.h>

namespace {

constexpr int K = 128;
constexpr int R = 16;  // rows per warp
constexpr unsigned FULL = 0xffffffffu;

template <int N, int OFF>
__device__ __forceinline__ void rs(float* v, int lane) {
  if constexpr (OFF > 0) {
    if constexpr (N >= 2) {
      const bool up = (lane & OFF) != 0;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float lo = v[i], hi = v[i + N / 2];
        const float send = up ? lo : hi;
        const float keep = up ? hi : lo;
        v[i] = keep + __shfl_xor_sync(FULL, send, OFF);
      }
      rs<N / 2, OFF / 2>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(FULL, v[0], OFF);
      rs<1, OFF / 2>(v, lane);
    }
  }
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
  return x;
}

// VAR (an experiment of the forty-first pass, chosen by REPLAYSSM_CUDA_STEP_VARIANT): where the
// key products (2) and also the ring's loads (3) sit: 0 both before the rows' products, 2 the key
// products after them, 3 both after them.
template <int NW, int CAPMAX, int VAR>
__global__ void __launch_bounds__(NW * 32) gdn_f32_step_kernel(
    const float* __restrict__ Rc, float* __restrict__ ring_la, float* __restrict__ ring_beta,
    float* __restrict__ ring_v, float* __restrict__ ring_u, float* __restrict__ ring_k,
    const float* __restrict__ q, const float* __restrict__ kn, const float* __restrict__ vn,
    const float* __restrict__ gn, const float* __restrict__ bn, const int64_t* __restrict__ hp,
    float* __restrict__ o, int H, int G, int CAP) {
  constexpr int V = NW * R;
  constexpr int SLOTS = CAPMAX / NW;  // ring slots whose key products each warp forms
  static_assert(CAPMAX % NW == 0, "CAPMAX must be a multiple of the warps");
  __shared__ float zs[CAPMAX][2];  // (k_j . k, k_j . q)
  const int mat = blockIdx.x;
  const int b = mat / H, hd = mat - b * H, g = hd / (H / G);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = warp * R;
  const float4* sm =
      reinterpret_cast<const float4*>(Rc + ((size_t)mat * V + row0) * K) + lane;
  float4 c[R];
#pragma unroll
  for (int r = 0; r < R; ++r) c[r] = __ldg(sm + r * (K / 4));
  const int p = (int)hp[b];
  const int row = row0 + (lane >> 1);
  if (p < 0 || p >= CAP) {  // the caller's range check failed: NaN outputs, no ring write
    if ((lane & 1) == 0) o[(size_t)mat * V + row] = __int_as_float(0x7fc00000);
    return;
  }
  const float4 k4 = reinterpret_cast<const float4*>(kn + ((size_t)b * G + g) * K)[lane];
  const float4 q4 = reinterpret_cast<const float4*>(q + ((size_t)b * G + g) * K)[lane];
  float u[CAPMAX], lv[CAPMAX];
  auto ring_loads = [&]() {
#pragma unroll
    for (int j = 0; j < CAPMAX; ++j) {
      const bool in = j < p;
      u[j] = in ? ring_u[(((size_t)b * CAP + j) * H + hd) * V + row] : 0.f;
      lv[j] = in ? ring_la[((size_t)b * CAP + j) * H + hd] : 0.f;
    }
  };
  auto key_products = [&]() {
#pragma unroll
    for (int s = 0; s < SLOTS; ++s) {
      const int j = warp * SLOTS + s;
      float pk = 0.f, pq = 0.f;
      if (j < p) {
        const float4 r4 =
            reinterpret_cast<const float4*>(ring_k + (((size_t)b * CAP + j) * G + g) * K)[lane];
        pk = dot4(r4, k4);
        pq = dot4(r4, q4);
      }
      pk = warp_sum(pk);
      pq = warp_sum(pq);
      if (lane == 0) {
        zs[j][0] = pk;
        zs[j][1] = pq;
      }
    }
  };
  if constexpr (VAR < 3) ring_loads();
  if constexpr (VAR < 2) key_products();
  const float vr = vn[(size_t)mat * V + row];
  const float beta = bn[mat];
  const float gl = gn[mat];
  const float kq = warp_sum(dot4(k4, q4));
  // y0 = R k, y1 = R q on the warp's rows
  float v[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    v[2 * r] = dot4(c[r], k4);
    v[2 * r + 1] = dot4(c[r], q4);
  }
  rs<2 * R, 16>(v, lane);  // lane l: row l >> 1, column l & 1
  const float other = __shfl_xor_sync(FULL, v[0], 1);
  const bool odd = lane & 1;
  const float y0 = odd ? other : v[0];
  const float y1 = odd ? v[0] : other;
  if constexpr (VAR >= 2) key_products();
  if constexpr (VAR >= 3) ring_loads();
  __syncthreads();
  float cv[CAPMAX];
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < CAPMAX; ++j) {
    acc += lv[j];  // zero past p - 1
    cv[j] = acc;
  }
  const float cp = acc + gl;  // c_p
  const float ep = expf(cp);
  float corr = 0.f, eo = 0.f;
#pragma unroll
  for (int j = 0; j < CAPMAX; ++j) {
    if (j < p) {
      const float d = expf(cp - cv[j]);
      corr = fmaf(beta * d * zs[j][0], u[j], corr);
      eo = fmaf(d * zs[j][1], u[j], eo);
    }
  }
  const float un = beta * (vr - ep * y0) - corr;
  const float ov = ep * y1 + eo + kq * un;
  if (!odd) {
    o[(size_t)mat * V + row] = ov;
    const size_t slot = (((size_t)b * CAP + p) * H + hd) * V + row;
    ring_u[slot] = un;
    ring_v[slot] = vr;
  }
  if (threadIdx.x == 0) {
    ring_la[((size_t)b * CAP + p) * H + hd] = gl;
    ring_beta[((size_t)b * CAP + p) * H + hd] = beta;
  }
  if (hd % (H / G) == 0 && warp == 0)  // the key group's first head appends its key
    reinterpret_cast<float4*>(ring_k + (((size_t)b * CAP + p) * G + g) * K)[lane] = k4;
}

}  // namespace

// Launches the kernel on `stream` (the caller, gdn_step.cpp, has checked every operand: float32,
// contiguous, on one device, the shapes above; V in {64, 128}, K = 128, 1 <= CAP <= 32).
void launch_gdn_f32_step(const float* read, float* ring_la, float* ring_beta, float* ring_v,
                         float* ring_u, float* ring_k, const float* q, const float* k,
                         const float* v, const float* g, const float* beta, const int64_t* h,
                         float* o, int64_t B, int64_t H, int64_t G, int64_t V, int64_t CAP,
                         int variant, cudaStream_t stream) {
  const dim3 grid((unsigned)(B * H));
#define L(NW, CM, VA) gdn_f32_step_kernel<NW, CM, VA><<<grid, NW * 32, 0, stream>>>(           \
      read, ring_la, ring_beta, ring_v, ring_u, ring_k, q, k, v, g, beta, h, o, (int)H, (int)G, \
      (int)CAP)
#define LV(NW, CM) { if (variant == 2) L(NW, CM, 2); else if (variant == 3) L(NW, CM, 3); \
                     else L(NW, CM, 0); }
  if (V == 128) {
    if (CAP <= 16) LV(8, 16) else LV(8, 32)
  } else {
    if (CAP <= 16) LV(4, 16) else LV(4, 32)
  }
#undef LV
#undef L
}

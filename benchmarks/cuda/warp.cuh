// Warp helpers shared by the CUDA stand-ins of benchmarks/cuda/ (step_standin.cu,
// fold_standin.cu; forty-first pass of issue 15). Benchmarks' loader
// (benchmarks/_cuda_ext.py) inlines this file where a source includes it, so the extension's
// build hash follows its text; nvcc -I benchmarks/cuda compiles a source on its own.
#pragma once
#include <cuda_runtime.h>

namespace {

constexpr unsigned FULL = 0xffffffffu;

// Reduce-scatter over the warp: N partial sums per lane in, max(N / 32, 1) full sums out in
// v[0 ..]. N >= 32: lane l holds the sums of indices l * (N / 32) + j; N < 32: lane l holds
// index l >> (5 - log2 N) (the lanes that differ only in the low bits hold the same sum).
// Every sum is taken in the same butterfly order, whatever the lane.
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

// a . b in a fixed order
__device__ __forceinline__ float dot4(float4 a, float4 b) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
}

// the sum over the warp, every lane
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL, x, o);
  return x;
}

// a read-only 16-byte load; CS: with the streaming (evict-first) hint
template <bool CS>
__device__ __forceinline__ float4 ld_c(const float4* p) {
  if constexpr (CS) {
    return __ldcs(p);
  } else {
    return __ldg(p);
  }
}

}  // namespace

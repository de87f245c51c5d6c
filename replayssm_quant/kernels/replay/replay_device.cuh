// Device helpers shared by the CUDA C++ kernels of GDN's verify (gdn_verify.cu), decode step
// (gdn_step.cu) and flush (gdn_flush.cu): the headers every one of them includes, an assert
// that stays on under NDEBUG (the kernels' range checks are asserts), the 16-byte cp.async
// and the m16n8k16 bf16 mma. Built with them by cuda_verify.build: torch's ninja build
// follows nvcc's dependency files, so a change here rebuilds all three in the next process
// (not where TORCH_EXTENSION_SKIP_NVCC_GEN_DEPENDENCIES=1 turns those files off).
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
// (the range checks are asserts that must not compile away under NDEBUG)
#ifdef NDEBUG
#undef NDEBUG
#include <assert.h>
#define NDEBUG
#else
#include <assert.h>
#endif

namespace replay_device {

// 16 bytes global -> shared, asynchronously, cached in L2 only (cp.async.cg; sm_80)
__device__ __forceinline__ void cp16(void* dst, const void* src) {
  const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(src));
}

// d += A B on the tensor cores: m16n8k16, bf16 operands, FP32 accumulation (the PTX ISA's
// fragment layouts: A in a0..a3, B in b0, b1, D in d)
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace replay_device

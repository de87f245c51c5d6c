// Python binding of gdn_step.cu's launcher (kept out of the .cu file: the host code that
// throws c10::Error is compiled by the host C++ compiler, as torch's extensions do it). The
// Python wrapper (kernels/cuda/__init__.py) checks every operand first and raises ValueError
// naming it; these checks are the last line.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

void launch_gdn_f32_step(const float* read, float* ring_la, float* ring_beta, float* ring_v,
                         float* ring_u, float* ring_k, const float* q, const float* k,
                         const float* v, const float* g, const float* beta, const int64_t* h,
                         float* o, int64_t B, int64_t H, int64_t G, int64_t V, int64_t CAP,
                         int variant, cudaStream_t stream);

torch::Tensor gdn_f32_step(torch::Tensor read, torch::Tensor ring_la, torch::Tensor ring_beta,
                           torch::Tensor ring_v, torch::Tensor ring_u, torch::Tensor ring_k,
                           torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                           torch::Tensor beta, torch::Tensor h, int64_t variant) {
  TORCH_CHECK(read.is_cuda() && read.dim() == 4 && read.size(3) == 128, "gdn_f32_step: read");
  const int64_t B = read.size(0), H = read.size(1), V = read.size(2);
  const int64_t CAP = ring_la.size(1), G = ring_k.size(2);
  TORCH_CHECK((V == 64 || V == 128) && CAP >= 1 && CAP <= 32 && G >= 1 && H % G == 0,
              "gdn_f32_step: V, CAP or G");
  for (const auto& t : {read, ring_la, ring_beta, ring_v, ring_u, ring_k, q, k, v, g, beta})
    TORCH_CHECK(t.device() == read.device() && t.scalar_type() == torch::kFloat32 &&
                    t.is_contiguous(), "gdn_f32_step: operands");
  TORCH_CHECK(h.device() == read.device() && h.scalar_type() == torch::kInt64 && h.numel() == B,
              "gdn_f32_step: h");
  auto o = torch::empty({B, H, V}, read.options());
  if (B == 0 || H == 0) return o;
  const c10::cuda::CUDAGuard guard(read.device());
  launch_gdn_f32_step(read.data_ptr<float>(), ring_la.data_ptr<float>(),
                      ring_beta.data_ptr<float>(), ring_v.data_ptr<float>(),
                      ring_u.data_ptr<float>(), ring_k.data_ptr<float>(), q.data_ptr<float>(),
                      k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                      beta.data_ptr<float>(), h.data_ptr<int64_t>(), o.data_ptr<float>(), B, H,
                      G, V, CAP, (int)variant, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return o;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gdn_f32_step", &gdn_f32_step,
        "GDN decode step from an FP32 read copy (one launch; see gdn_step.cu)");
}

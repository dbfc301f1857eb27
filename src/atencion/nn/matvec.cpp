// A few rows times a weight matrix, y = x W^T + b, for decoding on a CPU (atencion/nn/matvec.py
// compiles it on first use and says when it is used).
//
// Generating one token multiplies one row (or a beam of a few) by every weight matrix of the
// model, so the time goes into reading the weights from memory. This reads each row of W once,
// from start to end, and multiplies it by every row of x while it is in the L1 cache; the output
// rows are split over torch's threads. `omp simd reduction` lets the compiler keep several vector
// accumulators per dot product (a reordered float sum, as every BLAS does).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <optional>

torch::Tensor matvec(const torch::Tensor& x, const torch::Tensor& weight, const std::optional<torch::Tensor>& bias) {
  // x: (m, k) float32; weight: (n, k) float32 contiguous; bias: (n) or none. Returns (m, n).
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "matvec: shapes (m, k) and (n, k)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "matvec: float32 only");
  TORCH_CHECK(weight.is_contiguous(), "matvec: the weight must be contiguous");
  const torch::Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1), n = weight.size(0);
  torch::Tensor y = torch::empty({m, n}, rows.options());
  const float* X = rows.data_ptr<float>();
  const float* W = weight.data_ptr<float>();
  const float* B = nullptr;
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "matvec: the bias must be float32, one per row of W");
    B = b.data_ptr<float>();
  }
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const float* w = W + o * k;
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = X + r * k;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < k; ++i) sum += w[i] * xr[i];
        Y[r * n + o] = B ? sum + B[o] : sum;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("matvec", &matvec, "x W^T + b for a few rows x");
}

// A few rows times a weight matrix, y = x W^T + b, for decoding on a CPU (atencion/nn/matvec.py
// compiles it on first use and says when it is used).
//
// Generating one token multiplies one row (or a beam of a few) by every weight matrix of the
// model, so the time goes into reading the weights from memory. This reads each row of W once,
// from start to end, and multiplies it by every row of x while it is in the L1 cache; the output
// rows are split over torch's threads. `omp simd reduction` lets the compiler keep several vector
// accumulators per dot product (a reordered float sum, as every BLAS does).
//
// matvec_int8 is the same for int8 weights (nn/quantize.py), a quarter of the bytes to read. It
// does what PyTorch's dynamic int8 linear (fbgemm) does, in the same integers: the rows are
// quantized together to 7-bit unsigned values with one scale and zero point from their range
// (reduce_range), each dot product is summed exactly in int32, and the sum is rescaled to float32.
// Where the CPU has AVX-512 VNNI, vpdpbusd multiplies and adds 64 bytes at a time.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>
#ifdef __AVX512VNNI__
#include <immintrin.h>
#endif

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

// sum_i q[i] * w[i] for 7-bit unsigned q and int8 w, exact in int32
static int32_t dot_int8(const uint8_t* q, const int8_t* w, int64_t k) {
#ifdef __AVX512VNNI__
  __m512i sum = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) sum = _mm512_dpbusd_epi32(sum, _mm512_loadu_si512(q + i), _mm512_loadu_si512(w + i));
  if (i < k) {
    const __mmask64 tail = (__mmask64(1) << (k - i)) - 1;
    sum = _mm512_dpbusd_epi32(sum, _mm512_maskz_loadu_epi8(tail, q + i), _mm512_maskz_loadu_epi8(tail, w + i));
  }
  return _mm512_reduce_add_epi32(sum);
#else
  int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < k; ++i) sum += int32_t(q[i]) * int32_t(w[i]);
  return sum;
#endif
}

torch::Tensor matvec_int8(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                          const torch::Tensor& sums, const std::optional<torch::Tensor>& bias) {
  // x: (m, k) float32; weight: (n, k) int8 contiguous, row o is W[o] / scales[o] rounded; sums: (n) int32, the
  // sum of each int8 row; bias: (n) float32 or none. Returns (m, n) float32.
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "matvec_int8: shapes (m, k) and (n, k)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "matvec_int8: float32 rows and a contiguous int8 weight");
  const int64_t n = weight.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n &&
              sums.scalar_type() == at::kInt && sums.is_contiguous() && sums.numel() == n,
              "matvec_int8: one float32 scale and one int32 sum per row of the weight");
  const torch::Tensor rows = x.contiguous();
  const int64_t m = rows.size(0), k = rows.size(1);
  const float* X = rows.data_ptr<float>();
  // the rows' quantization: fbgemm's with reduce_range (qmin 0, qmax 127; the range always holds 0)
  float lo = 0.f, hi = 0.f;
  for (int64_t i = 0; i < m * k; ++i) lo = std::min(lo, X[i]), hi = std::max(hi, X[i]);
  double scale = (double(hi) - lo) / 127;
  if (float(scale) == 0.f || std::isinf(1.f / float(scale))) scale = 0.1;
  const int32_t zero = std::clamp(int32_t(std::nearbyint(-lo / scale)), 0, 127);
  const float inverse = 1.f / float(scale);
  std::vector<uint8_t> quantized(m * k);
  for (int64_t i = 0; i < m * k; ++i)
    quantized[i] = uint8_t(std::clamp(zero + int32_t(std::nearbyint(X[i] * inverse)), 0, 127));

  torch::Tensor y = torch::empty({m, n}, rows.options());
  torch::Tensor b;
  const float* B = nullptr;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "matvec_int8: the bias must be float32, one per row of W");
    B = b.data_ptr<float>();
  }
  const uint8_t* Q = quantized.data();
  const int8_t* W = weight.data_ptr<int8_t>();
  const float* S = scales.data_ptr<float>();
  const int32_t* Z = sums.data_ptr<int32_t>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t r = 0; r < m; ++r) {  // (q - zero) . w = q . w - zero * sum(w)
        const float value = float(scale) * S[o] * float(dot_int8(Q + r * k, W + o * k, k) - zero * Z[o]);
        Y[r * n + o] = B ? value + B[o] : value;
      }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("matvec", &matvec, "x W^T + b for a few rows x");
  module.def("matvec_int8", &matvec_int8, "x W^T + b for a few rows x, W in int8 with a scale per row");
}

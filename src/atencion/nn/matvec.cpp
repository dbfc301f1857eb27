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
// quantized together to unsigned bytes with one scale and zero point from their range
// (reduce_range), each dot product is summed exactly in int32, and the sum is rescaled to float32.
// Where the CPU has AVX-512 VNNI, vpdpbusd multiplies and adds 64 bytes at a time; with AVX2, vpmaddubsw 32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifdef __AVX2__
// AVX2's mask of the first `count` (<= 8) of 8 lanes, for its masked loads and stores
static inline __m256i lanes8(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

// The vector registers the float32 kernels are written in: AVX-512's 16 floats or, on a CPU without it,
// AVX2's 8 (with FMA); SIMD is their width, 0 where there is neither (then only the portable loops below
// are compiled, and matvec.py uses PyTorch where they would have run).
#if defined(__AVX512F__)
#define SIMD 16
typedef __m512 vec;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vset(float a) { return _mm512_set1_ps(a); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
// the first `count` (< 16) floats at p, and zeros; a vector's first `count` lanes stored at p; lanes past count made 0
static inline __mmask16 lanes(int64_t count) { return __mmask16((1u << count) - 1); }
static inline vec vload_part(const float* p, int64_t count) { return _mm512_maskz_loadu_ps(lanes(count), p); }
static inline void vstore_part(float* p, vec a, int64_t count) { _mm512_mask_storeu_ps(p, lanes(count), a); }
static inline vec vkeep(vec a, int64_t count) { return _mm512_maskz_mov_ps(lanes(count), a); }
// e^x for x <= 0 (scores less their maximum): 2^n · e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its
// Taylor series to r^7 (relative error below 1e-8 before float32 rounding); 2^n by scalef, down to 0.
static inline vec vexp_nonpositive(vec x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 is below float32's least subnormal: 0 from scalef
  const vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  vec p = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SIMD 8
typedef __m256 vec;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vset(float a) { return _mm256_set1_ps(a); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vfmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vec vload_part(const float* p, int64_t count) { return _mm256_maskload_ps(p, lanes8(count)); }
static inline void vstore_part(float* p, vec a, int64_t count) { _mm256_maskstore_ps(p, lanes8(count), a); }
static inline vec vkeep(vec a, int64_t count) { return _mm256_and_ps(a, _mm256_castsi256_ps(lanes8(count))); }
// e^x for x <= 0, as above; 2^n made from its exponent bits, so for x below -87 (e^x under float32's least
// normal number, nothing next to the maximum's e^0 = 1) it gives 0.
static inline vec vexp_nonpositive(vec x) {
  const vec kept = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);  // the lanes not set to 0
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const vec n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f), r);
  vec p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(power)), kept);
}
#else
#define SIMD 0
#endif

// The bias' floats (n of them, made contiguous into `kept`), or null without a bias.
static const float* bias_data(const std::optional<torch::Tensor>& bias, int64_t n, torch::Tensor& kept,
                              const char* name) {
  if (!bias.has_value()) return nullptr;
  kept = bias->contiguous();
  TORCH_CHECK(kept.scalar_type() == at::kFloat && kept.numel() == n, name, ": the bias must be float32, one per row of W");
  return kept.data_ptr<float>();
}

// x (..., k) as rows (m, k), contiguous; and the shape (..., n) of a product of those rows: the kernels take
// and give a layer's tensors as they are, so that the caller reshapes nothing around the call.
static torch::Tensor as_rows(const torch::Tensor& x) { return x.reshape({-1, x.size(-1)}).contiguous(); }

static std::vector<int64_t> shaped(const torch::Tensor& x, int64_t n) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  return shape;
}

// Asks for the `bytes` that follow a row of W (the rows read next) PREFETCH bytes ahead, a cache line at a time,
// so that they are on their way from memory while this row is multiplied.
#ifndef PREFETCH
#define PREFETCH 2048
#endif
static inline void prefetch_ahead(const void* row, int64_t bytes) {
  const char* start = static_cast<const char*>(row) + PREFETCH;
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(start + i);
}

#if SIMD
// J rows of W at a time, o to o + J - 1, times each of the M rows of X: M·J vector accumulators, summed
// across their lanes at the end (no prefetching: asking for the next rows ahead made it slower).
template <int M, int J>
static void rows_dot_products(const float* __restrict X, int64_t k, const float* __restrict W, int64_t n,
                              int64_t o, const float* B, float* __restrict Y) {
  vec acc[M][J];
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = vzero();
  const float* w = W + o * k;
  const auto step = [&](int64_t i, auto load) {
    vec wj[J];
    for (int j = 0; j < J; ++j) wj[j] = load(w + j * k + i);
    for (int r = 0; r < M; ++r) {
      const vec x = load(X + r * k + i);
      for (int j = 0; j < J; ++j) acc[r][j] = vfmadd(x, wj[j], acc[r][j]);
    }
  };
  const int64_t whole = k - k % SIMD;
  for (int64_t i = 0; i < whole; i += SIMD) step(i, [](const float* p) { return vload(p); });
  if (whole < k) step(whole, [&](const float* p) { return vload_part(p, k - whole); });
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < J; ++j) {
      const float sum = vsum(acc[r][j]);
      Y[r * n + o + j] = B ? sum + B[o + j] : sum;
    }
}

// How many rows of W rows_dot_products takes at a time for M rows of X: four, or fewer where M·J accumulators
// and J weights would not fit AVX2's 16 registers (AVX-512 has 32).
template <int M>
constexpr int ROWS_OF_W = SIMD == 16 || M <= 2 ? 4 : 2;
#endif

// Rows [begin, end) of Y (m, n) = X (m, k) W^T + B by dot products: each row of W is read once, from start
// to end, and multiplied by every row of X while it is in the L1 cache.
static void dot_rows(const float* X, int64_t m, int64_t k, const float* W, int64_t n, const float* B, float* Y,
                     int64_t begin, int64_t end) {
#if SIMD
  // the rows of W left over one at a time by the same kernel: every output is summed in the same order,
  // whatever the rows of x and the threads' shares of W
  switch (m) {
#define ROWS(M) case M: for (; begin + ROWS_OF_W<M> <= end; begin += ROWS_OF_W<M>) \
                        rows_dot_products<M, ROWS_OF_W<M>>(X, k, W, n, begin, B, Y); \
                      for (; begin < end; ++begin) rows_dot_products<M, 1>(X, k, W, n, begin, B, Y); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5)
#undef ROWS
  }
#endif
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
}

// The same for all n rows, split over torch's threads.
static void dot_products(const float* X, int64_t m, int64_t k, const float* W, int64_t n, const float* B, float* Y) {
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) { dot_rows(X, m, k, W, n, B, Y, begin, end); });
}

torch::Tensor matvec(const torch::Tensor& x, const torch::Tensor& weight, const std::optional<torch::Tensor>& bias) {
  // x: (..., k) float32; weight: (n, k) float32 contiguous; bias: (n) or none. Returns (..., n).
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1), "matvec: shapes (..., k) and (n, k)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "matvec: float32 only");
  TORCH_CHECK(weight.is_contiguous(), "matvec: the weight must be contiguous");
  const torch::Tensor rows = as_rows(x);
  const int64_t m = rows.size(0), k = rows.size(1), n = weight.size(0);
  torch::Tensor y = torch::empty({m, n}, rows.options());
  torch::Tensor b;  // the bias made contiguous, alive while it is read
  const float* B = bias_data(bias, n, b, "matvec");
  dot_products(rows.data_ptr<float>(), m, k, weight.data_ptr<float>(), n, B, y.data_ptr<float>());
  return y.view(shaped(x, n));
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
#elif defined(__AVX2__)
  // vpmaddubsw multiplies 32 bytes of q by 32 of w and adds neighbouring products into 16-bit lanes: exact,
  // as q is 7-bit (2 · 127 · 128 < 2^15); vpmaddwd by ones adds those pairs into int32.
  __m256i sum = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i)),
                                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
  }
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
  int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1)));
  for (; i < k; ++i) total += int32_t(q[i]) * int32_t(w[i]);
  return total;
#else
  int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < k; ++i) sum += int32_t(q[i]) * int32_t(w[i]);
  return sum;
#endif
}

// The rows of x (m, k) quantized together as fbgemm's dynamic linear does with reduce_range: one
// scale and zero point from their range (which always holds 0) for 7-bit values, 0 to 127; each
// value x · (1 / scale) + zero in one fused multiply-add, rounded to the nearest (even) integer and
// clamped to 8 bits, exactly as fbgemm computes it (a separate product and sum round a value or two
// in a thousand differently). Each row is stored `stride` bytes apart, the bytes past k zero.
struct Quantized {
  std::vector<uint8_t> values;
  float scale;
  int32_t zero;
};

static Quantized quantize_rows(const float* X, int64_t m, int64_t k, int64_t stride) {
  float lo = 0.f, hi = 0.f;
  for (int64_t i = 0; i < m * k; ++i) lo = std::min(lo, X[i]), hi = std::max(hi, X[i]);
  double scale = (double(hi) - lo) / 127;
  if (float(scale) == 0.f || std::isinf(1.f / float(scale))) scale = 0.1;
  const int32_t zero = std::clamp(int32_t(std::nearbyint(-lo / scale)), 0, 127);
  const float inverse = 1.f / float(scale);
  std::vector<uint8_t> values(m * stride, 0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) {
      const int32_t value = int32_t(std::nearbyint(std::fma(X[r * k + i], inverse, float(zero))));
      values[r * stride + i] = uint8_t(std::clamp(value, 0, 255));
    }
  return {std::move(values), float(scale), zero};
}

// Rows [begin, end) of Y (m, n) = the m rows of x, quantized (Q, as quantize_rows makes them with stride k), times
// the int8 W (n, k), rescaled by S (n) and the rows' scale, + B.
static void int8_dot_rows(const Quantized& quantized, int64_t m, int64_t k, const int8_t* W, int64_t n, const float* S,
                          const int32_t* Z, const float* B, float* Y, int64_t begin, int64_t end) {
  const uint8_t* Q = quantized.values.data();
  for (int64_t o = begin; o < end; ++o) {
    prefetch_ahead(W + o * k, k);
    for (int64_t r = 0; r < m; ++r) {  // (q - zero) . w = q . w - zero * sum(w)
      const float value = quantized.scale * S[o] * float(dot_int8(Q + r * k, W + o * k, k) - quantized.zero * Z[o]);
      Y[r * n + o] = B ? value + B[o] : value;
    }
  }
}

// Y (m, n) = X (m, k), quantized, times the int8 W (n, k), rescaled, + B, split over torch's threads.
static void int8_dot_products(const float* X, int64_t m, int64_t k, const int8_t* W, int64_t n, const float* S,
                              const int32_t* Z, const float* B, float* Y) {
  const Quantized quantized = quantize_rows(X, m, k, k);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    int8_dot_rows(quantized, m, k, W, n, S, Z, B, Y, begin, end);
  });
}

torch::Tensor matvec_int8(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scales,
                          const torch::Tensor& sums, const std::optional<torch::Tensor>& bias) {
  // x: (..., k) float32; weight: (n, k) int8 contiguous, row o is W[o] / scales[o] rounded; sums: (n) int32, the
  // sum of each int8 row; bias: (n) float32 or none. Returns (..., n) float32.
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1),
              "matvec_int8: shapes (..., k) and (n, k)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "matvec_int8: float32 rows and a contiguous int8 weight");
  const int64_t n = weight.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n &&
              sums.scalar_type() == at::kInt && sums.is_contiguous() && sums.numel() == n,
              "matvec_int8: one float32 scale and one int32 sum per row of the weight");
  const torch::Tensor rows = as_rows(x);
  const int64_t m = rows.size(0), k = rows.size(1);
  torch::Tensor y = torch::empty({m, n}, rows.options());
  torch::Tensor b;  // the bias made contiguous, alive while B is read
  const float* B = bias_data(bias, n, b, "matvec_int8");
  int8_dot_products(rows.data_ptr<float>(), m, k, weight.data_ptr<int8_t>(), n, scales.data_ptr<float>(),
                    sums.data_ptr<int32_t>(), B, y.data_ptr<float>());
  return y.view(shaped(x, n));
}

// From 6 to 16 rows (a batch of sentences, a beam) reading each weight once per row no longer pays:
// the product is bound by arithmetic, not memory. matmul_panels takes the weight in panels of 16
// rows stored column by column, (n / 16, k, 16) (matvec.py makes this copy once), and keeps one
// 16-wide accumulator per row of x in registers (one AVX-512 vector, or two of AVX2's): each step loads
// 16 weights and does one fused multiply-add per row and vector, with no sums across a vector at the end.
// AVX2's 16 registers hold the accumulators of 6 rows at a time, so its panels are read once per 6 rows
// of x (from the cache after the first).

#if SIMD
constexpr int PANEL_GROUP = SIMD == 16 ? 16 : 6;  // rows of x whose accumulators fit in the registers at once

template <int M>
static void panel_product(const float* __restrict X, int64_t k, const float* __restrict panel, float* __restrict Y,
                          int64_t n, int64_t first, const float* B) {
  constexpr int V = 16 / SIMD;  // vectors per 16 weights
  vec acc[M][V];
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t i = 0; i < k; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + i * 16) + PREFETCH, _MM_HINT_T0);
    vec w[V];
    for (int v = 0; v < V; ++v) w[v] = vload(panel + i * 16 + v * SIMD);
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      const vec x = vset(X[r * k + i]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfmadd(x, w[v], acc[r][v]);
    }
  }
  const int64_t valid = std::min<int64_t>(16, n - first);  // the last panel may be partly padding
  for (int v = 0; v < V; ++v) {
    const int64_t count = std::clamp<int64_t>(valid - v * SIMD, 0, SIMD), at = first + v * SIMD;
    const vec b = B ? vload_part(B + at, count) : vzero();
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) vstore_part(Y + r * n + at, vadd(acc[r][v], b), count);
  }
}

// One panel times M rows of x, in as few groups of at most PANEL_GROUP rows as can be, of even sizes
// (16 rows on AVX2: 6, 5, 5).
template <int M>
static void panel_rows(const float* X, int64_t k, const float* panel, float* Y, int64_t n, int64_t first,
                       const float* B) {
  constexpr int G = M / ((M + PANEL_GROUP - 1) / PANEL_GROUP);  // the first group's rows
  panel_product<G>(X, k, panel, Y, n, first, B);
  if constexpr (G < M) panel_rows<M - G>(X + G * k, k, panel, Y + G * n, n, first, B);
}

#endif

#if SIMD
// Y (m, n) = X (m, k) W^T + B, W given as its rows (n, k), multiplied by dot products (up to 5 rows of X),
// or in panels (ceil(n / 16), k, 16) (up to 16): for W's rows [begin, end), or its panels [begin, end).
static void product_range(const float* X, int64_t m, int64_t k, const torch::Tensor& W, int64_t n, const float* B,
                          float* Y, int64_t begin, int64_t end) {
  if (W.dim() == 2) return dot_rows(X, m, k, W.data_ptr<float>(), n, B, Y, begin, end);
  const float* P = W.data_ptr<float>();
  switch (m) {
#define ROWS(M) case M: for (int64_t p = begin; p < end; ++p) panel_rows<M>(X, k, P + p * k * 16, Y, n, p * 16, B); \
                        break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
    ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
  }
}

// The same for all of W, split over torch's threads.
static void product(const float* X, int64_t m, int64_t k, const torch::Tensor& W, int64_t n, const float* B, float* Y) {
  at::parallel_for(0, W.size(0), W.dim() == 2 ? 16 : 1, [&](int64_t begin, int64_t end) {
    product_range(X, m, k, W, n, B, Y, begin, end);
  });
}
#endif

torch::Tensor matmul_panels(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                            const std::optional<torch::Tensor>& bias) {
  // x: (..., k) float32, at most 16 rows; panels: (ceil(n / 16), k, 16) float32 contiguous; bias: (n) or none.
  // Returns (..., n).
#if SIMD
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.numel() <= 16 * x.size(-1),
              "matmul_panels: (..., k) float32, at most 16 rows");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.scalar_type() == at::kFloat &&
              panels.size(0) == (n + 15) / 16 && panels.size(1) == x.size(-1) && panels.size(2) == 16,
              "matmul_panels: panels (ceil(n / 16), k, 16) float32");
  const torch::Tensor rows = as_rows(x);
  const int64_t m = rows.size(0), k = rows.size(1);
  torch::Tensor y = torch::empty({m, n}, rows.options());
  torch::Tensor b;  // the bias made contiguous, alive while B is read
  const float* B = bias_data(bias, n, b, "matmul_panels");
  product(rows.data_ptr<float>(), m, k, panels, n, B, y.data_ptr<float>());
  return y.view(shaped(x, n));
#else
  TORCH_CHECK(false, "matmul_panels: compiled without AVX-512 or AVX2");
#endif
}

// The same for int8 weights: panels of 16 rows in VNNI's layout, (n / 16, k / 4, 16, 4): each 64
// bytes hold 4 consecutive weights of each of 16 rows, so that vpdpbusd multiplies them by 4 bytes
// of a row of x broadcast to every lane and adds each lane's 4 products to its row's int32 sum.
// The rows are quantized as matvec_int8 quantizes them, and the sums are the same integers.

#if defined(__AVX512VNNI__)
#define INT8_PANELS 16  // rows of x whose int32 sums fit in the registers at once
#define INT8_PANELS_FROM 1  // the fewest rows of x for which the panels beat the dot products (benchmarks/matvec.py)
// acc += the byte products of u (unsigned) and s (signed), summed in fours, written in place: with the
// intrinsic, gcc copies every accumulator to another register (and some to the stack) each step.
static inline void dpbusd(__m512i& acc, __m512i u, __m512i s) {
#ifdef SIMDE_VERSION  // emulated on a CPU without VNNI (tests/avx512_by_simde.h): the intrinsic, as SIMDe defines it
  acc = _mm512_dpbusd_epi32(acc, u, s);
#else
  asm("vpdpbusd %[s], %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [s] "v"(s));
#endif
}

template <int M>
static void int8_panel_product(const uint8_t* __restrict Q, int64_t stride, const int8_t* __restrict panel,
                               float* __restrict Y, int64_t n, int64_t first, float scale, int32_t zero,
                               const float* S, const int32_t* Z, const float* B) {
  __m512i acc[M];
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < stride / 4; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + g * 64 + PREFETCH), _MM_HINT_T0);
    const __m512i w = _mm512_loadu_si512(panel + g * 64);
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      int32_t four;
      std::memcpy(&four, Q + r * stride + 4 * g, 4);
      dpbusd(acc[r], _mm512_set1_epi32(four), w);
    }
  }
  const int64_t valid = std::min<int64_t>(16, n - first);
  const __mmask16 mask = __mmask16((1u << valid) - 1);
  const __m512 scales = _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_maskz_loadu_ps(mask, S + first));
  const __m512i zeros = _mm512_mullo_epi32(_mm512_set1_epi32(zero), _mm512_maskz_loadu_epi32(mask, Z + first));
  const __m512 b = B ? _mm512_maskz_loadu_ps(mask, B + first) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r) {
    const __m512 value = _mm512_mul_ps(scales, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], zeros)));
    _mm512_mask_storeu_ps(Y + r * n + first, mask, B ? _mm512_add_ps(value, b) : value);
  }
}
#elif defined(__AVX2__)
#define INT8_PANELS 5
#define INT8_PANELS_FROM 3
// The same with AVX2: each 64 bytes of the panel are two vectors (rows 0-7, rows 8-15), and vpdpbusd's
// sum of four byte products is vpmaddubsw (pairs, exact in 16 bits for 7-bit u) then vpmaddwd by ones.
template <int M>
static void int8_panel_product(const uint8_t* __restrict Q, int64_t stride, const int8_t* __restrict panel,
                               float* __restrict Y, int64_t n, int64_t first, float scale, int32_t zero,
                               const float* S, const int32_t* Z, const float* B) {
  __m256i acc[M][2];
  for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < stride / 4; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + g * 64 + PREFETCH), _MM_HINT_T0);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + g * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + g * 64 + 32));
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      int32_t four;
      std::memcpy(&four, Q + r * stride + 4 * g, 4);
      const __m256i u = _mm256_set1_epi32(four);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u, w0), ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u, w1), ones));
    }
  }
  const int64_t valid = std::min<int64_t>(16, n - first);
  for (int v = 0; v < 2; ++v) {
    const int64_t count = std::clamp<int64_t>(valid - 8 * v, 0, 8), at = first + 8 * v;
    const __m256i mask = lanes8(count);
    const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_maskload_ps(S + at, mask));
    const __m256i zeros = _mm256_mullo_epi32(_mm256_set1_epi32(zero), _mm256_maskload_epi32(Z + at, mask));
    const __m256 b = B ? _mm256_maskload_ps(B + at, mask) : _mm256_setzero_ps();
    for (int r = 0; r < M; ++r) {
      const __m256 value = _mm256_mul_ps(scales, _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][v], zeros)));
      _mm256_maskstore_ps(Y + r * n + at, mask, B ? _mm256_add_ps(value, b) : value);
    }
  }
}
#endif

#ifdef INT8_PANELS
// One panel times M rows of x, in as few groups of at most INT8_PANELS rows as can be, of even sizes.
template <int M>
static void int8_panel_rows(const uint8_t* Q, int64_t stride, const int8_t* panel, float* Y, int64_t n, int64_t first,
                            float scale, int32_t zero, const float* S, const int32_t* Z, const float* B) {
  constexpr int G = M / ((M + INT8_PANELS - 1) / INT8_PANELS);  // the first group's rows
  int8_panel_product<G>(Q, stride, panel, Y, n, first, scale, zero, S, Z, B);
  if constexpr (G < M)
    int8_panel_rows<M - G>(Q + G * stride, stride, panel, Y + G * n, n, first, scale, zero, S, Z, B);
}
#endif

#ifdef INT8_PANELS
// Panels [begin, end) of Y (m <= 16, n) = the m rows of x, quantized (with stride 4 · ceil(k / 4)), times the int8 W
// in panels (ceil(n / 16), ceil(k / 4), 16, 4), rescaled, + B.
static void int8_panel_range(const Quantized& quantized, int64_t m, const torch::Tensor& panels, int64_t n,
                             const float* S, const int32_t* Z, const float* B, float* Y, int64_t begin, int64_t end) {
  const int64_t groups = panels.size(1), stride = 4 * groups;
  const uint8_t* Q = quantized.values.data();
  const int8_t* P = panels.data_ptr<int8_t>();
  switch (m) {
#define ROWS(M) case M: for (int64_t p = begin; p < end; ++p) \
        int8_panel_rows<M>(Q, stride, P + p * groups * 64, Y, n, p * 16, quantized.scale, quantized.zero, S, Z, B); \
    break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
    ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
  }
}

// Y (m <= 16, n) = X (m, k), quantized, times the int8 W in panels, rescaled, + B, split over torch's threads.
static void int8_panel_products(const float* X, int64_t m, int64_t k, const torch::Tensor& panels, int64_t n,
                                const float* S, const int32_t* Z, const float* B, float* Y) {
  const Quantized quantized = quantize_rows(X, m, k, 4 * panels.size(1));
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    int8_panel_range(quantized, m, panels, n, S, Z, B, Y, begin, end);
  });
}
#endif

torch::Tensor matmul_int8_panels(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                                 const torch::Tensor& scales, const torch::Tensor& sums,
                                 const std::optional<torch::Tensor>& bias) {
  // x: (..., k) float32, at most 16 rows; panels: (ceil(n / 16), ceil(k / 4), 16, 4) int8; scales, sums, bias
  // as matvec_int8's. Returns (..., n).
#ifdef INT8_PANELS
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.numel() <= 16 * x.size(-1),
              "matmul_int8_panels: (..., k) float32, at most 16 rows");
  const int64_t groups = (x.size(-1) + 3) / 4;
  TORCH_CHECK(panels.dim() == 4 && panels.is_contiguous() && panels.scalar_type() == at::kChar &&
              panels.size(0) == (n + 15) / 16 && panels.size(1) == groups && panels.size(2) == 16 && panels.size(3) == 4,
              "matmul_int8_panels: panels (ceil(n / 16), ceil(k / 4), 16, 4) int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n &&
              sums.scalar_type() == at::kInt && sums.is_contiguous() && sums.numel() == n,
              "matmul_int8_panels: one float32 scale and one int32 sum per row of the weight");
  const torch::Tensor rows = as_rows(x);
  const int64_t m = rows.size(0), k = rows.size(1);
  torch::Tensor y = torch::empty({m, n}, rows.options());
  torch::Tensor b;  // the bias made contiguous, alive while B is read
  const float* B = bias_data(bias, n, b, "matmul_int8_panels");
  int8_panel_products(rows.data_ptr<float>(), m, k, panels, n, scales.data_ptr<float>(), sums.data_ptr<int32_t>(), B,
                      y.data_ptr<float>());
  return y.view(shaped(x, n));
#else
  TORCH_CHECK(false, "matmul_int8_panels: compiled without AVX-512 VNNI or AVX2");
#endif
}

// Two more of a decoding step's small operations, which as PyTorch expressions cost several calls
// each (a few microseconds apiece) for a few hundred numbers.

// Each of the m rows of X (m, d) times G / sqrt(mean(row²) + eps), into Y.
static void rms_rows(const float* X, int64_t m, int64_t d, const float* G, float eps, float* Y) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = X + r * d;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < d; ++i) squares += row[i] * row[i];
    const float scale = 1.f / std::sqrt(squares / float(d) + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) Y[r * d + i] = row[i] * scale * G[i];
  }
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  // x: (..., d) float32 contiguous; each row of d times weight / sqrt(mean(row²) + eps), as nn.RMSNorm
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous() && x.scalar_type() == at::kFloat, "rms_norm: contiguous float32 rows");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kFloat && weight.numel() == d,
              "rms_norm: one float32 weight per feature");
  torch::Tensor y = torch::empty_like(x);
  rms_rows(x.data_ptr<float>(), d ? x.numel() / d : 0, d, weight.data_ptr<float>(), float(eps), y.data_ptr<float>());
  return y;
}

// RoPE on `heads` consecutive heads of d_k features at x: (x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin)
// on the halves of each head, with one position's cos and sin (d_k each).
static void turn_heads(float* x, int64_t heads, int64_t d_k, const float* c, const float* s) {
  const int64_t half = d_k / 2;
  for (int64_t head = 0; head < heads; ++head) {
    float* x1 = x + head * d_k;
    float* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], z = x2[i];
      x1[i] = a * c[i] - z * s[i];
      x2[i] = z * c[half + i] + a * s[half + i];
    }
  }
}

void rotate_(torch::Tensor& x, int64_t heads, int64_t d_k, const torch::Tensor& cos, const torch::Tensor& sin) {
  // x: (b, t, n) float32 contiguous, whose first heads · d_k features of each position (the queries' and
  // keys' heads, side by side) are turned in place by RoPE, with cos and sin (t, d_k) of the positions.
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.scalar_type() == at::kFloat && heads * d_k <= x.size(2) &&
              d_k % 2 == 0, "rotate_: contiguous float32 (b, t, n) with heads · d_k <= n, d_k even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.numel() == x.size(1) * d_k && sin.numel() == cos.numel(),
              "rotate_: cos and sin (t, d_k) float32");
  const int64_t b = x.size(0), t = x.size(1), n = x.size(2);
  float* X = x.data_ptr<float>();
  const float *C = cos.data_ptr<float>(), *S = sin.data_ptr<float>();
  for (int64_t row = 0; row < b * t; ++row) turn_heads(X + row * n, heads, d_k, C + (row % t) * d_k, S + (row % t) * d_k);
}

// Attention of one new query per head over the cache, the step of generation (eq. (1) for a single
// query): for each row and key/value head, the scores of its query heads (several share one key/value
// head in grouped-query attention) against every cached key, their softmax, and the weighted sum of
// the values, in one pass over the cache with no copy of it. PyTorch's fused kernel spends most of
// its time on the blocking it does for many queries.

#if SIMD
// One row's key/value head: the scores of its `per` query heads against the T keys (each query held in
// registers, D vectors), their softmax, and each head's weighted sum of the values, summed in registers.
// The keys and values (T · d floats each) are read from memory once and then from the cache.
template <int D>
static void attend_pair(const float* queries, int64_t q_step, int64_t per, const float* keys, int64_t k_step,
                        const float* values, int64_t v_step, int64_t T, float factor, float* weights, float* outputs) {
  for (int64_t j = 0; j < per; ++j) {
    vec query[D];
    for (int c = 0; c < D; ++c) query[c] = vmul(vload(queries + j * q_step + SIMD * c), vset(factor));
    float* w = weights + j * T;
    for (int64_t t = 0; t < T; ++t) {
      const float* key = keys + t * k_step;
      vec dot = vmul(query[0], vload(key));
      for (int c = 1; c < D; ++c) dot = vfmadd(query[c], vload(key + SIMD * c), dot);
      w[t] = vsum(dot);
    }
    const float top = *std::max_element(w, w + T);  // softmax over the T scores
    vec total = vzero();
    int64_t t = 0;
    for (; t + SIMD <= T; t += SIMD) {
      const vec e = vexp_nonpositive(vsub(vload(w + t), vset(top)));
      vstore(w + t, e);
      total = vadd(total, e);
    }
    if (t < T) {
      const vec e = vexp_nonpositive(vsub(vload_part(w + t, T - t), vset(top)));
      vstore_part(w + t, e, T - t);
      total = vadd(total, vkeep(e, T - t));
    }
    const vec inverse = vset(1.f / vsum(total));
    vec out[D];
    for (int c = 0; c < D; ++c) out[c] = vzero();
    for (int64_t t = 0; t < T; ++t) {
      const vec weight = vset(w[t]);
      const float* value = values + t * v_step;
      for (int c = 0; c < D; ++c) out[c] = vfmadd(weight, vload(value + SIMD * c), out[c]);
    }
    for (int c = 0; c < D; ++c) vstore(outputs + j * SIMD * D + SIMD * c, vmul(out[c], inverse));
  }
}

// attend_pair for heads of d_k = SIMD · D features, D found among those d_k of 16 to 256 in steps of 16.
template <int D = 16 / SIMD>
static void attend_head(int64_t d_k, const float* queries, int64_t q_step, int64_t per, const float* keys,
                        int64_t k_step, const float* values, int64_t v_step, int64_t T, float factor, float* weights,
                        float* outputs) {
  if constexpr (D * SIMD <= 256) {
    if (d_k == D * SIMD)
      return attend_pair<D>(queries, q_step, per, keys, k_step, values, v_step, T, factor, weights, outputs);
    attend_head<D + 16 / SIMD>(d_k, queries, q_step, per, keys, k_step, values, v_step, T, factor, weights, outputs);
  }
}
#endif

torch::Tensor attend_one(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale) {
  // q: (b, h, 1, d); k, v: (b, g, T, d), g dividing h, query head j reading key/value head j / (h / g); any
  // strides but 1 along d; d a multiple of 16 up to 256. Returns (b, h, 1, d), laid out as (b, 1, h, d) (the
  // heads side by side).
#if SIMD
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) && q.size(2) == 1 &&
              q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 && k.size(2) > 0,
              "attend_one: q (b, h, 1, d), k and v (b, g, T, d) with g dividing h");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attend_one: float32, contiguous along d");
  TORCH_CHECK(q.size(3) % 16 == 0 && q.size(3) <= 256, "attend_one: d a multiple of 16, at most 256");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(3), g = k.size(1), T = k.size(2), per = h / g;
  torch::Tensor out = torch::empty({b, 1, h, d}, q.options());
  const float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float factor = float(scale);
  at::parallel_for(0, b * g, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(per * T);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t row = pair / g, head = pair % g;
      const float* queries = Q + row * q.stride(0) + head * per * q.stride(1);
      const float* keys = K + row * k.stride(0) + head * k.stride(1);
      const float* values = V + row * v.stride(0) + head * v.stride(1);
      float* outputs = O + (row * h + head * per) * d;
      attend_head(d, queries, q.stride(1), per, keys, k.stride(2), values, v.stride(2), T, factor, weights.data(),
                  outputs);
    }
  });
  return out.transpose(1, 2);
#else
  TORCH_CHECK(false, "attend_one: compiled without AVX-512 or AVX2");
#endif
}

// A whole generation step of a Llama-style decoder in one call (nn/fused.py says when it applies): for
// each layer, x += W^O · attention(RoPE(W^QKV · RMSNorm(x))) over the cache, then x += W2 (SiLU(W1 h) ⊙ W3 h)
// with h = RMSNorm(x). The same products and kernels as the layer by layer path (dot_products,
// rms_rows, turn_heads, attend_pair), without the hundreds of small PyTorch calls between them.

static const float* optional_data(const torch::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

// One product of a layer: its weight, float32 as rows (n, k) for up to 5 rows of x or in panels (ceil(n / 16), k, 16)
// (matvec.py's panels), or int8 (nn/quantize.py) as rows or in int8 panels (ceil(n / 16), ceil(k / 4), 16, 4)
// (matvec.py's int8_panels); its bias (n), empty where there is none; for an int8 weight its scales (n) float32 and
// row sums (n) int32, empty for a float32 one.
// (hidden, as pybind11's own types are: the module's classes stay its own)
struct __attribute__((visibility("hidden"))) Product {
  torch::Tensor weight, bias, scales, sums;
};

// One Llama block's parameters, made once per layer for a decoding (nn/fused.py's plan) and read by name: the
// RMSNorm weight before attention, W^QKV (q heads, then k, then v), W^O, the RMSNorm weight before the feed-forward
// layer, W1 (gate), W3 (up) and W2 (down) of SwiGLU.
struct __attribute__((visibility("hidden"))) Layer {
  torch::Tensor attn_norm;
  Product qkv, out;
  torch::Tensor ffn_norm;
  Product gate, up, down;
};

torch::Tensor decoder_step(const torch::Tensor& x, const std::vector<std::shared_ptr<Layer>>& layer_list,
                           const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                           const torch::Tensor& starts, const torch::Tensor& cos, const torch::Tensor& sin,
                           int64_t heads, int64_t kv_heads, double eps, double scale) {
  // x: (m, d) float32, each row's new token embedded. layer_list: a Layer per layer (above), every weight float32
  // or every weight int8 (the rows of x then quantized before each product as matvec_int8 does).
  // keys, values: per layer a buffer (m, kv_heads, capacity, d_k); starts: (m) int64, row r's first starts[r]
  // positions hold its cache, its new key and value are written at starts[r] (capacity > every start), and its
  // query sees its starts[r] + 1 keys: rows of one batch at positions of their own (decode/continuous.py's
  // sequences), or all at one (a batch decoded together). cos, sin: (m, d_k), each row's new position's angles.
  // Returns the residual stream after the last layer, (m, d).
#if SIMD
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(0) >= 1 && x.size(0) <= 16,
              "decoder_step: x (m <= 16, d) float32");
  const int64_t layers = int64_t(keys.size()), m = x.size(0), d = x.size(1), d_k = d / heads;
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) == m && starts.scalar_type() == at::kLong && starts.is_contiguous(),
              "decoder_step: starts (m) int64");
  const int64_t* start_of = starts.data_ptr<int64_t>();
  const int64_t start = *std::max_element(start_of, start_of + m);
  TORCH_CHECK(*std::min_element(start_of, start_of + m) >= 0, "decoder_step: starts >= 0");
  const int64_t per = heads / kv_heads, width = (heads + 2 * kv_heads) * d_k, T = start + 1;
  TORCH_CHECK(layers >= 1 && int64_t(layer_list.size()) == layers && int64_t(values.size()) == layers &&
              heads % kv_heads == 0 && d_k * heads == d && d_k % 16 == 0 && d_k <= 256,
              "decoder_step: one Layer and one key/value buffer per layer, d_k a multiple of 16 up to 256");
  TORCH_CHECK(cos.numel() == m * d_k && sin.numel() == m * d_k && cos.is_contiguous() && sin.is_contiguous(),
              "decoder_step: cos and sin (m, d_k)");
  for (const auto& L : layer_list) TORCH_CHECK(L != nullptr, "decoder_step: a Layer per layer, not None");
  std::vector<const Layer*> P;
  for (const auto& L : layer_list) P.push_back(L.get());
  const bool quantized = P[0]->qkv.weight.scalar_type() == at::kChar;  // every weight int8, or none
  // W1's scales; W2 (d, d_ff) or its panels (ceil(d / 16), d_ff, 16)
  const int64_t d_ff = quantized ? P[0]->gate.scales.numel() : P[0]->down.weight.size(1);
  for (const Layer* L : P) {
    TORCH_CHECK(L->attn_norm.numel() == d && L->ffn_norm.numel() == d && L->attn_norm.scalar_type() == at::kFloat &&
                L->ffn_norm.scalar_type() == at::kFloat && L->attn_norm.is_contiguous() &&
                L->ffn_norm.is_contiguous(), "decoder_step: RMSNorm weights (d)");
    const std::array<std::tuple<const Product*, int64_t, int64_t>, 5> products{
        {{&L->qkv, width, d}, {&L->out, d, d}, {&L->gate, d_ff, d}, {&L->up, d_ff, d}, {&L->down, d, d_ff}}};
    for (const auto& [product, n, k] : products) {
      const torch::Tensor &W = product->weight, &B = product->bias;
      const torch::Tensor &scales = product->scales, &sums = product->sums;
      TORCH_CHECK((W.scalar_type() == at::kFloat || W.scalar_type() == at::kChar) && W.is_contiguous(),
                  "decoder_step: contiguous float32 (or int8) weights");
      TORCH_CHECK(B.scalar_type() == at::kFloat && B.is_contiguous() && (B.numel() == 0 || B.numel() == n),
                  "decoder_step: each bias (n) float32 or empty");
      TORCH_CHECK((W.scalar_type() == at::kChar) == quantized, "decoder_step: every weight int8 or none");
      if (!quantized) {
        TORCH_CHECK(((W.dim() == 2 && m <= 5 && W.size(0) == n) || (W.dim() == 3 && W.size(0) == (n + 15) / 16 &&
                     W.size(2) == 16)) && W.size(1) == k && scales.numel() == 0 && sums.numel() == 0,
                    "decoder_step: each weight (n, k) as rows for up to 5 rows of x or in panels "
                    "(ceil(n / 16), k, 16)");
        continue;
      }
#ifdef INT8_PANELS
      const bool panelled = W.dim() == 4 && W.size(0) == (n + 15) / 16 && W.size(1) == (k + 3) / 4 &&
                            W.size(2) == 16 && W.size(3) == 4;
#else
      const bool panelled = false;
#endif
      TORCH_CHECK((panelled || (W.dim() == 2 && m <= 5 && W.size(0) == n && W.size(1) == k)) &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n &&
                  sums.scalar_type() == at::kInt && sums.is_contiguous() && sums.numel() == n,
                  "decoder_step: each int8 weight (n, k) as rows for up to 5 rows of x or in int8 panels "
                  "(ceil(n / 16), ceil(k / 4), 16, 4), with n float32 scales and n int32 sums");
    }
  }
  for (int64_t l = 0; l < layers; ++l)
    for (const auto* buffer : {&keys[l], &values[l]})
      TORCH_CHECK(buffer->dim() == 4 && buffer->is_contiguous() && buffer->scalar_type() == at::kFloat &&
                  buffer->size(0) == m && buffer->size(1) == kv_heads && buffer->size(2) > start &&
                  buffer->size(3) == d_k, "decoder_step: key/value buffers (m, kv_heads, capacity > start, d_k)");
  // The whole step runs in one parallel region: each product split over the threads as product() splits it
  // (W's rows, or its panels, in equal shares), the threads meeting at a barrier where one needs another's
  // outputs. Every thread computes the RMSNorms (and, for int8 weights, quantizes the rows of x) itself,
  // into its own buffers: the same numbers, without a barrier.
  const int threads = std::max(1, at::get_num_threads());
  std::vector<float> qkv(m * width), attended(m * d), sublayer(m * d), gate(m * d_ff), up(m * d_ff);
  std::vector<float> normed(threads * m * d), weights(threads * per * T);
  torch::Tensor out = x.contiguous().clone();
  float* X = out.data_ptr<float>();
  const float *C = cos.data_ptr<float>(), *S = sin.data_ptr<float>();
  // one thread's part of the step, thread t of `team`
  auto part = [&](const int t, const int team) {
    float* own = normed.data() + t * m * d;
    // this thread's share of A (m, k) times one of a layer's weights, float32 or int8, as rows or in panels;
    // returns the outputs it wrote, [first, last)
    auto apply = [&](const Product& product, const float* A, int64_t k, int64_t n, float* Y) {
      const torch::Tensor &W = product.weight, &B = product.bias;
      const int64_t units = W.size(0), block = W.dim() == 2 ? 16 : 1, per_unit = W.dim() == 2 ? 1 : 16;
      const int64_t each = ((units + block - 1) / block + team - 1) / team * block;
      const int64_t begin = std::min(units, t * each), end = std::min(units, (t + 1) * each);
      if (!quantized) {
        product_range(A, m, k, W, n, optional_data(B), Y, begin, end);
      } else {
        const float* scales = product.scales.data_ptr<float>();
        const int32_t* sums = product.sums.data_ptr<int32_t>();
        const Quantized q = quantize_rows(A, m, k, W.dim() == 4 ? 4 * W.size(1) : k);
#ifdef INT8_PANELS
        if (W.dim() == 4) int8_panel_range(q, m, W, n, scales, sums, optional_data(B), Y, begin, end);
        else
#endif
        int8_dot_rows(q, m, k, W.data_ptr<int8_t>(), n, scales, sums, optional_data(B), Y, begin, end);
      }
      return std::pair<int64_t, int64_t>(std::min(n, begin * per_unit), std::min(n, end * per_unit));
    };
    // x += the sublayer's outputs [first, last) of each row
    auto add = [&](std::pair<int64_t, int64_t> outputs) {
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = outputs.first; i < outputs.second; ++i) X[r * d + i] += sublayer[r * d + i];
    };
    for (int64_t l = 0; l < layers; ++l) {
      const Layer& L = *P[l];
      float *K = keys[l].data_ptr<float>(), *V = values[l].data_ptr<float>();
      const int64_t capacity = keys[l].size(2);
      rms_rows(X, m, d, L.attn_norm.data_ptr<float>(), float(eps), own);
      apply(L.qkv, own, d, width, qkv.data());
#pragma omp barrier
#pragma omp single
      for (int64_t r = 0; r < m; ++r) {
        float* row = qkv.data() + r * width;
        turn_heads(row, heads + kv_heads, d_k, C + r * d_k, S + r * d_k);
        for (int64_t j = 0; j < kv_heads; ++j) {
          const int64_t at = ((r * kv_heads + j) * capacity + start_of[r]) * d_k;
          std::memcpy(K + at, row + (heads + j) * d_k, d_k * sizeof(float));
          std::memcpy(V + at, row + (heads + kv_heads + j) * d_k, d_k * sizeof(float));
        }
      }
#pragma omp for schedule(static)
      for (int64_t pair = 0; pair < m * kv_heads; ++pair) {
        const int64_t r = pair / kv_heads, j = pair % kv_heads;
        const float* queries = qkv.data() + r * width + j * per * d_k;
        const float* k = K + (r * kv_heads + j) * capacity * d_k;
        const float* v = V + (r * kv_heads + j) * capacity * d_k;
        float* o = attended.data() + r * d + j * per * d_k;
        attend_head(d_k, queries, d_k, per, k, d_k, v, d_k, start_of[r] + 1, float(scale), weights.data() + t * per * T,
                    o);
      }
      add(apply(L.out, attended.data(), d, d, sublayer.data()));
#pragma omp barrier
      rms_rows(X, m, d, L.ffn_norm.data_ptr<float>(), float(eps), own);
      const auto [first, last] = apply(L.gate, own, d, d_ff, gate.data());
      apply(L.up, own, d, d_ff, up.data());  // the same share of W3's rows: the same outputs
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = r * d_ff + first; i < r * d_ff + last; ++i)
          gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];  // SiLU(W1 h) ⊙ W3 h
#pragma omp barrier
      add(apply(L.down, gate.data(), d_ff, d, sublayer.data()));
#pragma omp barrier
    }
  };
  if (threads == 1) {
    part(0, 1);  // the same code without a parallel region, its barriers and single and for constructs orphaned
  } else {
#pragma omp parallel num_threads(threads)
    part(omp_get_thread_num(), omp_get_num_threads());
  }
  return out;
#else
  TORCH_CHECK(false, "decoder_step: compiled without AVX-512 or AVX2");
#endif
}

// The kernels run without Python's lock (their arguments are tensors, read and written by ATen alone), so
// that the server's event loop answers clients while a model's thread decodes (serve/, decode/continuous.py).
#define RELEASED pybind11::call_guard<pybind11::gil_scoped_release>()

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("attend_one", &attend_one, "attention of one query per head over a cache", RELEASED);
  pybind11::class_<Product>(module, "Product", "one product of a layer: weight, bias, int8 scales and sums")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>(), pybind11::arg("weight"),
           pybind11::arg("bias"), pybind11::arg("scales"), pybind11::arg("sums"))
      .def_readonly("weight", &Product::weight)
      .def_readonly("bias", &Product::bias)
      .def_readonly("scales", &Product::scales)
      .def_readonly("sums", &Product::sums);
  pybind11::class_<Layer, std::shared_ptr<Layer>>(module, "Layer", "one Llama block's parameters for decoder_step")
      .def(pybind11::init<torch::Tensor, Product, Product, torch::Tensor, Product, Product, Product>(),
           pybind11::arg("attn_norm"), pybind11::arg("qkv"), pybind11::arg("out"), pybind11::arg("ffn_norm"),
           pybind11::arg("gate"), pybind11::arg("up"), pybind11::arg("down"))
      .def_readonly("attn_norm", &Layer::attn_norm)
      .def_readonly("qkv", &Layer::qkv)
      .def_readonly("out", &Layer::out)
      .def_readonly("ffn_norm", &Layer::ffn_norm)
      .def_readonly("gate", &Layer::gate)
      .def_readonly("up", &Layer::up)
      .def_readonly("down", &Layer::down);
  module.def("decoder_step", &decoder_step, "a generation step of a Llama-style decoder through all its layers",
             RELEASED);
  module.def("matvec", &matvec, "x W^T + b for a few rows x", RELEASED);
  module.def("matvec_int8", &matvec_int8, "x W^T + b for a few rows x, W in int8 with a scale per row", RELEASED);
  module.def("rms_norm", &rms_norm, "nn.RMSNorm's rows", RELEASED);
  module.def("rotate_", &rotate_, "RoPE on the first heads of each position, in place", RELEASED);
  module.def("matmul_panels", &matmul_panels, "x W^T + b for up to 16 rows x, W in panels of 16 rows", RELEASED);
  module.def("matmul_int8_panels", &matmul_int8_panels, "matvec_int8's product for up to 16 rows, W in VNNI panels",
             RELEASED);
  module.attr("simd") = SIMD;  // the float32 kernels' vector width: 16 (AVX-512), 8 (AVX2) or 0
#ifdef INT8_PANELS
  module.attr("int8_panels_from") = INT8_PANELS_FROM;  // rows from which int8 layers use the panels
#else
  module.attr("int8_panels_from") = 0;
#endif
}

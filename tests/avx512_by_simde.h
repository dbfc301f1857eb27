// Included before src/atencion/nn/matvec.cpp (g++'s -include, through ATENCION_MATVEC_CFLAGS) to run its
// AVX-512 and VNNI branches on a CPU that has only AVX2: SIMDe (SIMD Everywhere, Debian's libsimde-dev)
// defines every _mm512_* intrinsic in portable code, and the two macros below then select those branches.
// Correctness only: emulated vectors are no measure of speed. tests/test_matvec.py's
// test_the_avx512_kernels_run_emulated builds the kernel so and runs the kernel tests against it.
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

// The intrinsics matvec.cpp uses that SIMDe 0.7.4 lacks, lane by lane as Intel's guide defines them. A
// masked load reads no lane outside its mask (the kernels rely on it at the ends of rows).
static inline simde__m512 atencion_cvtepi32_ps(simde__m512i a) {
  const simde__m512i_private a_ = simde__m512i_to_private(a);
  simde__m512_private r;
  for (int i = 0; i < 16; ++i) r.f32[i] = float(a_.i32[i]);
  return simde__m512_from_private(r);
}
static inline simde__m512 atencion_maskz_loadu_ps(uint16_t k, const void* p) {
  simde__m512_private r;
  for (int i = 0; i < 16; ++i) r.f32[i] = (k >> i) & 1 ? static_cast<const float*>(p)[i] : 0.f;
  return simde__m512_from_private(r);
}
static inline simde__m512i atencion_maskz_loadu_epi32(uint16_t k, const void* p) {
  simde__m512i_private r;
  for (int i = 0; i < 16; ++i) r.i32[i] = (k >> i) & 1 ? static_cast<const int32_t*>(p)[i] : 0;
  return simde__m512i_from_private(r);
}
static inline simde__m512i atencion_maskz_loadu_epi8(uint64_t k, const void* p) {
  simde__m512i_private r;
  for (int i = 0; i < 64; ++i) r.i8[i] = (k >> i) & 1 ? static_cast<const int8_t*>(p)[i] : int8_t(0);
  return simde__m512i_from_private(r);
}
static inline void atencion_mask_storeu_ps(void* p, uint16_t k, simde__m512 a) {
  const simde__m512_private a_ = simde__m512_to_private(a);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) static_cast<float*>(p)[i] = a_.f32[i];
}
// the sums in the order of GCC's own _mm512_reduce_add_ps: halves added, 256, 128, 64 then 32 bits wide
static inline float atencion_reduce_add_ps(simde__m512 a) {
  simde__m512_private a_ = simde__m512_to_private(a);
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) a_.f32[i] = a_.f32[i] + a_.f32[i + width];
  return a_.f32[0];
}
static inline int32_t atencion_reduce_add_epi32(simde__m512i a) {
  const simde__m512i_private a_ = simde__m512i_to_private(a);
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) sum += a_.i32[i];
  return sum;
}
#define _mm512_cvtepi32_ps(a) atencion_cvtepi32_ps(a)
#define _mm512_maskz_loadu_ps(k, p) atencion_maskz_loadu_ps(k, p)
#define _mm512_maskz_loadu_epi32(k, p) atencion_maskz_loadu_epi32(k, p)
#define _mm512_maskz_loadu_epi8(k, p) atencion_maskz_loadu_epi8(k, p)
#define _mm512_mask_storeu_ps(p, k, a) atencion_mask_storeu_ps(p, k, a)
#define _mm512_reduce_add_ps(a) atencion_reduce_add_ps(a)
#define _mm512_reduce_add_epi32(a) atencion_reduce_add_epi32(a)

#define __AVX512F__ 1
#define __AVX512VNNI__ 1

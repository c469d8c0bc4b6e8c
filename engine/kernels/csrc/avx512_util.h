// Helpers shared by our AVX-512 CPU kernels: 16 floats from fp32 or bf16 memory, and back;
// e^x.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace specserve {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {  // round to nearest even, as torch does
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  u = _mm512_mask_mov_epi32(u, nan, _mm512_set1_epi32(0x7fc00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

// v as the dtype of T would hold it (rounded to nearest even for bf16), back in fp32: what
// torch's op in that dtype rounds its result to before the next op reads it.
inline __m512 rounded(const float*, __m512 v) { return v; }
inline __m512 rounded(const at::BFloat16*, __m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  u = _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(u), nan, v);
}

// e^x for x <= 0 (scores minus their max): 2^n * p(r), |r| <= ln2 / 2, a degree-6 polynomial
// (relative error ~1e-7); below -87 it is 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_mask_mov_ps(y, tiny, _mm512_setzero_ps());
}

}  // namespace specserve

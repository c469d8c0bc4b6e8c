// The element-wise work between a decoder layer's matmuls, fused per row on the CPU (AVX-512):
// RMSNorm (with the residual add before it), rotary embedding, SiLU(gate) x up. Called by the
// lean forward (engine/models/lean_forward.py) through engine/kernels/fused.py, which says what
// each computes against torch's ops and how exact it is.
//
// Every row is computed on its own, in one fixed order (16 lanes, then a fixed reduction), so a
// row's bits never depend on the other rows of the call or on how the rows are split over
// threads: batch-invariant by construction. Rows are spread over torch's threads only where a
// call has enough of them to pay for it (a prompt chunk); a decode step's few rows run on the
// calling thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512_util.h"

#include <cmath>
#include <cstdint>

namespace {

using specserve::exp16;
using specserve::load16;
using specserve::rounded;
using specserve::store16;

constexpr int64_t kGrainElements = 1 << 16;  // elements a thread takes at least

template <typename F>
void rows_of(int64_t M, int64_t width, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1));
  if (M <= grain) {
    for (int64_t m = 0; m < M; ++m) f(m);
    return;
  }
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) f(m);
  });
}

// One row: h = T(x + d) (d null: h = x) stored to hout (null: not stored), then
// y = T(w * T(h * r)) with r = 1 / sqrt(mean(h^2) + eps) in fp32, as transformers' RMSNorm
// rounds (the normalized row to T, then the product with the weight).
template <typename T>
inline void norm_row(const T* x, const T* d, const T* w, T* hout, T* y, int64_t K, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 h = load16(x + k);
    if (d) {
      h = rounded(x, _mm512_add_ps(h, load16(d + k)));
      store16(hout + k, h);
    }
    ss = _mm512_fmadd_ps(h, h, ss);
  }
  const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(K) + eps);
  const __m512 vr = _mm512_set1_ps(r);
  const T* h = d ? hout : x;
  for (int64_t k = 0; k < K; k += 16) {
    __m512 n = rounded(x, _mm512_mul_ps(load16(h + k), vr));
    store16(y + k, _mm512_mul_ps(load16(w + k), n));
  }
}

// One row of SiLU(g) x u, rounded as torch's two ops are: T(T(silu(g)) * u).
template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* y, int64_t K) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t k = 0; k < K; k += 16) {
    __m512 x = load16(g + k);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_and_ps(x, sign)));  // e^-|x|
    __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
    __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 sig = _mm512_mask_mul_ps(inv, neg, inv, e);  // x < 0: e / (1 + e)
    __m512 s = rounded(g, _mm512_mul_ps(x, sig));
    store16(y + k, _mm512_mul_ps(s, load16(u + k)));
  }
}

// One row of rotary embedding over H heads of D, in place: for i < D/2,
// x[i] <- T(T(x[i] c[i]) - T(x[i+D/2] s[i])), x[i+D/2] <- T(T(x[i+D/2] c[i+D/2]) + T(x[i] s[i+D/2]))
// (transformers' q * cos + rotate_half(q) * sin, each op rounded to T as torch's are).
template <typename T>
inline void rotary_row(T* x, const T* c, const T* s, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H; ++h) {
    T* xh = x + h * D;
    for (int64_t i = 0; i < half; i += 16) {
      __m512 a = load16(xh + i), b = load16(xh + half + i);
      __m512 ca = rounded(x, _mm512_mul_ps(a, load16(c + i)));
      __m512 sb = rounded(x, _mm512_mul_ps(b, load16(s + i)));
      __m512 cb = rounded(x, _mm512_mul_ps(b, load16(c + half + i)));
      __m512 sa = rounded(x, _mm512_mul_ps(a, load16(s + half + i)));
      store16(xh + i, _mm512_sub_ps(ca, sb));
      store16(xh + half + i, _mm512_add_ps(cb, sa));
    }
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be a [M, K] matrix of unit stride");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16,
              name, " must be fp32 or bf16");
  TORCH_CHECK(t.size(1) % 16 == 0, name, ": the row length must be a multiple of 16");
}

template <typename F>
void dispatch(const torch::Tensor& t, const F& f) {
  if (t.scalar_type() == torch::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<at::BFloat16*>(nullptr));
  }
}

}  // namespace

// x [M, K], weight [K] -> T(weight * T(x * rsqrt(mean(x^2) + eps))) per row.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
              weight.scalar_type() == x.scalar_type(), "weight: [K] in x's dtype");
  auto y = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t K = x.size(1), sx = x.stride(0);
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(weight.data_ptr());
    T* yp = static_cast<T*>(y.data_ptr());
    rows_of(x.size(0), K, [&](int64_t m) {
      norm_row<T>(xp + m * sx, nullptr, wp, nullptr, yp + m * K, K, static_cast<float>(eps));
    });
  });
  return y;
}

// h, d [M, K] -> (T(h + d), its RMSNorm as rms_norm's): the residual add and the next norm.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor d, torch::Tensor weight,
                                        double eps) {
  check_rows(h, "h");
  check_rows(d, "d");
  TORCH_CHECK(h.sizes() == d.sizes() && h.scalar_type() == d.scalar_type(), "h and d differ");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1) &&
              weight.scalar_type() == h.scalar_type(), "weight: [K] in h's dtype");
  const int64_t M = h.size(0), K = h.size(1);
  auto out = torch::empty({M, K}, h.options());
  auto y = torch::empty({M, K}, h.options());
  dispatch(h, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* hp = static_cast<const T*>(h.data_ptr());
    const T* dp = static_cast<const T*>(d.data_ptr());
    const T* wp = static_cast<const T*>(weight.data_ptr());
    T* op = static_cast<T*>(out.data_ptr());
    T* yp = static_cast<T*>(y.data_ptr());
    rows_of(M, K, [&](int64_t m) {
      norm_row<T>(hp + m * h.stride(0), dp + m * d.stride(0), wp, op + m * K, yp + m * K, K,
                  static_cast<float>(eps));
    });
  });
  return {out, y};
}

// gate, up [M, I] (rows of unit stride, e.g. the halves of one merged projection) -> [M, I].
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
              "gate and up differ");
  const int64_t M = gate.size(0), K = gate.size(1);
  auto y = torch::empty({M, K}, gate.options());
  dispatch(gate, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* gp = static_cast<const T*>(gate.data_ptr());
    const T* up_ = static_cast<const T*>(up.data_ptr());
    T* yp = static_cast<T*>(y.data_ptr());
    rows_of(M, K, [&](int64_t m) {
      silu_mul_row<T>(gp + m * gate.stride(0), up_ + m * up.stride(0), yp + m * K, K);
    });
  });
  return y;
}

// x [T, H * D] (rows of unit stride: the query or key part of a merged projection), cos and
// sin [T, D]: rotary embedding in place.
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t head_dim) {
  check_rows(x, "x");
  TORCH_CHECK(head_dim % 32 == 0 && x.size(1) % head_dim == 0, "head_dim: a multiple of 32");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
              cos.size(1) == head_dim && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin: [T, head_dim] in x's dtype");
  const int64_t H = x.size(1) / head_dim;
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xp = static_cast<T*>(x.data_ptr());
    const T* cp = static_cast<const T*>(cos.data_ptr());
    const T* sp = static_cast<const T*>(sin.data_ptr());
    rows_of(x.size(0), x.size(1), [&](int64_t m) {
      rotary_row<T>(xp + m * x.stride(0), cp + m * head_dim, sp + m * head_dim, H, head_dim);
    });
  });
}

// The keyed uniforms of seeded sampling (engine/sample/keys.py stream_uniform): row r, column
// j is draw j + 1 of the SplitMix64 stream that starts at keys[r], x = keys[r] + (j + 1) gamma
// (mod 2^64) through the finalizer, its top 23 bits + 1/2 over 2^23. Integer arithmetic and
// one exact float conversion, so the bits equal the torch and Triton versions' everywhere.
constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull, kMix1 = 0xBF58476D1CE4E5B9ull,
                   kMix2 = 0x94D049BB133111EBull;
constexpr int kUniformBits = 23;

inline float keyed_uniform(uint64_t x) {
  x ^= x >> 30;
  x *= kMix1;
  x ^= x >> 27;
  x *= kMix2;
  x ^= x >> 31;
  return (static_cast<float>(static_cast<int32_t>(x >> (64 - kUniformBits))) + 0.5f) *
         (1.f / static_cast<float>(1 << kUniformBits));
}

inline __m256 keyed_uniform8(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 30));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64(static_cast<int64_t>(kMix1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 27));
  x = _mm512_mullo_epi64(x, _mm512_set1_epi64(static_cast<int64_t>(kMix2)));
  x = _mm512_xor_si512(x, _mm512_srli_epi64(x, 31));
  const __m256 top = _mm512_cvtepi64_ps(_mm512_srli_epi64(x, 64 - kUniformBits));
  return _mm256_mul_ps(_mm256_add_ps(top, _mm256_set1_ps(0.5f)),
                       _mm256_set1_ps(1.f / static_cast<float>(1 << kUniformBits)));
}

void keyed_row(uint64_t key, float* out, int64_t n) {
  // lanes j .. j + 7 hold key + (j + 1 + lane) gamma
  __m512i x = _mm512_add_epi64(
      _mm512_set1_epi64(static_cast<int64_t>(key)),
      _mm512_mullo_epi64(_mm512_set_epi64(8, 7, 6, 5, 4, 3, 2, 1),
                         _mm512_set1_epi64(static_cast<int64_t>(kGamma))));
  const __m512i step = _mm512_set1_epi64(static_cast<int64_t>(8 * kGamma));
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(out + j, keyed_uniform8(x));
    x = _mm512_add_epi64(x, step);
  }
  for (; j < n; ++j) out[j] = keyed_uniform(key + static_cast<uint64_t>(j + 1) * kGamma);
}

// keys [R] int64 (the bit patterns of the streams' states) -> [R, n] float32.
torch::Tensor keyed_uniforms(torch::Tensor keys, int64_t n) {
  TORCH_CHECK(keys.device().is_cpu() && keys.dim() == 1 && keys.is_contiguous() &&
                  keys.scalar_type() == torch::kInt64,
              "keys: a contiguous int64 vector on the CPU");
  TORCH_CHECK(n >= 0, "n: at least 0");
  const int64_t R = keys.size(0);
  auto out = torch::empty({R, n}, keys.options().dtype(torch::kFloat32));
  const int64_t* kp = keys.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  rows_of(R, n, [&](int64_t r) { keyed_row(static_cast<uint64_t>(kp[r]), op + r * n, n); });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm per row (AVX-512)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "residual add then RMSNorm per row (AVX-512)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "SiLU(gate) x up per row (AVX-512)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rotary_", &rotary_, "rotary embedding in place per row (AVX-512)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("keyed_uniforms", &keyed_uniforms, "seeded sampling's keyed uniforms (AVX-512)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  // the functions' addresses, for decode_layers.cpp's loop (the same code, hence the same bits)
  m.attr("rms_norm_address") = reinterpret_cast<uintptr_t>(&rms_norm);
  m.attr("add_rms_norm_address") = reinterpret_cast<uintptr_t>(&add_rms_norm);
  m.attr("silu_mul_address") = reinterpret_cast<uintptr_t>(&silu_mul);
  m.attr("rotary_address") = reinterpret_cast<uintptr_t>(&rotary_);
}

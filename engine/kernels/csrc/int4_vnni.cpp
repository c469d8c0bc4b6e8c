// int4 weights x int8 activations on AVX-512 VNNI: the CPU kernel of Int4Linear
// (engine/kernels/quant_linear.py says what it computes and how exact it is).
//
// Weights, packed once (`pack_vnni` in quant_linear.py): output rows in blocks of 16, input
// features in groups of 32. For block b and group g, 256 bytes: 4 parts p of 64 bytes; byte
// 4*j + i of part p holds, for the block's row j, the code of feature g*32 + p*8 + i in its
// low nibble and that of feature g*32 + p*8 + 4 + i in its high nibble. A part is then two
// operands of `vpdpbusd` (16 rows x 4 features each, codes as unsigned bytes) against 4
// activation bytes broadcast to every lane.
// Each group's scale and offset per row, in one of two forms:
// - compact (a GGUF Q4_K layer, and our own round-to-nearest ones): [blocks, groups, 32]
//   bytes, the 16 rows' scales as unsigned multiples (0..255) of a unit, then their offsets as
//   signed multiples (-127..127) of another; the units fp16, [blocks, ceil(groups / 8), 32]
//   (16 scale units, 16 offset units), one per row and run of 8 groups (256 inputs: Q4_K's
//   super-block, whose d and dmin they are). 36 bytes of them per 256 of codes, not 64: a
//   decode step streams 7.5% fewer bytes. scale = unit * multiple is exact in fp32.
// - plain (any other values): fp16, [blocks, groups, 32], the 16 scales then the 16 offsets;
//   no units (an empty tensor).
//
// Activations are quantized per row and group of 32: a = round(x * 127 / max|x|) as int8
// with d = max|x| / 127, and s = the exact fp32 sum of the group's x. Then
//   y[m, n] = sum_g  scale[n, g] * d[m, g] * (sum_k q[n, k] a[m, k])  +  offset[n, g] * s[m, g]
// A row's result depends on its own activations only, in a fixed order: the kernel is
// batch-invariant by construction.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512_util.h"

#include <algorithm>
#include <cstdint>

namespace {

using specserve::load16;
using specserve::store16;

constexpr int kGroup = 32;
constexpr int kBlock = 16;
constexpr int kRows = 8;  // activation rows per pass over a block's weights (registers)
constexpr int kPrefetch = 8;  // groups of codes (256 bytes each) prefetched ahead

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* a, float* d, float* s) {
  const int64_t G = K / kGroup;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const T* xp = x + m * K + g * kGroup;
      __m512 v0 = load16(xp), v1 = load16(xp + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign),
                                                      _mm512_and_ps(v1, sign)));
      float inv = amax > 0.f ? 127.f / amax : 0.f;
      __m512 vi = _mm512_set1_ps(inv);
      __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vi)));
      __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vi)));
      int8_t* ap = a + m * K + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ap), q0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ap + 16), q1);
      d[m * G + g] = amax / 127.f;
      s[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    }
  }
}

// One block's scales and offsets, group by group (see the layouts above).
struct PlainScales {
  const at::Half* p;  // [groups, 32] fp16
  inline void at(int64_t g, __m512& scale, __m512& offset) {
    const __m256i* q = reinterpret_cast<const __m256i*>(p + g * 32);
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(q));
    offset = _mm512_cvtph_ps(_mm256_loadu_si256(q + 1));
  }
};

struct CompactScales {
  const uint8_t* p;     // [groups, 32] multiples
  const at::Half* u;    // [ceil(groups / 8), 32] fp16 units
  __m512 su, ou;
  inline void at(int64_t g, __m512& scale, __m512& offset) {
    if ((g & 7) == 0) {
      const __m256i* q = reinterpret_cast<const __m256i*>(u + (g >> 3) * 32);
      su = _mm512_cvtph_ps(_mm256_loadu_si256(q));
      ou = _mm512_cvtph_ps(_mm256_loadu_si256(q + 1));
    }
    const __m128i* m = reinterpret_cast<const __m128i*>(p + g * 32);
    // an 8-bit integer times an fp16 unit: exact in fp32
    scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(m))), su);
    offset = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(m + 1))), ou);
  }
};

// MR rows of activations against one block of 16 output rows, every group.
template <int MR, typename T, typename Scales>
inline void block_rows(const uint8_t* w, Scales sc, const float* bias,
                       const int8_t* a, const float* d, const float* s, int64_t K, int64_t G,
                       T* y, int64_t N, int64_t n0) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * 256;
    // the codes kPrefetch groups ahead (past this block: the next one, which this thread
    // takes next), into L1: the hardware prefetcher alone left the weights' stream at 20 GB/s
    // of this machine's 26-28 (one row; 15 at five), software prefetch reaches 25 (22)
    for (int line = 0; line < 4; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetch * 256 + line * 64), _MM_HINT_T0);
    __m512i wv[8];
    for (int p = 0; p < 4; ++p) {
      __m512i v = _mm512_loadu_si512(wg + p * 64);
      wv[2 * p] = _mm512_and_si512(v, low);
      wv[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    __m512 scale, offset;
    sc.at(g, scale, offset);
    for (int r = 0; r < MR; ++r) {
      const int32_t* ar = reinterpret_cast<const int32_t*>(a + r * K + g * kGroup);
      // CH independent chains of dot products (vpdpbusd's latency, not its throughput, would
      // bound a single chain of 8 when few rows share the weights)
      constexpr int CH = MR <= 2 ? 4 : MR <= 4 ? 2 : 1;
      __m512i part[CH];
      for (int c = 0; c < CH; ++c) part[c] = _mm512_setzero_si512();
      for (int q = 0; q < 8; ++q)
        part[q % CH] = _mm512_dpbusd_epi32(part[q % CH], wv[q], _mm512_set1_epi32(ar[q]));
      __m512i dot = part[0];
      for (int c = 1; c < CH; ++c) dot = _mm512_add_epi32(dot, part[c]);
      // one fma, written out: a compiler left to contract a mul and an add may or may not
      // (gcc did: these are the bits it gave), and the bits must not depend on the compiler
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                               _mm512_mul_ps(scale, _mm512_set1_ps(d[r * G + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(s[r * G + g]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    __m512 v = bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias + n0)) : acc[r];
    store16(y + r * N + n0, v);
  }
}

// scales(b): block b's Scales
template <typename T, typename BlockScales>
void run(const T* x, const uint8_t* w, BlockScales scales, const float* bias,
         T* y, int64_t M, int64_t K, int64_t N) {
  const int64_t G = K / kGroup, blocks = N / kBlock;
  std::vector<int8_t> a(M * K);
  std::vector<float> d(M * G), s(M * G);
  quantize_rows(x, M, K, a.data(), d.data(), s.data());
  // each thread takes whole blocks of outputs; every row of a block in the same loop
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = w + b * G * 256;
      const auto sb = scales(b);
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t mr = std::min<int64_t>(kRows, M - m);
        const int8_t* am = a.data() + m * K;
        const float* dm = d.data() + m * G;
        const float* sm = s.data() + m * G;
        T* ym = y + m * N;
        const int64_t n0 = b * kBlock;
        switch (mr) {
#define ROWS(R) case R: block_rows<R>(wb, sb, bias, am, dm, sm, K, G, ym, N, n0); break;
          ROWS(8) ROWS(7) ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2) ROWS(1)
#undef ROWS
        }
      }
    }
  });
}

template <typename T>
void dispatch(const T* x, const uint8_t* w, const torch::Tensor& groups, const torch::Tensor& units,
              const float* bias, T* y, int64_t M, int64_t K, int64_t N) {
  const int64_t G = K / kGroup;
  if (units.numel()) {
    const uint8_t* p = groups.data_ptr<uint8_t>();
    const at::Half* u = units.data_ptr<at::Half>();
    const int64_t S = (G + 7) / 8;
    run(x, w, [=](int64_t b) { return CompactScales{p + b * G * 32, u + b * S * 32}; }, bias,
        y, M, K, N);
  } else {
    const at::Half* p = groups.data_ptr<at::Half>();
    run(x, w, [=](int64_t b) { return PlainScales{p + b * G * 32}; }, bias, y, M, K, N);
  }
}

}  // namespace

// x [M, K] fp32 or bf16 (contiguous); packed [N/16, K/32, 256] uint8; groups and units: the
// scales and offsets in the compact form (groups [N/16, K/32, 32] uint8, units
// [N/16, ceil(K/256), 32] fp16) or the plain one (groups [N/16, K/32, 32] fp16, units empty);
// bias [N] fp32 or empty. Returns [M, N] in x's dtype.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor groups,
                          torch::Tensor units, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] matrix");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "packed codes");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kBlock;
  TORCH_CHECK(K % kGroup == 0 && packed.size(1) * kGroup == K && packed.size(2) == 256,
              "packed codes do not match the input features");
  const int64_t G = K / kGroup;
  TORCH_CHECK(groups.is_contiguous() && groups.numel() == N / kBlock * G * 32,
              "scales do not match the codes");
  if (units.numel()) {
    TORCH_CHECK(groups.scalar_type() == torch::kUInt8 && units.scalar_type() == torch::kHalf
                && units.is_contiguous() && units.numel() == N / kBlock * ((G + 7) / 8) * 32,
                "compact scales: uint8 multiples and fp16 units per 8 groups");
  } else {
    TORCH_CHECK(groups.scalar_type() == torch::kHalf, "fp16 scales and offsets");
  }
  const float* b = nullptr;
  if (bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat && bias.numel() == N, "fp32 bias of N");
    b = bias.data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == torch::kFloat) {
    dispatch(x.data_ptr<float>(), w, groups, units, b, y.data_ptr<float>(), M, K, N);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
    dispatch(x.data_ptr<at::BFloat16>(), w, groups, units, b, y.data_ptr<at::BFloat16>(), M, K,
             N);
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "int4 weights x int8 activations (AVX-512 VNNI)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  // the function's address, for decode_layers.cpp's loop (the same code, hence the same bits)
  m.attr("int4_linear_address") = reinterpret_cast<uintptr_t>(&int4_linear);
}

// Attention of single query rows over the paged KV cache, on the CPU (AVX-512): the rows of
// generated tokens (decode, verification of drafts) in engine/attention/paged.py.
//
// Each row r attends to pos[r] + 1 keys of its sequence, read in place through the row's block
// table (no gather, no padding): key j at position j, except a token tree's node
// (engine/batch.py), whose keys from tree_from[r] on are its ancestors' and its own, at
// positions tree_pos[r][j - tree_from[r]]. The keys are visited in that order (a node's are the
// same path's as a chain), so a node gets the bits of the same tokens verified as a chain. A
// row's result depends only on its query and those keys, computed in one fixed order (scores
// key by key, max, exp and sum in a fixed vector order, the weighted sum of values key by key),
// whatever the other rows of the call: batch-invariant by construction, and the same for a row
// of a 1-token decode step and of a 1 + k verification step. Tasks are (row, kv head) pairs
// spread over torch's threads; a task computes whole rows, so the split never changes a result.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx512_util.h"

#include <cstdint>
#include <vector>

namespace {

using specserve::exp16;
using specserve::load16;
using specserve::store16;

constexpr int kMaxChunks = 16;  // head_dim up to 256

template <typename T>
void attend(const T* q, const T* kc, const T* vc, T* out, const int64_t* rows, const int64_t* pos,
            const int64_t* tables, const int64_t* tree_from, const int64_t* tree_pos,
            int64_t W, int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t MB, int64_t bs,
            float scale) {
  const int64_t group = H / KVH, chunks = D / 16;
  at::parallel_for(0, R * KVH, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / KVH, kvh = t % KVH, row = rows[r], n = pos[r] + 1;
      const int64_t* table = tables + r * MB;
      const int64_t from = tree_from[r], *tree = tree_pos + r * W;
      auto slot_of = [&](int64_t j) {
        const int64_t p = j < from ? j : tree[j - from];
        return table[p / bs] * bs + p % bs;
      };
      scores.assign(group * n, 0.f);
      // the group's queries, as fp32, scaled
      __m512 qv[8][kMaxChunks];
      for (int64_t g = 0; g < group && g < 8; ++g)
        for (int64_t c = 0; c < chunks; ++c)
          qv[g][c] = _mm512_mul_ps(load16(q + (row * H + kvh * group + g) * D + c * 16),
                                   _mm512_set1_ps(scale));
      for (int64_t g0 = 0; g0 < group; g0 += 8) {  // more than 8 heads per kv head: in turns
        const int64_t gn = std::min<int64_t>(8, group - g0);
        if (g0)
          for (int64_t g = 0; g < gn; ++g)
            for (int64_t c = 0; c < chunks; ++c)
              qv[g][c] = _mm512_mul_ps(load16(q + (row * H + kvh * group + g0 + g) * D + c * 16),
                                       _mm512_set1_ps(scale));
        for (int64_t j = 0; j < n; ++j) {
          const int64_t slot = slot_of(j);
          const T* k = kc + (slot * KVH + kvh) * D;
          __m512 kv[kMaxChunks];
          for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(k + c * 16);
          for (int64_t g = 0; g < gn; ++g) {
            __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
            for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
            scores[(g0 + g) * n + j] = _mm512_reduce_add_ps(acc);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
        const __m512 m = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
          __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
          _mm512_storeu_ps(s + j, e);
          sum = _mm512_add_ps(sum, e);
        }
        if (j < n) {
          __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
          __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), m));
          e = _mm512_maskz_mov_ps(tail, e);
          _mm512_mask_storeu_ps(s + j, tail, e);
          sum = _mm512_add_ps(sum, e);
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
        __m512 acc[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t jj = 0; jj < n; ++jj) {
          const int64_t slot = slot_of(jj);
          const T* v = vc + (slot * KVH + kvh) * D;
          const __m512 p = _mm512_set1_ps(s[jj]);
          for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(p, load16(v + c * 16), acc[c]);
        }
        T* o = out + (row * H + kvh * group + g) * D;
        for (int64_t c = 0; c < chunks; ++c) store16(o + c * 16, _mm512_mul_ps(acc[c], inv));
      }
    }
  });
}

}  // namespace

// out, q: [T, H, D]; k_cache, v_cache: [slots, KVH, D] (all contiguous, one dtype: fp32 or
// bf16); rows, pos: [R] int64; tables: [R, MB] int64 block tables; tree_from: [R] int64
// (pos + 1 for a row that is no tree node); tree_pos: [R, W] int64 (W >= every node's depth).
// Writes out[rows[r]].
void paged_attention_rows(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor rows, torch::Tensor pos,
                          torch::Tensor tables, torch::Tensor tree_from, torch::Tensor tree_pos,
                          int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes(),
              "q and out: contiguous [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "k_cache, v_cache: contiguous [slots, KVH, D]");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D % 16 == 0 && D <= 16 * kMaxChunks && H % KVH == 0,
              "head_dim must be a multiple of 16 up to 256, heads a multiple of kv heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type()
              && q.scalar_type() == out.scalar_type(), "one dtype");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && pos.scalar_type() == torch::kLong &&
              tables.scalar_type() == torch::kLong && tables.is_contiguous() && tables.dim() == 2 &&
              rows.numel() == pos.numel() && tables.size(0) == rows.numel(), "int64 metadata");
  TORCH_CHECK(tree_from.scalar_type() == torch::kLong && tree_pos.scalar_type() == torch::kLong &&
              tree_from.numel() == rows.numel() && tree_pos.dim() == 2 &&
              tree_pos.size(0) == rows.numel() && tree_pos.is_contiguous(), "int64 tree metadata");
  const int64_t R = rows.numel(), MB = tables.size(1), W = tree_pos.size(1);
  {  // a node's tree keys within its tree_pos row, each a position its block table covers
    const int64_t *p = pos.data_ptr<int64_t>(), *f = tree_from.data_ptr<int64_t>();
    const int64_t* t = tree_pos.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(f[r] >= 0 && f[r] <= p[r] + 1 && p[r] + 1 - f[r] <= W, "tree keys of row ", r);
      for (int64_t j = f[r]; j <= p[r]; ++j)
        TORCH_CHECK(t[r * W + j - f[r]] >= 0 && t[r * W + j - f[r]] < MB * block_size,
                    "tree key position of row ", r);
    }
  }
  if (R == 0) return;
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    attend(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
           out.data_ptr<float>(), rows.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
           tables.data_ptr<int64_t>(), tree_from.data_ptr<int64_t>(),
           tree_pos.data_ptr<int64_t>(), W, R, H, KVH, D, MB, block_size, sc);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "fp32 or bf16");
    attend(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
           v_cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(),
           rows.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), tables.data_ptr<int64_t>(),
           tree_from.data_ptr<int64_t>(), tree_pos.data_ptr<int64_t>(), W, R, H, KVH, D, MB,
           block_size, sc);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_rows", &paged_attention_rows, "paged attention of query rows (AVX-512)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  // the function's address, for decode_layers.cpp's loop (the same code, hence the same bits)
  m.attr("paged_attention_rows_address") = reinterpret_cast<uintptr_t>(&paged_attention_rows);
}

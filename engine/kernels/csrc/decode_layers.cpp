// The decoder layers of a decode or verification step in one call: the lean forward's
// (engine/models/lean_forward.py) per-layer work without Python between the ops, where every
// row of the step is a generated token (attention on the CPU row kernel) and every projection
// runs on the int4 VNNI kernel. engine/models/native_layers.py says when.
//
// It computes nothing of its own: it calls the very functions the Python path calls (their
// addresses come from the loaded modules of int4_vnni.cpp, fused_ops.cpp and
// paged_attention.cpp), on the same inputs, in the same order, so a row gets the same bits on
// either path (tests/test_native_layers.py checks it). What it saves is the interpreter: ~4400
// Python calls and ~250 tensor views per forward of the 1.5B target (~6 ms on a 2-core Xeon).
// The GIL is released while it runs: the server's threads may run between the kernels.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

using torch::Tensor;

namespace {

using Int4Fn = Tensor (*)(Tensor, Tensor, Tensor, Tensor, Tensor);
using AddNormFn = std::vector<Tensor> (*)(Tensor, Tensor, Tensor, double);
using NormFn = Tensor (*)(Tensor, Tensor, double);
using SiluFn = Tensor (*)(Tensor, Tensor);
using RotaryFn = void (*)(Tensor, Tensor, Tensor, int64_t);
using AttentionFn = void (*)(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor, int64_t, double);

struct Linear {  // an Int4Linear's VNNI buffers (codes, groups, units); bias empty where none
  Tensor codes, groups, units, bias;
  Tensor operator()(Int4Fn f, const Tensor& x) const { return f(x, codes, groups, units, bias); }
};

struct Layer {
  Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

}  // namespace

class DecodeLayers {
 public:
  // layers: per layer [input norm, post-attention norm, then codes, groups, units, bias of
  // qkv, o, gate_up, down]; dims: heads, kv heads, head_dim, intermediate size; kernels: the
  // addresses of int4_linear, rms_norm, add_rms_norm, silu_mul, rotary_, paged_attention_rows.
  DecodeLayers(const std::vector<std::vector<Tensor>>& layers, std::vector<int64_t> dims,
               double eps, double scaling, std::vector<uint64_t> kernels)
      : eps_(eps), scaling_(scaling) {
    TORCH_CHECK(dims.size() == 4 && kernels.size() == 6, "dims: 4, kernels: 6");
    heads_ = dims[0], kv_heads_ = dims[1], head_dim_ = dims[2], inter_ = dims[3];
    int4_ = reinterpret_cast<Int4Fn>(kernels[0]);
    norm_ = reinterpret_cast<NormFn>(kernels[1]);
    add_norm_ = reinterpret_cast<AddNormFn>(kernels[2]);
    silu_ = reinterpret_cast<SiluFn>(kernels[3]);
    rotary_ = reinterpret_cast<RotaryFn>(kernels[4]);
    attention_ = reinterpret_cast<AttentionFn>(kernels[5]);
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 18, "a layer: 2 norms and 4 linears of 4 tensors");
      auto lin = [&](size_t i) { return Linear{t[i], t[i + 1], t[i + 2], t[i + 3]}; };
      layers_.push_back(Layer{t[0], t[1], lin(2), lin(6), lin(10), lin(14)});
    }
  }

  // h [T, hidden] (the residual stream), cos and sin [T, head_dim], slots [T] (where each row's
  // K/V is written), rows/pos/tables/tree_from/tree_pos: the attention row kernel's metadata
  // (paged_attention.cpp), k and v: each
  // layer's cache [blocks, block_size, kv heads, head_dim]. Returns [h, pending] (the last
  // layer's output not yet added to h) and h with every output added after each layer of
  // `capture`, in its order.
  std::vector<Tensor> forward(Tensor h, Tensor cos, Tensor sin, Tensor slots, Tensor rows,
                              Tensor pos, Tensor tables, Tensor tree_from, Tensor tree_pos,
                              int64_t block_size,
                              const std::vector<Tensor>& k, const std::vector<Tensor>& v,
                              const std::vector<int64_t>& capture) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "a cache per layer");
    const int64_t T = h.size(0), qd = heads_ * head_dim_, kd = kv_heads_ * head_dim_;
    Tensor pending;
    std::vector<Tensor> out(2);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      Tensor x = norm(h, pending, L.input_norm);
      Tensor qkv = L.qkv(int4_, x);
      Tensor q = qkv.narrow(1, 0, qd), key = qkv.narrow(1, qd, kd);
      Tensor value = qkv.narrow(1, qd + kd, kd);
      rotary_(q, cos, sin, head_dim_);
      rotary_(key, cos, sin, head_dim_);
      Tensor kc = k[l].view({-1, kv_heads_, head_dim_}), vc = v[l].view({-1, kv_heads_, head_dim_});
      kc.index_copy_(0, slots, key.view({T, kv_heads_, head_dim_}));
      vc.index_copy_(0, slots, value.view({T, kv_heads_, head_dim_}));
      Tensor qc = q.contiguous().view({T, heads_, head_dim_});
      Tensor o = torch::empty_like(qc);
      attention_(o, qc, kc, vc, rows, pos, tables, tree_from, tree_pos, block_size, scaling_);
      pending = L.o(int4_, o.view({T, qd}));
      x = norm(h, pending, L.post_norm);
      Tensor gate_up = L.gate_up(int4_, x);
      pending = L.down(int4_, silu_(gate_up.narrow(1, 0, inter_), gate_up.narrow(1, inter_, inter_)));
      if (std::find(capture.begin(), capture.end(), static_cast<int64_t>(l)) != capture.end()) {
        h = h + pending;  // the Python path's settle: torch's add
        pending = Tensor();
        out.push_back(h);
      }
    }
    out[0] = h;
    out[1] = pending;  // None where the last layer was captured
    return out;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // the norm of h with the pending output added first (h becomes the sum)
  Tensor norm(Tensor& h, Tensor& pending, const Tensor& weight) {
    if (!pending.defined()) return norm_(h, weight, eps_);
    auto both = add_norm_(h, pending, weight, eps_);
    h = both[0];
    pending = Tensor();
    return both[1];
  }

  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_, inter_;
  double eps_, scaling_;
  Int4Fn int4_;
  NormFn norm_;
  AddNormFn add_norm_;
  SiluFn silu_;
  RotaryFn rotary_;
  AttentionFn attention_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers")
      .def(pybind11::init<const std::vector<std::vector<Tensor>>&, std::vector<int64_t>, double,
                          double, std::vector<uint64_t>>())
      .def_property_readonly("num_layers", &DecodeLayers::num_layers)
      .def("forward", &DecodeLayers::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>());
}

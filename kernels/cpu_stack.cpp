// The decoder layers of a LLaMA-shaped model in one call: the operator sequence of
// services/worker/models/llama.py's DecoderLayer.forward (with layers.py's Attention, GatedMLP and
// RMSNorm on their CPU paths), run from C++ so no Python runs between the ~35 operators of a layer.
//
// Built at first use by fuseserve/kernels/cpu_stack.py and registered as
// torch.ops.fuseserve_stack.decoder_layers. It calls the same operators as the Python layers, in the
// same order, through the dispatcher: mkldnn::_linear_pointwise on the packed weights
// (services/worker/prepacked_linear.py), fuseserve_fused::{rms_norm, add_rms_norm, rotary, silu_mul}
// (cpu_fused.cpp), index_copy_ into the KV cache (kernels/reference.py's write_kv) and
// fuseserve_cpu::paged_attention (cpu_attention.cpp); so its output equals the Python layers' bit for
// bit (tests/unit/test_layer_stack.py). Both libraries must be loaded first (cpu_stack.py does it).
//
// Per layer l, weights[10 l ..]: input norm, qkv (packed), qkv bias, o (packed), o bias, post-attention
// norm, gate_up (packed), gate_up bias, down (packed), down bias; a bias with no elements means none.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t PER_LAYER = 10;

c10::OperatorHandle op(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

c10::IValue optional_bias(const at::Tensor& b) { return b.numel() > 0 ? c10::IValue(b) : c10::IValue(); }

// x [T, in] times a packed weight (+ bias) -> [T, out], as prepacked_linear._matmul calls it.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  static const c10::OperatorHandle h = op("mkldnn::_linear_pointwise");
  torch::jit::Stack st{x, w, optional_bias(b), std::string("none"), c10::List<std::optional<c10::Scalar>>(),
                       std::string("")};
  h.callBoxed(st);
  return st[0].toTensor();
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  static const c10::OperatorHandle h = op("fuseserve_fused::rms_norm");
  at::Tensor out = at::empty_like(x);
  torch::jit::Stack st{out, x, w, eps, false};
  h.callBoxed(st);
  return out;
}

// (norm(x + residual), x + residual)
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                               double eps) {
  static const c10::OperatorHandle h = op("fuseserve_fused::add_rms_norm");
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  torch::jit::Stack st{out, sum, x, residual, w, eps, false};
  h.callBoxed(st);
  return {out, sum};
}

// x [T, hidden] (the embeddings) -> the last layer's output [T, hidden] (before the final norm).
at::Tensor decoder_layers(const at::Tensor& x_in, const at::Tensor& positions, const at::Tensor& cos,
                          const at::Tensor& sin, at::TensorList weights, at::TensorList k_caches,
                          at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                          const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, at::IntArrayRef windows,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  static const c10::OperatorHandle rotary = op("fuseserve_fused::rotary");
  static const c10::OperatorHandle silu_mul = op("fuseserve_fused::silu_mul");
  static const c10::OperatorHandle attend = op("fuseserve_cpu::paged_attention");
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == PER_LAYER * layers && v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(windows.size()) == layers,
              "decoder_layers: ", PER_LAYER, " weights, one K and one V cache and one window per layer");
  TORCH_CHECK(x_in.dim() == 2 && positions.scalar_type() == at::kLong, "x [T, hidden], positions int64 [T]");
  const int64_t T = x_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = x_in;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * PER_LAYER;
    // attention: norm, stacked q/k/v projection, rotary in place, KV write, paged attention, o projection
    const at::Tensor qkv = linear(rms_norm(x, w[0], eps), w[1], w[2]);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    torch::jit::Stack rot{q, k, positions, cos, sin};
    rotary.callBoxed(rot);
    k_caches[l].view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, k);
    v_caches[l].view({-1, num_kv_heads, head_dim}).index_copy_(0, slot_mapping, v);
    at::Tensor attn = at::empty({T, num_heads, head_dim}, q.options());
    torch::jit::Stack att{attn, q, k_caches[l], v_caches[l], block_tables, cu_seqlens_q, seq_lens, scale, windows[l],
                          0.0};
    attend.callBoxed(att);
    const at::Tensor o = linear(attn.view({T, q_size}), w[3], w[4]);
    // MLP: residual add + norm, gate_up projection, silu(gate) * up, down projection, residual add
    auto [normed, h] = add_rms_norm(o, x, w[5], eps);
    const at::Tensor gate_up = linear(normed, w[6], w[7]);
    at::Tensor act = at::empty({T, gate_up.size(1) / 2}, gate_up.options());
    torch::jit::Stack sm{act, gate_up};
    silu_mul.callBoxed(sm);
    x = h + linear(act, w[8], w[9]);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(fuseserve_stack, m) {
  m.def("decoder_layers(Tensor x, Tensor positions, Tensor cos, Tensor sin, Tensor[] weights, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, "
        "int[] windows, int num_heads, int num_kv_heads, int head_dim, float eps, float scale) -> Tensor");
}

// CatchAll: the packed weights are oneDNN (MkldnnCPU) tensors, the rest plain CPU ones.
TORCH_LIBRARY_IMPL(fuseserve_stack, CatchAll, m) { m.impl("decoder_layers", decoder_layers); }

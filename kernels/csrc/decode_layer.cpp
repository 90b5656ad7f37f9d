// Consecutive decoder layers' decode step (every row one decoding sequence) in one call from Python.
// A Llama layer computes
//   h  = x + W_O · Attn(RoPE(W_QKV · RMSNorm_a(x)))   (the step's keys and values stored in the pages)
//   x' = h + W_down · (SiLU(gate) ⊙ up),  [gate, up] = W_gate_up · RMSNorm_m(h)
// and a Dory (nGPT) layer, on the unit sphere (N: the L2 projection, `interpolate` nGPT's step)
//   h  = N(x);  [q, k, v, g] = W_QKVG · h;  q, k = RoPE(N(q)) · s_q, RoPE(N(k))
//   h  = interpolate(h, W_O · N(Attn(q, k, v) ⊙ sigmoid(g · s_g)), a1), normalised
//   x' = interpolate(h, W_down · N(SiLU(gate · s_gate) ⊙ up · s_up), a2),  [gate, up] = W_gate_up · h
// each with the same ops, in the same order and dtype, as depthserve/archs/{llama,dory}/model.py's
// eager layer with its projections on the native group GEMM: the result is bit-identical to that
// layer's. What it saves is the dispatched torch ops and module calls per layer that the eager step
// pays in Python (about 0.4 ms a Llama layer on a 2-core Xeon, more than the layer's own arithmetic
// at one row); a whole section's layers in one call also save the per-layer module call and table
// slicing. The native ops are called through the dispatcher (the other csrc files define them), the
// elementwise ones are ATen's, as the eager layer calls them. kernels/cpu_native.py builds this file.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> native_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using GemmSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                 int64_t, bool);
using NormSignature = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using RopeSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using StoreSignature = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
using AttentionSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double, c10::optional<int64_t>);
using GateSignature = at::Tensor(const at::Tensor&);
using L2NormSignature = at::Tensor(const at::Tensor&, double);
using InterpolateSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool);
using GatedNormSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SwigluNormSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       double);
using UnitRopeSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const c10::optional<at::Tensor>&, double);

struct NativeOps {
  c10::TypedOperatorHandle<GemmSignature> gemm = native_op<GemmSignature>("depthserve_cpu::group_gemm");
  c10::TypedOperatorHandle<NormSignature> norm = native_op<NormSignature>("depthserve_cpu::rms_norm");
  c10::TypedOperatorHandle<RopeSignature> rope = native_op<RopeSignature>("depthserve_cpu::apply_rope");
  c10::TypedOperatorHandle<StoreSignature> store = native_op<StoreSignature>("depthserve_cpu::store_kv");
  c10::TypedOperatorHandle<AttentionSignature> attention =
      native_op<AttentionSignature>("depthserve_cpu::paged_decode_attention");
  c10::TypedOperatorHandle<GateSignature> gate = native_op<GateSignature>("depthserve_cpu::silu_and_mul");
  c10::TypedOperatorHandle<L2NormSignature> l2_norm = native_op<L2NormSignature>("depthserve_cpu::l2_normalize");
  c10::TypedOperatorHandle<InterpolateSignature> interpolate =
      native_op<InterpolateSignature>("depthserve_cpu::ngpt_interpolate");
  c10::TypedOperatorHandle<GatedNormSignature> gated_norm =
      native_op<GatedNormSignature>("depthserve_cpu::gated_l2_normalize");
  c10::TypedOperatorHandle<SwigluNormSignature> swiglu_norm =
      native_op<SwigluNormSignature>("depthserve_cpu::swiglu_l2_normalize");
  c10::TypedOperatorHandle<UnitRopeSignature> unit_rope = native_op<UnitRopeSignature>("depthserve_cpu::unit_rope");
};

const NativeOps& ops() {
  static const NativeOps handles;
  return handles;
}

// A layer's projections in `weights`, three tensors each (codes, scale, low; csrc/group_gemm.cpp), in
// the order qkv, o, gate_up, down.
enum Projection : int64_t { kQKV = 0, kOut = 1, kGateUp = 2, kDown = 3 };
constexpr int64_t kProjections = 4, kTensorsPerProjection = 3;

// One layer's projection p of `input` on the native group GEMM (the layer's `weights`, `bits`, `out_features`).
at::Tensor run_projection(const NativeOps& native, const at::Tensor& input, Projection p, at::TensorList weights,
                   at::IntArrayRef bits, at::IntArrayRef out_features) {
  const int64_t first = kTensorsPerProjection * p;
  return native.gemm.call(input, weights[first], weights[first + 1], weights[first + 2], bits[p], out_features[p], false);
}

// One layer's step; `weights`, `bits` and `out_features` are that layer's, slot_index [rows, kv_heads]
// and page_table [rows, kv_heads, blocks] its cache columns.
at::Tensor decode_layer(const NativeOps& native, const at::Tensor& x, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, at::TensorList weights, at::IntArrayRef bits,
                        at::IntArrayRef out_features, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                        at::Tensor& k_pages, at::Tensor& v_pages, const at::Tensor& slot_index,
                        const at::Tensor& page_table, const at::Tensor& context_lens, double scale) {
  const int64_t rows = x.size(0), kv_heads = slot_index.size(1), head_dim = k_pages.size(2);
  const int64_t q_size = num_heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(out_features[kQKV] == q_size + 2 * kv_size, "llama_decode_layers: the qkv projection has ",
              out_features[kQKV], " outputs, the heads need ", q_size + 2 * kv_size);
  auto project = [&](const at::Tensor& input, Projection p) {
    return run_projection(native, input, p, weights, bits, out_features);
  };

  const at::Tensor qkv = project(native.norm.call(x, input_norm, eps), kQKV);
  const at::Tensor qk = native.rope.call(qkv.narrow(1, 0, q_size + kv_size).view({rows, num_heads + kv_heads, head_dim}),
                                         cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
  native.store.call(k, v, k_pages, v_pages, slot_index);
  const at::Tensor attended = native.attention.call(q, k_pages, v_pages, page_table, context_lens, scale, c10::nullopt);
  const at::Tensor h = at::add(x, project(attended.view({rows, q_size}), kOut));

  const at::Tensor gate_up = project(native.norm.call(h, post_norm, eps), kGateUp);
  return at::add(h, project(native.gate.call(gate_up), kDown));
}

// Runs `layer(i, hidden, slots, table)` for each layer i in turn from x, layer i on the cache columns
// first_columns[i] .. + kv_heads of slot_index [rows, width] and page_table [rows, blocks, width]
// (the step's whole tables, sliced here rather than per layer in Python); `op` names the caller in errors.
template <typename Layer>
at::Tensor run_layers(const char* op, const at::Tensor& x, int64_t kv_heads, const at::Tensor& slot_index,
                      const at::Tensor& page_table, at::IntArrayRef first_columns, Layer&& layer) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [rows, hidden]");
  TORCH_CHECK(slot_index.dim() == 2 && page_table.dim() == 3 && slot_index.size(1) == page_table.size(2), op,
              ": slot_index [rows, width] and page_table [rows, blocks, width]");
  at::Tensor hidden = x;
  for (int64_t i = 0; i < static_cast<int64_t>(first_columns.size()); ++i) {
    TORCH_CHECK(first_columns[i] >= 0 && first_columns[i] + kv_heads <= slot_index.size(1), op, ": layer ", i,
                "'s cache columns are outside the tables");
    const at::Tensor slots = slot_index.narrow(1, first_columns[i], kv_heads);
    const at::Tensor table = page_table.narrow(2, first_columns[i], kv_heads).transpose(1, 2);
    hidden = layer(i, hidden, slots, table);
  }
  return hidden;
}

// Consecutive layers, layer i with norms[2 i] and norms[2 i + 1], the 12 tensors of weights from
// 12 i and its cache columns first_columns[i] (run_layers).
at::Tensor llama_decode_layers(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList weights,
                               at::IntArrayRef bits, at::IntArrayRef out_features, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t num_heads, int64_t kv_heads, at::Tensor& k_pages,
                               at::Tensor& v_pages, const at::Tensor& slot_index, const at::Tensor& page_table,
                               const at::Tensor& context_lens, double scale, at::IntArrayRef first_columns) {
  const int64_t layers = static_cast<int64_t>(first_columns.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(weights.size()) == kProjections * kTensorsPerProjection * layers &&
                  static_cast<int64_t>(bits.size()) == kProjections * layers &&
                  static_cast<int64_t>(out_features.size()) == kProjections * layers,
              "llama_decode_layers: per layer two norms and four projections (qkv, o, gate_up, down) of three "
              "tensors each");
  const NativeOps& native = ops();
  return run_layers("llama_decode_layers", x, kv_heads, slot_index, page_table, first_columns,
                    [&](int64_t i, const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& table) {
    return decode_layer(native, hidden, norms[2 * i], norms[2 * i + 1], eps,
                        weights.slice(kProjections * kTensorsPerProjection * i, kProjections * kTensorsPerProjection),
                        bits.slice(kProjections * i, kProjections), out_features.slice(kProjections * i, kProjections),
                        cos, sin, num_heads, k_pages, v_pages, slots, table, context_lens, scale);
  });
}

// A Dory layer's learned scales as its forward applies them (model.py's `derive_scales`), in `scales`
// in this order: the queries' s_q [q_size], the output gate's s_g [q_size], the MLP gate's and up's
// [intermediate], the interpolation rates a1 and a2 [hidden].
enum DoryScale : int64_t { kQueryScale = 0, kOutputGateScale, kSwigluGateScale, kSwigluUpScale, kAttentionRate, kMlpRate };
constexpr int64_t kDoryScales = 6;

// One Dory layer's step (the header's formulas); projections as in decode_layer, qkv's output holding
// q, k, v and the output gate g; `window` > 0: a sliding-window layer's last `window` keys.
at::Tensor dory_decode_layer(const NativeOps& native, const at::Tensor& x, at::TensorList scales, double eps,
                             at::TensorList weights, at::IntArrayRef bits, at::IntArrayRef out_features,
                             const at::Tensor& cos, const at::Tensor& sin, int64_t window, int64_t num_heads,
                             at::Tensor& k_pages, at::Tensor& v_pages, const at::Tensor& slot_index,
                             const at::Tensor& page_table, const at::Tensor& context_lens, double scale) {
  const int64_t rows = x.size(0), kv_heads = slot_index.size(1), head_dim = k_pages.size(2);
  const int64_t q_size = num_heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(out_features[kQKV] == 2 * q_size + 2 * kv_size, "dory_decode_layers: the qkvg projection has ",
              out_features[kQKV], " outputs, the heads need ", 2 * q_size + 2 * kv_size);
  TORCH_CHECK(out_features[kGateUp] % 2 == 0, "dory_decode_layers: gate_up's outputs are gate and up, alike");
  auto project = [&](const at::Tensor& input, Projection p) {
    return run_projection(native, input, p, weights, bits, out_features);
  };

  const at::Tensor h = native.l2_norm.call(x, eps);
  const at::Tensor qkvg = project(h, kQKV);
  const at::Tensor q = native.unit_rope.call(qkvg.narrow(1, 0, q_size).view({rows, num_heads, head_dim}), cos, sin,
                                             scales[kQueryScale], eps);
  const at::Tensor k = native.unit_rope.call(qkvg.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim}), cos,
                                             sin, c10::nullopt, eps);
  const at::Tensor v = qkvg.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
  native.store.call(k, v, k_pages, v_pages, slot_index);
  const at::Tensor attended = native.attention.call(q, k_pages, v_pages, page_table, context_lens, scale,
                                                    window > 0 ? c10::optional<int64_t>(window) : c10::nullopt);
  const at::Tensor gated = native.gated_norm.call(attended.view({rows, q_size}),
                                                  qkvg.narrow(1, q_size + 2 * kv_size, q_size),
                                                  scales[kOutputGateScale], eps);
  const at::Tensor moved = native.interpolate.call(h, project(gated, kOut), scales[kAttentionRate], eps, true);

  const at::Tensor gate_up = project(moved, kGateUp);
  const int64_t intermediate = out_features[kGateUp] / 2;
  const at::Tensor mixed = native.swiglu_norm.call(gate_up.narrow(1, 0, intermediate),
                                                   gate_up.narrow(1, intermediate, intermediate),
                                                   scales[kSwigluGateScale], scales[kSwigluUpScale], eps);
  return native.interpolate.call(moved, project(mixed, kDown), scales[kMlpRate], eps, false);
}

// Consecutive Dory layers, layer i with the six scales from 6 i, the 12 tensors of weights from 12 i,
// its rotary tables cos[i], sin[i] (its layer type's), windows[i] (0: full attention) and its cache
// columns first_columns[i] .. + kv_heads of slot_index [rows, width] and page_table [rows, blocks, width].
at::Tensor dory_decode_layers(const at::Tensor& x, at::TensorList scales, double eps, at::TensorList weights,
                              at::IntArrayRef bits, at::IntArrayRef out_features, at::TensorList cos,
                              at::TensorList sin, at::IntArrayRef windows, int64_t num_heads, int64_t kv_heads,
                              at::Tensor& k_pages, at::Tensor& v_pages, const at::Tensor& slot_index,
                              const at::Tensor& page_table, const at::Tensor& context_lens, double scale,
                              at::IntArrayRef first_columns) {
  const int64_t layers = static_cast<int64_t>(first_columns.size());
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == kDoryScales * layers &&
                  static_cast<int64_t>(weights.size()) == kProjections * kTensorsPerProjection * layers &&
                  static_cast<int64_t>(bits.size()) == kProjections * layers &&
                  static_cast<int64_t>(out_features.size()) == kProjections * layers &&
                  static_cast<int64_t>(cos.size()) == layers && static_cast<int64_t>(sin.size()) == layers &&
                  static_cast<int64_t>(windows.size()) == layers,
              "dory_decode_layers: per layer six scales, four projections (qkvg, o, gate_up, down) of three tensors "
              "each, a rotary table pair and a window");
  const NativeOps& native = ops();
  return run_layers("dory_decode_layers", x, kv_heads, slot_index, page_table, first_columns,
                    [&](int64_t i, const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& table) {
    return dory_decode_layer(
        native, hidden, scales.slice(kDoryScales * i, kDoryScales), eps,
        weights.slice(kProjections * kTensorsPerProjection * i, kProjections * kTensorsPerProjection),
        bits.slice(kProjections * i, kProjections), out_features.slice(kProjections * i, kProjections), cos[i], sin[i],
        windows[i], num_heads, k_pages, v_pages, slots, table, context_lens, scale);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(depthserve_cpu, m) {
  m.def("llama_decode_layers(Tensor x, Tensor[] norms, float eps, Tensor[] weights, int[] bits, int[] out_features, "
        "Tensor cos, Tensor sin, int num_heads, int kv_heads, Tensor(a!) k_pages, Tensor(b!) v_pages, "
        "Tensor slot_index, Tensor page_table, Tensor context_lens, float scale, int[] first_columns) -> Tensor");
  m.def("dory_decode_layers(Tensor x, Tensor[] scales, float eps, Tensor[] weights, int[] bits, int[] out_features, "
        "Tensor[] cos, Tensor[] sin, int[] windows, int num_heads, int kv_heads, Tensor(a!) k_pages, "
        "Tensor(b!) v_pages, Tensor slot_index, Tensor page_table, Tensor context_lens, float scale, "
        "int[] first_columns) -> Tensor");
}

TORCH_LIBRARY_IMPL(depthserve_cpu, CPU, m) {
  m.impl("llama_decode_layers", &llama_decode_layers);
  m.impl("dory_decode_layers", &dory_decode_layers);
}

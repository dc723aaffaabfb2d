// model_py.h: Python-side helpers shared by the model bindings (bind_model.cpp for the CPU
// model, bind_cuda_model.cpp for the GPU model): the config dict (ModelConfig.to_native()) ->
// kdtree::ModelConfig, and integer-array validation. Header-only; included by bindings only.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "model/config.h"
#include "model/model.h"

namespace kdtree_py {

namespace py = pybind11;
using kdtree::Error;

// One call at a time per native model. A generate holds its target for the whole run, every Python-facing model
// method that moves the cache or the weights for its own call, and a native ModelDrafter's draft for its own call; a
// second call meanwhile (another thread, or a drafter / progress callback of the running generate) raises
// RuntimeError instead of interleaving with the first: interleaved forward / commit calls overwrite each other's
// pending cache entries, which gave wrong tokens without an error. Only the draft calls wait (wait = true: no
// callback runs while one is held, so the wait ends; a ModelDrafter re-syncs its cache at every call, so drafts of
// two generates sharing a draft model may take turns, as they did under the drafter's own mutex); every other
// call raises at once (a callback waiting for its own generate would hang). Keys: the model as a TargetModel*, as
// the Generator records its target.
class ModelUse {
 public:
  ModelUse(const kdtree::TargetModel* model, const char* what, bool wait = false) : key_(model) {
    if (!key_) return;
    std::unique_lock<std::mutex> lock(mu());
    for (auto it = holders().find(key_); it != holders().end(); it = holders().find(key_)) {
      if (!wait)
        throw kdtree::RuntimeFailure(std::string(what) + ": the model is busy with " + it->second +
                                     " (another thread, or a callback of that call): a model runs one call at a "
                                     "time; use one Engine per thread");
      cv().wait(lock);
    }
    holders().emplace(key_, what);
  }
  ~ModelUse() {
    if (!key_) return;
    {
      std::lock_guard<std::mutex> lock(mu());
      holders().erase(key_);
    }
    cv().notify_all();
  }
  ModelUse(const ModelUse&) = delete;
  ModelUse& operator=(const ModelUse&) = delete;

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::condition_variable& cv() {
    static std::condition_variable c;
    return c;
  }
  static std::unordered_map<const kdtree::TargetModel*, const char*>& holders() {
    static std::unordered_map<const kdtree::TargetModel*, const char*> h;
    return h;
  }
  const kdtree::TargetModel* key_;
};

inline py::object dict_get(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw Error(std::string("model config dict: missing key '") + key + "'");
  return d[key];
}

inline int64_t get_int(const py::dict& d, const char* key) {
  py::object v = dict_get(d, key);
  if (py::isinstance<py::bool_>(v) || !py::hasattr(v, "__index__"))
    throw Error(std::string("model config dict: '") + key + "' must be an integer");
  return py::int_(v.attr("__index__")()).cast<int64_t>();
}

inline double get_float(const py::dict& d, const char* key) {
  py::object v = dict_get(d, key);
  if (py::isinstance<py::bool_>(v)) throw Error(std::string("model config dict: '") + key + "' must be a number");
  try {
    return py::float_(v).cast<double>();
  } catch (const py::error_already_set&) {
    throw Error(std::string("model config dict: '") + key + "' must be a number");
  }
}

inline bool get_bool(const py::dict& d, const char* key) {
  py::object v = dict_get(d, key);
  if (!py::isinstance<py::bool_>(v) && !py::isinstance<py::int_>(v))
    throw Error(std::string("model config dict: '") + key + "' must be a bool");
  return v.cast<bool>();
}

inline kdtree::ModelConfig config_from_dict(const py::dict& d) {
  kdtree::ModelConfig c;
  c.vocab_size = get_int(d, "vocab_size");
  c.hidden_size = get_int(d, "hidden_size");
  c.intermediate_size = get_int(d, "intermediate_size");
  c.moe_intermediate_size = get_int(d, "moe_intermediate_size");
  c.num_hidden_layers = get_int(d, "num_hidden_layers");
  c.num_attention_heads = get_int(d, "num_attention_heads");
  c.n_routed_experts = get_int(d, "n_routed_experts");
  c.n_shared_experts = get_int(d, "n_shared_experts");
  c.num_experts_per_tok = get_int(d, "num_experts_per_tok");
  c.n_group = get_int(d, "n_group");
  c.topk_group = get_int(d, "topk_group");
  c.first_k_dense_replace = get_int(d, "first_k_dense_replace");
  c.q_lora_rank = get_int(d, "q_lora_rank");
  c.kv_lora_rank = get_int(d, "kv_lora_rank");
  c.qk_nope_head_dim = get_int(d, "qk_nope_head_dim");
  c.qk_rope_head_dim = get_int(d, "qk_rope_head_dim");
  c.v_head_dim = get_int(d, "v_head_dim");
  c.norm_topk_prob = get_bool(d, "norm_topk_prob");
  c.rope_interleave = get_bool(d, "rope_interleave");
  c.tie_word_embeddings = get_bool(d, "tie_word_embeddings");
  c.routed_scaling_factor = get_float(d, "routed_scaling_factor");
  c.rms_norm_eps = get_float(d, "rms_norm_eps");
  if (d.contains("latent_norm_eps")) c.latent_norm_eps = get_float(d, "latent_norm_eps");
  c.softmax_scale = get_float(d, "softmax_scale");
  c.rope_attention_factor = get_float(d, "rope_attention_factor");
  py::object inv = dict_get(d, "rope_inv_freq");
  py::array_t<float, py::array::c_style | py::array::forcecast> a;
  try {
    a = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(inv);
  } catch (const py::error_already_set&) {
  }
  if (!a || a.ndim() != 1) throw Error("model config dict: 'rope_inv_freq' must be a 1-D sequence of floats");
  c.rope_inv_freq.assign(a.data(), a.data() + a.shape(0));
  c.validate();
  return c;
}

inline std::string dtype_str(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

// A 1-D integer array-like -> int32 values, each checked to lie in [lo, hi).
inline std::vector<int32_t> int_vector(const py::object& obj, const char* what, int64_t lo, int64_t hi) {
  py::array a = py::array::ensure(obj);
  if (!a) throw Error(std::string(what) + ": expected an integer array");
  if (a.ndim() == 0) a = a.attr("reshape")(1);
  if (a.ndim() != 1) throw Error(std::string(what) + ": expected a 1-D array, got " + std::to_string(a.ndim()) + "-D");
  if (a.size() == 0) return {};  // an empty list has NumPy's default dtype (float64)
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u') throw Error(std::string(what) + ": expected an integer dtype, got " + dtype_str(a));
  auto v = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  if (kind == 'u' && a.dtype().itemsize() == 8) {  // uint64 above int64 range would wrap
    auto u = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(a);
    for (py::ssize_t i = 0; i < u.shape(0); ++i)
      if (u.data()[i] > (uint64_t)std::numeric_limits<int64_t>::max())
        throw Error(std::string(what) + ": value out of range at index " + std::to_string(i));
  }
  std::vector<int32_t> out((size_t)v.shape(0));
  for (py::ssize_t i = 0; i < v.shape(0); ++i) {
    const int64_t x = v.data()[i];
    if (x < lo || x >= hi)
      throw Error(std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(x) + " is outside [" +
                  std::to_string(lo) + ", " + std::to_string(hi) + ")");
    out[(size_t)i] = (int32_t)x;
  }
  return out;
}

// forward(tokens, positions, visibility=None) -> logits float32 [T, V], validated, GIL released;
// rows >= 0: forward_last, the logits of the last `rows` tokens only ([rows, V]).
template <class Model>
py::array_t<float> model_forward_rows(Model& m, const py::object& tokens_obj, const py::object& positions_obj,
                                      const py::object& vis_obj, int64_t rows) {
  ModelUse use(&m, rows < 0 ? "forward" : "forward_last");
  if (!m.finalized()) throw Error("forward: the model is not finalized (set every weight, then finalize())");
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> tokens = int_vector(tokens_obj, "tokens", 0, V);
  const int64_t T = (int64_t)tokens.size();
  if (T == 0) throw Error("tokens: empty (need at least one token)");
  std::vector<int32_t> positions = int_vector(positions_obj, "positions", 0, std::numeric_limits<int32_t>::max());
  if ((int64_t)positions.size() != T)
    throw Error("positions: length " + std::to_string(positions.size()) + " != number of tokens " + std::to_string(T));
  if (m.cache_len() + T > m.max_seq_len())
    throw Error("forward: cache_len (" + std::to_string(m.cache_len()) + ") + tokens (" + std::to_string(T) +
                ") exceeds max_seq_len (" + std::to_string(m.max_seq_len()) + ")");
  std::vector<uint8_t> vis;
  if (!vis_obj.is_none()) {
    py::array a = py::array::ensure(vis_obj);
    if (!a) throw Error("visibility: expected a bool/uint8 array");
    const char kind = a.dtype().kind();
    if (!(kind == 'b' || (kind == 'u' && a.dtype().itemsize() == 1)))
      throw Error("visibility: expected dtype bool or uint8, got " + dtype_str(a));
    if (a.ndim() != 2 || a.shape(0) != T || a.shape(1) != T)
      throw Error("visibility: expected shape (" + std::to_string(T) + ", " + std::to_string(T) + "), got " +
                  py::str(a.attr("shape")).cast<std::string>());
    auto u = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>::ensure(a.attr("view")("uint8"));
    vis.assign(u.data(), u.data() + T * T);
  }
  if (rows > T) throw Error("forward_last: rows " + std::to_string(rows) + " > number of tokens " + std::to_string(T));
  py::array_t<float> out({(py::ssize_t)(rows < 0 ? T : rows), (py::ssize_t)V});
  float* o = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    if (rows < 0) m.forward(tokens.data(), positions.data(), vis.empty() ? nullptr : vis.data(), T, o);
    else m.forward_last(tokens.data(), positions.data(), vis.empty() ? nullptr : vis.data(), T, rows, o);
  }
  return out;
}

template <class Model>
py::array_t<float> model_forward(Model& m, const py::object& tokens_obj, const py::object& positions_obj,
                                 const py::object& vis_obj) {
  return model_forward_rows(m, tokens_obj, positions_obj, vis_obj, -1);
}

// The first NaN / infinity among n floats (-1 if none): blocks of 1024 reduced branch-free (the
// compiler vectorises the OR of exponent tests), the index found only in a block that has one.
inline int64_t first_non_finite(const float* p, int64_t n) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(p);
  for (int64_t b = 0; b < n; b += 1024) {
    const int64_t e = std::min<int64_t>(n, b + 1024);
    uint32_t any = 0;
    for (int64_t i = b; i < e; ++i) any |= (uint32_t)((u[i] & 0x7F800000u) == 0x7F800000u);
    if (any)
      for (int64_t i = b; i < e; ++i)
        if ((u[i] & 0x7F800000u) == 0x7F800000u) return i;
  }
  return -1;
}

// set_weight's (and set_weight_bf16's) refusal of a non-finite weight
inline Error non_finite_weight(const std::string& name, bool nan, int64_t index) {
  return Error("set_weight: '" + name + "' holds " + (nan ? "NaN" : "an infinity") + " at flat index " +
               std::to_string(index) + " (a corrupt or overflowed checkpoint: every generated token would be garbage)");
}

// The methods CpuModel and CudaModel bind identically (weights, commit/truncate/reset, sizes).
template <class Model>
py::class_<Model> def_model_common(py::class_<Model> cls) {
  cls
      .def(
          "set_weight",
          [](Model& self, const std::string& name, const py::object& obj, bool check_finite) {
            py::array arr = py::array::ensure(obj);
            if (!arr) throw Error("set_weight: '" + name + "' is not an array");
            if (arr.dtype().kind() != 'f' || arr.dtype().itemsize() != 4)
              throw Error("set_weight: '" + name + "' must be float32, got " + dtype_str(arr));
            auto a = py::array_t<float, py::array::c_style>::ensure(arr);
            if (!a) throw Error("set_weight: '" + name + "' could not be made contiguous");
            std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
            const float* p = a.data();
            ModelUse use(&self, "set_weight");
            py::gil_scoped_release nogil;
            if (check_finite) {
              const int64_t bad = first_non_finite(p, (int64_t)a.size());
              if (bad >= 0) throw non_finite_weight(name, std::isnan(p[bad]), bad);
            }
            self.set_weight(name, p, shape);
          },
          py::arg("name"), py::arg("array"), py::arg("check_finite") = true)
      .def(
          "set_weight_bf16",
          [](Model& self, const std::string& name, const py::object& obj, bool check_finite) {
            py::array arr = py::array::ensure(obj);
            if (!arr) throw Error("set_weight_bf16: '" + name + "' is not an array");
            if (arr.dtype().kind() != 'u' || arr.dtype().itemsize() != 2)
              throw Error("set_weight_bf16: '" + name + "' must be the BF16 bits as uint16, got " + dtype_str(arr));
            auto a = py::array_t<uint16_t, py::array::c_style>::ensure(arr);
            if (!a) throw Error("set_weight_bf16: '" + name + "' could not be made contiguous");
            std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
            const uint16_t* p = a.data();
            ModelUse use(&self, "set_weight_bf16");
            py::gil_scoped_release nogil;
            if (check_finite) {
              const int64_t n = (int64_t)a.size();
              for (int64_t i = 0; i < n; ++i)
                if ((p[i] & 0x7F80u) == 0x7F80u) throw kdtree_py::non_finite_weight(name, (p[i] & 0x7Fu) != 0, i);
            }
            self.set_weight_bf16(name, p, shape);
          },
          py::arg("name"), py::arg("bits"), py::arg("check_finite") = true,
          "set_weight of a BF16 tensor given as its bits (uint16, the high halves of the float32 values): the same "
          "as set_weight of the widened values, without widening them first (what from_pretrained hands a CPU "
          "model, or a CUDA model holding BF16 weights only, for a BF16 checkpoint).")
      .def(
          "set_weight_int4",
          [](Model& self, const std::string& name, const py::object& packed_obj, const py::object& scales_obj,
             int64_t group) {
            py::array pa = py::array::ensure(packed_obj), sa = py::array::ensure(scales_obj);
            if (!pa || pa.dtype().kind() != 'u' || pa.dtype().itemsize() != 1 || pa.ndim() != 2)
              throw Error("set_weight_int4: '" + name + "': packed must be uint8 [N, K / 2]");
            if (!sa || sa.dtype().kind() != 'f' || sa.dtype().itemsize() != 4 || sa.ndim() != 2)
              throw Error("set_weight_int4: '" + name + "': scales must be float32 [N, K / group]");
            auto p = py::array_t<uint8_t, py::array::c_style>::ensure(pa);
            auto sc = py::array_t<float, py::array::c_style>::ensure(sa);
            if (!p || !sc) throw Error("set_weight_int4: '" + name + "' could not be made contiguous");
            const int64_t N = p.shape(0), K = 2 * p.shape(1);
            if (group <= 0 || K % group || sc.shape(0) != N || sc.shape(1) != K / group)
              throw Error("set_weight_int4: '" + name + "': scales of shape [" + std::to_string(sc.shape(0)) + ", " +
                          std::to_string(sc.shape(1)) + "] do not fit packed [" + std::to_string(N) + ", " +
                          std::to_string(K / 2) + "] in groups of " + std::to_string(group));
            const uint8_t* pp = p.data();
            const float* sp = sc.data();
            ModelUse use(&self, "set_weight_int4");
            py::gil_scoped_release nogil;
            self.set_weight_int4(name, pp, sp, group, {N, K});
          },
          py::arg("name"), py::arg("packed"), py::arg("scales"), py::arg("group"),
          "A symmetric 4-bit group-quantized weight [N, K] with BF16 scales (compressed-tensors pack-quantized): "
          "packed uint8 [N, K / 2] (element 2j in the low nibble of byte j, each nibble the integer + 8), scales "
          "float32 [N, K / group]. CpuModel: held packed with bf16_weights 'only' (the GEMMs dequantize rows as they "
          "go), else dequantized; docs/MODEL.md. CudaModel: a routed expert's matrix held packed with "
          "int4_experts_group = group (the expert kernels dequantize in registers), else dequantized; "
          "docs/CUDA_MODEL.md. The same logits as the dequantized matrix either way.")
      .def_property_readonly("int4_weight_bytes", &Model::int4_weight_bytes,
                             "Bytes of weight matrices held packed as 4-bit integers plus their scales.")
      .def(
          "forward_last",
          [](Model& self, const py::object& tokens, const py::object& positions, int64_t rows, const py::object& vis) {
            if (rows < 0) throw Error("forward_last: rows must be >= 0, got " + std::to_string(rows));
            return model_forward_rows(self, tokens, positions, vis, rows);
          },
          py::arg("tokens"), py::arg("positions"), py::arg("rows"), py::arg("visibility") = py::none(),
          "forward() with the logits of the last `rows` tokens only: float32 [rows, V] (rows = 0: none; the cache "
          "entries are forward()'s). What a prefill needs: the LM head runs over those rows alone (on the GPU when "
          "they lie in the last max_tokens chunk).")
      .def("missing_weights", &Model::missing_weights)
      .def("finalize",
           [](Model& self) {
             ModelUse use(&self, "finalize");
             py::gil_scoped_release nogil;
             self.finalize();
           })
      .def_property_readonly("finalized", &Model::finalized)
      .def(
          "commit",
          [](Model& self, const py::object& keep_obj) {
            ModelUse use(&self, "commit");
            std::vector<int32_t> keep = int_vector(keep_obj, "keep", 0, std::max<int64_t>(self.pending_len(), 1));
            if ((int64_t)keep.size() > self.pending_len())
              throw Error("commit: keeping " + std::to_string(keep.size()) + " entries but only " +
                          std::to_string(self.pending_len()) + " are pending");
            py::gil_scoped_release nogil;
            self.commit(keep.data(), (int64_t)keep.size());
          },
          py::arg("keep"), "Keep pending entries keep[j] (strictly increasing) packed after the context.")
      .def(
          "truncate",
          [](Model& self, int64_t n) {
            ModelUse use(&self, "truncate");
            self.truncate(n);
          },
          py::arg("n"), "Keep only the first n committed cache entries (0 <= n <= cache_len) and drop the pending ones.")
      .def("reset",
           [](Model& self) {
             ModelUse use(&self, "reset");
             self.reset();
           })
      .def_property_readonly("cache_len", &Model::cache_len)
      .def_property_readonly("pending_len", &Model::pending_len)
      .def_property_readonly("max_seq_len", &Model::max_seq_len);
  return cls;
}

}  // namespace kdtree_py

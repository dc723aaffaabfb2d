// bind_model.cpp: Python bindings of the target model (cpp/model): _native.CpuModel, plus the
// SGEMM test hook _native.sgemm. Validates every input (dtype, shape, ranges) with a
// ValueError naming the problem before native memory is touched, and releases the GIL while
// the model computes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common.h"
#include "model/config.h"
#include "model_py.h"
#include "model/cpu_model.h"
#include "model/sgemm.h"

namespace py = pybind11;
using kdtree::Error;
using kdtree_py::config_from_dict;
using kdtree_py::dtype_str;
using kdtree_py::int_vector;
using kdtree_py::model_forward;
using kdtree_py::ModelUse;

namespace {

// The model plus the lock-free parts the binding needs.
using Model = kdtree::CpuModel;

py::array_t<float> sgemm_py(const py::array& a_obj, const py::array& b_obj, bool trans_b, float alpha, float beta,
                            const py::object& c_obj, bool portable) {
  auto chk = [](const py::array& x, const char* what) {
    if (x.dtype().kind() != 'f' || x.dtype().itemsize() != 4)
      throw Error(std::string("sgemm: ") + what + " must be float32, got " + dtype_str(x));
    if (x.ndim() != 2) throw Error(std::string("sgemm: ") + what + " must be 2-D");
    return py::array_t<float, py::array::c_style>::ensure(x);
  };
  auto A = chk(a_obj, "a");
  auto B = chk(b_obj, "b");
  const int64_t M = A.shape(0), K = A.shape(1);
  const int64_t N = trans_b ? B.shape(0) : B.shape(1);
  const int64_t KB = trans_b ? B.shape(1) : B.shape(0);
  if (KB != K) throw Error("sgemm: inner dimensions differ");
  py::array_t<float> C({(py::ssize_t)M, (py::ssize_t)N});
  if (!c_obj.is_none()) {
    auto c0 = chk(c_obj.cast<py::array>(), "c");
    if (c0.shape(0) != M || c0.shape(1) != N) throw Error("sgemm: c has the wrong shape");
    std::memcpy(C.mutable_data(), c0.data(), (size_t)(M * N) * sizeof(float));
  } else if (beta != 0.f) {
    throw Error("sgemm: beta != 0 needs c");
  } else {
    std::fill(C.mutable_data(), C.mutable_data() + M * N, std::numeric_limits<float>::quiet_NaN());  // poison
  }
  const float* pa = A.data();
  const float* pb = B.data();
  float* pc = C.mutable_data();
  {
    py::gil_scoped_release nogil;
    if (portable) kdtree::sgemm_portable(trans_b, M, N, K, alpha, pa, K, pb, trans_b ? K : N, beta, pc, N);
    else kdtree::sgemm(trans_b, M, N, K, alpha, pa, K, pb, trans_b ? K : N, beta, pc, N);
  }
  return C;
}

}  // namespace

void bind_model(py::module_& m) {
  m.def("sgemm_set_skinny_isa", [](const std::string& isa) { return kdtree::sgemm_set_skinny_isa(isa.c_str()); },
        py::arg("isa"),
        "Tests / benchmarks: 'avx2' or 'avx512' for the CPU skinny kernels from now on (process-wide); False where "
        "the CPU lacks it.");
  m.def("sgemm_skinny_isa", []() { return std::string(kdtree::sgemm_skinny_isa()); },
        "The CPU skinny GEMM kernels' vector ISA here: 'avx512', 'avx2' or 'none' (KDTREE_CPU_ISA=avx2 keeps AVX2).");
  m.def("sgemm_backend", []() { return std::string(kdtree::sgemm_backend()); },
        "Which SGEMM the CPU model uses now: 'cblas' or 'portable'.");
  m.def("sgemm_force_portable", &kdtree::sgemm_force_portable, py::arg("on"),
        "Process-wide: make the CPU model use the portable SGEMM even when CBLAS is built in (tests).");
  m.def("sgemm", &sgemm_py, py::arg("a"), py::arg("b"), py::arg("trans_b") = false, py::arg("alpha") = 1.0f,
        py::arg("beta") = 0.0f, py::arg("c") = py::none(), py::arg("portable") = false,
        "Test hook: alpha * a @ (b.T if trans_b else b) + beta * c with the CPU model's SGEMM "
        "(portable=True forces the portable kernel). float32 2-D arrays.");
  m.def(
      "model_weight_specs",
      [](const py::dict& cfg) {
        std::vector<std::pair<std::string, std::vector<int64_t>>> out;
        for (auto& s : kdtree::model_weight_specs(config_from_dict(cfg))) out.emplace_back(s.name, s.shape);
        return out;
      },
      py::arg("config"), "[(HF name, shape)] of every tensor the native model needs for this config.");

  kdtree_py::def_model_common(py::class_<Model>(m, "CpuModel",
                    "The CPU target model (DeepSeek-V3 / Kimi-K2, FP32 arithmetic). CpuModel(config_dict, max_seq_len, "
                    "bf16_weights='only', bf16_weight_copies=None) with config_dict = ModelConfig.to_native(). "
                    "bf16_weights: how a weight matrix whose values are all exactly BF16 (a BF16 checkpoint) is held: "
                    "'only' (as BF16, 2 bytes a weight), 'copies' (FP32 plus a BF16 copy for the few-row GEMMs, 6 "
                    "bytes) or 'off' (FP32, 4 bytes); the logits are the same bits in all three (docs/MODEL.md). "
                    "bf16_weight_copies (older name): False = 'off', True = 'copies'."))
      .def(py::init([](const py::dict& cfg, int64_t max_seq_len, const std::string& bf16_weights,
                       const py::object& bf16_weight_copies) {
             kdtree::ModelConfig c = config_from_dict(cfg);
             kdtree::Bf16Weights mode = kdtree::bf16_weights_from_name(bf16_weights);
             if (!bf16_weight_copies.is_none()) {
               if (!py::isinstance<py::bool_>(bf16_weight_copies))
                 throw Error("bf16_weight_copies must be True, False or None");
               const kdtree::Bf16Weights old = bf16_weight_copies.cast<bool>() ? kdtree::Bf16Weights::kCopies
                                                                               : kdtree::Bf16Weights::kOff;
               if (bf16_weights != "only" && mode != old)
                 throw Error("bf16_weight_copies=" + std::string(bf16_weight_copies.cast<bool>() ? "True" : "False") +
                             " contradicts bf16_weights='" + bf16_weights + "': give one of them");
               mode = old;
             }
             return new Model(c, max_seq_len, mode);
           }),
           py::arg("config"), py::arg("max_seq_len"), py::arg("bf16_weights") = "only",
           py::arg("bf16_weight_copies") = py::none())
      .def("forward", &model_forward<Model>, py::arg("tokens"), py::arg("positions"), py::arg("visibility") = py::none(),
           "Logits float32 [T, V] of T new tokens at `positions` against the cache; visibility bool/uint8 "
           "[T, T] (None = causal). The new entries stay pending until commit().")
      .def_property_readonly("device", [](const Model& self) { return std::string(self.device()); })
      .def_property_readonly("memory_bytes", &Model::memory_bytes)
      .def(
          "use_bf16_weights",
          [](Model& self, bool on) {
            ModelUse use(&self, "use_bf16_weights");
            self.use_bf16_weights(on);
          },
          py::arg("on"),
          "A/B switch: False holds every weight as FP32 (bf16_weights 'off'), True goes back to the mode the "
          "model was built with ('only' if that was 'off'). The logits are the same bits either way.")
      .def(
          "set_bf16_weights",
          [](Model& self, const std::string& mode) {
            const kdtree::Bf16Weights m = kdtree::bf16_weights_from_name(mode);
            ModelUse use(&self, "set_bf16_weights");
            self.set_bf16_weights(m);
          },
          py::arg("mode"), "Hold the exactly-BF16 weight matrices as 'only', 'copies' or 'off' from now on.")
      .def_property_readonly(
          "bf16_weights", [](const Model& self) { return std::string(kdtree::bf16_weights_name(self.bf16_weights())); },
          "How exactly-BF16 weight matrices are held now: 'only', 'copies' or 'off'.")
      .def_property_readonly("bf16_weight_bytes", &Model::bf16_weight_bytes,
                             "Bytes of weight matrices held as BF16 (0: every GEMM reads FP32).")
      .def_property_readonly("fp32_weight_bytes", &Model::fp32_weight_bytes,
                             "Bytes of weight matrices held as FP32 (norm weights and biases not counted).")
      .def(
          "read_cache",
          [](const Model& self, int64_t layer, int64_t begin, int64_t n) {
            const int64_t CR = self.config().kv_lora_rank + self.config().qk_rope_head_dim;
            if (n < 0) throw Error("read_cache: negative count");
            if (begin < 0 || n > self.max_seq_len() || begin > self.max_seq_len() - n)  // (before the output is made)
              throw Error("read_cache: rows [" + std::to_string(begin) + ", " + std::to_string(begin) + " + " +
                          std::to_string(n) + ") outside the cache of " + std::to_string(self.max_seq_len()) + " rows");
            py::array_t<float> out({(py::ssize_t)n, (py::ssize_t)CR});
            self.read_cache(layer, begin, n, out.mutable_data());
            return out;
          },
          py::arg("layer"), py::arg("begin"), py::arg("n"),
          "Latent cache rows [begin, begin+n) of a layer: float32 [n, kv_lora_rank + qk_rope_head_dim].");
}

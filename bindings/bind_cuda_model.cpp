// bind_cuda_model.cpp: Python bindings of the GPU target model (cuda/model/cuda_model.h) as
// _native.CudaModel, with the same methods as _native.CpuModel (set_weight / finalize /
// forward / commit / reset / cache_len ...) plus a device-pointer path for the GPU round
// (forward_ptr / commit_ptr / set_committed: integer addresses of device buffers, e.g. torch
// CUDA tensors' data_ptr()). Also _native.cublas_probe() -> (ok, path or error). Validates
// every input with a ValueError naming the problem and releases the GIL while the model runs.
// Without the CUDA backend or without cuBLAS headers at build time, CudaModel is not bound.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

namespace py = pybind11;

#if defined(KDTREE_HAVE_CUDA) && defined(KDTREE_HAVE_CUBLAS)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <vector>

#include "common.h"
#include "model/config.h"
#include "model/cublas_loader.h"
#include "model/cuda_model.h"
#include "model_py.h"

using kdtree::Error;
using kdtree_py::config_from_dict;
using kdtree_py::dtype_str;
using kdtree_py::int_vector;
using kdtree_py::model_forward;
using kdtree_py::ModelUse;

namespace {

// An integer device address; ValueError when it is 0, misaligned or not device memory.
template <class P>
P* device_ptr(uintptr_t addr, const char* what, bool allow_null = false) {
  if (addr == 0) {
    if (allow_null) return nullptr;
    throw Error(std::string(what) + ": null pointer");
  }
  if (addr % alignof(P) != 0) throw Error(std::string(what) + ": pointer not aligned to " + std::to_string(alignof(P)) + " bytes");
  cudaPointerAttributes at;
  if (cudaPointerGetAttributes(&at, reinterpret_cast<void*>(addr)) != cudaSuccess) {
    cudaGetLastError();
    throw Error(std::string(what) + ": not a CUDA pointer");
  }
  if (at.type != cudaMemoryTypeDevice && at.type != cudaMemoryTypeManaged)
    throw Error(std::string(what) + ": expected device memory (got host or unregistered memory)");
  return reinterpret_cast<P*>(addr);
}

using Model = kdtree::CudaModel;

int parse_choice(const std::string& v, const char* what, std::initializer_list<const char*> names) {
  int i = 0;
  std::string all;
  for (const char* n : names) {
    if (v == n) return i;
    all += (i ? ", " : "") + std::string("'") + n + "'";
    ++i;
  }
  throw Error(std::string(what) + " must be one of " + all + ", got '" + v + "'");
}

}  // namespace

void bind_cuda_model(py::module_& m) {
  m.def(
      "cublas_probe",
      []() {
        std::string info;
        const bool ok = kdtree::cuda::cublas_probe(&info);
        return py::make_tuple(ok, info);
      },
      "(ok, path or error): whether cuBLAS loads at run time (dlopen), and from where.");

  m.def(
      "cuda_bf16_only_unsupported",
      [](const py::dict& cfg, bool tile_tensor_cores, const std::string& expert_kernel) {
        kdtree::CudaModelOptions o;
        o.tile_tensor_cores = tile_tensor_cores;
        o.expert_kernel = parse_choice(expert_kernel, "expert_kernel", {"auto", "skinny", "tiled", "mma"});
        return Model::bf16_only_unsupported(config_from_dict(cfg), o);
      },
      py::arg("config"), py::arg("tile_tensor_cores") = true, py::arg("expert_kernel") = "auto",
      "Why CudaModel(bf16_weights='only') cannot hold this config with these options ('' when it can).");

  m.def(
      "cuda_matrix_block",
      [](const py::dict& cfg, const std::string& name) { return Model::matrix_block(config_from_dict(cfg), name); },
      py::arg("config"), py::arg("name"),
      "The storage block of the GPU model an HF weight matrix lands in (what fp32_matrices holds as FP32 whole: "
      "'<layer>.router' holds the router and the shared expert's gate/up rows, '<layer>.experts_down' a layer's "
      "routed down projections, ...); '' for a name that is not a weight matrix of this config.");

  m.def(
      "cuda_int4_experts_unsupported",
      [](const py::dict& cfg, int64_t group, const std::string& expert_kernel) {
        kdtree::CudaModelOptions o;
        o.expert_kernel = parse_choice(expert_kernel, "expert_kernel", {"auto", "skinny", "tiled", "mma"});
        return Model::int4_experts_unsupported(config_from_dict(cfg), o, group);
      },
      py::arg("config"), py::arg("group"), py::arg("expert_kernel") = "auto",
      "Why CudaModel(int4_experts_group=group) cannot hold this config with these options ('' when it can).");

  kdtree_py::def_model_common(py::class_<Model>(m, "CudaModel",
                    "The GPU target model (DeepSeek-V3 / Kimi-K2, FP32, cuBLAS). CudaModel(config_dict, max_seq_len, "
                    "max_tokens=0, device=0, math='default', attention_naive=False, expert_kernel='auto', graphs=True, skinny_max_tokens=-1, "
                    "attention_kernel='auto', side_stream=True, skinny_big_max_tokens=-1, tile_max_tokens=-1, "
                    "tile_tensor_cores=True, expert_mma_rows=0, bf16_weight_copies=True, uv_combine_max_tokens=1, "
                    "context_buckets=1, combine_norm=True, bf16_weights=None, bf16_widen_elements=0, int4_experts_group=0, fp32_matrices=(), row_exact=False, q_fold_max_tokens=-1) with "
                    "config_dict = ModelConfig.to_native(); the same methods as CpuModel. bf16_weights: 'copies' "
                    "(exactly-BF16 matrices held as FP32 plus a BF16 copy the few-token kernels read), 'off' (FP32 "
                    "alone), 'only' (every matrix held as BF16 alone, 2 bytes a weight; each matrix given must be "
                    "exactly BF16); None: from bf16_weight_copies. The same logits in all three (docs/CUDA_MODEL.md). "
                    "int4_experts_group > 0: the routed experts held as 4-bit integers in groups of that many "
                    "weights (set_weight_int4; docs/CUDA_MODEL.md \"INT4 experts\"). fp32_matrices (with 'only'): HF "
                    "names of matrices held as FP32 all the same (a checkpoint storing a few in F32). row_exact: steps of up "
                    "to 264 tokens on kernels whose rows do not depend on the other rows (a tree node's logits are the "
                    "one-token step's bits; slower; docs/CUDA_MODEL.md \"Row-exact steps\"). q_fold_max_tokens: steps of 5 up to "
                    "that many tokens project the queries through one folded matrix (-1 auto: 24 where the folded rows "
                    "are small, else never; 0 never; FP32 q-LoRA models; docs/CUDA_MODEL.md \"Folded query projection\")."))
      .def(py::init([](const py::dict& cfg, int64_t max_seq_len, int64_t max_tokens, int device, const std::string& math,
                       bool attention_naive, const std::string& expert_kernel, bool graphs, int skinny_max_tokens,
                       const std::string& attention_kernel, bool side_stream, int skinny_big_max_tokens, int tile_max_tokens,
                       bool tile_tensor_cores, int expert_mma_rows, bool bf16_weight_copies, int uv_combine_max_tokens,
                       int context_buckets, bool combine_norm, const py::object& bf16_weights,
                       int64_t bf16_widen_elements, int int4_experts_group,
                       const std::vector<std::string>& fp32_matrices, bool row_exact, int q_fold_max_tokens) {
             kdtree::ModelConfig c = config_from_dict(cfg);
             kdtree::CudaModelOptions o;
             o.max_tokens = max_tokens;
             o.device = device;
             o.math = parse_choice(math, "math", {"default", "pedantic", "tf32"});
             o.attention_naive = attention_naive;
             o.expert_kernel = parse_choice(expert_kernel, "expert_kernel", {"auto", "skinny", "tiled", "mma"});
             o.graphs = graphs;
             o.skinny_max_tokens = skinny_max_tokens;
             o.side_stream = side_stream;
             o.skinny_big_max_tokens = skinny_big_max_tokens;
             o.tile_max_tokens = tile_max_tokens;
             o.tile_tensor_cores = tile_tensor_cores;
             o.expert_mma_rows = expert_mma_rows;
             o.bf16_weight_copies = bf16_weight_copies;
             o.bf16_widen_elements = bf16_widen_elements;
             o.int4_experts_group = int4_experts_group;
             o.fp32_matrices = fp32_matrices;
             if (!bf16_weights.is_none()) {
               if (!py::isinstance<py::str>(bf16_weights)) throw Error("bf16_weights must be 'only', 'copies', 'off' or None");
               const int mode = parse_choice(bf16_weights.cast<std::string>(), "bf16_weights", {"off", "copies", "only"});
               if (mode != 0 && !bf16_weight_copies)
                 throw Error("bf16_weight_copies=False contradicts bf16_weights='" + bf16_weights.cast<std::string>() +
                             "': give one of them");
               o.bf16_weight_copies = mode >= 1;
               o.bf16_weights_only = mode == 2;
             }
             if (!fp32_matrices.empty() && !o.bf16_weights_only)  // (after bf16_weights is read)
               throw Error("fp32_matrices goes with bf16_weights='only' (the other modes hold every matrix as FP32)");
             o.uv_combine_max_tokens = uv_combine_max_tokens;
             o.context_buckets = context_buckets;
             o.combine_norm = combine_norm;
             o.row_exact = row_exact;
             o.q_fold_max_tokens = q_fold_max_tokens;
             const int ak = parse_choice(attention_kernel, "attention_kernel",
                                         {"auto", "tiled", "splitkv", "decode", "splitkv16", "splitkv8", "splitkv4", "mma"});
             o.attention_kernel = ak == 7 ? 4 : ak >= 4 ? 2 : ak;  // splitkv16 / 8 / 4: split-KV with
             o.attention_rows = ak == 4 ? 16 : ak == 5 ? 8 : ak == 6 ? 4 : 0;  // that many query rows per block
             py::gil_scoped_release nogil;
             return new Model(c, max_seq_len, o);
           }),
           py::arg("config"), py::arg("max_seq_len"), py::arg("max_tokens") = 0, py::arg("device") = 0,
           py::arg("math") = "default", py::arg("attention_naive") = false, py::arg("expert_kernel") = "auto",
           py::arg("graphs") = true, py::arg("skinny_max_tokens") = -1, py::arg("attention_kernel") = "auto",
           py::arg("side_stream") = true, py::arg("skinny_big_max_tokens") = -1,
           py::arg("tile_max_tokens") = -1, py::arg("tile_tensor_cores") = true, py::arg("expert_mma_rows") = 0,
           py::arg("bf16_weight_copies") = true, py::arg("uv_combine_max_tokens") = 1, py::arg("context_buckets") = 1,
           py::arg("combine_norm") = true, py::arg("bf16_weights") = py::none(),
           py::arg("bf16_widen_elements") = 0, py::arg("int4_experts_group") = 0,
           py::arg("fp32_matrices") = std::vector<std::string>(), py::arg("row_exact") = false,
           py::arg("q_fold_max_tokens") = -1)
      .def(
          "context_bucket",
          [](const Model& self, int64_t L, int64_t T) {
            if (L < 0 || T < 1 || L + T > self.max_seq_len())
              throw kdtree::Error("context_bucket: need L >= 0, T >= 1 and L + T <= max_seq_len (" +
                                  std::to_string(self.max_seq_len()) + "), got L = " + std::to_string(L) +
                                  ", T = " + std::to_string(T));
            return self.context_bucket(L, T);
          },
          py::arg("L"), py::arg("T"),
           "the context bucket of a T-token step at committed length L: the upper bound of L its attention "
           "(grid, kernel, key splits) is sized for")
      .def_property_readonly("graph_replays", &Model::graph_replays,
                             "forward_device calls served by a CUDA graph replay so far")
      .def_property_readonly("graph_captures", &Model::graph_captures, "CUDA graphs captured so far")
      .def("forward", &model_forward<Model>, py::arg("tokens"), py::arg("positions"), py::arg("visibility") = py::none(),
           "Logits float32 [T, V] of T new tokens at `positions` against the cache; visibility bool/uint8 "
           "[T, T] (None = causal, run in chunks of max_tokens when longer). Entries stay pending until commit().")
      .def_property_readonly("max_tokens", &Model::max_tokens)
      .def_property_readonly("device", [](const Model& self) { return std::string(self.device()); })
      .def_property_readonly("device_name", &Model::device_name)
      .def_property_readonly("cublas_library", &Model::cublas_path)
      .def_property_readonly("memory_bytes", &Model::memory_bytes)
      .def_property_readonly("weight_bytes", &Model::weight_bytes)
      .def_property_readonly("cache_bytes", &Model::cache_bytes)
      .def_property_readonly("workspace_bytes", &Model::workspace_bytes)
      .def_property_readonly("bf16_weight_bytes", &Model::bf16_weight_bytes,
                             "Device bytes of the BF16 weight copies (0 without a BF16-exact weight or with "
                             "bf16_weight_copies=False); made at finalize()")
      .def_property_readonly(
          "bf16_weights",
          [](const Model& self) {
            return std::string(self.bf16_weights_only() ? "only" : self.bf16_weight_copies() ? "copies" : "off");
          },
          "How the model holds exactly-BF16 weight matrices: 'only', 'copies' or 'off'.")
      .def_property_readonly("int4_experts_group", &Model::int4_experts_group,
                             "Group size of the routed experts held as 4-bit integers (0: held as the other matrices)")
      .def_property_readonly("bf16_weight_elements", &Model::bf16_weight_elements,
                             "How many weight values the BF16 copies cover (those read as BF16 by the few-token kernels)")
      .def(
          "read_cache",
          [](Model& self, int64_t layer, int64_t begin, int64_t n) {
            const int64_t CR = self.config().kv_lora_rank + self.config().qk_rope_head_dim;
            if (n < 0) throw Error("read_cache: negative count");
            if (begin < 0 || n > self.max_seq_len() || begin > self.max_seq_len() - n)  // (before the output is made)
              throw Error("read_cache: rows [" + std::to_string(begin) + ", " + std::to_string(begin) + " + " +
                          std::to_string(n) + ") outside the cache of " + std::to_string(self.max_seq_len()) + " rows");
            py::array_t<float> out({(py::ssize_t)n, (py::ssize_t)CR});
            float* o = out.mutable_data();
            py::gil_scoped_release nogil;
            self.read_cache(layer, begin, n, o);
            return out;
          },
          py::arg("layer"), py::arg("begin"), py::arg("n"),
          "Latent cache rows [begin, begin+n) of a layer: float32 [n, kv_lora_rank + qk_rope_head_dim].")
      .def(
          "last_expert_counts",
          [](Model& self) {
            std::vector<int32_t> c;
            {
              py::gil_scoped_release nogil;
              c = self.last_expert_counts();
            }
            const int64_t E = self.config().n_routed_experts;
            const int64_t rows = E > 0 ? (int64_t)c.size() / E : 0;
            py::array_t<int32_t> out({(py::ssize_t)rows, (py::ssize_t)(rows ? E : 0)});
            if (!c.empty()) std::memcpy(out.mutable_data(), c.data(), c.size() * sizeof(int32_t));
            return out;
          },
          "Tokens routed to each expert in the last forward, int32 [MoE layers, n_routed_experts] (the last "
          "chunk of a chunked forward).")
      .def(
          "forward_ptr",
          [](Model& self, uintptr_t tokens, uintptr_t positions, uintptr_t vis, int64_t vis_stride, int64_t T,
             uintptr_t logits, bool sync) {
            const int32_t* tk = device_ptr<const int32_t>(tokens, "tokens_ptr");
            const int32_t* ps = device_ptr<const int32_t>(positions, "positions_ptr");
            const uint64_t* vb = device_ptr<const uint64_t>(vis, "vis_ptr", true);
            float* lg = device_ptr<float>(logits, "logits_ptr");
            ModelUse use(&self, "forward_ptr");
            py::gil_scoped_release nogil;
            self.forward_device(tk, ps, vb, vis_stride, T, lg);
            if (sync) self.synchronize();
          },
          py::arg("tokens_ptr"), py::arg("positions_ptr"), py::arg("vis_ptr"), py::arg("vis_stride"), py::arg("T"),
          py::arg("logits_ptr"), py::arg("sync") = true,
          "Device path: int32 tokens [T], int32 positions [T], uint64 visibility bitmask [T, vis_stride] "
          "(vis_ptr 0 = causal), float32 logits [T, V], all device addresses; runs on the model's stream "
          "(`stream`), synchronised only when sync=True. T <= max_tokens.")
      .def(
          "commit_ptr",
          [](Model& self, uintptr_t keep, uintptr_t count) {
            const int32_t* k = device_ptr<const int32_t>(keep, "keep_ptr");
            const int32_t* c = device_ptr<const int32_t>(count, "count_ptr");
            ModelUse use(&self, "commit_ptr");
            py::gil_scoped_release nogil;
            self.commit_device(k, c);
          },
          py::arg("keep_ptr"), py::arg("count_ptr"),
          "Device path: compact pending entries keep[0..*count) after the context (queued on `stream`); "
          "then call set_committed(count) once the count is known on the host.")
      .def(
          "set_committed",
          [](Model& self, int64_t n) {
            ModelUse use(&self, "set_committed");
            self.set_committed(n);
          },
          py::arg("n"))
      .def("synchronize", &Model::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("stream", [](const Model& self) { return reinterpret_cast<uintptr_t>(self.stream()); },
                             "The model's cudaStream_t as an integer (torch.cuda.ExternalStream(ptr)).");
}

#else  // no CUDA backend or no cuBLAS headers

void bind_cuda_model(py::module_& m) {
  m.def(
      "cublas_probe",
      []() {
#ifdef KDTREE_HAVE_CUDA
        return py::make_tuple(false, std::string("built without cuBLAS headers"));
#else
        return py::make_tuple(false, std::string("built without CUDA"));
#endif
      },
      "(ok, path or error): whether cuBLAS loads at run time; False in this build.");
}

#endif

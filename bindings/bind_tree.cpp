// bind_tree.cpp: Python bindings of the host tree ops (cpp/tree.h) as kdtree_native._native.*_cpu.
// Everything is validated here (dtype, shape, ranges, values) before native memory is touched;
// problems raise ValueError naming them. The native work runs with the GIL released.
// Python users call kdtree_native.ops (which also validates, identically to the reference).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "tree.h"

namespace py = pybind11;

namespace {

// A C-contiguous view of `obj` as T, after checking it is a numpy array of dtype T and `ndim`.
template <typename T>
py::array_t<T, py::array::c_style> as_array(const py::handle& obj, const char* name, int ndim) {
  if (!py::isinstance<py::array>(obj))
    throw py::value_error(std::string(name) + " must be a numpy array, got " +
                          std::string(py::str(py::type::of(obj).attr("__name__"))));
  py::array arr = py::reinterpret_borrow<py::array>(obj);
  if (!arr.dtype().is(py::dtype::of<T>()))
    throw py::value_error(std::string(name) + " must have dtype " + std::string(py::str(py::dtype::of<T>())) +
                          ", got " + std::string(py::str(arr.dtype())));
  if (arr.ndim() != ndim)
    throw py::value_error(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                          std::to_string(arr.ndim()) + "-D");
  return py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(arr);
}

// Integer ids given as int32 or int64, as int32 (int64 values must fit).
std::vector<int32_t> as_int32_ids(const py::handle& obj, const char* name, int ndim, std::vector<int64_t>* shape) {
  if (!py::isinstance<py::array>(obj)) throw py::value_error(std::string(name) + " must be a numpy array");
  py::array arr = py::reinterpret_borrow<py::array>(obj);
  if (arr.ndim() != ndim)
    throw py::value_error(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                          std::to_string(arr.ndim()) + "-D");
  shape->assign(arr.shape(), arr.shape() + arr.ndim());
  std::vector<int32_t> out(arr.size());
  if (arr.dtype().is(py::dtype::of<int32_t>())) {
    auto a = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    std::copy(a.data(), a.data() + a.size(), out.begin());
  } else if (arr.dtype().is(py::dtype::of<int64_t>())) {
    auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    for (py::ssize_t i = 0; i < a.size(); ++i) {
      const int64_t v = a.data()[i];
      if (v < INT32_MIN || v > INT32_MAX)
        throw py::value_error(std::string(name) + " value " + std::to_string(v) + " does not fit int32");
      out[i] = static_cast<int32_t>(v);
    }
  } else {
    throw py::value_error(std::string(name) + " must have dtype int32 or int64, got " + std::string(py::str(arr.dtype())));
  }
  return out;
}

// A 1-D or 2-D numpy array viewing `data` (owned by `owner`).
template <typename T>
py::array_t<T> view(std::vector<py::ssize_t> shape, const T* data, const py::capsule& owner) {
  return py::array_t<T>(shape, data, owner);
}

struct TreeInputs {
  py::array_t<float, py::array::c_style> logprobs;
  std::vector<int32_t> ids;
  int64_t D = 0, K = 0, budget = 0;
};

TreeInputs tree_inputs(const py::object& logprobs, const py::object& token_ids, int64_t budget) {
  TreeInputs in;
  in.logprobs = as_array<float>(logprobs, "logprobs", 2);
  std::vector<int64_t> shape;
  in.ids = as_int32_ids(token_ids, "token_ids", 2, &shape);
  in.D = in.logprobs.shape(0);
  in.K = in.logprobs.shape(1);
  if (shape[0] != in.D || shape[1] != in.K)
    throw py::value_error("token_ids shape must equal logprobs shape [" + std::to_string(in.D) + ", " +
                          std::to_string(in.K) + "]");
  in.budget = budget;
  std::string err;
  {
    py::gil_scoped_release nogil;
    err = kdtree::tree_build_input_error(in.logprobs.data(), in.ids.data(), in.D, in.K, budget);
  }
  if (!err.empty()) throw py::value_error("tree_build: " + err);
  return in;
}

}  // namespace

void bind_tree(py::module_& m) {
  m.attr("TREE_MAX_DEPTH") = kdtree::kTreeMaxDepth;
  m.attr("TREE_MAX_BUDGET") = kdtree::kTreeMaxBudget;

  m.def(
      "tree_build_cpu",
      [](const py::object& logprobs, const py::object& token_ids, int64_t budget) {
        TreeInputs in = tree_inputs(logprobs, token_ids, budget);
        auto* tree = new kdtree::Tree();
        py::capsule owner(tree, [](void* p) { delete static_cast<kdtree::Tree*>(p); });
        {
          py::gil_scoped_release nogil;
          thread_local kdtree::TreeBuildWorkspace ws;
          kdtree::tree_build(in.logprobs.data(), in.ids.data(), in.D, in.K, in.budget, tree, &ws);
        }
        const py::ssize_t n = tree->n;
        return py::make_tuple(view<int32_t>({n}, tree->tokens.data(), owner),
                              view<int32_t>({n}, tree->depths.data(), owner),
                              view<int32_t>({n + 1}, tree->parents.data(), owner),
                              view<uint64_t>({n + 1, static_cast<py::ssize_t>(tree->vis_words)},
                                             tree->visibility.data(), owner));
      },
      py::arg("logprobs"), py::arg("token_ids"), py::arg("budget"),
      "Best-first DDTree build. logprobs float32 [D,K] (rows sorted descending), token_ids int32/int64\n"
      "[D,K], budget >= 0 -> (tokens int32 [n], depths int32 [n], parents int32 [n+1],\n"
      "visibility uint64 [n+1, ceil((n+1)/64)] bitmask: bit j%64 of word j//64 of row i = i sees j).");

  m.def(
      "tree_build_cpu_timing",
      [](const py::object& logprobs, const py::object& token_ids, int64_t budget, int64_t repeats) {
        if (repeats < 1) throw py::value_error("repeats must be >= 1");
        TreeInputs in = tree_inputs(logprobs, token_ids, budget);
        py::array_t<double> seconds(repeats);
        double* out = seconds.mutable_data();
        {
          py::gil_scoped_release nogil;
          kdtree::TreeBuildWorkspace ws;
          kdtree::Tree tree;
          for (int64_t i = 0; i < repeats; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            kdtree::tree_build(in.logprobs.data(), in.ids.data(), in.D, in.K, in.budget, &tree, &ws);
            const auto t1 = std::chrono::steady_clock::now();
            out[i] = std::chrono::duration<double>(t1 - t0).count();
          }
        }
        return seconds;
      },
      py::arg("logprobs"), py::arg("token_ids"), py::arg("budget"), py::arg("repeats"),
      "Benchmark helper: seconds of each of `repeats` native tree builds (workspace reused,\n"
      "timed in C++, visibility bitmask included, no Python conversion).");

  m.def(
      "tree_accept_cpu",
      [](const py::object& parents, const py::object& tokens, const py::object& choice) {
        auto par = as_array<int32_t>(parents, "parents", 1);
        auto tok = as_array<int32_t>(tokens, "tokens", 1);
        const int64_t n = tok.shape(0);
        if (par.shape(0) != n + 1)
          throw py::value_error("parents must have shape [n+1] = [" + std::to_string(n + 1) + "], got [" +
                                std::to_string(par.shape(0)) + "]");
        if (!py::isinstance<py::array>(choice)) throw py::value_error("choice must be a numpy array");
        py::array ch_arr = py::reinterpret_borrow<py::array>(choice);
        if (!(ch_arr.dtype().is(py::dtype::of<int32_t>()) || ch_arr.dtype().is(py::dtype::of<int64_t>())))
          throw py::value_error("choice must have dtype int32 or int64, got " + std::string(py::str(ch_arr.dtype())));
        if (ch_arr.ndim() != 1 || ch_arr.shape(0) != n + 1)
          throw py::value_error("choice must have shape [n+1] = [" + std::to_string(n + 1) + "]");
        auto ch = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(ch_arr);
        const std::string err = kdtree::tree_structure_error(par.data(), n);
        if (!err.empty()) throw py::value_error("tree_accept: " + err);
        std::vector<int32_t> path(n + 1);
        int64_t bonus = 0, len = 0;
        {
          py::gil_scoped_release nogil;
          len = kdtree::tree_accept(par.data(), tok.data(), n, ch.data(), path.data(), &bonus);
        }
        py::array_t<int32_t> out(len);
        std::copy(path.begin(), path.begin() + len, out.mutable_data());
        return py::make_tuple(out, bonus);
      },
      py::arg("parents"), py::arg("tokens"), py::arg("choice"),
      "Accept walk. parents int32 [n+1], tokens int32 [n], choice int32/int64 [n+1]\n"
      "-> (path int32 [m] node indices from 0, bonus token int).");

  m.def(
      "topk_logsoftmax_cpu",
      [](const py::object& logits, int64_t k) {
        auto x = as_array<float>(logits, "logits", 2);
        const int64_t D = x.shape(0), V = x.shape(1);
        std::string err;
        {
          py::gil_scoped_release nogil;
          err = kdtree::topk_logsoftmax_input_error(x.data(), D, V, k);
        }
        if (!err.empty()) throw py::value_error("topk_logsoftmax: " + err);
        const int64_t kk = std::min(k, V);
        py::array_t<float> lp({D, kk});
        py::array_t<int32_t> ids({D, kk});
        float* lp_out = lp.mutable_data();
        int32_t* ids_out = ids.mutable_data();
        {
          py::gil_scoped_release nogil;
          kdtree::topk_logsoftmax(x.data(), D, V, k, lp_out, ids_out);
        }
        return py::make_tuple(lp, ids);
      },
      py::arg("logits"), py::arg("k"),
      "Top-k + log-softmax. logits float32 [D,V], k >= 1 -> (logprobs float32 [D,min(k,V)],\n"
      "ids int32 [D,min(k,V)]), rows sorted descending, ties by lower id.");
}

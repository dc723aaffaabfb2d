// bind_cuda.cpp: Python bindings of the DDTree CUDA kernels (cuda/kernels.h) as
// kdtree_native._native.cuda_*. Compiled in every build; without the CUDA backend
// (KDTREE_HAVE_CUDA undefined) it binds nothing and kdtree_native._cuda_ops reports that.
//
// Two kinds of entry points:
//  * numpy in / numpy out (cuda_tree_build, cuda_verify_attention, ...): validate everything,
//    copy to the device, run, copy back; device outputs are poisoned first (0xFF bytes: -1 for
//    ints, NaN for floats) so unwritten elements show. Used by kdtree_native._cuda_ops + tests.
//  * device pointers (cuda_*_ptr): integer addresses of device buffers (torch/cupy tensors,
//    the GPU engine), a stream handle; only shape arguments are checked. They return at once.
//  * timing helpers (cuda_time_*): run a kernel many times on device-resident inputs and return
//    per-launch CUDA-event times in milliseconds (benchmarks/bench_cuda_*.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;

#ifdef KDTREE_HAVE_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "model/bf16.h"
#include "kernels.h"
#include "engine/choose_kernels.h"
#include "engine/round_kernels.h"
#include "model/model_kernels.h"

namespace {

namespace kc = kdtree::cuda;

void check_cuda(cudaError_t e, const char* what) {
  if (e == cudaErrorInvalidValue) {
    cudaGetLastError();
    throw kdtree::Error(std::string(what) + ": invalid arguments (cudaErrorInvalidValue)");
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw kdtree::RuntimeFailure(std::string(what) + ": " + cudaGetErrorString(e));
  }
}

// A device buffer (RAII).
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t n) : bytes(n) {
    if (n) check_cuda(cudaMalloc(&p, n), "cudaMalloc");
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; o.bytes = 0; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      if (p) cudaFree(p);
      p = o.p; bytes = o.bytes; o.p = nullptr; o.bytes = 0;
    }
    return *this;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
  void upload(const void* src, size_t n) {
    if (n) check_cuda(cudaMemcpy(p, src, n, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  void download(void* dst, size_t n) const {
    if (n) check_cuda(cudaMemcpy(dst, p, n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }
  void poison() {
    if (bytes) check_cuda(cudaMemset(p, 0xFF, bytes), "cudaMemset");
  }
};

void require_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    throw kdtree::RuntimeFailure("no usable CUDA device");
  }
}

template <typename T>
py::array_t<T, py::array::c_style> as_c(const py::handle& obj, const char* name, int ndim) {
  if (!py::isinstance<py::array>(obj))
    throw kdtree::Error(std::string(name) + " must be a numpy array");
  py::array arr = py::reinterpret_borrow<py::array>(obj);
  if (!arr.dtype().is(py::dtype::of<T>()))
    throw kdtree::Error(std::string(name) + " must have dtype " + std::string(py::str(py::dtype::of<T>())) +
                        ", got " + std::string(py::str(arr.dtype())));
  if (arr.ndim() != ndim)
    throw kdtree::Error(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                        std::to_string(arr.ndim()) + "-D");
  return py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(arr);
}

template <typename T>
py::array_t<T> to_numpy(const DevBuf& b, std::vector<py::ssize_t> shape) {
  py::array_t<T> out(shape);
  b.download(out.mutable_data(), (size_t)out.size() * sizeof(T));
  return out;
}

float median_of(std::vector<float> v) {
  if (v.empty()) return 0.f;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times `launch(stream)`: (1) `iters` launches on one stream, an event pair around each
// (includes launch gaps when the host is slower than the GPU); (2) CUDA-graph replay of
// kGraphOps back-to-back launches, per-op time = graph time / kGraphOps (the GPU time an
// engine round that replays a graph sees). The SMs are kept busy for 150 ms first so their
// clocks leave the idle state. Returns {stream ms per launch, graph ms per op}.
constexpr int kGraphOps = 10;
struct Timing {
  std::vector<float> stream, graph;
};
template <class F>
Timing time_op(F launch, int iters, int warmup, int graph_ops = kGraphOps) {
  Timing out;
  cudaStream_t s;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  int sms = 132;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  check_cuda(kc::gpu_spin(150.0, 2 * sms, s), "spin");
  for (int i = 0; i < warmup; ++i) check_cuda(launch(s), "warmup launch");
  check_cuda(cudaStreamSynchronize(s), "sync");
  std::vector<cudaEvent_t> ev(iters + 1);
  for (auto& e : ev) check_cuda(cudaEventCreate(&e), "cudaEventCreate");
  check_cuda(cudaEventRecord(ev[0], s), "record");
  for (int i = 0; i < iters; ++i) {
    check_cuda(launch(s), "timed launch");
    check_cuda(cudaEventRecord(ev[i + 1], s), "record");
  }
  check_cuda(cudaEventSynchronize(ev[iters]), "sync");
  out.stream.resize(iters);
  for (int i = 0; i < iters; ++i) check_cuda(cudaEventElapsedTime(&out.stream[i], ev[i], ev[i + 1]), "elapsed");
  // graph replay
  cudaGraph_t g;
  cudaGraphExec_t ge;
  check_cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
  for (int i = 0; i < graph_ops; ++i) {
    cudaError_t e = launch(s);
    if (e != cudaSuccess) {
      cudaGraph_t dummy;
      cudaStreamEndCapture(s, &dummy);
      check_cuda(e, "captured launch");
    }
  }
  check_cuda(cudaStreamEndCapture(s, &g), "end capture");
  check_cuda(cudaGraphInstantiate(&ge, g, 0), "instantiate");
  const int reps = std::max(5, iters / graph_ops);
  for (int i = 0; i < 3; ++i) check_cuda(cudaGraphLaunch(ge, s), "graph");
  check_cuda(kc::gpu_spin(20.0, 2 * sms, s), "spin");
  std::vector<cudaEvent_t> gv(reps + 1);
  for (auto& e : gv) check_cuda(cudaEventCreate(&e), "cudaEventCreate");
  check_cuda(cudaEventRecord(gv[0], s), "record");
  for (int i = 0; i < reps; ++i) {
    check_cuda(cudaGraphLaunch(ge, s), "graph");
    check_cuda(cudaEventRecord(gv[i + 1], s), "record");
  }
  check_cuda(cudaEventSynchronize(gv[reps]), "sync");
  out.graph.resize(reps);
  for (int i = 0; i < reps; ++i) {
    check_cuda(cudaEventElapsedTime(&out.graph[i], gv[i], gv[i + 1]), "elapsed");
    out.graph[i] /= graph_ops;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  for (auto& e : gv) cudaEventDestroy(e);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  return out;
}

// Stream-only timing (for copies), one event pair per launch on the legacy stream.
template <class F>
std::vector<float> time_launches(F launch, int iters, int warmup) {
  for (int i = 0; i < warmup; ++i) check_cuda(launch(), "warmup launch");
  check_cuda(cudaDeviceSynchronize(), "sync");
  std::vector<cudaEvent_t> ev(iters + 1);
  for (auto& e : ev) check_cuda(cudaEventCreate(&e), "cudaEventCreate");
  check_cuda(cudaEventRecord(ev[0], 0), "record");
  for (int i = 0; i < iters; ++i) {
    check_cuda(launch(), "timed launch");
    check_cuda(cudaEventRecord(ev[i + 1], 0), "record");
  }
  check_cuda(cudaEventSynchronize(ev[iters]), "sync");
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) check_cuda(cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]), "elapsed");
  for (auto& e : ev) cudaEventDestroy(e);
  return ms;
}

void put_timing(py::dict& d, const std::string& prefix, const Timing& t) {
  d[py::str(prefix + "stream_ms")] = t.stream;
  d[py::str(prefix + "graph_ms")] = t.graph;
  d[py::str(prefix + "median_ms")] = median_of(t.stream);
  d[py::str(prefix + "graph_median_ms")] = median_of(t.graph);
}

// ---------------------------------------------------------------- tree build
struct TreeDev {
  int B, W;
  DevBuf tokens, depths, parents, positions, vis, n, path;
  explicit TreeDev(int budget)
      : B(budget), W(kc::tree_vis_words(budget)),
        tokens(sizeof(int32_t) * std::max(budget, 1)), depths(sizeof(int32_t) * std::max(budget, 1)),
        parents(sizeof(int32_t) * (budget + 1)), positions(sizeof(int32_t) * (budget + 1)),
        vis(sizeof(uint64_t) * (size_t)(budget + 1) * kc::tree_vis_words(budget)), n(4), path(4) {}
  void poison() {
    tokens.poison(); depths.poison(); parents.poison(); positions.poison(); vis.poison(); n.poison(); path.poison();
  }
  void fill(kc::TreeBuildParams& p) {
    p.tokens = tokens.as<int32_t>();
    p.depths = depths.as<int32_t>();
    p.parents = parents.as<int32_t>();
    p.positions = positions.as<int32_t>();
    p.visibility = vis.as<uint64_t>();
    p.n_nodes = n.as<int32_t>();
    p.path_taken = path.as<int32_t>();
  }
  py::dict result() const {
    py::dict d;
    int32_t nn = -1, pt = -1;
    n.download(&nn, 4);
    path.download(&pt, 4);
    d["n"] = nn;
    d["path"] = pt;
    d["tokens"] = to_numpy<int32_t>(tokens, {B});
    d["depths"] = to_numpy<int32_t>(depths, {B});
    d["parents"] = to_numpy<int32_t>(parents, {B + 1});
    d["positions"] = to_numpy<int32_t>(positions, {B + 1});
    d["visibility"] = to_numpy<uint64_t>(vis, {B + 1, W});
    return d;
  }
};

void check_budget_depth(int64_t budget, int64_t D) {
  if (budget < 0 || budget > kc::kTreeMaxBudget)
    throw kdtree::Error("budget must be in [0, " + std::to_string(kc::kTreeMaxBudget) + "] on the GPU, got " +
                        std::to_string(budget));
  if (D > kc::kTreeMaxDepth)
    throw kdtree::Error("depth D=" + std::to_string(D) + " exceeds the GPU limit " + std::to_string(kc::kTreeMaxDepth));
}

// A tree build's drafter input on the device: [D, K] log-probabilities and token ids, checked (equal
// shapes, K >= 1, budget and depth within the GPU's limits) and uploaded.
struct TreeBuildInput {
  int64_t D = 0, K = 0;
  DevBuf lp, ids;
  TreeBuildInput(const py::object& lp_o, const py::object& ids_o, int64_t budget) {
    auto lp_h = as_c<float>(lp_o, "logprobs", 2);
    auto ids_h = as_c<int32_t>(ids_o, "token_ids", 2);
    D = lp_h.shape(0);
    K = lp_h.shape(1);
    if (ids_h.shape(0) != D || ids_h.shape(1) != K) throw kdtree::Error("token_ids shape must equal logprobs shape");
    check_budget_depth(budget, D);
    if (K < 1) throw kdtree::Error("K must be >= 1");
    lp = DevBuf(sizeof(float) * D * K);
    ids = DevBuf(sizeof(int32_t) * D * K);
    lp.upload(lp_h.data(), lp.bytes);
    ids.upload(ids_h.data(), ids.bytes);
  }
  kc::TreeBuildParams params(int64_t budget, int force_fallback) const {
    kc::TreeBuildParams p{};
    p.logprobs = lp.as<float>();
    p.token_ids = ids.as<int32_t>();
    p.D = (int)D;
    p.K = (int)K;
    p.ld = (int)K;
    p.budget = (int)budget;
    p.force_fallback = force_fallback;
    return p;
  }
};

py::dict tree_build_np(const py::object& lp_o, const py::object& ids_o, int64_t budget, int64_t cache_len,
                       int force_fallback) {
  if (force_fallback < 0 || force_fallback > 4)
    throw kdtree::Error("force_fallback must be 0 (auto), 1 (fallback), 2 (one warp), 3 (parallel) or 4 (parallel, "
                        "adaptive threshold only)");
  require_device();
  if (cache_len < 0 || cache_len > INT32_MAX - 64) throw kdtree::Error("cache_len out of range");
  TreeBuildInput in(lp_o, ids_o, budget);
  TreeDev out((int)budget);
  out.poison();
  kc::TreeBuildParams p = in.params(budget, force_fallback);
  p.cache_len = (int)cache_len;
  out.fill(p);
  {
    py::gil_scoped_release nogil;
    check_cuda(kc::tree_build(p, 0), "tree_build");
    check_cuda(cudaDeviceSynchronize(), "tree_build (kernel)");
  }
  return out.result();
}

py::dict tree_from_logits_np(const py::object& x_o, int64_t budget, int64_t top_k, int64_t cache_len) {
  require_device();
  auto x = as_c<float>(x_o, "logits", 2);
  const int64_t D = x.shape(0), V = x.shape(1);
  check_budget_depth(budget, D);
  if (D < 1 || V < 1 || V > kc::kTopkMaxV) throw kdtree::Error("logits shape out of range");
  if (top_k < 1 || std::min<int64_t>(top_k, V) > kc::kTopkMaxK)
    throw kdtree::Error("top_k must be in [1, 1024] (after clamping to V)");
  DevBuf dx(sizeof(float) * D * V);
  dx.upload(x.data(), sizeof(float) * D * V);
  DevBuf ws(kc::tree_from_logits_workspace_bytes((int)D, (int)V, (int)top_k));
  TreeDev out((int)budget);
  out.poison();
  kc::TreeFromLogitsParams p{};
  p.logits = dx.as<float>();
  p.D = (int)D;
  p.V = (int)V;
  p.ld = (int)V;
  p.top_k = (int)top_k;
  p.tree.budget = (int)budget;
  p.tree.cache_len = (int)cache_len;
  out.fill(p.tree);
  p.workspace = ws.p;
  {
    py::gil_scoped_release nogil;
    check_cuda(kc::tree_build_from_logits(p, 0), "tree_build_from_logits");
    check_cuda(cudaDeviceSynchronize(), "tree_build_from_logits (kernel)");
  }
  return out.result();
}

py::tuple topk_np(const py::object& x_o, int64_t k) {
  require_device();
  auto x = as_c<float>(x_o, "logits", 2);
  const int64_t D = x.shape(0), V = x.shape(1);
  if (D < 1 || D > kc::kTreeMaxDepth || V < 1 || V > kc::kTopkMaxV) throw kdtree::Error("logits shape out of range");
  if (k < 1 || k > V || k > kc::kTopkMaxK) throw kdtree::Error("k must be in [1, min(V, 1024)]");
  DevBuf dx(sizeof(float) * D * V), dlp(sizeof(float) * D * k), dids(sizeof(int32_t) * D * k);
  DevBuf ws(kc::topk_workspace_bytes((int)D, (int)V, (int)k));
  dx.upload(x.data(), sizeof(float) * D * V);
  dlp.poison();
  dids.poison();
  kc::TopkParams p{};
  p.logits = dx.as<float>();
  p.D = (int)D;
  p.V = (int)V;
  p.ld = (int)V;
  p.k = (int)k;
  p.logprobs = dlp.as<float>();
  p.ids = dids.as<int32_t>();
  p.workspace = ws.p;
  {
    py::gil_scoped_release nogil;
    check_cuda(kc::topk_logsoftmax(p, 0), "topk_logsoftmax");
    check_cuda(cudaDeviceSynchronize(), "topk_logsoftmax (kernel)");
  }
  return py::make_tuple(to_numpy<float>(dlp, {D, k}), to_numpy<int32_t>(dids, {D, k}));
}

// ---------------------------------------------------------------- accept / compaction
struct AcceptDev {
  int n;
  DevBuf tokens, parents, choice, nn, path, count, bonus;
  AcceptDev(const py::object& tok_o, const py::object& par_o, const py::object& ch_o)
      : n(0), tokens(4 * 1025), parents(4 * 1025), choice(4 * 1025), nn(4), path(4 * 1025), count(4), bonus(4) {
    auto tok = as_c<int32_t>(tok_o, "tokens", 1);
    auto par = as_c<int32_t>(par_o, "parents", 1);
    auto ch = as_c<int32_t>(ch_o, "choice", 1);
    n = (int)tok.shape(0);
    if (n > 1024) throw kdtree::Error("the GPU accept walk supports n <= 1024 nodes");
    if (par.shape(0) != n + 1 || ch.shape(0) != n + 1) throw kdtree::Error("parents and choice must be [n+1]");
    const int32_t* pp = par.data();
    if (pp[0] != -1) throw kdtree::Error("parents[0] must be -1");
    for (int i = 1; i <= n; ++i)
      if (pp[i] < 0 || pp[i] >= i) throw kdtree::Error("parents[" + std::to_string(i) + "] must be in [0, i)");
    tokens.upload(tok.data(), 4 * n);
    parents.upload(pp, 4 * (n + 1));
    choice.upload(ch.data(), 4 * (n + 1));
    nn.upload(&n, 4);
    path.poison();
    count.poison();
    bonus.poison();
  }
  kc::TreeAcceptParams params() const {
    kc::TreeAcceptParams a{};
    a.tokens = tokens.as<int32_t>();
    a.parents = parents.as<int32_t>();
    a.choice = choice.as<int32_t>();
    a.n_nodes = nn.as<int32_t>();
    a.n_max = n;
    a.path = path.as<int32_t>();
    a.count = count.as<int32_t>();
    a.bonus = bonus.as<int32_t>();
    return a;
  }
  py::tuple result() const {
    int32_t m = 0, b = 0;
    count.download(&m, 4);
    bonus.download(&b, 4);
    if (m < 1 || m > n + 1) throw kdtree::RuntimeFailure("tree_accept returned a bad count");
    py::array_t<int32_t> p(m);
    path.download(p.mutable_data(), 4 * m);
    return py::make_tuple(p, (int)b);
  }
};

py::tuple tree_accept_np(const py::object& tok, const py::object& par, const py::object& ch) {
  require_device();
  AcceptDev a(tok, par, ch);
  {
    py::gil_scoped_release nogil;
    check_cuda(kc::tree_accept(a.params(), 0), "tree_accept");
    check_cuda(cudaDeviceSynchronize(), "tree_accept (kernel)");
  }
  return a.result();
}

// cache: float32 [layers, S, row]; path int32 [m]. Returns the compacted copy.
py::array_t<float> kv_compact_np(const py::object& cache_o, int64_t cache_len, const py::object& path_o) {
  require_device();
  auto cache = as_c<float>(cache_o, "cache", 3);
  auto path = as_c<int32_t>(path_o, "path", 1);
  const int64_t layers = cache.shape(0), S = cache.shape(1), row = cache.shape(2);
  const int64_t m = path.shape(0);
  if (m < 1 || m > 1025) throw kdtree::Error("path must have 1..1025 entries");
  const int32_t* pp = path.data();
  if (pp[0] != 0) throw kdtree::Error("path[0] must be 0");
  for (int64_t j = 1; j < m; ++j)
    if (pp[j] <= pp[j - 1]) throw kdtree::Error("path must be strictly increasing");
  if (cache_len < 0 || cache_len + pp[m - 1] >= S) throw kdtree::Error("path reaches past the cache");
  DevBuf dc(sizeof(float) * layers * S * row), dp(4 * m), dm(4);
  dc.upload(cache.data(), dc.bytes);
  dp.upload(pp, 4 * m);
  int32_t mm = (int32_t)m;
  dm.upload(&mm, 4);
  kc::KvCompactParams p{};
  p.cache = dc.p;
  p.num_layers = (int)layers;
  p.layer_stride = (long long)S * row * 4;
  p.row_stride = (long long)row * 4;
  p.row_bytes = (int)(row * 4);
  p.cache_len = (int)cache_len;
  p.path = dp.as<int32_t>();
  p.count = dm.as<int32_t>();
  {
    py::gil_scoped_release nogil;
    check_cuda(kc::kv_compact(p, 0), "kv_compact");
    check_cuda(cudaDeviceSynchronize(), "kv_compact (kernel)");
  }
  return to_numpy<float>(dc, {layers, S, row});
}

py::tuple tree_accept_compact_np(const py::object& tok, const py::object& par, const py::object& ch,
                                 const py::object& cache_o, int64_t cache_len) {
  require_device();
  AcceptDev a(tok, par, ch);
  auto cache = as_c<float>(cache_o, "cache", 3);
  const int64_t layers = cache.shape(0), S = cache.shape(1), row = cache.shape(2);
  if (cache_len < 0 || cache_len + a.n >= S) throw kdtree::Error("the verify window reaches past the cache");
  DevBuf dc(sizeof(float) * layers * S * row);
  dc.upload(cache.data(), dc.bytes);
  kc::KvCompactParams p{};
  p.cache = dc.p;
  p.num_layers = (int)layers;
  p.layer_stride = (long long)S * row * 4;
  p.row_stride = (long long)row * 4;
  p.row_bytes = (int)(row * 4);
  p.cache_len = (int)cache_len;
  kc::TreeAcceptParams ap = a.params();
  p.path = ap.path;
  p.count = ap.count;
  // the round outputs: the host's result array and the next root, poisoned to catch unwritten words
  DevBuf res(4 * (3 + 1025)), root(4);
  res.poison();
  root.poison();
  ap.result = res.as<int32_t>();
  ap.next_root = root.as<int32_t>();
  {
    py::gil_scoped_release nogil;
    check_cuda(kc::tree_accept_compact(ap, p, 0), "tree_accept_compact");
    check_cuda(cudaDeviceSynchronize(), "tree_accept_compact (kernel)");
  }
  py::tuple r = a.result();
  const int64_t m = py::len(r[0]);
  py::array_t<int32_t> result(3 + m - 1);
  res.download(result.mutable_data(), 4 * (3 + m - 1));
  int32_t next_root = 0;
  root.download(&next_root, 4);
  return py::make_tuple(r[0], r[1], to_numpy<float>(dc, {layers, S, row}), result, next_root);
}

// ---------------------------------------------------------------- verify attention
// l_bound >= 0: the committed length goes to the kernels through a device int (p.L_dev) and
// p.L = l_bound is only the host's upper bound (the CUDA-graph mode); -1 = plain p.L.
struct AttnDev {
  DevBuf ql, qr, kv, vis, out, ws, ldev, qs;
  kc::VerifyAttentionParams p{};
  AttnDev(const py::object& ql_o, const py::object& qr_o, const py::object& kv_o, const py::object& vis_o,
          double scale, bool force_naive, int force_splits, int force_kernel = 0, int64_t l_bound = -1,
          int force_rows = 0, bool exact = false, int exact_split = 0) {
    auto a = as_c<float>(ql_o, "q_latent", 3);
    auto b = as_c<float>(qr_o, "q_rope", 3);
    auto c = as_c<float>(kv_o, "kv", 2);
    auto v = as_c<uint64_t>(vis_o, "visibility", 2);
    const int64_t T = a.shape(0), H = a.shape(1), C = a.shape(2), R = b.shape(2);
    if (b.shape(0) != T || b.shape(1) != H) throw kdtree::Error("q_rope must be [T, H, R] like q_latent");
    if (c.shape(1) != C + R) throw kdtree::Error("kv must be [L+T, C+R]");
    const int64_t N = c.shape(0);
    if (N < T) throw kdtree::Error("kv must have at least T rows");
    if (v.shape(0) != T || v.shape(1) < (T + 63) / 64) throw kdtree::Error("visibility must be uint64 [T, >= ceil(T/64)]");
    if (T < 1 || H < 1 || C < 1 || C > 2048) throw kdtree::Error("bad attention shapes");
    if (force_kernel < 0 || force_kernel > 4)
      throw kdtree::Error("force_kernel must be 0 (auto), 1 (tiled), 2 (split-KV), 3 (decode) or 4 (tensor cores)");
    if (force_splits < 0) throw kdtree::Error("force_splits must be >= 0");
    if (force_rows != 0 && force_rows != 4 && force_rows != 8 && force_rows != 16)
      throw kdtree::Error("force_rows must be 0, 4, 8 or 16");
    if (l_bound != -1 && (l_bound < N - T || l_bound > (int64_t)1 << 30))
      throw kdtree::Error("l_bound must be >= L (the committed length) and <= 2^30");
    ql = DevBuf(sizeof(float) * a.size());
    qr = DevBuf(sizeof(float) * b.size());
    kv = DevBuf(sizeof(float) * c.size());
    vis = DevBuf(sizeof(uint64_t) * v.size());
    out = DevBuf(sizeof(float) * T * H * C);
    ql.upload(a.data(), ql.bytes);
    qr.upload(b.data(), qr.bytes);
    kv.upload(c.data(), kv.bytes);
    vis.upload(v.data(), vis.bytes);
    out.poison();
    p.q_latent = ql.as<float>();
    p.q_rope = qr.as<float>();
    p.kv = kv.as<float>();
    p.kv_stride = (int)(C + R);
    p.visibility = vis.as<uint64_t>();
    p.vis_stride = (int)v.shape(1);
    p.T = (int)T;
    p.H = (int)H;
    p.C = (int)C;
    p.R = (int)R;
    p.L = (int)(N - T);
    p.scale = (float)scale;
    p.out = out.as<float>();
    p.force_naive = force_naive ? 1 : 0;
    p.force_splits = force_splits;
    p.force_kernel = force_kernel;
    p.force_splitkv_rows = force_rows;
    if (exact_split < 0 || exact_split % 32 != 0) throw kdtree::Error("exact_split must be 0 (default) or a multiple of 32");
    p.exact = exact ? 1 : 0;
    p.exact_split = exact_split;
    if (l_bound >= 0) {
      const int32_t L = (int32_t)(N - T);
      ldev = DevBuf(sizeof(int32_t));
      ldev.upload(&L, sizeof(L));
      p.L_dev = ldev.as<int32_t>();
      p.L = (int)l_bound;
    }
    ws = DevBuf(kc::verify_attention_workspace_bytes(p));
    ws.poison();  // NaN partials: a split that forgets its (O, max, sum) shows in the output
    p.workspace = ws.p;
  }
};

// shape-only params (aligned dummy pointers) for the workspace / choice queries
kc::VerifyAttentionParams attn_shape_params(int T, int H, int C, int R, int L, int kv_stride, int force_kernel,
                                            int force_splits) {
  kc::VerifyAttentionParams p{};
  alignas(16) static float dummy[4];
  static uint64_t vdummy[1];
  p.q_latent = p.q_rope = p.kv = dummy;
  p.out = dummy;
  p.visibility = vdummy;
  p.kv_stride = kv_stride;
  p.vis_stride = (T + 63) / 64;
  p.T = T; p.H = H; p.C = C; p.R = R; p.L = L;
  p.scale = 1.f;
  p.force_kernel = force_kernel;
  p.force_splits = force_splits;
  return p;
}

py::array_t<float> verify_attention_np(const py::object& ql, const py::object& qr, const py::object& kv,
                                       const py::object& vis, double scale, bool force_naive, int force_splits,
                                       int force_kernel, const py::object& l_bound, int force_rows, bool exact,
                                       int exact_split, const py::object& q_scale) {
  require_device();
  AttnDev d(ql, qr, kv, vis, scale, force_naive, force_splits, force_kernel,
            l_bound.is_none() ? -1 : l_bound.cast<int64_t>(), force_rows, exact, exact_split);
  if (!q_scale.is_none()) {  // per-token factors of the scores (CudaModel's folded query norm)
    auto f = as_c<float>(q_scale, "q_scale", 1);
    if (f.shape(0) != d.p.T) throw kdtree::Error("q_scale must be float32 [T]");
    d.qs = DevBuf(sizeof(float) * f.size());
    d.qs.upload(f.data(), d.qs.bytes);
    d.p.q_scale = d.qs.as<float>();
  }
  {
    py::gil_scoped_release nogil;
    check_cuda(kc::verify_attention(d.p, 0), "verify_attention");
    check_cuda(cudaDeviceSynchronize(), "verify_attention (kernel)");
  }
  return to_numpy<float>(d.out, {d.p.T, d.p.H, d.p.C});
}

// ---------------------------------------------------------------- timing helpers
py::dict time_tree_build(const py::object& lp_o, const py::object& ids_o, int64_t budget, int iters, int warmup,
                         int force_path) {
  require_device();
  if (force_path != 0 && force_path != 2 && force_path != 3 && force_path != 4)
    throw kdtree::Error("force_path must be 0 (auto), 2 (one warp), 3 (parallel) or 4 (parallel, adaptive threshold)");
  TreeBuildInput in(lp_o, ids_o, budget);
  TreeDev out((int)budget);
  kc::TreeBuildParams p = in.params(budget, force_path);
  out.fill(p);
  Timing t = time_op([&](cudaStream_t s) { return kc::tree_build(p, s); }, iters, warmup);
  py::dict d = out.result();
  put_timing(d, "", t);
  return d;
}

py::dict time_tree_from_logits(const py::object& x_o, int64_t budget, int64_t top_k, int iters, int warmup) {
  require_device();
  auto x = as_c<float>(x_o, "logits", 2);
  const int64_t D = x.shape(0), V = x.shape(1);
  check_budget_depth(budget, D);
  DevBuf dx(sizeof(float) * D * V);
  dx.upload(x.data(), dx.bytes);
  DevBuf ws(kc::tree_from_logits_workspace_bytes((int)D, (int)V, (int)top_k));
  TreeDev out((int)budget);
  kc::TreeFromLogitsParams p{};
  p.logits = dx.as<float>();
  p.D = (int)D;
  p.V = (int)V;
  p.ld = (int)V;
  p.top_k = (int)top_k;
  p.tree.budget = (int)budget;
  out.fill(p.tree);
  p.workspace = ws.p;
  Timing tl = time_op([&](cudaStream_t s) { return kc::tree_build_from_logits(p, s); }, iters, warmup);
  // top-k alone, for the split
  int k = (int)std::min<int64_t>(top_k, V);
  DevBuf dlp(sizeof(float) * D * k), dids(4 * D * k), ws2(kc::topk_workspace_bytes((int)D, (int)V, k));
  kc::TopkParams t{};
  t.logits = dx.as<float>();
  t.D = (int)D;
  t.V = (int)V;
  t.ld = (int)V;
  t.k = k;
  t.logprobs = dlp.as<float>();
  t.ids = dids.as<int32_t>();
  t.workspace = ws2.p;
  Timing tk = time_op([&](cudaStream_t s) { return kc::topk_logsoftmax(t, s); }, iters, warmup);
  py::dict d = out.result();
  put_timing(d, "", tl);
  put_timing(d, "topk_", tk);
  return d;
}

py::dict time_verify_attention(const py::object& ql, const py::object& qr, const py::object& kv,
                               const py::object& vis, double scale, int iters, int warmup, bool force_naive,
                               int force_kernel, int force_splits, int force_rows, bool exact) {
  require_device();
  AttnDev d(ql, qr, kv, vis, scale, force_naive, force_splits, force_kernel, -1, force_rows, exact);
  Timing t = time_op([&](cudaStream_t s) { return kc::verify_attention(d.p, s); }, iters, warmup);
  py::dict r;
  put_timing(r, "", t);
  r["fast_path"] = kc::verify_attention_fast_path(d.p);
  int kernel = 0, splits = 1, rows = 16, sf = 1, sl = 1;
  kc::verify_attention_choice(d.p, &kernel, &splits, &rows, &sf, &sl);
  r["kernel"] = kernel;
  r["splits"] = splits;
  r["rows"] = rows;
  r["splits_full"] = sf;
  r["splits_last"] = sl;
  r["out"] = to_numpy<float>(d.out, {d.p.T, d.p.H, d.p.C});
  return r;
}

// accept + compaction over `layers` caches [S, row] float32 (device-only random data).
py::dict time_accept_compact(const py::object& tok, const py::object& par, const py::object& ch, int layers,
                             int64_t S, int row, int64_t cache_len, int iters, int warmup) {
  require_device();
  AcceptDev a(tok, par, ch);
  if (cache_len + a.n >= S) throw kdtree::Error("window past the cache");
  DevBuf dc(sizeof(float) * layers * S * row);
  check_cuda(cudaMemset(dc.p, 0, dc.bytes), "memset");
  kc::KvCompactParams p{};
  p.cache = dc.p;
  p.num_layers = layers;
  p.layer_stride = (long long)S * row * 4;
  p.row_stride = (long long)row * 4;
  p.row_bytes = row * 4;
  p.cache_len = (int)cache_len;
  kc::TreeAcceptParams ap = a.params();
  p.path = ap.path;
  p.count = ap.count;
  Timing two = time_op(
      [&](cudaStream_t s) {
        cudaError_t e = kc::tree_accept(ap, s);
        if (e != cudaSuccess) return e;
        return kc::kv_compact(p, s);
      },
      iters, warmup);
  Timing fused = time_op([&](cudaStream_t s) { return kc::tree_accept_compact(ap, p, s); }, iters, warmup);
  py::dict r;
  put_timing(r, "two_", two);
  put_timing(r, "fused_", fused);
  r["path"] = a.result()[0];
  return r;
}

// Device facts for rooflines: SMs, peak SM clock, and FP32 peak = SMs x 128 lanes x 2 x clock.
py::dict device_props() {
  require_device();
  int dev = 0, sms = 0, clk = 0, mclk = 0, bus = 0, l2 = 0, major = 0, minor = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "attr");
  check_cuda(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, dev), "attr");
  check_cuda(cudaDeviceGetAttribute(&mclk, cudaDevAttrMemoryClockRate, dev), "attr");
  check_cuda(cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, dev), "attr");
  check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "attr");
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "attr");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "attr");
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, dev), "props");
  py::dict d;
  d["name"] = std::string(prop.name);
  d["sm"] = major * 10 + minor;
  d["sms"] = sms;
  d["sm_clock_khz"] = clk;
  d["mem_clock_khz"] = mclk;
  d["bus_width_bits"] = bus;
  d["l2_bytes"] = l2;
  d["fp32_cores_per_sm"] = 128;
  d["fp32_peak_flops"] = (double)sms * 128.0 * 2.0 * (double)clk * 1e3;
  return d;
}

// Device-to-device copy bandwidth in bytes/s, counting bytes read + written (median of iters).
double copy_bandwidth(int64_t nbytes, int iters) {
  require_device();
  DevBuf a((size_t)nbytes), b((size_t)nbytes);
  check_cuda(cudaMemset(a.p, 1, nbytes), "memset");
  auto ms = time_launches([&] { return cudaMemcpyAsync(b.p, a.p, nbytes, cudaMemcpyDeviceToDevice, 0); }, iters, 3);
  return 2.0 * (double)nbytes / (median_of(ms) * 1e-3);
}

uintptr_t as_ptr(uintptr_t x) { return x; }

}  // namespace

// The tensor-core kernels' 3xTF32 operand split (model/tile_mma.h) on host float32 x: (hi, lo) as
// uint32 bit patterns, as the kernels hand them to mma.sync.
py::tuple tf32_split_np(const py::object& x_o) {
  auto x = as_c<float>(x_o, "x", 1);
  const int64_t n = x.shape(0);
  if (n > (int64_t)1 << 30) throw kdtree::Error("cuda_tf32_split: at most 2^30 values");
  py::array_t<uint32_t> hi(n), lo(n);
  if (n == 0) return py::make_tuple(hi, lo);
  require_device();
  DevBuf dx((size_t)n * 4), dh((size_t)n * 4), dl((size_t)n * 4);
  dx.upload(x.data(), dx.bytes);
  dh.poison();
  dl.poison();
  check_cuda(kc::tf32_split(dx.as<float>(), dh.as<uint32_t>(), dl.as<uint32_t>(), (int)n, 0), "tf32_split");
  check_cuda(cudaDeviceSynchronize(), "tf32_split sync");
  dh.download(hi.mutable_data(), dh.bytes);
  dl.download(lo.mutable_data(), dl.bytes);
  return py::make_tuple(hi, lo);
}

// The GPU round's per-node choice (engine/choose_kernels.h choose_tokens) on host logits [T, V], for tests.
py::array_t<int32_t> choose_tokens_np(const py::object& logits_o, const py::object& positions_o, double temperature,
                                      int64_t top_k, double top_p, uint64_t seed) {
  auto logits = as_c<float>(logits_o, "logits", 2);
  auto positions = as_c<int32_t>(positions_o, "positions", 1);
  const int64_t T = logits.shape(0), V = logits.shape(1);
  if (positions.shape(0) != T) throw kdtree::Error("cuda_choose_tokens: positions must be [T]");
  if (V < 1 || V > (1 << 26)) throw kdtree::Error("cuda_choose_tokens: V must be in [1, 2^26]");
  py::array_t<int32_t> out(T);
  if (T == 0) return out;
  require_device();
  DevBuf dl((size_t)(T * V) * sizeof(float)), dp((size_t)T * sizeof(int32_t)), dc((size_t)T * sizeof(int32_t));
  dl.upload(logits.data(), dl.bytes);
  dp.upload(positions.data(), dp.bytes);
  dc.poison();
  kc::ChooseParams cp{};
  cp.logits = dl.as<float>();
  cp.ldl = V;
  cp.T = (int)T;
  cp.V = (int)V;
  cp.positions = dp.as<int32_t>();
  cp.temperature = (float)temperature;
  cp.top_k = top_k;
  cp.top_p = (float)top_p;
  cp.seed = seed;
  cp.choice = dc.as<int32_t>();
  check_cuda(kc::choose_tokens(cp, nullptr), "choose_tokens");
  dc.download(out.mutable_data(), dc.bytes);
  return out;
}

// The GPU round's check of a device draft (draft_check) on host arrays: values float32 [d, k]
// (log-probs with ids int32 / int64 [d, k], or logits with ids None). Returns (fault [d],
// finite [d], ids as int32 [d, k] or None); ids_out is poisoned first (-7).
py::tuple draft_check_np(const py::array& values_o, const py::object& ids_o, int64_t vocab) {
  auto values = as_c<float>(values_o, "values", 2);
  const int64_t d = values.shape(0), k = values.shape(1);
  if (d < 1 || k < 1) throw kdtree::Error("cuda_draft_check: values must be [d >= 1, k >= 1]");
  require_device();
  DevBuf dv((size_t)(d * k) * sizeof(float)), ds((size_t)(2 * d) * sizeof(int32_t));
  dv.upload(values.data(), dv.bytes);
  kc::DraftCheckParams cp{};
  cp.values = dv.as<float>();
  cp.d = (int)d;
  cp.k = (int)k;
  cp.vocab = (int)vocab;
  cp.stats = ds.as<int32_t>();
  cp.ids_bytes = 4;
  DevBuf di, dout;
  if (!ids_o.is_none()) {
    py::array ids = py::array::ensure(ids_o, py::array::c_style);
    if (!ids || ids.ndim() != 2 || ids.shape(0) != d || ids.shape(1) != k || ids.dtype().kind() != 'i' ||
        (ids.itemsize() != 4 && ids.itemsize() != 8))
      throw kdtree::Error("cuda_draft_check: ids must be int32 / int64 [d, k]");
    cp.ids_bytes = (int)ids.itemsize();
    di = DevBuf((size_t)(d * k) * ids.itemsize());
    di.upload(ids.data(), di.bytes);
    dout = DevBuf((size_t)(d * k) * sizeof(int32_t));
    std::vector<int32_t> poison((size_t)(d * k), -7);
    dout.upload(poison.data(), dout.bytes);
    cp.ids = di.p;
    cp.ids_out = dout.as<int32_t>();
  }
  check_cuda(kc::draft_check(cp, nullptr), "draft_check");
  std::vector<int32_t> st((size_t)(2 * d));
  ds.download(st.data(), ds.bytes);
  py::array_t<int64_t> fault(d), fin(d);
  for (int64_t r = 0; r < d; ++r) {
    fault.mutable_data()[r] = st[2 * r];
    fin.mutable_data()[r] = st[2 * r + 1];
  }
  py::object ids32 = py::none();
  if (!ids_o.is_none()) {
    py::array_t<int32_t> o({d, k});
    dout.download(o.mutable_data(), dout.bytes);
    ids32 = o;
  }
  return py::make_tuple(fault, fin, ids32);
}

// The exact BF16 copy of a float32 array (its high halves) for the kernels' w_bf16 paths; throws
// unless every value is exactly a BF16.
DevBuf bf16_copy(const float* w, size_t n, const char* what) {
  if (!kdtree::bf16_exact(w, (int64_t)n))
    throw kdtree::Error(std::string(what) + ": bf16_weights needs every weight exactly a BF16");
  std::vector<uint16_t> h(n);
  kdtree::bf16_high_halves(w, (int64_t)n, h.data());
  DevBuf d(sizeof(uint16_t) * (n + 8));
  d.upload(h.data(), sizeof(uint16_t) * n);
  return d;
}

// linear_skinny on host arrays: x [rx, ldx], w [rw, cw] (flat, batch b at w_off + b * w_batch, row
// n at + n * Kd), y [ry, ldy] (uploaded as given: beta = 0 must not read it). Returns the y array
// after the kernel.
py::object linear_skinny_np(const py::object& x_o, const py::object& w_o, const py::object& y_o, int T, int N, int Kd,
                            int batch, long long x_batch, long long w_batch, long long y_batch, double beta,
                            long long x_off, long long w_off, const py::object& norm_o, double norm_eps, bool x_swiglu,
                            bool norm_out, int config, const std::string& kernel, int splits, int tile_math,
                            bool bf16_weights, const py::object& rope_cs_o, int rope_off, int rope_interleaved,
                            int tile_rows) {
  if (kernel != "skinny" && kernel != "tile") throw kdtree::Error("cuda_linear_skinny: kernel must be 'skinny' or 'tile'");
  auto x = as_c<float>(x_o, "x", 2);
  auto w = as_c<float>(w_o, "w", 2);
  auto y = as_c<float>(y_o, "y", 2);
  if (x_off < 0 || w_off < 0 || x_off > (long long)x.size() || w_off > (long long)w.size())
    throw kdtree::Error("cuda_linear_skinny: offsets out of range");
  // every element the kernel may touch must lie inside the arrays
  const long long ldx = x.shape(1), ldy = y.shape(1);
  auto last = [](long long off, long long bstride, long long rows, long long ld, long long cols, int b) {
    return off + (long long)(b - 1) * bstride + (rows - 1) * ld + cols;
  };
  if (T > 0 && batch > 0 &&
      (last(x_off, x_batch, T, ldx, x_swiglu ? 2LL * Kd : Kd, batch) > (long long)x.size() ||
       last(w_off, w_batch, N, Kd, Kd, batch) > (long long)w.size() || last(0, y_batch, T, ldy, N, batch) > (long long)y.size()))
    throw kdtree::Error("cuda_linear_skinny: the sizes reach past the arrays");
  require_device();
  DevBuf dx(sizeof(float) * (x.size() + 4)), dw(sizeof(float) * (w.size() + 4)), dy(sizeof(float) * y.size());
  dx.upload(x.data(), sizeof(float) * x.size());
  dw.upload(w.data(), sizeof(float) * w.size());
  dy.upload(y.data(), sizeof(float) * y.size());
  kc::LinearParams lp{dx.as<float>() + x_off, ldx, x_batch, dw.as<float>() + w_off, w_batch, dy.as<float>(), ldy, y_batch,
                      T, N, Kd, batch, (float)beta};
  lp.x_swiglu = x_swiglu ? 1 : 0;
  lp.force_config = config;
  lp.tile_splits = splits;
  lp.tile_math = tile_math;
  lp.tile_rows = tile_rows;
  DevBuf dwb;
  if (bf16_weights) {  // the kernel reads the BF16 copy (same layout, same offsets)
    dwb = bf16_copy(w.data(), w.size(), "cuda_linear_skinny");
    lp.w_bf16 = dwb.as<uint16_t>() + w_off;
  }
  DevBuf dn;
  if (!norm_o.is_none()) {
    auto g = as_c<float>(norm_o, "norm_w", 1);
    if (g.shape(0) != Kd) throw kdtree::Error("cuda_linear_skinny: norm_w must have Kd entries");
    dn = DevBuf(sizeof(float) * Kd);
    dn.upload(g.data(), sizeof(float) * Kd);
    lp.norm_w = dn.as<float>();
    lp.norm_eps = norm_eps;
  }
  DevBuf dno;
  if (norm_out) {  // the normalised rows [T, Kd], poisoned first (NaN)
    dno = DevBuf(sizeof(float) * (size_t)std::max(T, 1) * Kd);
    dno.poison();
    lp.norm_out = dno.as<float>();
    lp.ldn = Kd;
  }
  DevBuf dcs, dro;
  int64_t R = 0;
  if (!rope_cs_o.is_none()) {  // the rope block: rope_out [T, batch * R], poisoned first (NaN)
    if (kernel != "skinny") throw kdtree::Error("cuda_linear_skinny: rope_cs needs kernel='skinny'");
    auto cs = as_c<float>(rope_cs_o, "rope_cs", 2);
    R = cs.shape(1);
    if (cs.shape(0) < T) throw kdtree::Error("cuda_linear_skinny: rope_cs must have a row per token");
    if (T > 0 && batch > 0 && last(x_off, x_batch, T, ldx, rope_off + R, batch) > (long long)x.size())
      throw kdtree::Error("cuda_linear_skinny: the rope part reaches past x");
    dcs = DevBuf(sizeof(float) * cs.size());
    dcs.upload(cs.data(), sizeof(float) * cs.size());
    dro = DevBuf(sizeof(float) * (size_t)std::max(T, 1) * batch * R);
    dro.poison();
    lp.rope_cs = dcs.as<float>();
    lp.rope_out = dro.as<float>();
    lp.rope_ld = batch * R;
    lp.rope_off = rope_off;
    lp.rope_R = (int)R;
    lp.rope_interleaved = rope_interleaved;
  }
  if (kernel == "tile") check_cuda(kc::linear_tile(lp, nullptr), "linear_tile");
  else check_cuda(kc::linear_skinny(lp, nullptr), "linear_skinny");
  check_cuda(cudaDeviceSynchronize(), "linear");
  py::array_t<float> yo = to_numpy<float>(dy, {y.shape(0), y.shape(1)});
  if (R > 0) return py::make_tuple(yo, to_numpy<float>(dro, {(int64_t)std::max(T, 1), (int64_t)batch * R}));
  if (!norm_out) return std::move(yo);
  return py::make_tuple(yo, to_numpy<float>(dno, {(int64_t)std::max(T, 1), (int64_t)Kd}));
}

// mla_prep's cache rows (skip_q: the queries are the rope block's) on host arrays (tests): kv [T, ldkv] rows
// [latent (C = len(norm_w)) | k_rope (R = cs.shape[1])], cs [T, R]; by the mla_prep kernel (via="kernel") or by
// the rope blocks of a W_UK-like linear_skinny launch of H heads (via="uk", LinearParams::prep_on). Returns
// (cache rows [T, C + R] written at rows row0.. of a NaN-poisoned cache, q_scale [T] or None).
py::object mla_prep_rows_np(const py::object& kv_o, const py::object& norm_o, const py::object& cs_o, double eps,
                            int interleaved, const py::object& qa_o, double qa_eps, int H, const std::string& via,
                            int row0) {
  if (via != "kernel" && via != "uk") throw kdtree::Error("cuda_mla_prep_rows: via must be 'kernel' or 'uk'");
  auto kv = as_c<float>(kv_o, "kv", 2);
  auto g = as_c<float>(norm_o, "norm_w", 1);
  auto cs = as_c<float>(cs_o, "cs", 2);
  const int T = (int)kv.shape(0), C = (int)g.shape(0), R = (int)cs.shape(1);
  if (T < 1 || T > kc::kLinearSkinnyMaxT || H < 1 || row0 < 0 || cs.shape(0) < T || kv.shape(1) < C + R)
    throw kdtree::Error("cuda_mla_prep_rows: bad sizes");
  require_device();
  DevBuf dkv(sizeof(float) * kv.size()), dg(sizeof(float) * C), dcs(sizeof(float) * cs.size());
  dkv.upload(kv.data(), sizeof(float) * kv.size());
  dg.upload(g.data(), sizeof(float) * C);
  dcs.upload(cs.data(), sizeof(float) * cs.size());
  DevBuf dcache(sizeof(float) * (size_t)(row0 + T) * (C + R)), dqr(sizeof(float) * (size_t)T * H * R);
  dcache.poison();
  kc::MlaPrepParams mp{};
  mp.kv = dkv.as<float>();
  mp.ldkv = (int)kv.shape(1);
  mp.kv_norm_w = dg.as<float>();
  mp.cs = dcs.as<float>();
  mp.T = T;
  mp.H = H;
  mp.Dn = 64;
  mp.C = C;
  mp.R = R;
  mp.eps = eps;
  mp.interleaved = interleaved;
  mp.cache = dcache.as<float>();
  mp.ldc = C + R;
  mp.row0 = row0;
  mp.q_rope = dqr.as<float>();
  mp.skip_q = 1;
  DevBuf dqa, dsc;
  if (!qa_o.is_none()) {
    auto qa = as_c<float>(qa_o, "qa", 2);
    if (qa.shape(0) < T) throw kdtree::Error("cuda_mla_prep_rows: qa must have a row per token");
    dqa = DevBuf(sizeof(float) * qa.size());
    dqa.upload(qa.data(), sizeof(float) * qa.size());
    dsc = DevBuf(sizeof(float) * T);
    dsc.poison();
    mp.qa = dqa.as<float>();
    mp.ldqa = (int)qa.shape(1);
    mp.qa_n = (int)qa.shape(1);
    mp.qa_eps = qa_eps;
    mp.q_scale_out = dsc.as<float>();
  }
  DevBuf dx, dw, dy, dro;
  if (via == "kernel") {
    check_cuda(kc::mla_prep(mp, nullptr), "mla_prep");
  } else {  // the product itself (zeros, 48 rows of 64 per head) is not looked at
    const int Dn = 64, N = 48;
    dx = DevBuf(sizeof(float) * (size_t)T * H * (Dn + R) + 16);
    dw = DevBuf(sizeof(float) * (size_t)H * N * Dn + 16);
    dy = DevBuf(sizeof(float) * (size_t)T * H * N);
    dro = DevBuf(sizeof(float) * (size_t)T * H * R);
    check_cuda(cudaMemset(dx.as<float>(), 0, sizeof(float) * (size_t)T * H * (Dn + R)), "cudaMemset");
    check_cuda(cudaMemset(dw.as<float>(), 0, sizeof(float) * (size_t)H * N * Dn), "cudaMemset");
    kc::LinearParams lp{dx.as<float>(), (long long)H * (Dn + R), Dn + R, dw.as<float>(), (long long)N * Dn,
                        dy.as<float>(), (long long)H * N, N, T, N, Dn, H, 0.f};
    lp.rope_cs = dcs.as<float>();
    lp.rope_out = dro.as<float>();
    lp.rope_ld = (long long)H * R;
    lp.rope_off = Dn;
    lp.rope_R = R;
    lp.rope_interleaved = interleaved;
    lp.prep_on = 1;
    lp.prep = mp;
    check_cuda(kc::linear_skinny(lp, nullptr), "linear_skinny(prep)");
  }
  check_cuda(cudaDeviceSynchronize(), "mla_prep");
  std::vector<float> all((size_t)(row0 + T) * (C + R));
  dcache.download(all.data(), sizeof(float) * all.size());
  py::array_t<float> rows({(py::ssize_t)T, (py::ssize_t)(C + R)});
  std::memcpy(rows.mutable_data(), all.data() + (size_t)row0 * (C + R), sizeof(float) * (size_t)T * (C + R));
  if (qa_o.is_none()) return py::make_tuple(rows, py::none());
  return py::make_tuple(rows, to_numpy<float>(dsc, {(int64_t)T}));
}

// linear_skinny on device-only data (every float 0.0115: the speed does not depend on the
// values): median kernel time of one call, stream-launched and in graphs of `graph_ops` calls (PDL chain, as inside the model
// step). The weights rotate over copies (up to max(graph_ops, 8) of them, or about 192 MiB in
// all) so that they come from HBM, not from the 50 MB L2, as in the step.
py::dict time_linear_skinny(int T, int N, int Kd, int batch, int config, bool norm, bool swiglu, int iters, int warmup,
                            int graph_ops, const std::string& kernel, int splits, int tile_math, int tile_rows) {
  if (kernel != "skinny" && kernel != "tile") throw kdtree::Error("cuda_time_linear_skinny: kernel must be 'skinny' or 'tile'");
  if (T < 1 || N < 1 || Kd < 1 || batch < 1 || graph_ops < 1 || iters < 1)
    throw kdtree::Error("cuda_time_linear_skinny: sizes, iters and graph_ops must be >= 1");
  require_device();
  const size_t wfl = (size_t)batch * N * Kd, xcols = (size_t)(swiglu ? 2 : 1) * Kd;
  const size_t wbytes = wfl * sizeof(float);
  const int copies = (int)std::max<size_t>(1, std::min<size_t>((size_t)std::max(graph_ops, 8), ((size_t)192 << 20) / wbytes + 1));
  DevBuf dw(wbytes * copies), dx(sizeof(float) * (size_t)batch * T * xcols), dy(sizeof(float) * (size_t)batch * T * N),
      dg(sizeof(float) * Kd);
  // every float 0x3c3c3c3c = 0.0115
  for (DevBuf* b : {&dw, &dx, &dg}) check_cuda(cudaMemset(b->p, 0x3c, b->bytes), "memset");
  kc::LinearParams lp{dx.as<float>(), (long long)(batch * xcols), (long long)xcols, dw.as<float>(), (long long)N * Kd,
                      dy.as<float>(), (long long)batch * N, N, T, N, Kd, batch, 0.f};
  lp.x_swiglu = swiglu ? 1 : 0;
  lp.force_config = config;
  lp.tile_splits = splits;
  lp.tile_math = tile_math;
  lp.tile_rows = tile_rows;
  const bool tile = kernel == "tile";
  if (norm) {
    lp.norm_w = dg.as<float>();
    lp.norm_eps = 1e-6;
  }
  int k = 0;
  Timing t = time_op(
      [&](cudaStream_t s) {
        kc::LinearParams q = lp;
        q.w = dw.as<float>() + (size_t)(k++ % copies) * wfl;
        return tile ? kc::linear_tile(q, s) : kc::linear_skinny(q, s);
      },
      iters, warmup, graph_ops);
  py::dict r;
  put_timing(r, "", t);
  r["weight_copies"] = copies;
  r["bytes"] = (double)wbytes;
  return r;
}


// moe_group on host routing indices [T, K]: the schedule it builds (tests compare the one-block
// kernel with the two-pass one).
py::dict moe_group_np(const py::object& idx_o, int E, int tile_rows, bool force_two_pass) {
  auto idx = as_c<int32_t>(idx_o, "topk_idx", 2);
  const int T = (int)idx.shape(0), K = (int)idx.shape(1), A = T * K;
  if (E < 1 || tile_rows < 1 || K < 1) throw kdtree::Error("cuda_moe_group: E, K and tile_rows must be >= 1");
  for (int i = 0; i < A; ++i)
    if (idx.data()[i] < 0 || idx.data()[i] >= E) throw kdtree::Error("cuda_moe_group: expert index out of range");
  require_device();
  const int mt = kc::moe_max_tiles(A, E, tile_rows);
  DevBuf di(sizeof(int32_t) * std::max(A, 1)), counts(4 * E), offsets(4 * (E + 1)), st(4 * std::max(A, 1)),
      so(4 * std::max(A, 1)), te(4 * std::max(mt, 1)), tr(4 * std::max(mt, 1)), nt(4);
  di.upload(idx.data(), sizeof(int32_t) * A);
  for (DevBuf* b : {&counts, &offsets, &st, &so, &te, &tr, &nt}) b->poison();
  kc::MoeGroupParams gp{di.as<int32_t>(), T, K, E, tile_rows, counts.as<int32_t>(), offsets.as<int32_t>(),
                        st.as<int32_t>(), so.as<int32_t>(), te.as<int32_t>(), tr.as<int32_t>(), nt.as<int32_t>()};
  gp.force_two_pass = force_two_pass ? 1 : 0;
  check_cuda(kc::moe_group(gp, nullptr), "moe_group");
  check_cuda(cudaDeviceSynchronize(), "moe_group");
  py::dict d;
  d["counts"] = to_numpy<int32_t>(counts, {E});
  d["offsets"] = to_numpy<int32_t>(offsets, {E + 1});
  d["slot_token"] = to_numpy<int32_t>(st, {A});
  d["slot_of"] = to_numpy<int32_t>(so, {A});
  auto n = to_numpy<int32_t>(nt, {1});
  const int ntiles = n.data()[0];
  if (ntiles < 0 || ntiles > mt) throw kdtree::RuntimeFailure("cuda_moe_group: bad tile count");
  d["num_tiles"] = ntiles;
  d["tile_expert"] = to_numpy<int32_t>(te, {mt});
  d["tile_row0"] = to_numpy<int32_t>(tr, {mt});
  return d;
}

// The grouped expert GEMM on host arrays (tests): the schedule of topk_idx [T, K] with tile_rows
// slots per tile (moe_group), then y[slot] = x[token(slot)] @ w[expert(slot)]^T (swiglu: w holds
// gate rows [0, N) and up rows [N, 2N) of each expert, y = silu(gate) * up). kernel: "gemv"
// (tile_rows 8), "tiled" (tile_rows 64, no swiglu) or "mma" (tile_rows 8, 16, 32 or 64). y [A, N] by slot
// (poisoned before the call) and slot_token [A]. int4_packed / int4_scales (with int4_group): the weights as
// 4-bit integers, uint8 [E, rows, Kd / 2] and float32 [E, rows, Kd / group], read instead of w.
py::tuple expert_gemm_np(const py::object& x_o, const py::object& w_o, const py::object& idx_o, int E, bool swiglu,
                         int tile_rows, const std::string& kernel, bool bf16_weights, const py::object& q_o,
                         const py::object& qs_o, int int4_group) {
  auto x = as_c<float>(x_o, "x", 2);
  auto w = as_c<float>(w_o, "w", 3);
  auto idx = as_c<int32_t>(idx_o, "topk_idx", 2);
  const int T = (int)idx.shape(0), K = (int)idx.shape(1), A = T * K, Kd = (int)x.shape(1);
  if (E < 1 || K < 1 || tile_rows < 1 || x.shape(0) != T || w.shape(0) != E || w.shape(2) != Kd ||
      (swiglu && w.shape(1) % 2))
    throw kdtree::Error("cuda_expert_gemm: need x [T, Kd], w [E, N or 2N, Kd], topk_idx [T, K], E, K, tile_rows >= 1");
  if (kernel != "gemv" && kernel != "tiled" && kernel != "mma")
    throw kdtree::Error("cuda_expert_gemm: kernel must be 'gemv', 'tiled' or 'mma'");
  const int N = (int)(swiglu ? w.shape(1) / 2 : w.shape(1));
  for (int i = 0; i < A; ++i)
    if (idx.data()[i] < 0 || idx.data()[i] >= E) throw kdtree::Error("cuda_expert_gemm: expert index out of range");
  require_device();
  const int mt = kc::moe_max_tiles(A, E, tile_rows);
  DevBuf dx(4 * std::max<size_t>(x.size(), 1)), dw(4 * std::max<size_t>(w.size(), 1)), di(4 * std::max(A, 1)),
      counts(4 * E), offsets(4 * (E + 1)), st(4 * std::max(A, 1)), so(4 * std::max(A, 1)), te(4 * std::max(mt, 1)),
      tr(4 * std::max(mt, 1)), nt(4), dy(4 * std::max<size_t>((size_t)A * N, 1));
  dx.upload(x.data(), 4 * x.size());
  dw.upload(w.data(), 4 * w.size());
  di.upload(idx.data(), 4 * (size_t)A);
  dy.poison();
  kc::MoeGroupParams gp{di.as<int32_t>(), T, K, E, tile_rows, counts.as<int32_t>(), offsets.as<int32_t>(),
                        st.as<int32_t>(), so.as<int32_t>(), te.as<int32_t>(), tr.as<int32_t>(), nt.as<int32_t>()};
  check_cuda(kc::moe_group(gp, nullptr), "moe_group");
  kc::ExpertGemmParams xp{};
  xp.x = dx.as<float>();
  xp.ldx = Kd;
  xp.x_row = st.as<int32_t>();
  xp.w = dw.as<float>();
  xp.N = N;
  xp.Kd = Kd;
  xp.swiglu = swiglu ? 1 : 0;
  xp.offsets = offsets.as<int32_t>();
  xp.tile_expert = te.as<int32_t>();
  xp.tile_row0 = tr.as<int32_t>();
  xp.num_tiles = nt.as<int32_t>();
  xp.tile_rows = tile_rows;
  xp.max_tiles = mt;
  xp.y = dy.as<float>();
  xp.ldy = N;
  DevBuf dwb;
  if (bf16_weights) {
    dwb = bf16_copy(w.data(), w.size(), "cuda_expert_gemm");
    xp.w_bf16 = dwb.as<uint16_t>();
  }
  DevBuf dq, dqs;
  if (!q_o.is_none() || !qs_o.is_none()) {
    auto q = as_c<uint8_t>(q_o, "int4_packed", 3);
    auto qs = as_c<float>(qs_o, "int4_scales", 3);
    if (int4_group <= 0 || Kd % int4_group || (size_t)q.size() * 2 != (size_t)w.size() ||
        (size_t)qs.size() * int4_group != (size_t)w.size() || q.shape(0) != E || qs.shape(0) != E)
      throw kdtree::Error("cuda_expert_gemm: int4_packed [E, rows, Kd / 2] and int4_scales [E, rows, Kd / group] "
                          "must describe w's shape in groups of int4_group");
    dq = DevBuf(std::max<size_t>(q.size(), 16));
    dq.upload(q.data(), q.size());
    dqs = DevBuf(4 * std::max<size_t>(qs.size(), 4));
    dqs.upload(qs.data(), 4 * qs.size());
    xp.w_int4 = dq.as<uint8_t>();
    xp.w_scale = dqs.as<float>();
    xp.int4_group = int4_group;
    xp.int4_scales_bf16 = kdtree::bf16_exact(qs.data(), (int64_t)qs.size());
  }
  check_cuda(kernel == "mma" ? kc::expert_gemm_mma(xp, nullptr) : kc::expert_gemm(xp, nullptr), "expert_gemm");
  check_cuda(cudaDeviceSynchronize(), "expert_gemm");
  return py::make_tuple(to_numpy<float>(dy, {A, N}), to_numpy<int32_t>(st, {A}));
}

// moe_route + moe_group on host router logits [T, ldl >= E] (tests: fused = the one-launch
// moe_route_group, else the two kernels; block_path: moe_route_group's block-per-token path even
// where its two-barrier path applies): topk ids / weights and the schedule.
py::dict moe_route_group_np(const py::object& lg_o, const py::object& bias_o, int E, int K, int G, int topk_group,
                            bool norm_topk_prob, double scaling, int tile_rows, bool fused, bool block_path) {
  auto lg = as_c<float>(lg_o, "logits", 2);
  auto bias = as_c<float>(bias_o, "bias", 1);
  const int T = (int)lg.shape(0), ldl = (int)lg.shape(1), A = T * K;
  if (E < 1 || ldl < E || bias.shape(0) != E || K < 1 || tile_rows < 1)
    throw kdtree::Error("cuda_moe_route_group: need logits [T, >= E], bias [E], K >= 1, tile_rows >= 1");
  require_device();
  const int mt = kc::moe_max_tiles(A, E, tile_rows);
  DevBuf dl(sizeof(float) * std::max<size_t>(lg.size(), 1)), db(sizeof(float) * E), di(4 * std::max(A, 1)),
      dw(4 * std::max(A, 1)), counts(4 * E), offsets(4 * (E + 1)), st(4 * std::max(A, 1)), so(4 * std::max(A, 1)),
      te(4 * std::max(mt, 1)), tr(4 * std::max(mt, 1)), nt(4);
  dl.upload(lg.data(), sizeof(float) * lg.size());
  db.upload(bias.data(), sizeof(float) * E);
  for (DevBuf* b : {&di, &dw, &counts, &offsets, &st, &so, &te, &tr, &nt}) b->poison();
  kc::RouteParams rp{dl.as<float>(), db.as<float>(), T, E, K, G, topk_group, norm_topk_prob ? 1 : 0, (float)scaling,
                     di.as<int32_t>(), dw.as<float>(), ldl};
  rp.force_block = block_path ? 1 : 0;
  kc::MoeGroupParams gp{di.as<int32_t>(), T, K, E, tile_rows, counts.as<int32_t>(), offsets.as<int32_t>(),
                        st.as<int32_t>(), so.as<int32_t>(), te.as<int32_t>(), tr.as<int32_t>(), nt.as<int32_t>()};
  if (fused) {
    check_cuda(kc::moe_route_group(rp, gp, nullptr), "moe_route_group");
  } else {
    check_cuda(kc::moe_route(rp, nullptr), "moe_route");
    check_cuda(kc::moe_group(gp, nullptr), "moe_group");
  }
  check_cuda(cudaDeviceSynchronize(), "moe_route_group");
  py::dict d;
  d["topk_idx"] = to_numpy<int32_t>(di, {T, K});
  d["topk_w"] = to_numpy<float>(dw, {T, K});
  d["counts"] = to_numpy<int32_t>(counts, {E});
  d["offsets"] = to_numpy<int32_t>(offsets, {E + 1});
  d["slot_token"] = to_numpy<int32_t>(st, {A});
  d["slot_of"] = to_numpy<int32_t>(so, {A});
  d["num_tiles"] = to_numpy<int32_t>(nt, {1});
  d["tile_expert"] = to_numpy<int32_t>(te, {mt});
  d["tile_row0"] = to_numpy<int32_t>(tr, {mt});
  return d;
}

// uv_combine on host arrays (tests): partials [S, T*H, C] (unnormalised O of each key split), ml [S,
// T*H, 2] (max in the log2 domain, sum), w_uv [H, Dv, C] -> out [T, H * Dv]. w_bf16: the weights'
// exact BF16 copy (uint16 high halves, every value of w_uv must be a BF16) is read instead.
py::array_t<float> uv_combine_np(const py::object& part_o, const py::object& ml_o, const py::object& w_o, int T,
                                 bool w_bf16) {
  auto part = as_c<float>(part_o, "partials", 3);
  auto ml = as_c<float>(ml_o, "ml", 3);
  auto w = as_c<float>(w_o, "w_uv", 3);
  const int S = (int)part.shape(0), M = (int)part.shape(1), C = (int)part.shape(2);
  const int H = (int)w.shape(0), Dv = (int)w.shape(1);
  if (T < 1 || M != T * H || ml.shape(0) != S || ml.shape(1) != M || ml.shape(2) != 2 || w.shape(2) != C ||
      !kc::uv_combine_ok(T, S, C, Dv))
    throw kdtree::Error("cuda_uv_combine: need partials [S, T*H, 512], ml [S, T*H, 2], w_uv [H, Dv, 512] with "
                        "2 <= S <= 128, T <= 8, Dv a multiple of 16");
  require_device();
  const size_t np = (size_t)S * M * C, nm = (size_t)S * M * 2, nw = (size_t)H * Dv * C;
  DevBuf ws(sizeof(float) * (np + nm)), dw(sizeof(float) * nw), db(w_bf16 ? 2 * nw : 0), dout(sizeof(float) * T * H * Dv);
  check_cuda(cudaMemcpy(ws.p, part.data(), sizeof(float) * np, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  check_cuda(cudaMemcpy(ws.as<float>() + np, ml.data(), sizeof(float) * nm, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  dw.upload(w.data(), sizeof(float) * nw);
  if (w_bf16) check_cuda(kc::f32_to_bf16_high(dw.as<float>(), db.as<uint16_t>(), (long long)nw, nullptr), "f32_to_bf16_high");
  dout.poison();
  kc::UvCombineParams p{ws.as<float>(), S, T, H, C, Dv, dw.as<float>(), w_bf16 ? db.as<uint16_t>() : nullptr,
                        dout.as<float>()};
  check_cuda(kc::uv_combine(p, nullptr), "uv_combine");
  check_cuda(cudaDeviceSynchronize(), "uv_combine");
  return to_numpy<float>(dout, {T, H * Dv});
}

void bind_cuda(py::module_& m) {
  m.attr("cuda_kernels_compiled") = true;
  m.attr("CUDA_TREE_WARP_PATH_MAX_B") = kdtree::cuda::kTreeWarpPathMaxB;
  m.def("cuda_set_pdl", &kdtree::cuda::set_pdl, py::arg("on"),
        "Programmatic Dependent Launch for every kernel launched from now on (process-wide; a captured "
        "CUDA graph keeps its setting); returns the previous setting. Default on unless KDTREE_CUDA_PDL=0.");
  m.def("cuda_pdl_enabled", &kdtree::cuda::pdl_enabled);
  m.def("cuda_tree_build", &tree_build_np, py::arg("logprobs"), py::arg("token_ids"), py::arg("budget"),
        py::arg("cache_len") = 0, py::arg("force_fallback") = false,
        "GPU tree build from float32 [D,K] log-probs and int32 ids; returns a dict of full-size "
        "outputs (tokens [B], depths [B], parents [B+1], positions [B+1], visibility uint64 [B+1,W]), "
        "n and path (0 = parallel exact path, 1 = sequential fallback, 2 = one-warp path, 3 = parallel exact path "
        "with the threshold estimate). force_fallback: 0 = auto, 1 (or True) = the fallback, 2 = the one-warp "
        "path, 3 = the parallel path, 4 = the parallel path with the adaptive threshold only (testing).");
  m.def("cuda_tree_build_from_logits", &tree_from_logits_np, py::arg("logits"), py::arg("budget"),
        py::arg("top_k"), py::arg("cache_len") = 0, "GPU top-k + log-softmax + tree build from logits [D,V].");
  m.def("cuda_topk_logsoftmax", &topk_np, py::arg("logits"), py::arg("k"),
        "GPU top-k of float32 logits [D,V] as log-probs: (logprobs f32 [D,k], ids int32 [D,k]).");
  m.def("cuda_tf32_split", &tf32_split_np, py::arg("x"),
        "The 3xTF32 operand split of the tensor-core kernels on host float32 x [n]: (hi, lo) uint32 bit "
        "patterns (hi = x rounded to TF32, lo = x - hi truncated to TF32).");
  m.def("cuda_choose_tokens", &choose_tokens_np, py::arg("logits"), py::arg("positions"), py::arg("temperature") = 0.0,
        py::arg("top_k") = 0, py::arg("top_p") = 1.0, py::arg("seed") = 0,
        "The GPU round's per-node choice (choose_tokens) on host float32 logits [T, V] and int32 positions [T]: "
        "must equal _native.sampler_choose.");
  m.def("cuda_draft_check", &draft_check_np, py::arg("values"), py::arg("ids"), py::arg("vocab"),
        "The GPU round's device-draft check (draft_check) on host arrays: (fault [d], finite [d], ids as int32 "
        "or None); fault = 2^30 - (column * 4 + kind) of the row's first fault (0 NaN, 1 +inf, 2 id outside "
        "[0, vocab), 3 unsorted), 0 = none.");
  m.def("cuda_linear_skinny", &linear_skinny_np, py::arg("x"), py::arg("w"), py::arg("y"), py::arg("T"), py::arg("N"),
        py::arg("Kd"), py::arg("batch") = 1, py::arg("x_batch") = 0, py::arg("w_batch") = 0, py::arg("y_batch") = 0,
        py::arg("beta") = 0.0, py::arg("x_off") = 0, py::arg("w_off") = 0, py::arg("norm_w") = py::none(),
        py::arg("norm_eps") = 1e-6, py::arg("x_swiglu") = false, py::arg("norm_out") = false,
        py::arg("config") = 0, py::arg("kernel") = "skinny", py::arg("splits") = 0, py::arg("tile_math") = 0,
        py::arg("bf16_weights") = false, py::arg("rope_cs") = py::none(), py::arg("rope_off") = 0,
        py::arg("rope_interleaved") = 0, py::arg("tile_rows") = 0,
        "The skinny linear kernel on host arrays (tests): y[b][t, n] = beta y + sum_k x[b][t, k] w[b][n, k]; "
        "norm_w: the x rows RMSNorm-ed first (T <= 4); x_swiglu: x rows are [gate | up] (2 Kd) and "
        "silu(gate) * up is the input; config: 1 + an index of cuda_linear_skinny_configs() (0 = auto). "
        "kernel='tile': the same product through linear_tile (no prologues; splits: 0 auto, else 1..8 k splits; tile_math: 0 tensor cores "
        "3xTF32, 1 FP32 CUDA cores; tile_rows: token rows per tile, 8/16/24/32/48/64/72, 0 auto); bf16_weights: the kernel reads an exact BF16 copy of w (every value must be "
        "a BF16; the vector path only, else w); rope_cs [T, R] (cos | sin): the rope block also ropes x[b][t, "
        "rope_off .. rope_off + R) (pairs (2j, 2j+1) with rope_interleaved, else (j, j + R/2)) into a second "
        "returned array [T, batch * R] (the W_UK product's queries, LinearParams::rope_out).");
  m.def("cuda_mla_prep_rows", &mla_prep_rows_np, py::arg("kv"), py::arg("norm_w"), py::arg("cs"), py::arg("eps") = 1e-6,
        py::arg("interleaved") = 1, py::arg("qa") = py::none(), py::arg("qa_eps") = 1e-6, py::arg("H") = 16,
        py::arg("via") = "kernel", py::arg("row0") = 0,
        "mla_prep's cache rows on host arrays (tests): kv [T, >= C + R] = [latent | k_rope], norm_w [C], cs [T, R] "
        "(cos | sin); via='kernel' the mla_prep kernel, via='uk' the rope blocks of a W_UK-like linear_skinny "
        "launch of H heads (LinearParams::prep_on). Returns (rows [T, C + R], 1 / rms of each qa row or None).");
  m.def("cuda_linear_skinny_configs", []() {
        py::list l;
        for (int i = 0; i < kc::linear_skinny_num_configs(); ++i) {
          const kc::LinearSkinnyConfig c = kc::linear_skinny_config(i);
          l.append(py::make_tuple(c.RW, c.TT, c.U));
        }
        return l;
      },
      "The (rows per warp, tokens per slice, k-steps in flight) configurations of linear_skinny; "
      "config=i+1 forces entry i.");
  m.def("cuda_time_linear_skinny", &time_linear_skinny, py::arg("T"), py::arg("N"), py::arg("Kd"), py::arg("batch") = 1,
        py::arg("config") = 0, py::arg("norm") = false, py::arg("swiglu") = false, py::arg("iters") = 50,
        py::arg("warmup") = 5, py::arg("graph_ops") = 20, py::arg("kernel") = "skinny", py::arg("splits") = 0,
        py::arg("tile_math") = 0, py::arg("tile_rows") = 0,
        "Median time of one linear_skinny (kernel='skinny') or linear_tile (kernel='tile', splits: 0 auto or "
        "the forced k split count; tile_math 0 tensor cores 3xTF32, 1 FP32 CUDA cores; tile_rows as in cuda_linear_skinny) call on device-only data (weights rotated past the L2): "
        "median_ms (stream launches), graph_median_ms (per call in graphs of graph_ops calls), the samples, "
        "weight_copies and bytes (of one weight copy).");
  m.def("cuda_moe_route_group", &moe_route_group_np, py::arg("logits"), py::arg("bias"), py::arg("E"), py::arg("K"),
        py::arg("G"), py::arg("topk_group"), py::arg("norm_topk_prob"), py::arg("scaling"), py::arg("tile_rows"),
        py::arg("fused"), py::arg("block_path") = false,
        "MoE routing + expert schedule on router logits [T, >= E] (tests): fused = one launch (moe_route_group); "
        "block_path: its block-per-token path even where the two-barrier path (T <= 4, topk_group == G, K <= 32) "
        "would run.");
  m.def("cuda_expert_gemm", &expert_gemm_np, py::arg("x"), py::arg("w"), py::arg("topk_idx"), py::arg("E"),
        py::arg("swiglu"), py::arg("tile_rows"), py::arg("kernel"), py::arg("bf16_weights") = false,
        py::arg("int4_packed") = py::none(), py::arg("int4_scales") = py::none(), py::arg("int4_group") = 0,
        "The grouped expert GEMM (tests): schedule of topk_idx [T, K] with tile_rows slots per tile, then "
        "y[slot] = x[token] @ w[expert]^T (swiglu: silu(gate) * up); kernel 'gemv' (tile_rows 8), 'tiled' "
        "(64, no swiglu) or 'mma' (8, 16, 32 or 64). Returns (y [A, N] by slot, slot_token [A]). bf16_weights: "
        "the GEMV kernel reads an exact BF16 copy of w (every value must be a BF16). int4_packed uint8 [E, rows, "
        "Kd / 2] + int4_scales float32 [E, rows, Kd / int4_group]: both kernels read those 4-bit weights instead "
        "of w (the values bf16_round((q - 8) * scale)).");
  m.def("cuda_uv_combine", &uv_combine_np, py::arg("partials"), py::arg("ml"), py::arg("w_uv"), py::arg("T"),
        py::arg("w_bf16") = false,
        "The attention's split merge fused into the W_UV product (tests): partials [S, T*H, 512], ml [S, T*H, 2], "
        "w_uv [H, Dv, 512] -> [T, H * Dv].");
  m.def("cuda_moe_group", &moe_group_np, py::arg("topk_idx"), py::arg("E"), py::arg("tile_rows"),
        py::arg("force_two_pass") = false,
        "The MoE expert schedule (moe_group) of int32 routing indices [T, K]: counts, offsets, slots, tiles.");
  m.def("cuda_tree_accept", &tree_accept_np, py::arg("tokens"), py::arg("parents"), py::arg("choice"),
        "GPU accept walk: (path int32 [m], bonus).");
  m.def("cuda_kv_compact", &kv_compact_np, py::arg("cache"), py::arg("cache_len"), py::arg("path"),
        "GPU KV compaction of float32 caches [layers, S, row] (returns the compacted copy).");
  m.def("cuda_tree_accept_compact", &tree_accept_compact_np, py::arg("tokens"), py::arg("parents"),
        py::arg("choice"), py::arg("cache"), py::arg("cache_len"),
        "Fused GPU accept + compaction: (path, bonus, compacted cache copy, the round's result array "
        "[m, n, bonus, path tokens...], next root).");
  m.def("cuda_verify_attention", &verify_attention_np, py::arg("q_latent"), py::arg("q_rope"), py::arg("kv"),
        py::arg("visibility"), py::arg("scale"), py::arg("force_naive") = false, py::arg("force_splits") = 0,
        py::arg("force_kernel") = 0, py::arg("l_bound") = py::none(), py::arg("force_rows") = 0,
        py::arg("exact") = false, py::arg("exact_split") = 0, py::arg("q_scale") = py::none(),
        "GPU MLA verify attention (FP32): out_latent float32 [T,H,C]. force_kernel: 0 auto, 1 tiled, "
        "2 split-KV, 3 decode (two passes); l_bound (int >= L): pass L through a device int, with p.L = l_bound (graph mode); "
        "force_rows: 4, 8 or 16 query rows per split-KV block (0 auto); exact: the row-exact kernel (each row "
        "a function of its own query and visible keys alone; the force options ignored); exact_split: its keys per split (0 = the default); "
        "q_scale: float32 [T], token t's scores scaled by q_scale[t] as well (not with exact).");
  m.def("cuda_device_props", &device_props, "Device name, SMs, peak SM clock and FP32 CUDA-core peak FLOP/s.");
  m.def("cuda_copy_bandwidth", &copy_bandwidth, py::arg("nbytes") = (int64_t)1 << 31, py::arg("iters") = 20,
        "Measured device-to-device copy bandwidth, bytes/s (read + write counted).");
  m.def("cuda_time_tree_build", &time_tree_build, py::arg("logprobs"), py::arg("token_ids"), py::arg("budget"),
        py::arg("iters") = 200, py::arg("warmup") = 20, py::arg("force_path") = 0);
  m.def("cuda_time_tree_build_from_logits", &time_tree_from_logits, py::arg("logits"), py::arg("budget"),
        py::arg("top_k"), py::arg("iters") = 100, py::arg("warmup") = 10);
  m.def("cuda_time_verify_attention", &time_verify_attention, py::arg("q_latent"), py::arg("q_rope"), py::arg("kv"),
        py::arg("visibility"), py::arg("scale"), py::arg("iters") = 20, py::arg("warmup") = 3,
        py::arg("force_naive") = false, py::arg("force_kernel") = 0, py::arg("force_splits") = 0,
        py::arg("force_rows") = 0, py::arg("exact") = false);
  m.def("cuda_time_accept_compact", &time_accept_compact, py::arg("tokens"), py::arg("parents"), py::arg("choice"),
        py::arg("layers"), py::arg("slots"), py::arg("row"), py::arg("cache_len"), py::arg("iters") = 200,
        py::arg("warmup") = 20);

  // ---- device-pointer entry points (integer addresses; stream = cudaStream_t as an integer)
  m.def(
      "cuda_tree_build_ptr",
      [](uintptr_t lp, uintptr_t ids, int D, int K, int ld, int budget, int cache_len, uintptr_t tokens,
         uintptr_t depths, uintptr_t parents, uintptr_t positions, uintptr_t vis, uintptr_t n_nodes,
         uintptr_t stream) {
        kc::TreeBuildParams p{};
        p.logprobs = (const float*)lp;
        p.token_ids = (const int32_t*)ids;
        p.D = D; p.K = K; p.ld = ld; p.budget = budget; p.cache_len = cache_len;
        p.tokens = (int32_t*)tokens; p.depths = (int32_t*)depths; p.parents = (int32_t*)parents;
        p.positions = (int32_t*)positions; p.visibility = (uint64_t*)vis; p.n_nodes = (int32_t*)n_nodes;
        check_cuda(kc::tree_build(p, (cudaStream_t)stream), "tree_build");
      },
      py::arg("logprobs"), py::arg("token_ids"), py::arg("D"), py::arg("K"), py::arg("ld"), py::arg("budget"),
      py::arg("cache_len"), py::arg("tokens"), py::arg("depths"), py::arg("parents"), py::arg("positions"),
      py::arg("visibility"), py::arg("n_nodes"), py::arg("stream") = 0);
  m.def("cuda_tree_from_logits_workspace_bytes", &kc::tree_from_logits_workspace_bytes);
  m.def(
      "cuda_tree_build_from_logits_ptr",
      [](uintptr_t logits, int D, int V, int ld, int top_k, int budget, int cache_len, uintptr_t tokens,
         uintptr_t depths, uintptr_t parents, uintptr_t positions, uintptr_t vis, uintptr_t n_nodes,
         uintptr_t workspace, uintptr_t stream) {
        kc::TreeFromLogitsParams p{};
        p.logits = (const float*)logits;
        p.D = D; p.V = V; p.ld = ld; p.top_k = top_k;
        p.tree.budget = budget; p.tree.cache_len = cache_len;
        p.tree.tokens = (int32_t*)tokens; p.tree.depths = (int32_t*)depths; p.tree.parents = (int32_t*)parents;
        p.tree.positions = (int32_t*)positions; p.tree.visibility = (uint64_t*)vis; p.tree.n_nodes = (int32_t*)n_nodes;
        p.workspace = (void*)workspace;
        check_cuda(kc::tree_build_from_logits(p, (cudaStream_t)stream), "tree_build_from_logits");
      },
      py::arg("logits"), py::arg("D"), py::arg("V"), py::arg("ld"), py::arg("top_k"), py::arg("budget"),
      py::arg("cache_len"), py::arg("tokens"), py::arg("depths"), py::arg("parents"), py::arg("positions"),
      py::arg("visibility"), py::arg("n_nodes"), py::arg("workspace"), py::arg("stream") = 0);
  m.def(
      "cuda_tree_accept_ptr",
      [](uintptr_t tokens, uintptr_t parents, uintptr_t choice, uintptr_t n_nodes, int n_max, uintptr_t path,
         uintptr_t count, uintptr_t bonus, uintptr_t stream) {
        kc::TreeAcceptParams a{};
        a.tokens = (const int32_t*)tokens; a.parents = (const int32_t*)parents; a.choice = (const int32_t*)choice;
        a.n_nodes = (const int32_t*)n_nodes; a.n_max = n_max;
        a.path = (int32_t*)path; a.count = (int32_t*)count; a.bonus = (int32_t*)bonus;
        check_cuda(kc::tree_accept(a, (cudaStream_t)stream), "tree_accept");
      },
      py::arg("tokens"), py::arg("parents"), py::arg("choice"), py::arg("n_nodes"), py::arg("n_max"),
      py::arg("path"), py::arg("count"), py::arg("bonus"), py::arg("stream") = 0);
  m.def(
      "cuda_kv_compact_ptr",
      [](uintptr_t cache, int num_layers, long long layer_stride, long long row_stride, int row_bytes,
         int cache_len, uintptr_t path, uintptr_t count, uintptr_t stream) {
        kc::KvCompactParams p{};
        p.cache = (void*)cache; p.num_layers = num_layers; p.layer_stride = layer_stride;
        p.row_stride = row_stride; p.row_bytes = row_bytes; p.cache_len = cache_len;
        p.path = (const int32_t*)path; p.count = (const int32_t*)count;
        check_cuda(kc::kv_compact(p, (cudaStream_t)stream), "kv_compact");
      },
      py::arg("cache"), py::arg("num_layers"), py::arg("layer_stride"), py::arg("row_stride"),
      py::arg("row_bytes"), py::arg("cache_len"), py::arg("path"), py::arg("count"), py::arg("stream") = 0);
  m.def(
      "cuda_verify_attention_ptr",
      [](uintptr_t q_latent, uintptr_t q_rope, uintptr_t kv, int kv_stride, uintptr_t vis, int vis_stride, int T,
         int H, int C, int R, int L, double scale, uintptr_t out, uintptr_t workspace, uintptr_t stream,
         uintptr_t L_dev, int force_kernel) {
        kc::VerifyAttentionParams p{};
        p.q_latent = (const float*)q_latent; p.q_rope = (const float*)q_rope; p.kv = (const float*)kv;
        p.kv_stride = kv_stride; p.visibility = (const uint64_t*)vis; p.vis_stride = vis_stride;
        p.T = T; p.H = H; p.C = C; p.R = R; p.L = L; p.scale = (float)scale; p.out = (float*)out;
        p.workspace = (void*)workspace;
        p.L_dev = (const int*)L_dev;  // 0 = none; else int32 device address, L = its upper bound
        p.force_kernel = force_kernel;
        check_cuda(kc::verify_attention(p, (cudaStream_t)stream), "verify_attention");
      },
      py::arg("q_latent"), py::arg("q_rope"), py::arg("kv"), py::arg("kv_stride"), py::arg("visibility"),
      py::arg("vis_stride"), py::arg("T"), py::arg("H"), py::arg("C"), py::arg("R"), py::arg("L"), py::arg("scale"),
      py::arg("out"), py::arg("workspace"), py::arg("stream") = 0, py::arg("L_dev") = 0, py::arg("force_kernel") = 0);
  m.def(
      "cuda_verify_attention_workspace_bytes",
      [](int T, int H, int C, int R, int L, int kv_stride, int force_kernel, int force_splits) {
        kc::VerifyAttentionParams p = attn_shape_params(T, H, C, R, L, kv_stride, force_kernel, force_splits);
        return kc::verify_attention_workspace_bytes(p);
      },
      py::arg("T"), py::arg("H"), py::arg("C"), py::arg("R"), py::arg("L"), py::arg("kv_stride"),
      py::arg("force_kernel") = 0, py::arg("force_splits") = 0);
  m.def(
      "cuda_verify_attention_choice",
      [](int T, int H, int L, int C, int R, int force_kernel, int force_splits, int force_rows) {
        kc::VerifyAttentionParams p = attn_shape_params(T, H, C, R, L, C + R, force_kernel, force_splits);
        p.force_splitkv_rows = force_rows;
        int kernel = 0, splits = 1, rows = 16, sf = 1, sl = 1;
        kc::verify_attention_choice(p, &kernel, &splits, &rows, &sf, &sl);
        return py::make_tuple(kernel, splits, rows, sf, sl);
      },
      py::arg("T"), py::arg("H"), py::arg("L"), py::arg("C") = 512, py::arg("R") = 64, py::arg("force_kernel") = 0,
      py::arg("force_splits") = 0, py::arg("force_rows") = 0,
      "verify_attention's pick for aligned buffers of these shapes: (kernel, splits, split-KV rows per block, "
      "key splits of each full row block, of the last row block); kernel 0 = plain, 1 = tiled, 2 = split-KV, "
      "3 = decode, 4 = tensor cores (splits = its partial slots, the larger of the last two; other kernels: "
      "the last two equal splits).");
  (void)as_ptr;
}

#else  // no CUDA backend in this build

void bind_cuda(py::module_& m) { m.attr("cuda_kernels_compiled") = false; }

#endif

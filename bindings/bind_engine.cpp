// bind_engine.cpp: Python bindings for the engine loop (cpp/engine): _native.ToyTarget (a test
// target), _native.Generator (the prefill / AR / DDTree loop over a ToyTarget or a model).
// The GIL is released while the loop runs and taken back only to call the Python drafter and
// the progress callback. A Python exception raised by either is carried through the C++ loop
// and re-raised unchanged (same object, same traceback); malformed drafter output raises
// ValueError naming the problem. The public face is python/kdtree_native/generation.py.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cmath>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "engine/engine.h"
#include "engine/model_drafter.h"
#include "engine/model_target.h"
#include "engine/ngram_drafter.h"
#include "engine/toy_target.h"
#include "model/cpu_model.h"
#include "model/model.h"
#include "model_py.h"
#if defined(KDTREE_HAVE_CUDA) && defined(KDTREE_HAVE_CUBLAS)
#include "engine/cuda_model_drafter.h"
#include "engine/cuda_rounds.h"
#include "model/cuda_model.h"
#endif
#ifdef KDTREE_HAVE_CUDA
#include "cuda_device.h"
#endif

namespace py = pybind11;
using namespace kdtree;

namespace {

// Thrown through the C++ loop when a Python callback raised; the Python error itself is kept
// aside and re-raised once the GIL is held again.
struct CallbackAborted : std::exception {
  const char* what() const noexcept override { return "Python callback raised"; }
};

std::string type_name(const py::handle& h) { return py::str(py::type::of(h).attr("__name__")); }

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// ---------------------------------------------------------------- device arrays from drafters
// A drafter may return device arrays instead of numpy: anything with DLPack (__dlpack__ and
// __dlpack_device__ naming CUDA memory: torch, CuPy, JAX) or __cuda_array_interface__ (CAI:
// torch, CuPy, Numba, ...); CAI when an object has both (cheaper, below). DLPack arrays are
// exported for the legacy default stream (`stream=1`: the producer orders its work before that
// stream's next work, which costs torch nothing when it runs on its default stream) and the
// engine then waits for that stream; CAI names the producer's stream (v3) or none (v2: the whole
// device is synchronised). Host memory through DLPack (torch CPU tensors, ...) is read as a
// numpy view (numpy.from_dlpack, no copy).

// The DLPack C structures (the DLPack specification, legacy unversioned "dltensor" capsules).
struct DLDevice {
  int32_t device_type;  // 1 CPU, 2 CUDA, 3 CUDA pinned host, 13 CUDA managed
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; nullptr = C-contiguous
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

// One device array as the engine needs it.
struct DeviceArray {
  const void* ptr = nullptr;
  int device = -1;  // the CUDA ordinal of its memory (-1: not device memory)
  char kind = 0;    // 'f', 'i', 'u'; '?' another DLPack type (dl_dtype names it)
  std::string dl_dtype;
  int64_t itemsize = 0;
  std::vector<int64_t> shape;
  bool contiguous = true;
  int wait_kind = 2;  // what to wait for before reading: DraftOutput::device_wait_kind
  unsigned long long wait_stream = 0;
  std::shared_ptr<void> owner;  // keeps the memory alive (the Python object / the DLPack tensor)
  int64_t count() const {
    int64_t c = 1;
    for (int64_t d : shape) c *= d;
    return c;
  }
};

// How an object offers its memory, besides being a numpy array: proto 0 = it does not (numpy,
// or memory the engine cannot read), 1 = DLPack of CUDA / managed memory on CUDA device
// `dl_device`, 2 = CAI, 3 = DLPack of host memory (read as a numpy view). CAI first when an
// object has both: measured on the H200 with torch 2.x, reading a tensor's CAI takes ~2 us and the
// device-wide wait of its v2 interface ~6 us, where __dlpack__ takes ~12 us per tensor (18 us when
// it must record an event); either order is correct.
struct Probe {
  int proto = 0;
  int dl_device = -1;
  py::object cai;  // proto 2: the interface dict, read once (a property: torch builds it per read)
  bool device() const { return proto == 1 || proto == 2; }
};
Probe probe_array(const py::handle& h, const char* what = "output") {
  Probe p;
  if (py::isinstance<py::array>(h)) return p;
  // (torch: ~2 us; __dlpack__ ~12 us.) AttributeError: no CAI (torch CPU tensors raise it); any
  // other exception from the property is the producer's own and propagates unchanged.
  py::object cai = py::reinterpret_steal<py::object>(PyObject_GetAttrString(h.ptr(), "__cuda_array_interface__"));
  if (!cai) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
    PyErr_Clear();
    cai = py::none();
  }
  if (!cai.is_none()) {
    p.proto = 2;
    p.cai = std::move(cai);
    return p;
  }
  if (py::hasattr(h, "__dlpack__") && py::hasattr(h, "__dlpack_device__")) {
    int type = 0, dev_id = -1;
    try {
      py::tuple dev = h.attr("__dlpack_device__")();
      type = dev[0].cast<int>();
      dev_id = dev[1].cast<int>();
    } catch (const py::error_already_set& e) {
      if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit)) throw;
      throw Error(std::string("drafter ") + what + ": __dlpack_device__() failed or is not a (type, id) pair of ints (" +
                  e.what() + ")");
    } catch (const py::cast_error&) {
      throw Error(std::string("drafter ") + what + ": __dlpack_device__() is not a (type, id) pair of ints");
    }
    if (type == 2 || type == 13) {
      p.proto = 1;
      p.dl_device = dev_id;
    } else if (type == 1) {
      p.proto = 3;
    }
  }
  return p;
}

std::shared_ptr<void> py_owner(const py::handle& h) {
  PyObject* o = h.inc_ref().ptr();
  return std::shared_ptr<void>(o, [](void* p) {
    py::gil_scoped_acquire gil;
    Py_DECREF(static_cast<PyObject*>(p));
  });
}

// The fields of a __cuda_array_interface__ dict (v2 / v3) into a; Python / cast errors propagate.
void read_cai(const py::dict& cai, DeviceArray& a) {
  for (const char* key : {"typestr", "shape", "data"})
    if (!cai.contains(key)) throw Error(std::string("the '") + key + "' field is missing");
  const std::string typestr = py::str(cai["typestr"]);
  py::dtype dt(typestr);
  a.kind = dt.kind();
  a.itemsize = dt.itemsize();
  py::tuple shape = cai["shape"];
  for (auto d : shape) a.shape.push_back(d.cast<int64_t>());
  if (cai.contains("strides") && !cai["strides"].is_none()) {
    py::tuple st = cai["strides"];
    int64_t expect = a.itemsize;
    for (int64_t i = (int64_t)a.shape.size() - 1; i >= 0; --i) {
      if (a.shape[i] > 1 && st[i].cast<int64_t>() != expect) a.contiguous = false;
      expect *= a.shape[i];
    }
  }
  a.ptr = reinterpret_cast<const void*>(py::tuple(cai["data"])[0].cast<uintptr_t>());
  a.wait_kind = 0;
  if (cai.contains("stream")) {
    if (cai["stream"].is_none()) a.wait_kind = 2;
    else {
      a.wait_kind = 1;
      a.wait_stream = cai["stream"].cast<unsigned long long>();
    }
  }
}

// Opens a device array (probe.proto 1 or 2). DLPack: exported for the legacy default stream,
// which wait_kind / wait_stream then name; CAI: the producer's stream as it says.
DeviceArray open_device_array(const py::handle& h, const Probe& probe, const char* what) {
  DeviceArray a;
  const std::string who = std::string("drafter ") + what;
  if (probe.proto == 1) {
    py::object cap = h.attr("__dlpack__")(py::arg("stream") = 1);
    if (!PyCapsule_CheckExact(cap.ptr()) || !PyCapsule_IsValid(cap.ptr(), "dltensor"))
      throw Error(who + ": __dlpack__ did not return an unused 'dltensor' capsule");
    auto* mt = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"));
    if (mt == nullptr) throw py::error_already_set();
    PyCapsule_SetName(cap.ptr(), "used_dltensor");  // ours now: the capsule no longer frees it
    a.owner = std::shared_ptr<void>(mt, [](void* p) {
      auto* t = static_cast<DLManagedTensor*>(p);
      py::gil_scoped_acquire gil;  // producers' deleters may touch Python objects
      if (t->deleter) t->deleter(t);
    });
    const DLTensor& t = mt->dl_tensor;
    if (t.dtype.lanes != 1 || t.dtype.code > 2 || t.dtype.bits % 8 != 0) {
      a.kind = '?';  // bfloat16, complex, vectors: named by the dtype checks (float32 / integer)
      a.dl_dtype = "DLPack type code " + std::to_string(t.dtype.code) + ", " + std::to_string(t.dtype.bits) +
                   " bits, " + std::to_string(t.dtype.lanes) + " lanes";
    } else {
      a.kind = t.dtype.code == 2 ? 'f' : t.dtype.code == 1 ? 'u' : 'i';
    }
    a.itemsize = t.dtype.bits / 8;
    a.shape.assign(t.shape, t.shape + t.ndim);
    if (t.strides) {
      int64_t expect = 1;
      for (int i = t.ndim - 1; i >= 0; --i) {
        if (t.shape[i] > 1 && t.strides[i] != expect) a.contiguous = false;
        expect *= t.shape[i];
      }
    }
    a.ptr = static_cast<const char*>(t.data) + t.byte_offset;
    a.wait_kind = 1;  // the legacy default stream
    a.wait_stream = 1;
  } else {
    if (!py::isinstance<py::dict>(probe.cai))
      throw Error(who + ": __cuda_array_interface__ is not a dict, got " + type_name(probe.cai));
    try {
      read_cai(py::reinterpret_borrow<py::dict>(probe.cai), a);
    } catch (const py::error_already_set& e) {
      if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit)) throw;
      throw Error(who + ": a malformed __cuda_array_interface__ (" + e.what() + ")");
    } catch (const py::cast_error& e) {
      throw Error(who + ": a malformed __cuda_array_interface__ (a field of the wrong type: " + e.what() + ")");
    } catch (const Error& e) {
      throw Error(who + ": a malformed __cuda_array_interface__ (" + e.what() + ")");
    }
    a.owner = py_owner(h);
  }
  for (int64_t d : a.shape)
    if (d < 0) throw Error(who + ": a device array with a negative extent (" + std::to_string(d) + ")");
  if (a.count() > 0 && a.ptr == nullptr) throw Error(who + ": device array with a null pointer");
#ifdef KDTREE_HAVE_CUDA
  if (a.count() > 0) a.device = cuda_pointer_device(a.ptr);
#endif
  return a;
}

// A device array copied into a new numpy array, after the producer's work is visible.
// max_cols: the widest a draft row can be (the vocab, or a top-k up to the tree budget limit):
// a device array's shape is checked against it before a host buffer of that size is made.
py::array device_array_to_host(const py::handle& h, const Probe& probe, const char* what, int64_t max_cols) {
  const std::string who = std::string("drafter ") + what;
  DeviceArray a = open_device_array(h, probe, what);
  std::string shp = "[";
  for (size_t i = 0; i < a.shape.size(); ++i) shp += (i ? ", " : "") + std::to_string(a.shape[i]);
  shp += "]";
  if (a.shape.size() != 2) throw Error(who + " must be 2-D, got a device array of shape " + shp);
  if (a.shape[0] > kTreeMaxDepth || a.shape[1] > max_cols)
    throw Error(who + ": a device array of shape " + shp + " is larger than any draft (at most " +
                std::to_string(kTreeMaxDepth) + " rows of " + std::to_string(max_cols) + ")");
  if (!a.contiguous) throw Error(who + ": a device array must be C-contiguous (call .contiguous())");
  if (a.kind == '?')
    throw Error(who + " must be float32 (log-probs, logits) or an integer array (ids), got " + a.dl_dtype);
  std::string fmt(1, a.kind);
  fmt += std::to_string(a.itemsize);
  py::dtype dt(fmt);
  std::vector<py::ssize_t> dims(a.shape.begin(), a.shape.end());
  py::array out(dt, dims);
#ifdef KDTREE_HAVE_CUDA
  std::string err;
  {
    py::gil_scoped_release nogil;
    err = cuda_copy_to_host(out.mutable_data(), a.ptr, (size_t)(a.count() * a.itemsize), a.wait_kind, a.wait_stream);
  }
  if (!err.empty()) throw RuntimeFailure(who + ": copying the device array failed: " + err);
#else
  throw Error(who + ": a device array was returned but this build has no CUDA backend");
#endif
  return out;
}

py::array as_ndarray(const py::handle& h, const char* what, int64_t max_cols) {
  const Probe probe = probe_array(h, what);
  if (probe.device()) return device_array_to_host(h, probe, what, max_cols);
  if (py::isinstance<py::array>(h)) return py::reinterpret_borrow<py::array>(h);
  if (probe.proto == 3) {  // host memory through DLPack: a zero-copy numpy view
    try {
      return py::module_::import("numpy").attr("from_dlpack")(h).cast<py::array>();
    } catch (const py::error_already_set& e) {  // e.g. bfloat16, which numpy has no type for
      if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit)) throw;
      throw Error(std::string("drafter ") + what + ": its DLPack export could not be read as a numpy array (" +
                  e.what() + "); drafts must be float32 (log-probs, logits) and integer (ids) arrays");
    }
  }
  throw Error(std::string("drafter ") + what + " must be a numpy array (or a CPU / CUDA array with DLPack or "
              "__cuda_array_interface__), got " + type_name(h));
}

// A drafter's device arrays taken in place for a round executor on out.device_ok: true when it
// took them (out filled; the executor checks the values), false when the host path must read
// them (not all device arrays of that device, another layout or dtype: the host path copies
// them or names the problem).
bool take_device_draft(const py::object& r, DraftOutput& out) {
  if (out.device_ok < 0) return false;
  auto usable = [&](const DeviceArray& a) { return a.device == out.device_ok && a.contiguous && a.count() > 0; };
  // DLPack arrays of another device are not exported at all
  auto here = [&](const Probe& p) { return p.proto == 2 || (p.proto == 1 && p.dl_device == out.device_ok); };
  if (py::isinstance<py::tuple>(r) || py::isinstance<py::list>(r)) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(r);
    if (py::len(seq) != 2) return false;
    const Probe p0 = probe_array(seq[0]);
    if (!here(p0)) return false;
    const Probe p1 = probe_array(seq[1]);
    if (!here(p1)) return false;
    DeviceArray lp = open_device_array(seq[0], p0, "logprobs");
    DeviceArray ids = open_device_array(seq[1], p1, "token_ids");
    if (!usable(lp) || !usable(ids) || lp.kind != 'f' || lp.itemsize != 4 || ids.kind != 'i' ||
        (ids.itemsize != 4 && ids.itemsize != 8) || lp.shape.size() != 2 || lp.shape != ids.shape)
      return false;
    out.d = lp.shape[0];
    out.k = lp.shape[1];
    out.device_values = static_cast<const float*>(lp.ptr);
    out.device_ids = ids.ptr;
    out.device_ids_bytes = static_cast<int>(ids.itemsize);
    if (lp.wait_kind == ids.wait_kind && lp.wait_stream == ids.wait_stream) {
      out.device_wait_kind = lp.wait_kind;
      out.device_wait_stream = lp.wait_stream;
    } else if (lp.wait_kind == 2 || ids.wait_kind == 2) {
      const DeviceArray& w = lp.wait_kind == 2 ? ids : lp;
      out.device_wait_kind = w.wait_kind;
      out.device_wait_stream = w.wait_stream;
    } else {
      out.device_wait_kind = 0;  // two different producer streams: the whole device
    }
    auto lo = lp.owner, io = ids.owner;
    out.device_owner = std::shared_ptr<void>(nullptr, [lo, io](void*) mutable {
      lo.reset();
      io.reset();
    });
    return true;
  }
  const Probe p = probe_array(r);
  if (!here(p)) return false;
  DeviceArray lg = open_device_array(r, p, "logits");
  if (!usable(lg) || lg.kind != 'f' || lg.itemsize != 4 || lg.shape.size() != 2) return false;
  out.is_logits = true;
  out.d = lg.shape[0];
  out.k = lg.shape[1];
  out.device_values = static_cast<const float*>(lg.ptr);
  out.device_wait_kind = lg.wait_kind;
  out.device_wait_stream = lg.wait_stream;
  out.device_owner = lg.owner;
  return true;
}

// Python drafter result -> DraftOutput (shapes and dtypes here; values are checked by the engine).
void parse_draft(const py::object& r, int64_t vocab, DraftOutput& out) {
  out.clear();
  if (r.is_none()) return;  // no draft this round
  if (take_device_draft(r, out)) return;
  if (py::isinstance<py::tuple>(r) || py::isinstance<py::list>(r)) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(r);
    if (py::len(seq) != 2)
      throw Error("drafter must return (logprobs [d,k], token_ids [d,k]) or logits [d,V]; got a sequence of length " +
                  std::to_string(py::len(seq)));
    const int64_t max_k = std::max<int64_t>(vocab, kTreeMaxBudget);
    py::array lp = as_ndarray(seq[0], "logprobs", max_k);
    py::array ids = as_ndarray(seq[1], "token_ids", max_k);
    if (lp.dtype().kind() != 'f' || lp.itemsize() != 4)
      throw Error("drafter logprobs must be float32, got " + std::string(py::str(lp.dtype())));
    if (ids.dtype().kind() != 'i' && ids.dtype().kind() != 'u')
      throw Error("drafter token_ids must be an integer array, got " + std::string(py::str(ids.dtype())));
    if (lp.ndim() != 2 || ids.ndim() != 2)
      throw Error("drafter logprobs and token_ids must be 2-D [d, k], got shapes " + shape_str(lp) + " and " +
                  shape_str(ids));
    if (lp.shape(0) != ids.shape(0) || lp.shape(1) != ids.shape(1))
      throw Error("drafter logprobs and token_ids shapes differ: " + shape_str(lp) + " vs " + shape_str(ids));
    out.d = lp.shape(0);
    out.k = lp.shape(1);
    if (out.d == 0) { out.k = 0; return; }
    auto lpc = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(lp);
    auto idc = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(ids);
    if (!lpc || !idc) throw Error("drafter output could not be read as float32 / int64 arrays");
    const int64_t n = out.d * out.k;
    out.values.assign(lpc.data(), lpc.data() + n);
    out.ids.resize(static_cast<size_t>(n));
    const int64_t* p = idc.data();
    for (int64_t i = 0; i < n; ++i) {
      if (p[i] < 0 || p[i] >= vocab)
        throw Error("drafter token id " + std::to_string(p[i]) + " outside the vocab [0, " + std::to_string(vocab) +
                    ") (row " + std::to_string(i / out.k) + ", column " + std::to_string(i % out.k) + ")");
      out.ids[i] = static_cast<int32_t>(p[i]);
    }
    return;
  }
  if (py::isinstance<py::array>(r) || probe_array(r, "logits").proto) {
    py::array lg = as_ndarray(r, "logits", std::max<int64_t>(vocab, kTreeMaxBudget));
    if (lg.dtype().kind() != 'f' || lg.itemsize() != 4)
      throw Error("drafter logits must be float32, got " + std::string(py::str(lg.dtype())));
    if (lg.ndim() != 2) throw Error("drafter logits must be 2-D [d, V], got shape " + shape_str(lg));
    out.is_logits = true;
    out.d = lg.shape(0);
    out.k = lg.shape(1);
    if (out.d == 0) { out.k = 0; out.is_logits = false; return; }
    auto c = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(lg);
    out.values.assign(c.data(), c.data() + out.d * out.k);
    return;
  }
  throw Error("drafter must return (logprobs [d,k], token_ids [d,k]) or logits [d,V], got " + type_name(r));
}

// _native.NgramDraft: the C++ n-gram drafter; generate() calls it inside the round without Python.
// The mutex keeps its scratch buffers to one caller at a time (two Generators may share a drafter).
struct PyNgramDraft {
  NgramDrafter drafter;
  std::mutex mu;
  explicit PyNgramDraft(const NgramParams& p) : drafter(p) {}
};

// _native.ModelDraft: a draft model's greedy chain in C++ (cpp/engine/model_drafter.h; over a
// CudaModel the chain stays on the GPU: cuda/engine/cuda_model_drafter.h); generate() calls it
// inside the round without Python. One caller at a time (the mutex).
struct PyModelDraft {
  std::unique_ptr<ModelDrafter> drafter;
  std::mutex mu;
};

std::unique_ptr<PyModelDraft> make_model_draft(py::object model, double min_chain_prob, int64_t prefill_chunk) {
  ModelDraftParams p{min_chain_prob, prefill_chunk};
  check_model_draft_params(p);
  auto d = std::make_unique<PyModelDraft>();
  if (py::isinstance<CpuModel>(model)) {
    d->drafter = std::make_unique<ModelDrafter>(model.cast<CpuModel&>(), p);
    return d;
  }
#if defined(KDTREE_HAVE_CUDA) && defined(KDTREE_HAVE_CUBLAS)
  if (py::isinstance<CudaModel>(model)) {
    d->drafter = std::make_unique<CudaModelDrafter>(model.cast<CudaModel&>(), p);
    return d;
  }
#endif
  throw Error("ModelDraft: the draft model must be a native model (CpuModel or CudaModel), got " + type_name(model));
}

// A native drafter called from Python (NgramDraft / ModelDraft.__call__): the drafter runs without
// the GIL under its mutex; the result as the drafter protocol's arrays: None, (log-probs, ids)
// or logits.
template <class Draft>
py::object call_native_drafter(const char* name, std::mutex& mu, const py::array_t<int32_t>& context, Draft&& draft) {
  if (context.ndim() != 1) throw Error(std::string(name) + ": context must be 1-D");
  DraftOutput out;
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(mu);
    draft(context.data(), context.shape(0), out);
  }
  if (out.d == 0) return py::none();
  py::array_t<float> values({out.d, out.k});
  std::copy(out.values.begin(), out.values.end(), values.mutable_data());
  if (out.is_logits) return values;
  py::array_t<int32_t> ids({out.d, out.k});
  std::copy(out.ids.begin(), out.ids.end(), ids.mutable_data());
  return py::make_tuple(values, ids);
}

// A Generator together with the target it drives (a ToyTarget or an adapted model).
struct PyGenerator {
  std::unique_ptr<ModelTarget> adapter;     // set when driving a TargetModel through its host path
  std::unique_ptr<RoundExecutor> executor;  // set when the rounds run on the device (CudaRounds)
  const void* target_model = nullptr;       // the native model driven (a drafter may not use it too)
  Target* target = nullptr;
  std::string rounds = "host";              // "host" or "device"
  std::unique_ptr<Generator> gen;
  std::atomic<bool> busy{false};
};

py::dict run_generate(py::object self, py::array_t<int64_t, py::array::c_style | py::array::forcecast> prompt,
                      int64_t max_new_tokens, py::object drafter, int64_t tree_budget, int64_t depth, int64_t top_k,
                      double temperature, double top_p, int64_t target_top_k, uint64_t seed,
                      std::vector<int64_t> stop_tokens, py::object progress, int64_t prefill_chunk,
                      bool adaptive_budget, bool reuse_prefix) {
  PyGenerator& g = self.cast<PyGenerator&>();
  if (prompt.ndim() != 1) throw Error("prompt_ids must be 1-D, got " + std::to_string(prompt.ndim()) + " dims");
  const int64_t V = g.gen->executor().vocab_size();
  std::vector<int32_t> ids(static_cast<size_t>(prompt.shape(0)));
  for (int64_t i = 0; i < prompt.shape(0); ++i) {
    const int64_t t = prompt.data()[i];
    if (t < 0 || t >= V)
      throw Error("prompt token " + std::to_string(t) + " at index " + std::to_string(i) + " outside the vocab [0, " +
                  std::to_string(V) + ")");
    ids[i] = static_cast<int32_t>(t);
  }
  GenerateParams p;
  p.max_new_tokens = max_new_tokens;
  p.tree_budget = tree_budget;
  p.depth = depth;
  p.top_k = top_k;
  p.sampling.temperature = static_cast<float>(temperature);
  p.sampling.top_p = static_cast<float>(top_p);
  p.sampling.top_k = target_top_k;
  p.sampling.seed = seed;
  p.prefill_chunk = prefill_chunk;
  p.adaptive_budget = adaptive_budget;
  p.reuse_prefix = reuse_prefix;
  for (int64_t t : stop_tokens) {
    if (t < 0 || t >= V) throw Error("stop token " + std::to_string(t) + " outside the vocab [0, " + std::to_string(V) + ")");
    p.stop_tokens.push_back(static_cast<int32_t>(t));
  }
  if (!drafter.is_none() && !PyCallable_Check(drafter.ptr()))
    throw Error("drafter must be callable (or None), got " + type_name(drafter));
  PyNgramDraft* native_ngram = py::isinstance<PyNgramDraft>(drafter) ? &drafter.cast<PyNgramDraft&>() : nullptr;
  PyModelDraft* native_model = py::isinstance<PyModelDraft>(drafter) ? &drafter.cast<PyModelDraft&>() : nullptr;
  if (native_model && static_cast<const void*>(&native_model->drafter->model()) == g.target_model)
    throw Error("ModelDrafter: the draft model is the target model itself (its cache would be overwritten); "
                "load a second copy to draft with");
  if (!progress.is_none() && !PyCallable_Check(progress.ptr()))
    throw Error("progress must be callable (or None), got " + type_name(progress));

  std::exception_ptr py_error;  // a Python exception raised inside a callback
  DraftFn draft_fn;
  if (native_ngram) {  // no Python in the round (`drafter` keeps the object alive through the call)
    draft_fn = [native_ngram](const int32_t* ctx, int64_t n, int64_t d, int64_t k, DraftOutput& out) {
      std::lock_guard<std::mutex> lock(native_ngram->mu);
      native_ngram->drafter.draft(ctx, n, d, k, out);
    };
  } else if (native_model) {
    draft_fn = [native_model](const int32_t* ctx, int64_t n, int64_t d, int64_t k, DraftOutput& out) {
      std::lock_guard<std::mutex> lock(native_model->mu);
      kdtree_py::ModelUse use(&native_model->drafter->model(), "a ModelDrafter's draft", true);
      native_model->drafter->draft(ctx, n, d, k, out);
    };
  } else if (!drafter.is_none()) {
    draft_fn = [&](const int32_t* ctx, int64_t n, int64_t d, int64_t k, DraftOutput& out) {
      py::gil_scoped_acquire gil;
      try {
        // Zero-copy, read-only view of the engine's token buffer; `self` keeps it alive.
        py::array_t<int32_t> view({static_cast<py::ssize_t>(n)}, {static_cast<py::ssize_t>(sizeof(int32_t))}, ctx, self);
        view.attr("flags").attr("writeable") = false;
        py::object r = drafter(view, d, k);
        parse_draft(r, V, out);
      } catch (py::error_already_set&) {
        py_error = std::current_exception();
        throw CallbackAborted();
      }
    };
  }
  ProgressFn progress_fn;
  if (!progress.is_none()) {
    progress_fn = [&](const int32_t* toks, int64_t n, int64_t done, int64_t total) {
      py::gil_scoped_acquire gil;
      try {
        py::array_t<int32_t> a(static_cast<py::ssize_t>(n));
        std::copy(toks, toks + n, a.mutable_data());
        progress(a, done, total);
      } catch (py::error_already_set&) {
        py_error = std::current_exception();
        throw CallbackAborted();
      }
    };
  }

  // the target, held for the whole run (kdtree_py::ModelUse: a Python-facing call on it meanwhile raises instead of
  // corrupting the cache); a native ModelDrafter's model is held by each draft call (draft_fn)
  kdtree_py::ModelUse use_target(static_cast<const TargetModel*>(g.target_model), "generate");
  bool expected = false;
  if (!g.busy.compare_exchange_strong(expected, true))
    throw RuntimeFailure("generate: this Generator is already running (a generate on the same engine in another "
                         "thread); one at a time per engine");
  GenerateResult res;
  std::exception_ptr native_error;
  {
    py::gil_scoped_release nogil;
    try {
      res = g.gen->generate(ids.data(), static_cast<int64_t>(ids.size()), p, draft_fn, progress_fn);
    } catch (...) {
      native_error = std::current_exception();
    }
  }
  g.busy = false;
  if (py_error) std::rethrow_exception(py_error);
  if (native_error) std::rethrow_exception(native_error);

  auto to_np = [](const std::vector<int32_t>& v) {
    py::array_t<int32_t> a(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), a.mutable_data());
    return a;
  };
  py::dict out, secs;
  out["tokens"] = to_np(res.tokens);
  out["acceptance_lengths"] = to_np(res.acceptance_lengths);
  out["tree_sizes"] = to_np(res.tree_sizes);
  out["draft_depths"] = to_np(res.draft_depths);
  out["stopped"] = res.stopped;
  out["device_drafts"] = res.device_drafts;
  out["prefill_reused"] = res.prefill_reused;
  secs["prefill"] = res.seconds.prefill;
  secs["draft"] = res.seconds.draft;
  secs["tree_build"] = res.seconds.tree_build;
  secs["verify"] = res.seconds.verify;
  secs["accept_commit"] = res.seconds.accept_commit;
  secs["verify_forward_gpu"] = res.seconds.verify_forward_gpu;
  secs["total"] = res.seconds.total;
  out["seconds"] = secs;
  return out;
}

std::unique_ptr<PyGenerator> make_generator(py::object target, const std::string& rounds) {
  if (rounds != "auto" && rounds != "host" && rounds != "device")
    throw Error("Generator: rounds must be 'auto', 'host' or 'device', got '" + rounds + "'");
  auto g = std::make_unique<PyGenerator>();
  if (py::isinstance<ToyTarget>(target)) {
    if (rounds == "device") throw Error("Generator: rounds='device' needs a CudaModel target");
    g->target = &target.cast<ToyTarget&>();
    g->gen = std::make_unique<Generator>(*g->target);
    return g;
  }
  TargetModel* m = nullptr;
  if (py::isinstance<CpuModel>(target)) m = &target.cast<CpuModel&>();
#if defined(KDTREE_HAVE_CUDA) && defined(KDTREE_HAVE_CUBLAS)
  if (m == nullptr && py::isinstance<CudaModel>(target)) {
    CudaModel& cm = target.cast<CudaModel&>();
    g->target_model = static_cast<const void*>(static_cast<TargetModel*>(&cm));
    if (rounds != "host") {
      g->executor = std::make_unique<CudaRounds>(cm);
      g->rounds = "device";
      g->gen = std::make_unique<Generator>(*g->executor);
      return g;
    }
    m = &cm;
  }
#endif
  if (m == nullptr)
    throw Error("Generator: target must be a ToyTarget or a native model (CpuModel or CudaModel), got " + type_name(target));
  if (rounds == "device") throw Error("Generator: rounds='device' needs a CudaModel target");
  g->target_model = static_cast<const void*>(m);
  g->adapter = std::make_unique<ModelTarget>(*m);
  g->target = g->adapter.get();
  g->gen = std::make_unique<Generator>(*g->target);
  return g;
}

}  // namespace

void bind_engine(py::module_& m) {
  m.def(
      "sampler_choose",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> logits,
         py::array_t<int64_t, py::array::c_style | py::array::forcecast> positions, double temperature,
         int64_t top_k, double top_p, uint64_t seed) {
        if (logits.ndim() != 2) throw Error("sampler_choose: logits must be [T, V]");
        const int64_t T = logits.shape(0), V = logits.shape(1);
        if (positions.ndim() != 1 || positions.shape(0) != T) throw Error("sampler_choose: positions must be [T]");
        if (V < 1) throw Error("sampler_choose: V must be >= 1");
        SamplingParams sp;
        sp.temperature = (float)temperature;
        sp.top_k = top_k;
        sp.top_p = (float)top_p;
        sp.seed = seed;
        Sampler smp(sp);
        py::array_t<int32_t> out(T);
        for (int64_t t = 0; t < T; ++t)
          out.mutable_data()[t] = smp.choose(logits.data() + t * V, V, positions.data()[t] + 1);
        return out;
      },
      py::arg("logits"), py::arg("positions"), py::arg("temperature") = 0.0, py::arg("top_k") = 0,
      py::arg("top_p") = 1.0, py::arg("seed") = 0,
      "The engine's host sampler (cpp/engine/sampler.h) on logits [T, V]: row t's choice with the uniform "
      "of sequence index positions[t] + 1. For tests (the oracle of the GPU sampler).");

  py::class_<AdaptiveBudget>(m, "AdaptiveBudget",
                             "The adaptive tree-size policy of generate(adaptive_budget=True) "
                             "(cpp/engine/adaptive_budget.h), exposed for tests.")
      .def(py::init<>())
      .def("reset", &AdaptiveBudget::reset, py::arg("max_nodes"))
      .def(
          "choose",
          [](AdaptiveBudget& a, py::array_t<float, py::array::c_style | py::array::forcecast> logprobs,
             py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids, int64_t cap, int64_t root_index) {
            if (logprobs.ndim() != 2 || ids.ndim() != 2 || logprobs.shape(0) != ids.shape(0) ||
                logprobs.shape(1) != ids.shape(1))
              throw Error("AdaptiveBudget.choose: logprobs and ids must both be [d, k]");
            const int64_t d = logprobs.shape(0), k = logprobs.shape(1);
            const std::string err = tree_build_input_error(logprobs.data(), ids.data(), d, k, cap);
            if (!err.empty()) throw Error("AdaptiveBudget.choose: " + err);
            if (d > kTreeMaxDepth) throw Error("AdaptiveBudget.choose: d > kTreeMaxDepth");
            return a.choose(logprobs.data(), ids.data(), d, k, cap, root_index);
          },
          py::arg("logprobs"), py::arg("ids"), py::arg("cap"), py::arg("root_index"),
          "Nodes to verify (0..cap) for this draft [d, k] (finite log-probs: cap must not exceed the finite prefixes)")
      .def(
          "draft_rows",
          [](AdaptiveBudget& a) -> py::object {
            const auto& lp = a.draft_logprobs();
            const auto& ids = a.draft_ids();
            if (lp.empty()) return py::none();
            const int64_t k = a.draft_k(), d = static_cast<int64_t>(lp.size()) / k;
            py::array_t<float> l({d, k});
            py::array_t<int32_t> i({d, k});
            std::copy(lp.begin(), lp.end(), l.mutable_data());
            std::copy(ids.begin(), ids.end(), i.mutable_data());
            return py::make_tuple(l, i);
          },
          "(log-probs [d, k], ids [d, k]) the last choose() hands the round: the draft's rows in calibrated order "
          "(None when it chose without a tree)")
      .def("observe", &AdaptiveBudget::observe, py::arg("n"), py::arg("round_seconds"), py::arg("draft_seconds"),
           py::arg("draft_rows") = 0)
      .def("draft_depth", &AdaptiveBudget::draft_depth, py::arg("max_depth"),
           "The rows to ask the drafter for this round (1..max_depth): the depth recent drafts were worth")
      .def("draft_cost", &AdaptiveBudget::draft_cost, py::arg("rows"),
           "The seconds a draft of that many rows is counted at (measured, interpolated or extrapolated; 0: none yet)")
      .def("depth_rate", &AdaptiveBudget::depth_rate, py::arg("rows"),
           "The expected tokens a second of drafting that many rows (a moving average; 0: not measured yet)")
      .def("skip_draft", &AdaptiveBudget::skip_draft, "True: this round is a plain step without drafting")
      .def(
          "label",
          [](AdaptiveBudget& a, py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens) {
            if (tokens.ndim() != 1) throw Error("AdaptiveBudget.label: tokens must be 1-D");
            a.label(tokens.data(), tokens.shape(0));
          },
          py::arg("tokens"))
      .def("round_cost", &AdaptiveBudget::round_cost, py::arg("T"))
      .def("calibration", &AdaptiveBudget::calibration, py::arg("edge_probability"), py::arg("edge_class") = 0,
           "The calibration factor of an edge probability in an edge class (0 chain, 1 sibling, 2 off the chain)")
      .def("draft_seconds", &AdaptiveBudget::draft_seconds, "The drafting seconds the choice counts (0: none yet)")
      .def_property_readonly("trees_pending", &AdaptiveBudget::trees_pending);

  py::class_<ToyTarget>(m, "ToyTarget",
                        "Deterministic test target (cpp/engine/toy_target.h): a real cache of (token, position) "
                        "whose logits depend on every visible entry.")
      .def(py::init<int64_t, int64_t, uint64_t, float>(), py::arg("vocab_size"), py::arg("max_seq_len"),
           py::arg("seed") = 0, py::arg("scale") = 3.0f)
      .def_property_readonly("vocab_size", &ToyTarget::vocab_size)
      .def_property_readonly("max_seq_len", &ToyTarget::max_seq_len)
      .def_property_readonly("cache_len", &ToyTarget::cache_len)
      .def_property_readonly("forward_calls", &ToyTarget::forward_calls)
      .def_property_readonly("forward_tokens", &ToyTarget::forward_tokens)
      .def(
          "forward",
          [](ToyTarget& t, py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens,
             py::array_t<int32_t, py::array::c_style | py::array::forcecast> positions, py::object visibility) {
            const int64_t T = tokens.size();
            if (tokens.ndim() != 1 || positions.ndim() != 1 || positions.size() != T)
              throw Error("forward: tokens and positions must be 1-D of the same length");
            std::vector<uint8_t> vis(static_cast<size_t>(T * T), 0);
            if (visibility.is_none()) {
              for (int64_t i = 0; i < T; ++i)
                for (int64_t j = 0; j <= i; ++j) vis[i * T + j] = 1;
            } else {
              auto v = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>::ensure(visibility);
              if (!v || v.ndim() != 2 || v.shape(0) != T || v.shape(1) != T)
                throw Error("forward: visibility must be [T, T]");
              std::copy(v.data(), v.data() + T * T, vis.begin());
            }
            py::array_t<float> logits({T, t.vocab_size()});
            t.forward(tokens.data(), positions.data(), vis.data(), T, logits.mutable_data());
            return logits;
          },
          py::arg("tokens"), py::arg("positions"), py::arg("visibility") = py::none(),
          "logits [T, V]; writes T pending cache entries (visibility None = causal)")
      .def(
          "commit",
          [](ToyTarget& t, py::array_t<int32_t, py::array::c_style | py::array::forcecast> keep) {
            t.commit(keep.data(), keep.size());
          },
          py::arg("keep"))
      .def("reset", &ToyTarget::reset);

  py::class_<PyNgramDraft>(m, "NgramDraft",
                           "The n-gram drafter in C++ (cpp/engine/ngram_drafter.h); Generator.generate calls it "
                           "inside the round without Python. kdtree_native.NgramDrafter wraps it.")
      .def(py::init([](int64_t max_ngram, int64_t min_ngram, int64_t max_matches) {
             return std::make_unique<PyNgramDraft>(NgramParams{max_ngram, min_ngram, max_matches});
           }),
           py::arg("max_ngram") = 4, py::arg("min_ngram") = 1, py::arg("max_matches") = 32)
      .def_property_readonly("max_ngram", [](PyNgramDraft& d) { return d.drafter.params().max_ngram; })
      .def_property_readonly("min_ngram", [](PyNgramDraft& d) { return d.drafter.params().min_ngram; })
      .def_property_readonly("max_matches", [](PyNgramDraft& d) { return d.drafter.params().max_matches; })
      .def(
          "__call__",
          [](PyNgramDraft& d, py::array_t<int32_t, py::array::c_style | py::array::forcecast> context, int64_t depth,
             int64_t top_k) -> py::object {
            return call_native_drafter("NgramDraft", d.mu, context, [&](const int32_t* c, int64_t n, DraftOutput& out) {
              d.drafter.draft(c, n, depth, top_k, out);
            });
          },
          py::arg("context"), py::arg("depth"), py::arg("top_k"),
          "(log-probs float32 [d, k], ids int32 [d, k]) for a context int32 [n], or None when nothing matches "
          "(kdtree_native.reference.ngram_draft is the definition).");

  py::class_<PyModelDraft>(m, "ModelDraft",
                           "A draft model's greedy chain in C++ (cpp/engine/model_drafter.h; on a CudaModel the chain "
                           "stays on the GPU and a GPU round takes its logits in device memory); Generator.generate "
                           "calls it inside the round without Python. kdtree_native.ModelDrafter wraps it.")
      .def(py::init(&make_model_draft), py::arg("model"), py::arg("min_chain_prob") = 0.0,
           py::arg("prefill_chunk") = 512, py::keep_alive<1, 2>())
      .def_property_readonly("min_chain_prob", [](PyModelDraft& d) { return d.drafter->params().min_chain_prob; })
      .def_property_readonly("prefill_chunk", [](PyModelDraft& d) { return d.drafter->params().prefill_chunk; })
      .def(
          "__call__",
          [](PyModelDraft& d, py::array_t<int32_t, py::array::c_style | py::array::forcecast> context, int64_t depth,
             int64_t top_k, int64_t host_topk) -> py::object {
            if (host_topk < 0) throw Error("ModelDraft: host_topk must be >= 0, got " + std::to_string(host_topk));
            return call_native_drafter("ModelDraft", d.mu, context, [&](const int32_t* c, int64_t n, DraftOutput& out) {
              kdtree_py::ModelUse use(&d.drafter->model(), "a ModelDrafter's draft", true);
              out.host_topk = host_topk;
              d.drafter->draft(c, n, depth, top_k, out);
            });
          },
          py::arg("context"), py::arg("depth"), py::arg("top_k"), py::arg("host_topk") = 0,
          "logits float32 [d, V] of the greedy chain after a context int32 [n] (d <= depth), or None when the "
          "context is empty or does not fit the draft model's max_seq_len. host_topk > 0 asks for the [d, k] "
          "form, k = min(host_topk, V) (what generate's adaptive budget reads): a GPU model returns (log-probs "
          "float32 [d, k], ids int32 [d, k]) from its device top-k (depth <= 16, k <= 1024), a CPU model its "
          "logits as without it.");

  py::class_<PyGenerator>(m, "Generator",
                          "The prefill / AR / DDTree loop (cpp/engine/engine.h) over a ToyTarget or a native model.")
      .def(py::init(&make_generator), py::arg("target"), py::arg("rounds") = "auto", py::keep_alive<1, 2>(),
           "rounds: 'auto' (on the device for a CudaModel, else the host), 'host' (tree, logits and the walk on "
           "the host through the target's forward/commit), 'device' (CudaModel only: the round stays on the GPU)")
      .def_property_readonly("vocab_size", [](PyGenerator& g) { return g.gen->executor().vocab_size(); })
      .def_property_readonly("max_seq_len", [](PyGenerator& g) { return g.gen->executor().max_seq_len(); })
      .def_property_readonly("rounds", [](PyGenerator& g) { return g.rounds; })
      .def("generate", &run_generate, py::arg("prompt_ids"), py::arg("max_new_tokens"), py::arg("drafter") = py::none(),
           py::arg("tree_budget") = 64, py::arg("depth") = 15, py::arg("top_k") = 0, py::arg("temperature") = 0.0,
           py::arg("top_p") = 1.0, py::arg("target_top_k") = 0, py::arg("seed") = 0,
           py::arg("stop_token_ids") = std::vector<int64_t>{}, py::arg("progress") = py::none(),
           py::arg("prefill_chunk") = 512, py::arg("adaptive_budget") = false, py::arg("reuse_prefix") = false);
}

// module.cpp: the pybind11 module kdtree_native._native. Each area binds itself in its own
// file (bind_*.cpp); this file only assembles them and maps C++ errors to Python ones.
#include <pybind11/pybind11.h>

#include "common.h"
#ifdef KDTREE_HAVE_CUDA
#include "cuda_device.h"
#endif

namespace py = pybind11;

void bind_kdtr(py::module_& m);
void bind_tree(py::module_& m);
void bind_model(py::module_& m);
void bind_engine(py::module_& m);
void bind_cuda(py::module_& m);
void bind_cuda_model(py::module_& m);

PYBIND11_MODULE(_native, m) {
  m.doc() = "kdtree-native native core (C++ host library + optional CUDA backend)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kdtree::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const kdtree::RuntimeFailure& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("build_info", []() {
    kdtree::BuildInfo b = kdtree::build_info();
    py::dict d;
    d["version"] = b.version;
    d["compiler"] = b.compiler;
    d["cpu_blas"] = b.cpu_blas;
    d["cuda"] = b.cuda_compiled;
    d["cuda_archs"] = b.cuda_archs;
#ifdef KDTREE_HAVE_CUBLAS
    d["cublas"] = true;
#else
    d["cublas"] = false;
#endif
    d["cublas_libdir"] = b.cublas_libdir;
    return d;
  });
  m.def("cuda_available", []() {
    std::string why;
    bool ok = kdtree::cuda_available(&why);
    return py::make_tuple(ok, why);
  });
#ifdef KDTREE_HAVE_CUDA
  m.def("cuda_device_name", []() { return kdtree::cuda_device_name(); });
#else
  m.def("cuda_device_name", []() { return std::string(); });
#endif

  bind_kdtr(m);
  bind_tree(m);
  bind_model(m);
  bind_engine(m);
  bind_cuda(m);
  bind_cuda_model(m);
}

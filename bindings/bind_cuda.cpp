// bind_cuda.cpp: Python bindings for the cuda area (placeholder until that area lands).
#include <pybind11/pybind11.h>
namespace py = pybind11;
void bind_cuda(py::module_& m) { (void)m; }

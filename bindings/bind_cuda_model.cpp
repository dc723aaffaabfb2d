// bind_cuda_model.cpp: Python bindings for the GPU model (placeholder until that area lands).
#include <pybind11/pybind11.h>
namespace py = pybind11;
void bind_cuda_model(py::module_& m) { (void)m; }

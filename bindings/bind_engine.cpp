// bind_engine.cpp: Python bindings for the engine area (placeholder until that area lands).
#include <pybind11/pybind11.h>
namespace py = pybind11;
void bind_engine(py::module_& m) { (void)m; }
